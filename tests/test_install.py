"""What a newcomer's install needs: runtime dependencies only for the runtime, optional packages imported
lazily, the decoder independent of the benchmarks, no machine's absolute paths in the repository."""

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mlx_dflash"
OPTIONAL = {"matplotlib", "torch", "scipy", "regex", "pytest"}  # extras (bench, parity, dev) only
# What `generate` runs through: the CLI -> decoder -> (drafter, target, policy) -> kernels chain, the
# loaders and the default pair's download and conversion.
RUNTIME = ["cli", "decoder", "drafter", "target", "policy", "sampling", "costs", "kernels", "load", "config",
           "downloads", "gguf_convert", "files", "errors"]


def imports(module: str) -> tuple[set, set]:
    """(names imported at module level, names imported anywhere) by mlx_dflash/<module>.py; relative
    imports appear as ".name"."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    top, anywhere = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names = {"." + (node.module or "").split(".")[0]} if node.level else {node.module.split(".")[0]}
        else:
            continue
        anywhere |= names
        if node in tree.body:
            top |= names
    return top, anywhere


def test_runtime_modules_need_no_optional_package_and_no_benchmark():
    for module in RUNTIME:
        top, anywhere = imports(module)
        assert not top & OPTIONAL, f"mlx_dflash/{module}.py imports {top & OPTIONAL} at load time"
        if module != "cli":  # the CLI's `bench` command is where the benchmarks start
            assert not anywhere & {".bench", ".plot"}, f"mlx_dflash/{module}.py depends on the benchmarks"


def test_optional_packages_are_imported_lazily_everywhere():
    for path in sorted(PACKAGE.glob("*.py")):
        top, _ = imports(path.stem)
        assert not top & OPTIONAL, f"{path.name} imports {top & OPTIONAL} at load time"


def test_dependencies_runtime_and_extras():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {re.split(r"[<>=\[;! ]", d)[0] for d in project["dependencies"]}
    assert {"mlx-lm", "gguf", "tokenizers", "tqdm", "huggingface-hub", "click", "numpy"} <= runtime
    extras = project["optional-dependencies"]
    assert not any("torch" in d for d in project["dependencies"] + extras["dev"]), "torch belongs in [parity]"
    assert any(d.startswith("torch") for d in extras["parity"])
    assert any(d.startswith("matplotlib") for d in extras["bench"])


def test_parity_tests_skip_with_a_reason_without_torch():
    code = ("import sys; sys.modules['torch'] = None; import pytest; "
            f"sys.exit(pytest.main(['-q', '-rs', '-p', 'no:cacheprovider', {str(ROOT / 'tests' / 'test_parity_torch.py')!r}]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode in (0, 5), out.stdout + out.stderr  # 5: every test skipped at collection
    assert "skipped" in out.stdout and "pip install -e '.[parity]'" in out.stdout, out.stdout


def test_repository_names_no_absolute_paths_of_a_machine():
    files = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT).stdout.split()
    if not files:  # not a git checkout: every file but virtual environments and caches
        files = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file()
                 and not {".git", ".venv", ".ci-venv", "__pycache__"} & set(p.parts)]
    # Built from pieces so that this file does not match itself.
    pattern = re.compile("(?<![\\w.])/(?:" + "|".join(["wo" + "rk", "ro" + "ot", "ho" + "me/[^/\\s]+", "Us" + "ers/[^/\\s]+"]) + ")/")
    found = []
    for name in files:
        path = ROOT / name
        if path.suffix in {".png", ".safetensors", ".npz", ".gz"} or not path.is_file():
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line):
                found.append(f"{name}:{n}: {line.strip()[:120]}")
    assert not found, "absolute paths of a machine:\n" + "\n".join(found[:20])
