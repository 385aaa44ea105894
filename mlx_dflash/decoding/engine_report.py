"""The engine report: which path served a generation, and every fallback said once, never silently.

* `verify_paths(target)`: what serves the verify's matmuls (our wide kernel or MLX's quantized matmul) and
  its attention (our multi-row kernel or MLX's SDPA) for this target on this machine, with a note for
  each fallback known before generating.
* `Report`: follows one generation: the routed calls of its verifies per shape bin, as the race gate
  decided them (kernels/routes.py), the fallbacks met on the way and the width policy giving up on the
  drafter, each turned into a note in the statistics.
* `announce(note)`: a note on stderr, once per process (the CLI, the server and the Python API alike);
  `silenced()` keeps notes in the statistics only.
* `engine_lines(stats)`: the lines `generate --verbose` adds to the statistics.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import mlx.nn as nn

from ..kernels import routes, wide_qmm
from ..kernels import verify_attention as va
from ..machine import metal_available

_announced: set[str] = set()
_silenced: list[bool] = []


def announce(note: str):
    """Print `note` on stderr unless this process already did (or the caller prints notes its own way)."""
    if note not in _announced and not _silenced:
        _announced.add(note)
        print(note, file=sys.stderr, flush=True)


@contextmanager
def silenced():
    """Notes go to the statistics only (the doctor lists them under its checks)."""
    _silenced.append(True)
    try:
        yield
    finally:
        _silenced.pop()


def _matmul_path(model) -> tuple[str, list[str]]:
    modules = [m for _, m in model.named_modules()]
    ours = sum(isinstance(m, wide_qmm.WideQuantizedLinear) for m in modules)
    plain = [m for m in modules if type(m) is nn.QuantizedLinear]
    if not ours and not plain:
        return "MLX's matmul (the target is not quantized)", []
    if not metal_available():
        return "MLX's quantized matmul (no Metal: our wide kernel runs on Apple GPUs)", []
    refused = [m for m in plain if not wide_qmm.wide_capable(m)]
    note = (f"note: verify matmul: MLX's quantized matmul in {len(refused)} of {ours + len(plain)} quantized "
            f"layers: our wide kernel takes affine {'/'.join(map(str, wide_qmm.SUPPORTED_BITS))}-bit layers with "
            f"group size {'/'.join(map(str, wide_qmm.SUPPORTED_GROUP_SIZES))} only")
    if not ours:
        if refused:
            return "MLX's quantized matmul (no layer our wide kernel takes)", [note]
        route = f"{wide_qmm.ROUTE_ENV}={wide_qmm.default_route()}"
        return f"MLX's quantized matmul (our wide kernel not installed; {route})", []
    path = f"ours for 6..16 rows in {ours} quantized layers (race gate, or forced), MLX's quantized matmul otherwise"
    return path, [note] if refused else []


def _attention_path(target) -> tuple[str, list[str]]:
    sites, route = target.attention_routing
    if not metal_available():
        return "MLX's SDPA (no Metal: our attention kernel runs on Apple GPUs)", []
    if route == "mlx":
        return f"MLX's SDPA (our attention kernel not installed; {va.ROUTE_ENV}={va.default_route()})", []
    if not sites:
        return "MLX's SDPA (no attention module to route)", [
            "note: verify attention: MLX's SDPA for every call: this family's attention modules do not call "
            "mlx-lm's scaled_dot_product_attention, where our kernel is routed in"]
    how = "where the race gate picks it" if route == "auto" else f"route {route!r} forced"
    return f"ours for 2..16 rows in {sites} attention modules ({how}), MLX's SDPA otherwise", []


def verify_paths(target) -> tuple[dict, list[str]]:
    """({"matmul": ..., "attention": ...}, notes of the fallbacks known before generating)."""
    matmul, notes = _matmul_path(target.model)
    attention, more = _attention_path(target)
    return {"matmul": matmul, "attention": attention}, notes + more


DRAFTING_NOTE = ("note: width auto: drafting paid less than plain target steps here, so the target runs alone "
                 "for stretches (the drafter is re-tried now and then)")


class Report:
    """The engine side of one generation's statistics (GenerationStats): paths, routed calls, notes."""

    def __init__(self, target, policy, stats, quiet: bool = False, paths: tuple | None = None):
        """paths: `verify_paths(target)` when the caller keeps it (a server, for every request); else found here."""
        self.policy, self.stats, self.quiet, self.before = policy, stats, quiet, routes.snapshot()
        paths, notes = paths or verify_paths(target)
        stats.verify_paths = dict(paths)
        for note in policy.notes + notes:
            self.note(note)

    def note(self, note: str):
        if note not in self.stats.notes:
            self.stats.notes.append(note)
        if not self.quiet:
            announce(note)

    def update(self):
        """After a round: the routed calls so far, and a note for each fallback new in them."""
        self.stats.routes = routes.since(self.before)
        for note in routes.fallback_notes(self.stats.routes):
            self.note(note)
        if self.policy.drafting_loses and self.stats.plain_steps:
            self.note(DRAFTING_NOTE)


def engine_lines(stats) -> list[str]:
    """What served the generation: the verify paths, the drafter or plain steps, the routed calls."""
    nothing = stats.rounds - stats.drafted_rounds
    lines = [
        f"drafter: drafted in {stats.drafted_rounds} of {stats.rounds} verify rounds; plain target steps: "
        f"{stats.plain_steps}; verify rounds with no draft: {nothing}",
        f"verify matmul: {stats.verify_paths.get('matmul', '-')}",
        f"verify attention: {stats.verify_paths.get('attention', '-')}",
    ]
    return lines + [routes.route_line(e) for e in stats.routes]
