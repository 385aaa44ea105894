"""A Mac's first run cannot be broken by our kernels: with Metal faked (tests/metal_fakes.py), a kernel that fails
to compile, refuses its launch size or raises at run time leaves every mode answering with MLX's output and one
line saying what fell back; a refused size is retried smaller; verdicts expire with versions and sources; a slow
or stalling kernel is dropped by the soak."""

import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten as mlx_tree_flatten

from metal_fakes import CHIP, RUN_ERROR, FakeKernels, FixedTimer, fake_metal, head_dim_64_pair
from mlx_dflash.decoding import engine_report
from mlx_dflash.generate import generate
from mlx_dflash.kernels import attention as attn
from mlx_dflash.kernels import checks, race_gate, routes, source, wide_qmm
from mlx_dflash.kernels.race_gate import MARGIN, MLX, OURS, RaceGate, describe

PROMPT = [5, 17, 42, 99, 3, 150, 7, 61, 88, 23, 11, 190] * 2
STAMP = {"mlx": "0.32.4", "mlx_dflash": "0.1.0", "os": "15.5", "source": "abc"}
KEY = f"{CHIP}|wide_qmm|float32|K64xN32|gs32|b4|rows8"


@pytest.fixture(autouse=True)
def fresh_announcements(monkeypatch):
    monkeypatch.setattr(engine_report, "_announced", set())


def gate_at(tmp_path, timer=None, stamp=STAMP, **kw):
    return RaceGate(tmp_path / "verdicts.json", timer=timer or FixedTimer(), stamp=lambda kernel: dict(stamp), **kw)


def thunks(fail_at=None, limit=None):
    """(ours(size), theirs(), sizes run): ours fails the way Metal does when asked (fail_at: "compile", "run";
    limit: sizes above it are refused with MLX's message)."""
    x = mx.random.normal((8, 64), key=mx.random.key(1))
    ran = []

    def ours(size):
        ran.append(size)
        if fail_at == "compile":
            raise RuntimeError("[metal::Device] Unable to build metal library from source\nerror: ...")
        if limit is not None and size > limit:
            raise ValueError(f"Thread group size ({size}) is greater than  the maximum allowed threads per "
                             f"threadgroup ({limit}).")
        if fail_at == "run":
            raise RuntimeError(RUN_ERROR)
        return x * 2

    return ours, (lambda: x * 2), ran


# The gate, on its own.


@pytest.mark.parametrize("fail_at, limit, error", [
    ("compile", None, "RuntimeError: [metal::Device] Unable to build metal library from source"),
    (None, 16, "ValueError: Thread group size (128) is greater than  the maximum allowed threads per threadgroup "
               "(16)."),
    ("run", None, f"RuntimeError: {RUN_ERROR}"),
])
@pytest.mark.parametrize("forced", [False, True])
def test_a_failing_kernel_routes_to_mlx_once_and_is_remembered(tmp_path, capsys, fail_at, limit, error, forced):
    gate = gate_at(tmp_path)
    ours, theirs, ran = thunks(fail_at, limit)
    choice = gate.choose(KEY, ours, theirs, mx.float32, [128, 64, 32], forced)
    said = "every launch size over the pipeline's thread limit" if limit else error  # the same for every shape
    assert choice.route == MLX and choice.fallback and choice.reason.endswith(f"ours failed here: {said}")
    assert choice.reason.startswith("route 'dflash' forced, but" if forced else "ours failed")
    assert ran == [128]  # no size fits the limit the refusal names; other errors are not retried
    assert gate.choose(KEY, ours, theirs, mx.float32, [128], forced) == choice and ran == [128]
    saved = json.loads(gate.path.read_text())[KEY]
    assert saved["route"] == MLX and saved["failed"] == error and saved["stamp"] == STAMP
    for again_forced in (False, True):  # a new process: the failure stands, ours is not run again
        again = gate_at(tmp_path)
        assert again.choose(KEY, ours, theirs, mx.float32, [128], again_forced).route == MLX
    assert ran == [128] and capsys.readouterr().err == ""
    upgraded = gate_at(tmp_path, stamp=dict(STAMP, mlx="0.33.0"))  # after an upgrade: tried again
    assert upgraded.current(KEY) is None
    upgraded.choose(KEY, ours, theirs, mx.float32, [128], forced)
    assert ran == [128, 128]


