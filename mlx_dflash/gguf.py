"""Convert a llama.cpp GGUF file into a Hugging Face-layout MLX model directory.

The output (config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
generation_config.json) loads with `mlx_lm.load(path)`. Every tensor is dequantized with
`gguf.quants.dequantize` (numpy), so any GGUF quantization works, and the weights are stored
as plain float16/bfloat16/float32 (default: the one that runs fast on this machine). Only the `llama` and `qwen2` architectures are supported.
"""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from .errors import DFlashError
from .machine import fast_float_dtype
from .utils import DTYPES, sha256_file, staged_dir, write_json

SUPPORTED_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# Qwen2's split regex, as in the upstream tokenizer.json.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# llama.cpp token types (gguf.TokenType).
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4


def read_metadata(reader: gguf.GGUFReader) -> dict:
    """All key/value fields of a GGUF file as plain Python values."""
    return {name: field.contents() for name, field in reader.fields.items()}


def _f32(x) -> float:
    # GGUF stores float32; print 1e-05 rather than 9.999999747378752e-06.
    return float(str(np.float32(x)))


def hf_tensor_name(name: str) -> str:
    """Map a GGUF tensor name (`blk.3.attn_q.weight`) to its HF name."""
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
    if parts[0] == "rope_freqs":
        raise DFlashError(f"GGUF tensor {name} (llama3-style RoPE scaling) is not supported")
    raise DFlashError(f"GGUF tensor {name} has no Hugging Face equivalent in this converter")


