"""The multi-row attention kernel inside the target's verify forward (verify_attention.py).

On the CPU the routing is forced (Metal reported available) with a stand-in for the Metal kernel: a numpy
block attention, or the kernel's own source through the CPU Metal emulator. Checked: which calls are
routed, the race gate's verdicts both ways, the env override, logits equal to the unrouted forward,
lossless greedy decoding equal to mlx-lm's, and mlx-lm's classes and module globals left as they were.
The `metal` test runs the real kernel on a Mac.
"""

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map
from mlx_lm.models import base, llama
from mlx_lm.models.cache import QuantizedKVCache
from mlx_lm.utils import _get_classes

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import mlx_lm_greedy  # noqa: E402
from mlx_dflash.kernels import attention as attn  # noqa: E402
from mlx_dflash.kernels import verify_attention as va  # noqa: E402
from mlx_dflash.decoding.batch_decoder import speculative_rounds  # noqa: E402
from mlx_dflash.models.batch_cache import add_row, batched  # noqa: E402
from mlx_dflash.models.loader import drafter_config_for, init_drafter  # noqa: E402
from mlx_dflash.errors import DFlashError  # noqa: E402
from mlx_dflash.policies.width import DraftControls, make_policy  # noqa: E402
from mlx_dflash.kernels.race_gate import RACE_REPEATS, RaceGate  # noqa: E402
from mlx_dflash.decoding.sampling import SamplingParams  # noqa: E402
from mlx_dflash.models.target import Target  # noqa: E402

# Head dim 64 (the kernel's), GQA 4, two layers: small enough for the default tier.
COMMON = dict(hidden_size=128, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=1, head_dim=64, rms_norm_eps=1e-5, vocab_size=211, tie_word_embeddings=False,
              rope_theta=10000.0, max_position_embeddings=512)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[],
           norm_topk_prob=True)
FAMILIES = {
    "llama": {},
    "qwen3": {},
    "qwen2": dict(hidden_size=256, num_key_value_heads=2),  # qwen2's head dim is hidden / heads
    "qwen3_moe": dict(MOE),
    "qwen3_5": dict(num_hidden_layers=4, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                    linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2),
    "gemma3_text": dict(num_hidden_layers=3, sliding_window=8, sliding_window_pattern=3, query_pre_attn_scalar=64),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
}
PROMPT = [5, 17, 42, 99, 3, 150, 7, 61, 88, 23, 11, 190]
_models = {}


def random_model(family):
    config = dict(COMMON, model_type=family, **FAMILIES[family])
    model_class, args_class = _get_classes(config)
    mx.random.seed(sum(map(ord, family)) + 3)
    model = model_class(args_class.from_dict(config))
    model.update(tree_map(lambda p: p * 3 if p.ndim == 2 else p, model.parameters()))  # livelier than init
    mx.eval(model.parameters())
    return model


def tiny_model(family):
    """A tiny random float32 instance of the family's mlx-lm class (built once per session)."""
    if family not in _models:
        _models[family] = random_model(family)
    return _models[family]