def test_a_refused_size_is_retried_within_the_named_limit_and_remembered(tmp_path):
    gate = gate_at(tmp_path)
    ours, theirs, ran = thunks(limit=256)
    choice = gate.choose(KEY, ours, theirs, mx.float32, [512, 256, 128])
    assert choice == gate.choose(KEY, ours, theirs, mx.float32, [512, 256, 128])
    assert choice.route == OURS and choice.size == 256 and not choice.fallback
    assert ran[:2] == [512, 256] and json.loads(gate.path.read_text())[KEY]["size"] == 256
    ran.clear()
    again = gate_at(tmp_path)  # a new process runs ours once, at the size that worked, before trusting it
    assert again.choose(KEY, ours, theirs, mx.float32, [512, 256, 128]) == choice
    assert ran == [256]


def test_a_cached_verdict_for_ours_is_checked_in_each_process(tmp_path, capsys):
    ours, theirs, ran = thunks()
    gate_at(tmp_path).choose(KEY, ours, theirs, mx.float32, [128])
    assert ran == [128]  # the race's own check (the injected timer runs nothing)
    broken, _, _ = thunks("compile")
    again = gate_at(tmp_path)
    choice = again.choose(KEY, broken, theirs, mx.float32, [128])  # e.g. macOS's Metal compiler changed
    assert choice.route == MLX and choice.fallback and "failed" in json.loads(again.path.read_text())[KEY]
    wrong = gate_at(tmp_path / "other")
    wrong.choose(KEY, ours, theirs, mx.float32, [128])
    choice = gate_at(tmp_path / "other").choose(KEY, lambda size: ours(size) + 1, theirs, mx.float32, [128])
    assert choice.route == MLX and choice.fallback and "disagreed" in choice.reason
    assert "disagrees with MLX's" in capsys.readouterr().err


def test_verdicts_expire_with_versions_sources_and_unchecked_numerics(tmp_path):
    ours, theirs, _ = thunks()
    timer = FixedTimer()
    gate_at(tmp_path, timer).choose(KEY, ours, theirs, mx.float32, [128])
    assert timer.races == 1
    for changed in ("mlx", "mlx_dflash", "os", "source"):
        gate = gate_at(tmp_path, timer, stamp=dict(STAMP, **{changed: "new"}))
        assert gate.current(KEY) is None
        gate.choose(KEY, ours, theirs, mx.float32, [128])
    assert timer.races == 5
    saved = json.loads((tmp_path / "verdicts.json").read_text())
    saved[KEY].pop("numerics_ok")  # "ours" without a numerics check passed here: raced again
    (tmp_path / "verdicts.json").write_text(json.dumps(saved))
    gate_at(tmp_path, timer, stamp=dict(STAMP, source="new")).choose(KEY, ours, theirs, mx.float32, [128])
    assert timer.races == 6


def test_the_real_stamp_names_versions_os_and_each_kernels_sources():
    stamps = {kernel: source.kernel_stamp(kernel) for kernel in source.SOURCES}
    assert stamps["wide_qmm"]["mlx"] == mx.__version__ and stamps["wide_qmm"]["os"]
    assert stamps["wide_qmm"]["source"] != stamps["mr_attention"]["source"]
    assert all(len(s["source"]) == 16 for s in stamps.values())


@pytest.mark.parametrize("ours_s, soak_ours, route, stalled", [
    (1e-3, [1e-3] * 23 + [0.2], MLX, True),  # one call of ours 100x MLX's slowest: a stall
    (1e-3, [2.5e-3] * 24, MLX, False),  # won the race, slower over the longer burst
    (1e-3, [1e-3] * 23 + [5e-3], OURS, False),  # a slow call within the stall bound
    (MARGIN * 2e-3 * 1.01, None, MLX, False),  # a win within the margin is a tie: MLX's
])
def test_the_soak_drops_a_slow_or_stalling_kernel(tmp_path, ours_s, soak_ours, route, stalled):
    class Soak(FixedTimer):
        def __call__(self, calls, repeats):
            out = super().__call__(calls, repeats)
            return out if soak_ours is None or self.soaks == 0 else {**out, OURS: list(soak_ours)}

    timer = Soak(ours_s, 2e-3)
    ours, theirs, _ = thunks()
    choice = gate_at(tmp_path, timer).choose(KEY, ours, theirs, mx.float32, [128])
    assert choice.route == route and choice.fallback == stalled
    assert timer.soaks == (soak_ours is not None)
    found = json.loads((tmp_path / "verdicts.json").read_text())[KEY]
    assert bool((found["soak"] or {}).get("stalled")) == stalled
    if stalled:
        assert describe(found) == "soak: ours stalled (200 ms against MLX's slowest 2 ms)"
    elif route == MLX and soak_ours:
        assert describe(found) == "soak: ours 2.5 ms, MLX's 2 ms over 24 calls"


