"""Tiny synthetic GGUF files (written with gguf.GGUFWriter) for the converter's tests: a byte-level BPE
vocabulary with a few merges, random weights in the chosen GGML types, optionally llama.cpp's Q/K row order."""

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType


def bytes_to_unicode():
    """GPT-2's map of the 256 byte values to printable characters (bytes_to_unicode in openai/gpt-2's
    src/encoder.py), the alphabet of byte-level BPE vocabularies."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


# A few merges that a wrong pre-tokenizer would apply across piece boundaries (digits, spaces,
# newlines, punctuation), so the qwen2 tokenizer check can fail.
TINY_MERGES = ("Ġ t", "h e", "Ġt he", "i n", "Ġ a", "1 2", "12 3", "Ġ Ġ", "Ċ Ċ", "ĠĠ ĠĠ", ". Ġ",
               "Ġ 1", "e Ġ", "' s", "'s Ġ", "Ã ©", "ĉ ĉ", "Ġ ĉ")


def _byte_vocab(extra_merges=TINY_MERGES):
    byte_chars = list(bytes_to_unicode().values())
    merges = list(extra_merges)
    merged = [m.replace(" ", "") for m in merges]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = byte_chars + merged + specials + ["<tool_call>"]
    types = [1] * (len(byte_chars) + len(merged)) + [3] * len(specials) + [4]
    return tokens, types, merges


def write_gguf(path, arch="qwen2", tensors=None, pre="qwen2", hidden=64, n_head=4, n_kv=2,
               ffn=128, layers=2, tied=False, permute_qk=False, rng=None):
    """Write a tiny GGUF; returns {gguf tensor name: float32 weights in HF (out, in) order}.

    With permute_qk, Q/K rows are stored permuted as llama.cpp does for `llama` files.
    """
    rng = rng or np.random.default_rng(0)
    tokens, types, merges = _byte_vocab()
    vocab = len(tokens) + 7  # unused [PAD] rows, like Qwen2.5's padded vocabulary
    tokens = tokens + [f"[PAD{i}]" for i in range(len(tokens), vocab)]
    types = types + [5] * (vocab - len(types))
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    hd = hidden // n_head
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    if not tied:
        shapes["output.weight"] = (vocab, hidden)
    for i in range(layers):
        b = f"blk.{i}."
        shapes.update({b + "attn_norm.weight": (hidden,), b + "ffn_norm.weight": (hidden,),
                       b + "attn_q.weight": (n_head * hd, hidden), b + "attn_k.weight": (n_kv * hd, hidden),
                       b + "attn_v.weight": (n_kv * hd, hidden), b + "attn_output.weight": (hidden, n_head * hd),
                       b + "ffn_gate.weight": (ffn, hidden), b + "ffn_up.weight": (ffn, hidden),
                       b + "ffn_down.weight": (hidden, ffn)})
        if arch == "qwen2":
            shapes.update({b + "attn_q.bias": (n_head * hd,), b + "attn_k.bias": (n_kv * hd,),
                           b + "attn_v.bias": (n_kv * hd,)})
    tensors = tensors or {}
    originals = {}
    for name, shape in shapes.items():
        x = rng.normal(0, 0.05, size=shape).astype(np.float32)
        if name.endswith("norm.weight"):
            x = 1 + x
        originals[name] = x
        if permute_qk and ("attn_q." in name or "attn_k." in name):
            x = llama_cpp_permute(x, n_head if "attn_q." in name else n_kv)
        qtype = Q.F32 if len(shape) == 1 else tensors.get(name.split(".", 2)[-1].split(".")[0], Q.F16)
        if qtype == Q.F32:
            w.add_tensor(name, x)
        elif qtype == Q.F16:
            w.add_tensor(name, x.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return originals


def llama_cpp_permute(w, n_head):
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute: interleave the rotary halves."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