def numpy_block_attention(q, k, v, scale, keys, lengths=None, sees=None):
    """An independent float64 reference of the kernel's contract (not MLX's SDPA): batch row b attends its
    first lengths[b] keys (default: `keys`), its queries the last of them, each seeing the block keys its `sees`
    bits name (default: the ones up to itself)."""
    q64, k64, v64 = (np.array(a.astype(mx.float32), dtype=np.float64) for a in (q, k[:, :, :keys], v[:, :, :keys]))
    b, hq, rows, d = q64.shape
    g = hq // k64.shape[1]
    k64, v64 = np.repeat(k64, g, axis=1), np.repeat(v64, g, axis=1)
    s = np.einsum("bhld,bhsd->bhls", q64, k64) * scale
    before = np.array(lengths or [keys] * b)[:, None, None, None] - rows  # [B, 1, 1, 1]: keys before the block
    j = np.arange(keys)[None, None, None, :] - before  # the block key a column holds, where 0 <= j < rows
    if sees is None:
        visible = j <= np.arange(rows)[:, None]
    else:
        bits = np.array(sees, dtype=np.int64)[:, None, :, None]  # [B, 1, L, 1]
        visible = (j < 0) | ((j < rows) & ((bits >> np.clip(j, 0, rows - 1)) & 1).astype(bool))
    s = np.where(visible, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return mx.array(np.einsum("bhls,bhsd->bhld", p / p.sum(-1, keepdims=True), v64)).astype(q.dtype)


class Gate(RaceGate):
    """A race gate in a temp file with injected timings; counts races and first runs of ours (`probing` while
    it runs ours alone, before a shape's first routed call)."""

    def __init__(self, path, ours_faster):
        super().__init__(path, timer=self.timed)
        self.ours_faster, self.races, self.probes, self.probing = ours_faster, 0, 0, False

    def _run(self, key, ours, sizes):
        self.probes, self.probing = self.probes + 1, True
        try:
            return super()._run(key, ours, sizes)
        finally:
            self.probing = False

    def timed(self, calls, repeats):
        self.races += repeats == RACE_REPEATS
        return {"dflash": [1.0] * repeats, "mlx": [2.0] * repeats} if self.ours_faster else {
            "dflash": [2.0] * repeats, "mlx": [1.0] * repeats}


@pytest.fixture
def forced(monkeypatch, tmp_path):
    """Metal reported available, the kernel replaced by a counting stand-in, a fresh gate (ours faster)."""
    monkeypatch.delenv(va.ROUTE_ENV, raising=False)
    monkeypatch.setattr(attn, "metal_available", lambda: True)
    state = dict(calls=[], kernel=numpy_block_attention, gate=Gate(tmp_path / "verdicts.json", ours_faster=True))

    def stand_in(q, k, v, scale, keys=None, lengths=None, threads=None, sees=None):
        if not state["gate"].probing:  # the calls inside forwards
            state["calls"].append(q.shape[2] if sees is None else f"tree {q.shape[2]}")
        return state["kernel"](q, k, v, scale, k.shape[2] if keys is None else keys, lengths, sees)

    monkeypatch.setattr(attn, "multi_row_attention", stand_in)
    monkeypatch.setattr(attn, "shared_gate", lambda: state["gate"])
    return state


def prefilled(family, route=None):
    target = Target(tiny_model(family), layer_ids=(0, 1))
    routed = target.install_attention_kernel(route) if route else 0
    cache = target.make_cache()
    target.prefill(mx.array(PROMPT), cache)
    return target, cache, routed


def test_attention_sites_per_family():
    assert [n for _, n in va.attention_sites(tiny_model("llama").model.layers)] == ["self_attn"] * 2
    hybrid = tiny_model("qwen3_5").language_model.model.layers
    assert [(i, n) for i, layer in enumerate(hybrid) for _, n in va.attention_sites([layer])] == [
        (1, "self_attn"), (3, "self_attn")]  # full-attention layers only, not the GatedDeltaNet ones
    assert len(va.attention_sites(tiny_model("gpt_oss").model.layers)) == 2  # wired; its sinks keep MLX's


def test_which_calls_are_routed():
    q, k = mx.zeros((1, 4, 8, 64)), mx.zeros((1, 1, 40, 64))
    assert va.why_not_routed(q, k, k, None, "causal", None) is None
    assert va.why_not_routed(q, k, k, None, "causal", mx.zeros(4)) == "attention sinks"
    assert va.why_not_routed(q, k, k, QuantizedKVCache(), "causal", None) == "quantized KV cache"
    assert va.why_not_routed(q, k, k, None, mx.ones((8, 40), dtype=mx.bool_), None).startswith("not a causal mask")
    assert va.why_not_routed(q, k, k, None, None, None).startswith("not a causal mask")
    assert "rows=1" in va.why_not_routed(q[:, :, :1], k, k, None, "causal", None)
    assert "rows=17" in va.why_not_routed(mx.zeros((1, 4, 17, 64)), k, k, None, "causal", None)
    assert "head dim 256" in va.why_not_routed(mx.zeros((1, 4, 8, 256)), mx.zeros((1, 1, 40, 256)),
                                               mx.zeros((1, 1, 40, 256)), None, "causal", None)
    assert "multiple" in va.why_not_routed(mx.zeros((1, 3, 8, 64)), mx.zeros((1, 2, 40, 64)),
                                           mx.zeros((1, 2, 40, 64)), None, "causal", None)
    assert "dtype" in va.why_not_routed(q.astype(mx.float16), k, k, None, "causal", None)


def test_no_metal_or_env_mlx_installs_nothing(monkeypatch):
    target = Target(tiny_model("llama"))
    monkeypatch.setattr(attn, "metal_available", lambda: False)
    assert target.install_attention_kernel() == 0 and target.install_attention_kernel("dflash") == 0
    monkeypatch.setattr(attn, "metal_available", lambda: True)
    monkeypatch.setenv(va.ROUTE_ENV, "mlx")
    assert target.install_attention_kernel() == 0 and target._attention == ([], "mlx")
    monkeypatch.setenv(va.ROUTE_ENV, "fastest")
    with pytest.raises(DFlashError, match="MLX_DFLASH_ATTENTION_KERNEL='fastest'"):
        target.install_attention_kernel()
    monkeypatch.setenv(va.ROUTE_ENV, "dflash")
    assert target.install_attention_kernel() == 2 and target._attention[1] == "dflash"


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_routed_verify_logits_equal_the_unrouted(forced, family):
    plain, plain_cache, _ = prefilled(family)
    target, cache, routed = prefilled(family, "dflash")
    assert routed == 2 and forced["calls"] == []  # the prefill is not routed
    for rows in (1, 2, 7, 16):
        ids = mx.array([[(13 * rows + j) % 211 for j in range(rows)]])
        want, want_features = plain.forward(ids, plain_cache)
        got, features = target.forward(ids, cache)
        assert mx.allclose(got, want, atol=1e-4, rtol=1e-4) and mx.allclose(features, want_features, atol=1e-4)
    assert forced["calls"] == [2, 2, 7, 7, 16, 16]  # each layer, every verify of 2..16 rows, no race (forced)
    assert forced["gate"].probes == 3  # ours run alone once per shape first: a failure would fall back
    assert forced["gate"].races == 0


def test_a_batched_verify_is_routed_with_each_row_its_own_length(forced):
    """The batch cache at one row (and at rows of one length) gives the plain causal mask; rows of different
    lengths an array mask that the kernel computes from their lengths: the server's batched engine verifies
    through our kernel either way, with the logits of each row's own forward."""
    plain, plain_cache, _ = prefilled("llama")
    target, single, _ = prefilled("llama", "dflash")
    other, other_single, _ = prefilled("llama")
    other.forward(mx.array([[7, 7, 7]]), other_single)  # three positions longer
    _, longer, _ = prefilled("llama")
    other.forward(mx.array([[7, 7, 7]]), longer)
    ids = mx.array([[3, 1, 4, 1, 5]])
    want, _ = plain.forward(ids, plain_cache)
    want_other, _ = other.forward(ids, longer)
    for rows, wants in (([single], [want]), ([single, single], [want, want]),
                        ([single, other_single], [want, want_other]), ([other_single, single], [want_other, want])):
        cache = batched(target.make_cache())
        for row in rows:
            add_row(cache, row)
        forced["calls"].clear()
        got, _ = target.forward(mx.concatenate([ids] * len(rows)), cache)
        assert all(mx.allclose(got[b : b + 1], w, atol=1e-4, rtol=1e-4) for b, w in enumerate(wants))
        assert forced["calls"] == [5, 5]  # both layers, through the stand-in
    assert va.why_not_routed(mx.zeros((2, 4, 5, 64)), mx.zeros((2, 1, 20, 64)), mx.zeros((2, 1, 20, 64)), None,
                             mx.ones((2, 1, 5, 20), dtype=mx.bool_), None).startswith("not a causal mask")


def test_ragged_batched_decoding_through_the_kernel_is_lossless(forced):
    """Two requests of different lengths decoding together, every verify through the stand-in kernel with each
    row's own length: each gets mlx-lm's greedy output."""
    from mlx_dflash.decoding.batch_decoder import Batch
    from mlx_dflash.decoding.decoder import DecodeState

    model = tiny_model("llama")
    target = Target(model)
    drafter = init_drafter(drafter_config_for(target, num_layers=1, block_size=8, num_target_features=1),
                           seed=1).bind(target)
    target.install_attention_kernel("dflash")
    prompts = [PROMPT, PROMPT[:5] + [77, 78]]
    batch = Batch(target, drafter, make_policy(drafter.block_size, 6, controls=DraftControls(prompt_lookup=False)))
    for i, p in enumerate(prompts):
        state = DecodeState.fresh(target, drafter)
        state.extend(p[:-1], target.read(mx.array(p[:-1]), state.cache))
        batch.join(i, state, p[-1], SamplingParams(), 16)
    got = [[], []]
    while batch.rows:
        for handle, rnd in batch.round():
            got[handle] += rnd.tokens
        batch.leave({r.handle for r in batch.rows if r.remaining <= 0})
    assert got == [mlx_lm_greedy(model, p, 16) for p in prompts]
    assert forced["calls"] and set(forced["calls"]) <= set(range(2, 7))


@pytest.mark.parametrize("ours_faster", [True, False])
def test_race_verdict_routes_the_verify(forced, ours_faster):
    forced["gate"] = gate = Gate(forced["gate"].path, ours_faster)
    plain, plain_cache, _ = prefilled("llama")
    target, cache, _ = prefilled("llama", "auto")
    for _ in range(3):
        ids = mx.array([[3, 1, 4, 1, 5, 9]])  # 18, 24, 30 keys: one cache bin
        want, _ = plain.forward(ids, plain_cache)
        assert mx.allclose(target.forward(ids, cache)[0], want, atol=1e-4, rtol=1e-4)
    # One race for both layers (same shape, rows, cache bin), its numerics check running ours once alone;
    # then ours runs in both layers of all three forwards only if it won.
    assert gate.races == 1 and gate.probes == 1 and forced["calls"] == ([6] * 6 if ours_faster else [])
    (key, verdict), = RaceGate(gate.path).verdicts.items()
    assert key.endswith("|mr_attention|float32|B1|Hq4|Hkv1|D64|keys<=32|rows6")
    assert verdict["route"] == ("dflash" if ours_faster else "mlx") and verdict["numerics_ok"]


def test_a_wrong_kernel_loses_the_race(forced):
    forced["kernel"] = lambda q, k, v, scale, keys, lengths: numpy_block_attention(q, k, v, scale * 1.5, keys, lengths)
    plain, plain_cache, _ = prefilled("llama")
    target, cache, _ = prefilled("llama", "auto")
    ids = mx.array([[3, 1, 4, 1, 5]])
    assert mx.allclose(target.forward(ids, cache)[0], plain.forward(ids, plain_cache)[0], atol=1e-5)
    assert forced["gate"].races == 0 and next(iter(forced["gate"].verdicts.values()))["route"] == "mlx"


def test_mlx_lm_is_untouched(forced):
    module_globals = dict(vars(llama))
    call = llama.Attention.__call__
    target, cache, _ = prefilled("llama", "dflash")
    attention = [layer.self_attn for layer in target.model.model.layers]
    target.forward(mx.array([[1, 2, 3]]), cache)
    ran = []

    def fails_inside_the_forward(*a):  # runs alone (the gate's first run of a shape), then raises in the forward
        ran.append(1)
        if len(ran) > 1:
            raise RuntimeError("kernel failed")
        return numpy_block_attention(*a)

    forced["kernel"] = fails_inside_the_forward
    with pytest.raises(RuntimeError, match="kernel failed"):
        target.forward(mx.array([[1, 2, 3]]), cache)
    assert llama.Attention.__call__ is call and llama.scaled_dot_product_attention is base.scaled_dot_product_attention
    assert dict(vars(llama)) == module_globals and "scaled_dot_product_attention" not in vars(llama.Attention)
    assert all(layer.self_attn is a and type(a) is llama.Attention
               for layer, a in zip(target.model.model.layers, attention, strict=True))


# Attention modules our kernel serves per verify: gemma3's sliding layers pass a window mask, gpt-oss
# passes attention sinks; both stay with MLX's SDPA.
ROUTED_LAYERS = dict(llama=2, qwen3=2, qwen2=2, qwen3_moe=2, qwen3_5=2, gemma3_text=1, gpt_oss=0)


def greedy_run(family, block_size, max_tokens=24):
    """(our tokens, mlx-lm's greedy tokens, the rows of each verify attention call expected to be routed)."""
    model = tiny_model(family)
    target = Target(model)
    drafter = init_drafter(drafter_config_for(target, num_layers=1, block_size=block_size, num_target_features=1),
                           seed=1).bind(target)
    target.install_attention_kernel("dflash")
    policy = make_policy(drafter.block_size, block_size)
    rounds = list(speculative_rounds(target, drafter, mx.array(PROMPT), policy, SamplingParams(), max_tokens))
    routed = [r.drafted + 1 for r in rounds if r.drafted for _ in range(ROUTED_LAYERS[family])]
    return [t for r in rounds for t in r.tokens], mlx_lm_greedy(model, PROMPT, max_tokens), routed


@pytest.mark.parametrize("family,block_size", [("llama", 8), ("qwen3", 16)])
def test_routed_decoding_is_lossless(forced, family, block_size):
    got, want, routed = greedy_run(family, block_size)
    assert len(set(want)) > 3 and got == want
    assert forced["calls"] == routed and max(routed) == block_size  # every verify went through the stand-in


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe", "qwen3_5", "gemma3_text", "gpt_oss"])
def test_routed_decoding_is_lossless_on_more_families(forced, family):
    got, want, routed = greedy_run(family, 8)
    assert len(set(want)) > 3 and got == want
    assert forced["calls"] == routed


@pytest.mark.emulator
def test_the_kernel_source_in_the_verify_forward(forced):
    """The stand-in is the Metal source itself, run by the CPU emulator, inside a real verify forward."""
    from metal_emulator import run_kernel

    def emulated(q, k, v, scale, keys, lengths=None, sees=None):
        (k1, c1), (k2, c2) = attn.attention_calls(q, k, v, scale, keys, lengths, sees=sees)
        first = run_kernel(k1, **c1)
        return run_kernel(k2, **{**c2, "inputs": [*first.outputs, c2["inputs"][2]]}).outputs[0].reshape(q.shape)

    forced["kernel"] = emulated
    plain, plain_cache, _ = prefilled("qwen3")
    target, cache, _ = prefilled("qwen3", "dflash")
    ids = mx.array([[8, 6, 7, 5, 3, 0, 9]])
    assert mx.allclose(target.forward(ids, cache)[0], plain.forward(ids, plain_cache)[0], atol=1e-4, rtol=1e-4)
    assert forced["calls"] == [7, 7]


# parents of a 9-node draft tree, every parent before its children; batch row 1 a different tree
TREE_PARENTS = [[-1, 0, 0, 1, 1, 2, 3, 3, 6], [-1, 0, 1, 0, 3, 2, 2, 4, 0]]


def tree_of(parents: list):
    """The decoding/tree.py `TreeBlock` of the trees given by each row's parents (tokens left to the caller)."""
    from mlx_dflash.decoding.tree import TreeBlock

    parents = np.array(parents)
    depth = np.zeros(parents.shape, np.int32)
    for i in range(1, parents.shape[1]):  # parents come first
        depth[:, i] = depth[np.arange(len(parents)), parents[:, i]] + 1
    shape = parents.shape
    return TreeBlock(np.zeros(shape, np.int64), parents, depth, np.ones(shape, bool), np.ones(shape),
                     np.zeros(shape, bool))


def tree_logits(target, rows: int, kernel_route=None) -> mx.array:
    """The logits of a tree forward of `rows` batch rows (TREE_PARENTS) after the prompt, a different prompt
    length a row: one sequence's cache at one row, a batch cache of rows of their own lengths at two."""
    caches = []
    for b in range(rows):
        cache = target.make_cache()
        target.prefill(mx.array(PROMPT[: len(PROMPT) - 3 * b]), cache)
        caches.append(cache)
    if rows == 1:
        cache = caches[0]
    else:
        cache = batched(target.make_cache())
        for c in caches:
            add_row(cache, c)
    tokens = mx.array([[(29 * b + 7 * i) % 211 for i in range(9)] for b in range(rows)])
    return target.forward(tokens, cache, tree_of(TREE_PARENTS[:rows]))[0]


@pytest.mark.parametrize("rows", [1, 2])
def test_a_tree_verify_is_routed_with_each_node_seeing_its_ancestors(forced, rows):
    """A draft tree's forward goes through our kernel (the tree's mask given as each node's ancestor bits), alone
    and as a batch of rows of their own lengths, with the logits of the unrouted tree forward; a windowed layer's
    tree mask stays with MLX."""
    plain = Target(tiny_model("llama"), layer_ids=(0, 1))
    target = Target(tiny_model("llama"), layer_ids=(0, 1))
    assert target.install_attention_kernel("dflash") == 2
    want, got = tree_logits(plain, rows), tree_logits(target, rows)
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4)
    assert forced["calls"] == ["tree 9", "tree 9"]  # both layers, through the stand-in, as a tree