def test_an_error_met_only_when_repeated_is_a_failure(tmp_path):
    def timer(calls, repeats):
        raise RuntimeError("[METAL] Command buffer execution failed: Caused GPU Timeout Error")

    ours, theirs, _ = thunks()
    choice = gate_at(tmp_path, timer).choose(KEY, ours, theirs, mx.float32, [128])
    assert choice.route == MLX and choice.fallback and "GPU Timeout" in choice.reason


# Each kernel's real dispatch, with Metal faked: the launches as MLX would make them.


def test_the_real_dispatch_of_both_kernels_with_metal_faked(monkeypatch):
    fake_metal(monkeypatch)
    kernels = FakeKernels(monkeypatch)
    x = mx.random.normal((9, 128), key=mx.random.key(2)).astype(mx.float16)
    w, s, b = mx.quantize(mx.random.normal((96, 128), key=mx.random.key(3)), 64, 4)
    s, b = s.astype(mx.float16), b.astype(mx.float16)
    for threads in (None, 64):
        got = wide_qmm.wide_quantized_matmul(x, w, s, b, 64, 4, threads)
        assert mx.array_equal(got, mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=4))
    assert kernels.launches == [("wide_qmm", 256), ("wide_qmm", 64)]
    q = mx.random.normal((3, 8, 4, 64), key=mx.random.key(4))
    k, v = (mx.random.normal((3, 2, 700, 64), key=mx.random.key(i)) for i in (5, 6))
    for threads in (None, 128):
        got = attn.multi_row_attention(q, k, v, 0.125, 700, [700, 300, 9], threads)
        assert mx.allclose(got, attn.reference_attention(q, k, v, 0.125, 700, [700, 300, 9]), atol=1e-5)
    assert [n for _, n in kernels.launches[2:]] == [512, 32, 128, 32]  # pass 1 at 16 simdgroups, then 4


def test_the_launch_sizes_halve_down_to_one_simdgroup():
    assert wide_qmm.thread_sizes(mx.float32) == [512, 256, 128, 64, 32]
    assert wide_qmm.thread_sizes(mx.float16) == [256, 128, 64, 32]
    q, k = mx.zeros((1, 64, 16, 128)), mx.zeros((1, 8, 4, 128))  # GQA 8 x 16 rows: the most registers
    assert attn.thread_sizes(q, k) == [512, 256, 128, 64, 32]
    assert attn.thread_sizes(mx.zeros((1, 4, 2, 64)), mx.zeros((1, 4, 4, 64))) == [64, 32]


def test_inputs_mlx_binds_as_constant_are_refused():
    """MLX binds an input of fewer than 8 elements as `constant` memory; the kernel reads w as `device uint4`."""
    from mlx_dflash.kernels.source import metal_source

    w, s, b = mx.quantize(mx.random.normal((1, 32)), 32, 4)  # 1 feature of K=32 at 4 bits: 4 words
    reason = wide_qmm.check_wide_supported((8, 32), w, s, b, 32, 4, mx.float32)
    assert reason == "w of 4 words: MLX binds it as constant memory, which the kernel cannot read"
    w2, s2, b2 = mx.quantize(mx.random.normal((2, 32)), 32, 4)  # 8 words: `device`
    assert wide_qmm.check_wide_supported((8, 32), w2, s2, b2, 32, 4, mx.float32) is None
    kernel, call = wide_qmm.wide_qmm_call(mx.zeros((8, 32)), w2, s2, b2, 32, 4)
    source = metal_source(kernel, **call)
    assert "const device uint32_t* w [[buffer(1)]]" in source  # what the rule is about, in MLX's own words
    assert "const constant float* scales [[buffer(2)]]" in source


