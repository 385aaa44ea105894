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
BENCHMARKS = {"mlx_dflash.bench_widths", "mlx_dflash.plot"}  # reached through `mlx-dflash bench` only
# What a user runs: the CLI's commands but `bench`, and the Python API.
ENTRY_POINTS = ["mlx_dflash", "mlx_dflash.cli", "mlx_dflash.generate", "mlx_dflash.server.routes", "mlx_dflash.convert",
                "mlx_dflash.tuner.trainer"]


def module_file(name: str) -> Path | None:
    path = ROOT / Path(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def load_time(tree: ast.Module) -> set:
    """The ids of the nodes that run when the module loads: all but function bodies (a module-level
    `if` or `try` runs too)."""
    out, todo = set(), list(tree.body)
    while todo:
        node = todo.pop()
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            out.add(id(node))
            todo += ast.iter_child_nodes(node)
    return out


def imports(name: str) -> tuple[set, set]:
    """(modules imported when it loads, modules imported anywhere) by the package module `name`:
    third-party ones by their top-level name, ours by their full dotted name."""
    file = module_file(name)
    tree = ast.parse(file.read_text())
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]
    top, anywhere, at_load = set(), set(), load_time(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = {a.name if a.name.startswith("mlx_dflash") else a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            if not module.startswith("mlx_dflash"):
                names = {module.split(".")[0]}
            else:  # `from pkg import submodule` imports the submodule
                names = {module} | {f"{module}.{a.name}" for a in node.names if module_file(f"{module}.{a.name}")}
        else:
            continue
        anywhere |= names
        if id(node) in at_load:
            top |= names
    return top, anywhere


def reachable(roots: list) -> set:
    """Every package module the roots import, at any depth, also from inside functions (and the packages
    holding them, whose `__init__` runs first)."""
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name in seen or module_file(name) is None:
            continue
        seen.add(name)
        todo += [m for m in imports(name)[1] if m.startswith("mlx_dflash") and m not in BENCHMARKS]
        todo.append(name.rpartition(".")[0])
    return seen


def test_runtime_modules_need_no_optional_package_and_no_benchmark():
    runtime = reachable(ENTRY_POINTS)
    assert {"mlx_dflash.decoding.decoder", "mlx_dflash.models.target", "mlx_dflash.kernels.wide_qmm"} <= runtime
    for module in sorted(runtime):
        top, anywhere = imports(module)
        assert not top & OPTIONAL, f"{module} imports {top & OPTIONAL} at load time"
        # The CLI's `bench` command is where the benchmarks start; `doctor` runs a short widths sweep.
        if module not in ("mlx_dflash.cli", "mlx_dflash.doctor"):
            assert not anywhere & BENCHMARKS, f"{module} depends on the benchmarks"


def test_optional_packages_are_imported_lazily_everywhere():
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        top, _ = imports(name)
        assert not top & OPTIONAL, f"{path.relative_to(ROOT)} imports {top & OPTIONAL} at load time"


def test_dependencies_runtime_and_extras():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {re.split(r"[<>=\[;! ]", d)[0] for d in project["dependencies"]}
    assert {"mlx-lm", "gguf", "tokenizers", "tqdm", "huggingface-hub", "click", "numpy"} <= runtime
    extras = project["optional-dependencies"]
    assert not any("torch" in d for d in project["dependencies"] + extras["dev"]), "torch belongs in [parity]"
    assert any(d.startswith("torch") for d in extras["parity"])
    assert any(d.startswith("matplotlib") for d in extras["bench"])


def test_every_subpackage_ships_in_the_wheel():
    # A non-editable install carries only the packages pyproject.toml lists: a new subpackage left out
    # imports here (editable) and fails on a user's `pip install .`.
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(ROOT).parts) for init in PACKAGE.rglob("__init__.py")}
    assert found - listed == set(), f"add {sorted(found - listed)} to [tool.setuptools] packages"


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
