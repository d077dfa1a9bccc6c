"""The README and docs stay readable and true (issue 42): every repository path they name in backticks exists
(so a moved test or bench is caught), and the README is what a newcomer reads in five minutes: at most 300
lines, no paragraph over 8 lines, the two commands at the top."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from ethen.aliases import ALIAS_NAMES

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
#: a backticked token that starts with one of the repository's top folders
_PATH = re.compile(r"(?<![\w/.~$'\"-])((?:tests|ethen|bench|examples|docs)/[\w./*-]*[\w*])")
_INLINE = re.compile(r"`([^`]+)`")
#: ``ethen X [Y]`` where ``ethen`` is the command (at a line's start, after ``bin/``, a pipe, ``&&`` or ``;``)
_COMMAND = re.compile(r"(?:^|\n|bin/|\| |&& |; )\s*ethen ([a-z][\w-]*)(?: ([^\s`|;),]+))?")


def _named_paths(text: str) -> set[str]:
    """Repository paths inside code spans and fenced blocks (commands like ``pytest tests/x.py``); the
    ``ethen/*`` aliases are names, not paths."""
    spans = _INLINE.findall(re.sub(r"```.*?```", "", text, flags=re.S))
    spans += re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S)
    return {p for span in spans for p in _PATH.findall(span) if p not in ALIAS_NAMES}


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_named_path_exists(doc: Path) -> None:
    missing = []
    for path in sorted(_named_paths(doc.read_text(encoding="utf-8"))):
        hits = list(ROOT.glob(path)) if "*" in path else [ROOT / path] if (ROOT / path).exists() else []
        if not hits:
            missing.append(path)
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_the_path_finder_sees_code_spans_and_commands() -> None:
    text = ("See `tests/gateway/test_x.py` and `ethen/model/` and the alias `ethen/auto`; `pytest\n"
            "tests/b/c.py` across lines;\n"
            "```bash\n.venv/bin/pytest tests/a.py bench/b.py --ref x\n```\n")
    assert _named_paths(text) == {"tests/gateway/test_x.py", "ethen/model", "tests/b/c.py", "tests/a.py",
                                  "bench/b.py"}


def _paragraphs(text: str) -> list[list[str]]:
    """Runs of prose lines: blank lines, headings, fenced blocks, tables and list items end a paragraph (a
    list item starts a new one: each item is read on its own)."""
    out: list[list[str]] = []
    cur: list[str] = []
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            cur = []
            continue
        if fenced or not line.strip() or line.startswith(("#", "|")):
            cur = []
            continue
        if re.match(r"\s*([-*]|\d+\.) ", line):
            cur = []
        if not cur:
            out.append(cur)
        cur.append(line)
    return out


def test_the_readme_is_short() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    longest = max(_paragraphs(text), key=len)
    assert len(longest) <= 8, "\n".join(longest)


def test_the_readme_starts_with_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    first = re.search(r"```bash\n(.*?)```", text, re.S)
    assert first is not None
    commands = [ln.split("#")[0].strip() for ln in first.group(1).splitlines()]
    assert commands[:2] == ["bash run.sh up", "bash run.sh test"]
    assert text.index("bash run.sh up") < 1500  # on the first screen


def test_paragraphs_are_split_at_blank_lines_headings_fences_and_items() -> None:
    text = "a\nb\n\nc\n# h\nd\n- e\n  f\n- g\n```\nx\ny\n```\nz\n"
    assert _paragraphs(text) == [["a", "b"], ["c"], ["d"], ["- e", "  f"], ["- g"], ["z"]]


def _cli_tree() -> dict[str, Any]:
    import typer

    from ethen.cli import app

    return {name: cmd for name, cmd in typer.main.get_command(app).commands.items()}  # type: ignore[attr-defined]


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_named_command_exists(doc: Path) -> None:
    """``ethen gateway hash-key`` was documented for ``ethen gateway --hash-key``: each ``ethen X Y`` in code
    names a command X, and Y is one of X's sub-commands, an option, or X's argument."""
    text = doc.read_text(encoding="utf-8")
    spans = _INLINE.findall(re.sub(r"```.*?```", "", text, flags=re.S))
    spans += re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S)
    tree = _cli_tree()
    wrong = []
    for span in spans:
        for name, word in _COMMAND.findall(span):
            cmd = tree.get(name)
            if cmd is None:
                wrong.append(f"ethen {name}")
                continue
            subs = getattr(cmd, "commands", None)
            takes_args = any(p.param_type_name == "argument" for p in cmd.params)
            unknown_sub = subs is not None and word not in subs
            if word and not word.startswith(("-", "<", "[", "$", "#", ".")) and (
                    unknown_sub or (subs is None and not takes_args)):
                wrong.append(f"ethen {name} {word}")
    assert not wrong, f"{doc.relative_to(ROOT)} names commands that do not exist: {sorted(set(wrong))}"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (not ``-``, ``_``), spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_relative_link_resolves(doc: Path) -> None:
    """``[text](other.md#anchor)`` between the docs: the file exists and has a heading with that anchor."""
    text = re.sub(r"```.*?```", "", doc.read_text(encoding="utf-8"), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", dest.read_text(encoding="utf-8"),
                                                       flags=re.S), flags=re.M)
            if anchor not in {_slug(h) for h in headings}:
                broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)} has links that do not resolve: {broken}"


def test_slugs_are_githubs() -> None:
    assert _slug("Response cache (issue 27)") == "response-cache-issue-27"
    assert _slug("Against llama.cpp") == "against-llamacpp"
    heading = "The mesh in a gateway config (`kind = \"mesh\"`)"
    assert _slug(heading) == "the-mesh-in-a-gateway-config-kind--mesh"