def test_the_metal_sources_are_ascii():
    """MLX hands the sources to Metal as ASCII (and the package reads them so)."""
    for name in sorted({n for names in source.SOURCES.values() for n in names}):
        raw = source.metal_text(name).encode()
        assert raw.isascii(), name


# Every mode answers with MLX's output and one line saying what fell back.


def run(target, drafter, tokenizer):
    from mlx_dflash.policies.width import has_quantized_layers, make_policy

    if not drafter.is_bound:
        drafter.bind(target)
    policy = make_policy(drafter.block_size, quantized=has_quantized_layers(target.model),
                         wide_kernels=target.wide_kernels)
    return generate(target, drafter, tokenizer, PROMPT, max_tokens=12, policy=policy)


STAGES = [("compile", 256), ("launch", 16), ("run", 256)]


@pytest.mark.parametrize("stage, limit", STAGES)
def test_generate_falls_back_at_each_stage(monkeypatch, tiny_chat_pair, capsys, stage, limit):
    _, tokenizer, _ = tiny_chat_pair
    target, drafter = head_dim_64_pair()
    expected = run(target, drafter, tokenizer)  # no Metal: MLX's path
    fake_metal(monkeypatch)
    monkeypatch.setattr(race_gate, "_shared", [RaceGate(race_gate._shared[0].path, timer=FixedTimer())])
    FakeKernels(monkeypatch, fail=stage, limit=limit)
    assert target.install_wide_kernels() > 0 and target.install_attention_kernel() == 4
    text = run(target, drafter, tokenizer)
    assert text.tokens == expected.tokens
    stats = text.stats
    assert {e["kernel"] for e in stats.routes} == {"wide_qmm", "mr_attention"}
    assert all(e["route"] == MLX and e["fallback"] and "ours failed here" in e["reason"] for e in stats.routes)
    notes = [n for n in stats.notes if n.startswith("note: verify")]
    assert sorted(n.split(":")[1] for n in notes) == [" verify attention", " verify matmul"]  # a line per kernel
    assert all("instead of ours (ours failed here: " in n for n in notes)
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: verify")]
    assert said == notes  # once each
    again = run(target, drafter, tokenizer)  # remembered: no second try, nothing said again
    assert again.tokens == expected.tokens and set(again.stats.notes) == set(stats.notes)
    assert "note: verify" not in capsys.readouterr().err


def test_a_refused_size_runs_ours_smaller_without_a_fallback(monkeypatch, tiny_chat_pair):
    _, tokenizer, _ = tiny_chat_pair
    target, drafter = head_dim_64_pair()
    expected = run(target, drafter, tokenizer)
    fake_metal(monkeypatch)
    monkeypatch.setattr(race_gate, "_shared", [RaceGate(race_gate._shared[0].path, timer=FixedTimer())])
    kernels = FakeKernels(monkeypatch, fail="launch", limit=64)
    target.install_wide_kernels(), target.install_attention_kernel()
    stats = run(target, drafter, tokenizer).stats
    assert run(target, drafter, tokenizer).tokens == expected.tokens
    assert all(e["route"] == OURS and not e["fallback"] for e in stats.routes) and stats.notes == []
    assert max(n for kernel, n in kernels.launches if kernel == "mr_attention") > 64  # tried, refused
    sizes = {v["size"] for v in race_gate._shared[0].verdicts.values()}
    assert sizes == {64}


def test_batch_generate_falls_back_with_rows_of_their_own_lengths(monkeypatch, tiny_chat_pair):
    from mlx_dflash.decoding.batch_decoder import batch_generate

    _, tokenizer, _ = tiny_chat_pair
    target, drafter = head_dim_64_pair()
    drafter.bind(target)
    prompts = [PROMPT, PROMPT[:9], PROMPT[3:20]]
    expected = batch_generate(target, drafter, tokenizer, prompts, max_tokens=10, width=8)
    fake_metal(monkeypatch)
    monkeypatch.setattr(race_gate, "_shared", [RaceGate(race_gate._shared[0].path, timer=FixedTimer())])
    FakeKernels(monkeypatch, fail="run")
    target.install_wide_kernels(), target.install_attention_kernel()
    before = routes.snapshot()
    got = batch_generate(target, drafter, tokenizer, prompts, max_tokens=10, width=8)
    assert got.token_ids == expected.token_ids
    calls = routes.since(before)
    assert any(e["bin"].startswith("mr_attention float32 B3") for e in calls)  # the ragged batch was routed
    assert all(e["route"] == MLX and e["fallback"] for e in calls)


