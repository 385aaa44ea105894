"""One exception type for every problem a user can fix.

The CLI prints a DFlashError as a single line and exits non-zero; anything else is a bug and keeps its
traceback. Messages name the problem and the fix.
"""


class DFlashError(Exception):
    """A user-facing error: bad input, a mismatched model pair, a missing file."""