def test_decoding_with_trees_through_the_kernel_is_lossless(forced):
    """Greedy decoding with trees forced, every tree verify through the stand-in kernel: mlx-lm's greedy output.
    The drafter ranks the target's token second (test_trees.py `SecondChoice`), so each round keeps a node off the
    tree's first path, whose position is its depth, not its place in the block."""
    from oracles import OracleDrafter
    from test_trees import SecondChoice

    model = tiny_model("llama")
    target = Target(model)
    real = init_drafter(drafter_config_for(target, num_layers=1, block_size=16, num_target_features=1), seed=1)
    target.install_attention_kernel("dflash")
    want = mlx_lm_greedy(model, PROMPT, 20)
    for width in (4, 9):
        oracle = OracleDrafter(real.config, len(PROMPT), want, set(range(40))).bind(target)  # its first choice wrong
        policy = make_policy(real.block_size, width, controls=DraftControls(tree=True, prompt_lookup=False))
        rounds = list(speculative_rounds(target, SecondChoice(oracle, want, len(PROMPT)), mx.array(PROMPT), policy,
                                         SamplingParams(), 20))
        assert [t for r in rounds for t in r.tokens] == want, width
        assert sum(r.tree and r.accepted >= 1 for r in rounds) >= 4, width
    assert "tree 4" in forced["calls"] and "tree 9" in forced["calls"]