def test_the_server_answers_batched_requests_through_a_failing_kernel(monkeypatch, tiny_chat_pair):
    from concurrent.futures import ThreadPoolExecutor

    from serving import chat_text, client, running

    from mlx_dflash.policies.dcut import build_policy
    from mlx_dflash.policies.width import WidthOptions

    _, tokenizer, _ = tiny_chat_pair
    target, drafter = head_dim_64_pair()
    drafter.bind(target)
    pair = (target, drafter, tokenizer)
    asks = [f"Tell me about {what}." for what in ("the sea", "a mountain range", "rain")]

    def answers():
        policy = build_policy(target, drafter, WidthOptions(8), 3)
        with running(pair, policy=policy, engine_options=dict(max_batch=3)) as (url, engine):
            c = client(url)
            with ThreadPoolExecutor(3) as pool:
                return list(pool.map(lambda ask: chat_text(c, messages=[{"role": "user", "content": ask}],
                                                           max_tokens=10, temperature=0)[0], asks))

    expected = answers()
    fake_metal(monkeypatch)
    monkeypatch.setattr(race_gate, "_shared", [RaceGate(race_gate._shared[0].path, timer=FixedTimer())])
    FakeKernels(monkeypatch, fail="compile")
    target.install_wide_kernels(), target.install_attention_kernel()
    before = routes.snapshot()
    assert answers() == expected
    calls = routes.since(before)
    assert {e["kernel"] for e in calls} == {"wide_qmm", "mr_attention"}
    assert all(e["route"] == MLX and e["fallback"] for e in calls)


def test_the_doctor_reports_a_kernel_that_fails_only_when_run_again(monkeypatch):
    from mlx_dflash import doctor

    fake_metal(monkeypatch)
    monkeypatch.setattr(checks, "QMM_SHAPES", [(6, 128, 96, 64, 4, "float32")])
    monkeypatch.setattr(doctor, "RaceGate", lambda path, **kw: RaceGate(path, timer=FixedTimer(), **kw))
    calls = []

    def once(x, w, s, b, gs, bits, threads=None):  # the gate's run alone works; the float32 comparison's fails
        calls.append(threads)
        if len(calls) > 1:
            raise RuntimeError("[METAL] Command buffer execution failed: Internal Error")
        return mx.quantized_matmul(x, w, s, b, transpose=True, group_size=gs, bits=bits)

    monkeypatch.setattr(wide_qmm, "wide_quantized_matmul", once)
    check = doctor.check_kernel("wide_qmm", checks.check_qmm, "MLX's quantized matmul")
    assert check.status == "warn" and check.details[0]["error"].startswith("RuntimeError: [METAL] Command buffer")


def test_the_doctor_answers_with_failing_kernels(monkeypatch):
    from mlx_dflash import doctor

    fake_metal(monkeypatch)
    FakeKernels(monkeypatch, fail="run", kernels=("mr_attention",))
    monkeypatch.setattr(checks, "QMM_SHAPES", [(6, 128, 96, 64, 4, "float32")])
    monkeypatch.setattr(checks, "ATTENTION_SHAPES", [(2, 1, 4, 64, 40, "float32")])
    monkeypatch.setattr(doctor, "RaceGate", lambda path, **kw: RaceGate(path, timer=FixedTimer(), **kw))
    qmm = doctor.check_kernel("wide_qmm", checks.check_qmm, "MLX's quantized matmul")
    attention = doctor.check_kernel("mr_attention", checks.check_attention, "MLX's SDPA")
    assert qmm.status == "ok" and qmm.details[0]["threads"] == 512 and qmm.details[0]["soak_calls"] == 200
    assert attention.status == "warn" and attention.line == (
        "ours failed to run on 1 of 1 shapes, MLX's SDPA serves those: float32 2 rows, 4/1 heads, D64, 40 keys: "
        f"RuntimeError: {RUN_ERROR}; MLX's path serves it")


