"""The docs against the code: the module table lists exactly the package's modules, README.md stays short,
every relative link resolves, and the flags README documents for `generate` are real options."""

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
