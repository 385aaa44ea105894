"""The docs against the code: the module table lists exactly the package's modules, README.md stays short,
every relative link resolves, every file, module and symbol the docs name in code spans exists, and the flags
README documents for `generate` are real options."""

import ast
import re
from pathlib import Path

import click
import pytest

from mlx_dflash.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # [text](target), images too
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def section(text: str, heading: str) -> str:
    """The body of the markdown section whose heading line is `heading`, up to the next heading of its level."""
    level = heading.split()[0]
    lines = text.splitlines()
    start = lines.index(heading) + 1
    end = next((i for i in range(start, len(lines)) if re.match(rf"{level} ", lines[i])), len(lines))
    return "\n".join(lines[start:end])


def options_of(command: click.Command) -> set:
    return {name for p in command.params if isinstance(p, click.Option) for name in p.opts + p.secondary_opts}


def test_the_layout_table_lists_exactly_the_modules():
    table = section((ROOT / "docs" / "architecture.md").read_text(), "## Layout")
    listed = re.findall(r"^\| `(mlx_dflash/[\w/]+\.py)` \|", table, flags=re.M)
    modules = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "mlx_dflash").rglob("*.py"))
    assert len(listed) == len(set(listed)), "a module is listed twice in docs/architecture.md"
    assert not set(modules) - set(listed), f"add to docs/architecture.md's layout table: {sorted(set(modules) - set(listed))}"
    assert not set(listed) - set(modules), f"no longer in the tree, drop from the table: {sorted(set(listed) - set(modules))}"


def test_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= 300, f"README.md has {lines} lines; move detail to docs/ (at most 300)"


def anchors(path: Path) -> set:
    """The anchors GitHub gives the headings of a markdown file."""
    headings = re.findall(r"^#+ (.+)$", path.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_files(doc):
    missing = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):  # a URL
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists() or (anchor and path.suffix == ".md" and anchor not in anchors(path)):
            missing.append(target)
    assert not missing, f"{doc.relative_to(ROOT)} links to missing files or headings: {missing}"


CODE_SPAN = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"(?<![\w/.-])((?:(mlx_dflash|bench|tests|metal_kernels|docs|scripts|decoding|policies|models|kernels|"
                  r"server|tuner)/)[\w/.-]*\.(?:py|metal|md|sh))\b")
SUBPACKAGES = ("decoding", "policies", "models", "kernels", "server", "tuner")