def test_bench_widths_forced_says_what_fell_back(monkeypatch, tmp_path):
    from mlx_dflash.bench_widths import run_widths_bench

    fake_metal(monkeypatch)
    FakeKernels(monkeypatch, fail="compile")
    three = run_widths_bench(None, tmp_path / "3-bit", shapes=["128x96"], widths=[6], repeats=1, warmup=0, log=None,
                             quantize_bits=3)  # a layer our kernel does not take: MLX's alone, nothing to fall back
    assert {s["impl"] for s in three["series"]} == {"mlx"} and three["fallbacks"] == []
    assert three["traffic_model"]["rows"] == []  # no shape of ours to model
    lines = []
    res = run_widths_bench(None, tmp_path, shapes=["128x96"], widths=[5, 6], repeats=1, warmup=0, log=lines.append,
                           progress=False)
    assert res["fallbacks"] == ["note: verify matmul: MLX's quantized matmul instead of ours (route 'dflash' "
                                "forced, but ours failed here: RuntimeError: [metal::Device] Unable to build metal "
                                "library from source; the shape bins are in the routes)"]
    assert res["fallbacks"][0] in lines


# The Metal-guarded paths no other test reaches (docs/development.md, "Metal-guarded code").


def test_the_chip_and_machine_as_metal_reports_them(monkeypatch):
    from mlx_dflash import machine

    info = {"architecture": "applegpu_g16s", "device_name": "Apple M4 Pro", "memory_size": 48 << 30}
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(mx, "device_info", lambda: dict(info))
    assert machine.chip_name.__wrapped__() == "applegpu_g16s"
    found = machine.machine_info()
    assert found["metal"] and found["chip"] == "Apple M4 Pro" and found["device_info"] == info
    assert found["quantized_matmul_routing"].startswith("M3 and newer: qmv_wide")
    assert machine.fast_float_dtype() == "float16" and machine.prefill_step() == 2048
    assert machine.prefill_step(serving=True) == 512 and machine.half_precision_warning("float16") is None


def test_the_cpu_pitfall_and_the_blas_are_not_said_on_the_gpu(monkeypatch):
    from mlx_dflash import machine, pitfalls

    target, drafter = head_dim_64_pair()
    monkeypatch.setattr(mx, "default_device", lambda: mx.cpu)
    assert pitfalls.cpu_dtype_warning(target, drafter) is not None  # quantized, on the CPU
    slow = {"library": "mlx_cpu.libs/libblas-bd8a282c.so.3", "kind": "bundled", "slow": True}
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    assert pitfalls.cpu_dtype_warning(target, drafter) is None
    assert machine.slow_blas_warning(slow) is None and machine.rerun_with_fast_blas() is None  # no re-run


def test_the_process_gate_keeps_its_verdicts_in_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_DFLASH_CACHE", str(tmp_path))
    monkeypatch.setattr(race_gate, "_shared", [])
    gate = race_gate.shared_gate()
    assert gate is race_gate.shared_gate() and gate.path == tmp_path / "race_verdicts.json"


def test_the_words_of_each_verdict():
    assert describe({"route": OURS, "numerics_ok": True}) == "race gate: dflash (no timings recorded)"
    assert describe({"route": OURS, "numerics_ok": True, "dflash_s": 1e-3, "mlx_s": 2e-3}) == (
        "race gate: ours 1 ms, MLX's 2 ms")
    assert describe({"route": MLX, "failed": "ValueError: Thread group size (64) is greater than  the maximum "
                     "allowed threads per threadgroup (32)."}) == (
        "ours failed here: every launch size over the pipeline's thread limit")


def test_a_wide_layer_freezes_and_unfreezes_as_mlxs_does(monkeypatch):
    fake_metal(monkeypatch)
    wide = wide_qmm.WideQuantizedLinear(nn.QuantizedLinear(64, 32, bias=True, group_size=32, bits=4))
    plain = nn.QuantizedLinear(64, 32, bias=True, group_size=32, bits=4)
    names = lambda m: [k for k, _ in mlx_tree_flatten(m.trainable_parameters())]  # noqa: E731
    assert names(wide) == names(plain) == []  # frozen when made
    wide.unfreeze(), plain.unfreeze()
    assert names(wide) == names(plain) == ["weight", "scales", "biases", "bias"]


