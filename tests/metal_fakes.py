"""Metal faked on a machine without it: every Metal-guarded path of the package runs, our kernels' real
dispatch included, with the kernel objects MLX would compile replaced by stand-ins that compute the launch's
result with MLX's own ops, or fail the way Metal fails (MLX's own messages).

* ``FixedTimer``: the race gate's timer with fixed timings; counts races and soaks.
* ``fake_metal(monkeypatch)``: `metal_available()` true and an Apple GPU's `chip_name()` in every module of
  the package that imported them.
* ``FakeKernels``: installed over ``wide_qmm.wide_qmm_kernel`` and the attention's two kernels; ``fail``
  makes them fail at one stage: "compile" (Metal rejects the source), "launch" (a threadgroup over ``limit``
  threads, MLX's size error naming the limit) or "run" (a command buffer error). Each is raised when the
  kernel is called: on Metal they surface when the graph is evaluated, which the race gate does inside the
  same guard, but an error raised inside an evaluation on MLX's CPU stream can leave that stream hanging
  later evaluations, so no stand-in fails lazily.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import _get_classes

from mlx_dflash import machine
from mlx_dflash.kernels import attention as attn
from mlx_dflash.kernels import wide_qmm
from mlx_dflash.kernels.race_gate import RACE_REPEATS
from mlx_dflash.models.loader import drafter_config_for, init_drafter
from mlx_dflash.models.target import Target

CHIP = "applegpu_g15s"  # an M3
COMPILE_ERROR = ("[metal::Device] Unable to build metal library from source\n"
                 "program_source:57:9: error: use of undeclared identifier 'w4'")
RUN_ERROR = ("[METAL] Command buffer execution failed: Caused GPU Hang Error "
             "(00000003:kIOGPUCommandBufferCallbackErrorHang)")


class FixedTimer:
    """timer(calls, repeats) -> each call's fixed seconds, `repeats` times (a list, or one value for all)."""

    def __init__(self, dflash=1e-3, mlx=2e-3):
        self.seconds = {"dflash": dflash, "mlx": mlx}
        self.races = self.soaks = 0

    def __call__(self, calls, repeats):
        assert set(calls) == {"dflash", "mlx"}
        if repeats == RACE_REPEATS:
            self.races += 1
        else:
            self.soaks += 1
        return {name: list(s) if isinstance(s, (list, tuple)) else [s] * repeats for name, s in self.seconds.items()}


def fake_metal(monkeypatch, chip: str = CHIP):
    """Metal reported available, `chip` the GPU, in every loaded module of the package."""
    fakes = {machine.metal_available: ("metal_available", lambda: True), machine.chip_name: ("chip_name", lambda: chip)}
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_dflash"):
            for real, (attr, fake) in fakes.items():
                if getattr(module, attr, None) is real:
                    monkeypatch.setattr(module, attr, fake)


class FakeKernel:
    """A stand-in for one ``mx.fast.metal_kernel`` object: computes(inputs, template) -> outputs."""

    def __init__(self, owner: "FakeKernels", name: str, computes):
        self.owner, self.name, self.computes = owner, name, computes

    def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes, **_):
        owner = self.owner
        owner.launches.append((self.name, threadgroup[0] * threadgroup[1] * threadgroup[2]))
        if owner.failing(self.name):
            if owner.fail == "compile":
                raise RuntimeError(COMPILE_ERROR)
            size = threadgroup[0] * threadgroup[1] * threadgroup[2]
            if owner.fail == "launch" and size > owner.limit:
                raise ValueError(f"Thread group size ({size}) is greater than  the maximum allowed threads per "
                                 f"threadgroup ({owner.limit}).")
            if owner.fail == "run":
                raise RuntimeError(RUN_ERROR)
        return self.computes(inputs, dict(template), output_shapes)


def _wide(inputs, t, output_shapes):
    x, w, scales, biases = inputs[:4]
    return [mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=t["GS"], bits=t["BITS"])]