def dequantize_tensor(t) -> np.ndarray:
    """A GGUF tensor as float32 numpy in HF (row-major, out x in) shape."""
    try:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise DFlashError(f"GGUF tensor {t.name} has unsupported type {t.tensor_type.name}") from None
    # GGUF lists dimensions innermost first.
    return np.asarray(w, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (it interleaves rotary halves for its RoPE).

    llama.cpp's converter does reshape(n_head, 2, D/2, ...).swapaxes(1, 2); this is the inverse.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def build_config(meta: dict, tensor_names: set[str], dtype: str) -> dict:
    arch = meta["general.architecture"]
    a = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    hidden, n_head = int(a("embedding_length")), int(a("attention.head_count"))
    n_kv = int(a("attention.head_count_kv", n_head))
    head_dim = int(a("attention.key_length", hidden // n_head))
    if int(a("attention.value_length", head_dim)) != head_dim:
        raise DFlashError(f"{arch} GGUF with different key and value head sizes is not supported")
    if int(a("rope.dimension_count", head_dim)) != head_dim:
        raise DFlashError(f"{arch} GGUF with partial rotary embeddings is not supported")
    if arch == "qwen2" and head_dim * n_head != hidden:
        raise DFlashError("qwen2 GGUF with head_dim * heads != hidden size is not supported")
    rope_scaling = None
    scaling = a("rope.scaling.type", "none")
    if scaling == "linear":
        rope_scaling = {"type": "linear", "factor": _f32(a("rope.scaling.factor"))}
    elif scaling != "none":
        raise DFlashError(f"{arch} GGUF with rope scaling {scaling!r} is not supported")

    tokens = meta["tokenizer.ggml.tokens"]
    vocab_size = int(a("vocab_size", len(tokens)))
    config = {
        "architectures": [SUPPORTED_ARCHS[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(a("feed_forward_length")),
        "num_hidden_layers": int(a("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(a("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(a("rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(a("context_length")),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": dtype,
    }
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
        config["mlp_bias"] = "blk.0.ffn_up.bias" in tensor_names
    else:
        config.update(use_sliding_window=False, sliding_window=config["max_position_embeddings"],
                      max_window_layers=config["num_hidden_layers"])
    for key in ("bos", "eos"):
        if (tid := meta.get(f"tokenizer.ggml.{key}_token_id")) is not None:
            config[f"{key}_token_id"] = int(tid)
    return config


def convert_weights(reader: gguf.GGUFReader, config: dict, dtype: str) -> dict[str, mx.array]:
    """Every tensor dequantized, un-permuted and cast, with a progress bar over the tensors (stderr)."""
    from tqdm import tqdm

    target = DTYPES[dtype]
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    weights = {}
    for t in tqdm(reader.tensors, desc=f"converting GGUF tensors to {dtype}", unit="tensor"):
        name = hf_tensor_name(t.name)
        w = dequantize_tensor(t)
        if config["model_type"] == "llama":
            if ".q_proj." in name:
                w = unpermute_qk(w, n_head)
            elif ".k_proj." in name:
                w = unpermute_qk(w, n_kv)
        weights[name] = mx.array(w).astype(target)
        mx.eval(weights[name])  # free the float32 copy now, not at save time
    return weights


def build_tokenizer(meta: dict) -> Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` from the GGUF vocabulary, merges and token types."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise DFlashError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise DFlashError("GGUF vocabulary has duplicate tokens; cannot build tokenizer.json")
    # Split at the first space after position 0, as llama.cpp does.
    merges = []
    for m in meta.get("tokenizer.ggml.merges", []):
        i = m.index(" ", 1)
        merges.append((m[:i], m[i + 1:]))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False, byte_fallback=False))

    pre = meta.get("tokenizer.ggml.pre", "default")
    # ByteLevel(use_regex=True) applies GPT-2's split regex before mapping bytes to characters.
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=True)
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), gpt2])
    elif pre in ("gpt-2", "default"):
        tok.pre_tokenizer = gpt2
    elif pre == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ])
    else:
        raise DFlashError(f"GGUF pre-tokenizer {pre!r} is not supported (smollm, qwen2, gpt-2)")
    tok.decoder = decoders.ByteLevel()

    # Control tokens are special (matched verbatim, skipped on request); user-defined ones are
    # plain added tokens. Both keep the ids they already have in the vocabulary.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED])

    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos_id is not None:
        bos = tokens[int(bos_id)]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, int(bos_id))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def tokenizer_files(meta: dict, config: dict) -> tuple[dict, dict]:
    """tokenizer_config.json and generation_config.json contents."""
    tokens = meta["tokenizer.ggml.tokens"]
    name = lambda key: (tokens[int(meta[f"tokenizer.ggml.{key}_token_id"])]  # noqa: E731
                        if meta.get(f"tokenizer.ggml.{key}_token_id") is not None else None)
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name("bos"),
        "eos_token": name("eos"),
        "pad_token": name("padding"),
        "unk_token": name("unknown"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    if (template := meta.get("tokenizer.chat_template")) is not None:
        tok_config["chat_template"] = template
    # End-of-turn tokens also stop generation.
    eos_ids = []
    for key in ("eos", "eot", "eom"):
        tid = meta.get(f"tokenizer.ggml.{key}_token_id")
        if tid is not None and int(tid) not in eos_ids:
            eos_ids.append(int(tid))
    gen_config = {"bos_token_id": config.get("bos_token_id"),
                  "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids}
    if meta.get("tokenizer.ggml.padding_token_id") is not None:
        gen_config["pad_token_id"] = int(meta["tokenizer.ggml.padding_token_id"])
    return tok_config, gen_config


def _write_model(gguf_path: Path, out: Path, dtype: str, source: str, source_sha256: str) -> None:
    try:
        reader = gguf.GGUFReader(gguf_path)
    except (ValueError, OSError) as e:
        raise DFlashError(f"{gguf_path} is not a readable GGUF file ({e})") from None
    meta = read_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise DFlashError(f"GGUF architecture {arch!r} is not supported (supported: llama, qwen2)")
    tensor_names = {t.name for t in reader.tensors}
    config = build_config(meta, tensor_names, dtype)
    config["mlx_dflash"] = {"source": source, "source_sha256": source_sha256,
                            "tool_version": version("mlx-dflash")}
    tokenizer = build_tokenizer(meta)
    tok_config, gen_config = tokenizer_files(meta, config)

    mx.save_safetensors(str(out / "model.safetensors"), convert_weights(reader, config, dtype),
                        metadata={"format": "mlx"})
    tokenizer.save(str(out / "tokenizer.json"))
    write_json(out / "tokenizer_config.json", tok_config)
    write_json(out / "generation_config.json", gen_config)
    write_json(out / "config.json", config)


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: str | None = None, *,
                 overwrite: bool = False, source: str | None = None,
                 source_sha256: str | None = None) -> Path:
    """Convert `gguf_path` into an mlx-lm model directory `out_dir` and return its path.

    dtype: of the stored weights; default the one that runs fast here (`machine.fast_float_dtype`: float16
    on Metal, float32 on MLX's CPU backend).
    Everything is written into a temporary directory beside `out_dir` and renamed into place
    at the end (`files.staged_dir`), so a failure leaves nothing behind. `source` (default: the GGUF path) and
    `source_sha256` (default: computed) are recorded in config.json under "mlx_dflash".
    """
    gguf_path, out = Path(gguf_path), Path(out_dir)
    dtype = dtype or fast_float_dtype()
    if dtype not in DTYPES:
        raise DFlashError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if not gguf_path.is_file():
        raise DFlashError(f"GGUF file not found: {gguf_path}")
    source = source or str(gguf_path.resolve())
    source_sha256 = source_sha256 or sha256_file(gguf_path)

    with staged_dir(out, overwrite) as work:
        work.mkdir()
        _write_model(gguf_path, work, dtype, source, source_sha256)
    return out