def test_the_verify_paths_with_metal_and_nothing_of_ours_installed(monkeypatch):
    from types import SimpleNamespace

    fake_metal(monkeypatch)
    monkeypatch.setenv(wide_qmm.ROUTE_ENV, "mlx")
    target, _ = head_dim_64_pair()
    paths, notes = engine_report.verify_paths(target)
    assert paths["matmul"] == "MLX's quantized matmul (our wide kernel not installed; MLX_DFLASH_WIDE_KERNEL=mlx)"
    assert notes == []
    path, notes = engine_report._attention_path(SimpleNamespace(attention_routing=(0, "auto")))
    assert path == "MLX's SDPA (no attention module to route)" and notes[0].startswith("note: verify attention:")


def test_a_routed_attention_module_reads_as_itself_and_a_swapped_one_is_left_alone(monkeypatch):
    from mlx_dflash.kernels import verify_attention as va

    fake_metal(monkeypatch)
    target, _ = head_dim_64_pair()
    layers = target.model.model.layers
    sites, route = va.install_sites(layers, "auto")
    assert len(sites) == 4 and route == "auto"
    original = layers[0]["self_attn"]
    with va.routing(sites, route):
        routed = layers[0]["self_attn"]
        assert isinstance(routed, va.RoutedAttention) and routed.n_heads == original.n_heads  # the module's own
    assert layers[0]["self_attn"] is original
    layers[1]["self_attn"] = stand_in = nn.Linear(2, 2)  # no attention module
    with va.routing(sites, route):  # swapped since the sites were found: left as it is
        assert layers[1]["self_attn"] is stand_in and isinstance(layers[0]["self_attn"], va.RoutedAttention)


def test_each_call_our_kernels_refuse_says_why(monkeypatch):
    """The reasons a routed call stays with MLX's path (kernels/routes.py records them), one per check."""
    from mlx_dflash.errors import DFlashError
    from mlx_dflash.kernels import verify_attention as va

    x = mx.zeros((8, 128))
    w, s, b = mx.quantize(mx.random.normal((16, 128)), 64, 4)
    check = wide_qmm.check_wide_supported
    assert check(x.shape, w, s, b, 64, 4, mx.float32) is None
    assert check(x.shape, w, s, b, 16, 4, mx.float32) == "group_size=16 not in (32, 64, 128)"
    assert check(x.shape, w, s, b, 64, 4, mx.int32) == "dtype mlx.core.int32 not supported"
    assert check(x.shape, w.astype(mx.int32), s, b, 64, 4, mx.float32).startswith("expected x (..., K), w (N,")
    assert check((8, 96), w, s, b, 64, 4, mx.float32) == "K=96 does not match w (16, 16) / group_size 64"
    assert check(x.shape, w, s[:8], b, 64, 4, mx.float32) == "scales/biases shape mismatch"
    assert check(x.shape, w, s.astype(mx.int32), b, 64, 4, mx.float32) == "scales/biases dtype not supported"
    with pytest.raises(TypeError, match="expected nn.QuantizedLinear, got Linear"):
        wide_qmm.WideQuantizedLinear(nn.Linear(4, 4))
    q, k = mx.zeros((1, 4, 4, 64)), mx.zeros((1, 2, 40, 64))
    assert attn.check_supported(q[0], k, k, 40) == "expected q (B, Hq, L, D), k and v (B, Hkv, S, D)"
    assert attn.check_supported(q, k, k, 3) == "keys=3 must be in 4..40"
    assert attn.check_supported(q, k, k, 40, [40, 30]) == (
        "row lengths [40, 30] must be one per batch row, each in 4..40")
    with pytest.raises(ValueError, match="multi_row_attention: keys=50 must be in 4..40"):
        attn.attention_calls(q, k, k, 0.125, 50)
    monkeypatch.setattr(attn, "metal_available", lambda: False)
    with pytest.raises(RuntimeError, match="multi_row_attention needs Metal"):
        attn.multi_row_attention(q, k, k, 0.125)
    with pytest.raises(DFlashError, match="attention route 'fastest': use one of auto, dflash, mlx"):
        va.install_sites([], "fastest")


def test_a_metal_file_without_its_body_marker_is_named(monkeypatch):
    monkeypatch.setattr(source, "metal_text", lambda name: "//@@ header\n// nothing else\n")
    with pytest.raises(ValueError, match="wide_qmm.metal: missing '//@@ body' marker"):
        source.read_metal_file("wide_qmm.metal")