def _partial(inputs, t, output_shapes):
    """Pass 1 as one chunk holding the whole (normalised) result: m = 0, l = 1; the other chunks empty."""
    q, k, v, scale, lengths, sees = inputs[:6]
    lengths = [int(n) for n in lengths.tolist()]
    out = attn.reference_attention(q, k, v, scale, max(lengths), lengths, sees.reshape(q.shape[0], q.shape[2]))
    out = out.astype(mx.float32)
    (rows, chunks, d), _ = output_shapes
    o_part = mx.concatenate([out.reshape(rows, 1, d), mx.zeros((rows, chunks - 1, d))], axis=1)
    m = mx.array([0.0] + [-float("inf")] * (chunks - 1))
    l_ = mx.array([1.0] + [0.0] * (chunks - 1))
    return [o_part, mx.broadcast_to(mx.stack([m, l_], axis=-1), (rows, chunks, 2))]


def _combine(inputs, t, output_shapes):
    """Pass 2: the chunks merged by their softmax statistics."""
    o_part, ml = inputs[:2]
    m, l_ = ml[..., 0], ml[..., 1]
    weight = mx.exp(m - m.max(axis=1, keepdims=True))
    out = (weight[..., None] * o_part).sum(axis=1) / (weight * l_).sum(axis=1, keepdims=True)
    return [out.astype(t["T"])]


def failing_kernels_env(stage: str, verdicts) -> dict:
    """The environment that makes a child process fake Metal with our kernels failing at `stage`
    (tests/failing_kernels/sitecustomize.py), keeping its verdicts in the file `verdicts`."""
    import os
    from pathlib import Path

    site = str(Path(__file__).with_name("failing_kernels"))
    return {"FAILING_KERNEL": stage, "VERDICTS": str(verdicts),
            "PYTHONPATH": os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))}


def install_failing_kernels(stage: str, verdicts):
    """For a whole process (no test to undo it): Metal faked, our kernels failing at `stage`, a race gate
    keeping its verdicts in the file `verdicts`."""
    import pytest

    from mlx_dflash.kernels import race_gate
    from mlx_dflash.kernels.race_gate import RaceGate

    patch = pytest.MonkeyPatch()
    fake_metal(patch)
    FakeKernels(patch, fail=stage)
    patch.setattr(race_gate, "_shared", [RaceGate(verdicts, timer=FixedTimer())])


class FakeKernels:
    """Our kernels' objects replaced (see the module's docstring); `launches` lists (kernel, threads)."""

    def __init__(self, monkeypatch, fail: str | None = None, kernels=("wide_qmm", "mr_attention"), limit: int = 256):
        self.fail, self.kernels, self.limit, self.launches = fail, kernels, limit, []
        wide = FakeKernel(self, "wide_qmm", _wide)
        partial, combine = FakeKernel(self, "mr_attention", _partial), FakeKernel(self, "mr_attention", _combine)
        monkeypatch.setattr(wide_qmm, "wide_qmm_kernel", lambda: wide)
        monkeypatch.setattr(attn, "partial_kernel", lambda: partial)
        monkeypatch.setattr(attn, "combine_kernel", lambda: combine)

    def failing(self, kernel: str) -> bool:
        return self.fail is not None and kernel in self.kernels


def head_dim_64_pair(bits=4):
    """A 4-layer llama with head dim 64 (what our attention kernel takes), quantized to `bits` (None: not),
    and a drafter for it."""
    config = dict(model_type="llama", hidden_size=128, num_hidden_layers=4, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=1, head_dim=64, rms_norm_eps=1e-5, vocab_size=49152,
                  tie_word_embeddings=False)
    model_class, args_class = _get_classes(config)
    mx.random.seed(11)
    model = model_class(args_class.from_dict(config))
    if bits:
        nn.quantize(model, group_size=64, bits=bits)
    mx.eval(model.parameters())
    target = Target(model)
    drafter = init_drafter(drafter_config_for(target, num_layers=1, block_size=8, num_target_features=2), seed=0)
    return target, drafter
