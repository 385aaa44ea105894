"""A thinking model's reasoning, split from its answer as the reply streams.

Tokenizers whose vocabulary has a thinking section's markers (mlx-lm's `has_thinking`, `think_start`,
`think_end`: Qwen3's `<think>` and `</think>`, ...) get their reply cut by mlx-lm's `TextStateMachine`, as
`mlx_lm.server` cuts it: text between the markers is reasoning, the rest the answer, the markers go to
neither. The section may be opened by the prompt already (templates whose generation prompt ends with
`<think>`, or a continued message inside one): then the reply starts as reasoning.
"""

from typing import Optional

from mlx_lm.generate import TextStateMachine

KINDS = {"reasoning": "reasoning", "normal": "text"}  # the state machine's states as reply pieces


class ReasoningSplitter:
    """feed() and finish() return what may go out now: a list of ("reasoning", str) and ("text", str)."""

    def __init__(self, start: str, end: str, opened: bool):
        edges = {"normal": [(start, "reasoning")], "reasoning": [(end, "normal")]}
        self.state = TextStateMachine(edges).make_state("reasoning" if opened else "normal")

    def feed(self, text: str) -> list:
        self.state, segments = TextStateMachine.split(self.state, text)
        return [(KINDS[state], piece) for state, piece in segments if piece]

    def finish(self) -> list:
        """What was held back as a possible marker: the reply ended, so it is text of the state it is in."""
        self.state, rest, state = TextStateMachine.flush(self.state)
        return [(KINDS[state], rest)] if rest else []


def reasoning_splitter(tokenizer, prompt_ids: list) -> Optional[ReasoningSplitter]:
    """The splitter for a chat reply to `prompt_ids`, or None where the tokenizer has no thinking section."""
    if not getattr(tokenizer, "has_thinking", False):
        return None
    opened = tokenizer.rfind_think_start(prompt_ids) > tokenizer.rfind_think_end(prompt_ids)
    return ReasoningSplitter(tokenizer.think_start, tokenizer.think_end, opened)