def defined_names(path: Path) -> set:
    """What a module defines or imports at its top level, and its classes' attributes (Class.name)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names |= {f"{node.name}.{n.name}" for n in node.body if hasattr(n, "name")}
            names |= {f"{node.name}.{t.id}" for n in node.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                      for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
            names |= {f"{node.name}.{n.attr}" for n in ast.walk(node) if isinstance(n, ast.Attribute)
                      and isinstance(n.value, ast.Name) and n.value.id == "self" and isinstance(n.ctx, ast.Store)}
    return names


def package_modules() -> dict:
    """Dotted module name under mlx_dflash (e.g. "decoding.tree") -> the names it defines."""
    return {".".join(p.relative_to(ROOT / "mlx_dflash").with_suffix("").parts): defined_names(p)
            for p in (ROOT / "mlx_dflash").rglob("*.py")}


def resolves(reference: str, modules: dict) -> bool:
    """`mlx_dflash.a.b.C`, `decoding.tree.grow`, `tree.grow` or `Class.method`: a module, package, or a name one
    defines (the last part of a module's name is enough where only one module has it)."""
    parts = reference.removeprefix("mlx_dflash.").split(".")
    if parts == ["metal_kernels"]:  # the Metal sources, shipped inside the package (pyproject.toml)
        return True
    if reference.startswith("mlx_dflash.") and parts[0] in modules["__init__"]:  # the package's own API
        return len(parts) == 1
    for split in range(len(parts), 0, -1):
        module, rest = ".".join(parts[:split]), parts[split:]
        found = [m for m in modules if m == module or (not reference.startswith("mlx_dflash.")
                                                       and m.rsplit(".", 1)[-1] == module)]
        packages = [m for m in modules if m.startswith(module + ".")]
        if found or packages:
            return not rest or any(".".join(rest) in modules[m] or rest[0] in modules[m] for m in found)
    return False


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_files_modules_and_symbols_named_in_code_spans_exist(doc):
    """A path in a code span must exist; `mlx_dflash.x.y` must resolve; `module.name` where `module` is one of the
    package's modules and the name reads as code (an underscore, a capital or a call) must be defined there, and
    `Class.name` where Class is one of the package's classes."""
    modules = package_modules()
    classes = {n.split(".")[0] for names in modules.values() for n in names if "." in n}
    short = {m.rsplit(".", 1)[-1] for m in modules} - {"__init__"}
    missing = []
    for span in CODE_SPAN.findall(doc.read_text()):
        for path, top in PATH.findall(span):
            if not ((ROOT / path).exists() or (top in SUBPACKAGES and (ROOT / "mlx_dflash" / path).exists())):
                missing.append(path)
        ref = re.fullmatch(r"((?:[A-Za-z_]\w*\.)+[A-Za-z_]\w*)(\(.*\))?", span.strip())
        if not ref:
            continue
        name, head = ref.group(1), ref.group(1).split(".")[0]
        reads_as_code = "_" in name.split(".", 1)[1] or name.split(".")[-1][:1].isupper() or ref.group(2)
        checked = head == "mlx_dflash" or head in classes or (
            (head in short or head in SUBPACKAGES) and reads_as_code)
        if checked and not resolves(name, modules) and not any(f"{name}" in names for names in modules.values()):
            missing.append(span)
    assert not missing, f"{doc.relative_to(ROOT)} names what is not in the tree: {sorted(set(missing))}"


def test_readme_generate_flags_are_options_of_generate():
    documented = set(FLAG.findall(section(README.read_text(), "## `mlx-dflash generate`")))
    real = options_of(main.commands["generate"])
    assert {"--width", "--n-max", "--p-min", "--prompt-lookup"} <= documented  # the section was found and read
    assert not documented - real, f"README documents flags `mlx-dflash generate` does not have: {sorted(documented - real)}"


def test_readme_documents_every_generate_option():
    documented = set(FLAG.findall(section(README.read_text(), "## `mlx-dflash generate`")))
    undocumented = options_of(main.commands["generate"]) - documented - {"--help"}
    assert not undocumented, f"README's generate section leaves out: {sorted(undocumented)}"


def test_readme_commands_exist():
    text = README.read_text()
    code = "\n".join(re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S))  # fenced blocks
    named = set(re.findall(r"`mlx-dflash ([a-z]+)", text)) | set(re.findall(r"^\s*mlx-dflash ([a-z]+)", code, flags=re.M))
    assert {"generate", "serve", "convert", "train"} <= named
    assert not named - set(main.commands), f"README names commands the CLI does not have: {sorted(named - set(main.commands))}"


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_state_what_is(doc):
    """No development history, no references to notes that do not ship (machine paths: test_install.py)."""
    text = doc.read_text()
    for phrase in (r"this session", r"last session", r"the issue's goal", r"session [0-9]", r"\.\./shared"):
        assert not re.search(phrase, text, flags=re.I), f"{doc.relative_to(ROOT)} says {phrase!r}"


def test_readme_examples_get_right_answers(smollm2_path):
    """The README's first `generate` command and its Python API prompt, greedy on the default pair (slow tier:
    the real target), give right answers: the prompts are read out of README.md, so they cannot drift."""
    from click.testing import CliRunner

    import mlx_dflash

    text = README.read_text()
    prompt = re.search(r'^mlx-dflash generate --prompt "([^"]+)"$', text, flags=re.M).group(1)
    result = CliRunner().invoke(main, ["generate", "--prompt", prompt])
    assert result.exit_code == 0, result.output
    assert "5 * 4 = 20 legs" in result.stdout, result.stdout
    question = re.search(r'messages = \[\{"role": "user", "content": "([^"]+)"\}\]', text).group(1)
    target, drafter, tokenizer = mlx_dflash.load()
    chat = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)
    assert "equals 25" in mlx_dflash.generate(target, drafter, tokenizer, chat, max_tokens=128)
