"""Where a verify's cost jumps as it verifies more rows (the "verify-width cliff"), from a measured curve.

On Metal, MLX's quantized matmul streams the weights once for <= 5 rows and 2-4 times (or through a 32-row
tile) for 6..16 (mlx/backend/metal/quantized.cpp), so the curve jumps; on the CPU it is linear in rows.
"""

from __future__ import annotations

import math

import numpy as np

CLIFF_K = 4.0  # a jump is a marginal cost above CLIFF_K x the usual one ...

CLIFF_FLOOR = 0.05  # ... where "usual" is at least CLIFF_FLOOR x the cost of the previous width

CLIFF_RULE = (
    "t(w) = median seconds at width w; marginal m(w) = (t(w) - t(p)) / (w - p) for the previous measured "
    "width p; base(w) = max(0, median of m over the earlier widths that are not jumps, at least 3 of them, "
    f"so the first candidate is the 5th width); scale(w) = max(base(w), {CLIFF_FLOOR} * t(p)). w is a jump "
    f"if m(w) > {CLIFF_K} * scale(w) and the step persists: the next one or two measured widths q (at least "
    "one must exist, so the last width is never a jump) each have t(q) - t(p) - base(w) * (q - p) >= half of "
    "t(w) - t(p) - base(w) * (w - p) (a one-width spike is noise, not a cliff). The cliff is the first jump; "
    "none means the curve has no jump (on the CPU it is linear: see linear_fit)."
)


def _check_curve(widths, seconds) -> tuple[list[int], list[float]]:
    w, t = [int(x) for x in widths], [float(s) for s in seconds]
    if len(w) != len(t) or any(b <= a for a, b in zip(w, w[1:])) or any(not math.isfinite(s) for s in t):
        raise ValueError("widths must be strictly increasing and match finite seconds one to one")
    return w, t


def find_jumps(widths, seconds, k: float = CLIFF_K, floor: float = CLIFF_FLOOR) -> list[int]:
    """Every width where the marginal cost jumps, by the rule in CLIFF_RULE."""
    w, t = _check_curve(widths, seconds)
    m = [None] + [(t[i] - t[i - 1]) / (w[i] - w[i - 1]) for i in range(1, len(w))]
    jumps: list[int] = []
    for i in range(3, len(w) - 1):
        prior = [m[j] for j in range(1, i) if w[j] not in jumps]
        if len(prior) < 3:
            continue
        base = max(0.0, float(np.median(prior)))
        if m[i] <= k * max(base, floor * t[i - 1]):
            continue
        above = lambda j: t[j] - t[i - 1] - base * (w[j] - w[i - 1])  # noqa: E731
        if all(above(j) >= above(i) / 2 for j in range(i + 1, min(i + 3, len(w)))):
            jumps.append(w[i])
    return jumps


def cliff_width(widths, seconds) -> int | None:
    """The first width whose marginal cost jumps (CLIFF_RULE), or None for a curve without one."""
    jumps = find_jumps(widths, seconds)
    return jumps[0] if jumps else None


def linear_fit(widths, seconds) -> dict:
    """Least squares t = intercept + per_row * w, with R^2."""
    w, t = (np.asarray(a, dtype=np.float64) for a in _check_curve(widths, seconds))
    per_row, intercept = np.polyfit(w, t, 1) if len(w) > 1 else (0.0, float(t[0]))
    resid = t - (intercept + per_row * w)
    ss = float(((t - t.mean()) ** 2).sum())
    return {"seconds_per_row": float(per_row), "intercept_seconds": float(intercept),
            "r2": 1.0 - float((resid ** 2).sum()) / ss if ss > 0 else 1.0}


def verdict(widths, seconds) -> dict:
    """cliff_width, jumps, linear_fit and one sentence saying what the curve is."""
    jumps, fit = find_jumps(widths, seconds), linear_fit(widths, seconds)
    w, t = list(widths), list(seconds)
    if jumps:
        i = w.index(jumps[0])
        text = (f"cliff at width {jumps[0]}: {t[i - 1] * 1e3:.3g} -> {t[i] * 1e3:.3g} ms"
                + (f" (further jumps at {', '.join(map(str, jumps[1:]))})" if jumps[1:] else ""))
    elif fit["r2"] >= 0.95:
        text = (f"no cliff: linear, {fit['seconds_per_row'] * 1e3:.3g} ms per extra row "
                f"(R^2 {fit['r2']:.3f})")
    else:
        text = f"no cliff detected (not linear either: R^2 {fit['r2']:.3f}; noisy?)"
    return {"cliff_width": jumps[0] if jumps else None, "jumps": jumps, "linear_fit": fit, "verdict": text}