@pytest.mark.emulator
def test_the_kernel_source_in_a_tree_verify(forced):
    """The stand-in is the Metal source itself, run by the CPU emulator, inside a real tree forward of a batch of
    two rows of their own lengths."""
    from metal_emulator import run_kernel

    def emulated(q, k, v, scale, keys, lengths=None, sees=None):
        (k1, c1), (k2, c2) = attn.attention_calls(q, k, v, scale, keys, lengths, sees=sees)
        first = run_kernel(k1, **c1)
        return run_kernel(k2, **{**c2, "inputs": [*first.outputs, c2["inputs"][2]]}).outputs[0].reshape(q.shape)

    forced["kernel"] = emulated
    plain = Target(tiny_model("qwen3"), layer_ids=(0, 1))
    target = Target(tiny_model("qwen3"), layer_ids=(0, 1))
    target.install_attention_kernel("dflash")
    assert mx.allclose(tree_logits(target, 2), tree_logits(plain, 2), atol=1e-4, rtol=1e-4)
    assert forced["calls"] == ["tree 9", "tree 9"]


@pytest.mark.metal
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_the_metal_kernel_in_the_verify_forward(monkeypatch, tmp_path, dtype):
    gate = RaceGate(tmp_path / "verdicts.json")  # the real timer
    monkeypatch.setattr(attn, "shared_gate", lambda: gate)
    model = random_model("qwen3")
    model.set_dtype(dtype)
    plain = Target(model, layer_ids=(0,))
    plain_cache = plain.make_cache()
    plain.prefill(mx.array(PROMPT * 60), plain_cache)  # 720 keys: 2-3 key chunks
    for route in ("dflash", "auto"):
        target = Target(model, layer_ids=(0,))
        assert target.install_attention_kernel(route) == 2
        cache = target.make_cache()
        target.prefill(mx.array(PROMPT * 60), cache)
        for rows in (2, 9, 16):
            ids = mx.array([list(range(rows))])
            got, want = target.forward(ids, cache)[0], plain.forward(ids, plain_cache)[0]
            scale = mx.abs(want).max().item()
            assert (mx.abs(got - want).max().item() / scale) < (1e-4 if dtype == mx.float32 else 3e-2)
            plain.trim(plain_cache, rows)
            target.trim(cache, rows)
    assert len(gate.verdicts) == 3 and all(v["numerics_ok"] for v in gate.verdicts.values())
