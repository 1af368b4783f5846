"""What a user reads holds on first contact: no term of ``tests/banned_terms.txt`` (our own words, paths outside
the repository, issue numbers, code-version tags) and no dead reference (a ``README "Section"`` or a
``page.md, "Section"`` naming a heading that does not exist, a Markdown link to a missing file or anchor) in the
README, the user pages (``docs/`` except the contributor pages), the comments of ``configs/*.yaml`` and
``prefect.yaml``, and every ``--help`` text. mkdocs --strict checks the docs site's own links; this also covers the
README (which the site does not build), YAML comments, help texts and links into generated blocks. The
environment-variable page lists exactly the ``LEXIFLOW_*`` variables the code reads."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import markdown
import pytest

from tests.test_docs_wording import commands, help_text

ROOT = Path(__file__).resolve().parents[1]
CONTRIBUTOR = ("docs/contributing.md", "docs/notes/")


def banned_terms(path: Path = ROOT / "tests" / "banned_terms.txt") -> list[tuple[re.Pattern, str]]:
    """(pattern, why) for every line of the terms file."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        pattern, _, why = line.partition("  # ")
        out.append((re.compile(pattern.strip(), re.I), why.strip()))
    return out


def user_pages() -> list[Path]:
    docs = [p for p in sorted((ROOT / "docs").rglob("*.md"))
            if not p.relative_to(ROOT).as_posix().startswith(CONTRIBUTOR)]
    return [ROOT / "README.md", *docs]


def yaml_files() -> list[Path]:
    return [*sorted((ROOT / "configs").glob("*.yaml")), ROOT / "prefect.yaml"]


def yaml_comments(text: str) -> str:
    """The comments of a YAML file as prose: each comment without its ``#``, joined by spaces (a sentence may run
    over several comment lines)."""
    parts = [m.group(1).strip() for m in re.finditer(r"(?:^|\s)#(.*)$", text, re.M)]
    return " ".join(parts)


def terms_in(text: str) -> list[str]:
    return [f"{m.group(0)!r} ({why})" for pattern, why in banned_terms() for m in pattern.finditer(text)]


# ----------------------------------------------------------------------------- headings and anchors


@cache
def anchors(path: Path) -> frozenset[str]:
    """The ids of ``path``'s headings as the docs site makes them (Python-Markdown's toc, explicit ``{#id}`` kept)."""
    md = markdown.Markdown(extensions=["attr_list", "toc", "tables", "pymdownx.superfences"])
    md.convert(path.read_text(encoding="utf-8"))
    ids: set[str] = set()

    def walk(tokens):
        for t in tokens:
            ids.add(t["id"])
            walk(t["children"])

    walk(md.toc_tokens)
    return frozenset(ids)


@cache
def headings(path: Path) -> frozenset[str]:
    """The text of every Markdown heading of ``path``, without ``{#id}`` and inline-code backticks."""
    out = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*$", path.read_text(encoding="utf-8"), re.M):
        out.add(re.sub(r"\s*\{#[^}]*\}$", "", m.group(1)).replace("`", "").strip())
    return frozenset(out)


_SECTION_REF = re.compile(r"""(README|[\w./-]+\.md),?\s+["“]([^"”]+)["”]""")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def dead_references(text: str, where: Path, markdown_links: bool = True) -> list[str]:
    """Every section reference and (in Markdown) relative link of ``text`` that points nowhere."""
    dead = []
    for m in _SECTION_REF.finditer(text):
        name, section = m.group(1), m.group(2)
        target = ROOT / "README.md" if name == "README" else _resolve(name, where)
        if target is None or section not in headings(target):
            dead.append(f"{name} \"{section}\": no such {'file' if target is None else 'section'}")
    if markdown_links:
        for m in _LINK.finditer(_without_code(text)):
            url = m.group(1)
            if re.match(r"[a-z][a-z0-9+.-]*:", url):  # http:, https:, mailto:, data:
                continue
            file, _, anchor = url.partition("#")
            target = where if not file else (where.parent / file).resolve()
            if not target.exists():
                dead.append(f"({url}): no such file")
            elif anchor and target.suffix == ".md" and anchor not in anchors(target):
                dead.append(f"({url}): no such anchor in {target.name}")
    return dead


def _resolve(name: str, where: Path) -> Path | None:
    for base in (where.parent, ROOT, ROOT / "docs"):
        if (base / name).is_file():
            return (base / name).resolve()
    return None


def _without_code(text: str) -> str:
    """``text`` with fenced code blocks and inline code removed (a link shown as code is an example)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


# ----------------------------------------------------------------------------- the checks


def test_the_checks_find_what_they_are_for(tmp_path):
    text = "See issue 12, the seed size, ../shared/data, `pretrain-5` and what was fixed on the way."
    found = terms_in(text)
    assert len(found) == 5, found
    assert terms_in("#NUM# and bundle@production, ner-label, pretrain-log, (#eval-demo), the 384 × 6 model") == []
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## Real section {#real}\n\n## Another one\n", encoding="utf-8")
    (tmp_path / "other.md").write_text("x", encoding="utf-8")
    text = ('[a](page.md#real) [b](page.md#another-one) [c](page.md#gone) [d](missing.md) [e](other.md) '
            '`[f](nothere.md)` [g](https://example.org/#x) page.md, "Another one" and page.md, "Nope"')
    dead = dead_references(text, tmp_path / "here.md")
    assert dead == ['page.md "Nope": no such section', "(page.md#gone): no such anchor in page.md",
                    "(missing.md): no such file"], dead
    assert yaml_comments("a: 1  # see README \"X\n# Y\"\nb: 2\n") == 'see README "X Y"'


@pytest.mark.parametrize("path", user_pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_user_pages_hold(path):
    text = path.read_text(encoding="utf-8")
    problems = terms_in(text) + dead_references(text, path)
    assert not problems, f"{path.relative_to(ROOT)}: " + "; ".join(problems)


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_config_comments_hold(path):
    comments = yaml_comments(path.read_text(encoding="utf-8"))
    problems = terms_in(comments) + dead_references(comments, path, markdown_links=False)
    problems += [f"{p}: no such file" for p in re.findall(r"\b((?:docs|configs)/[\w./-]+\.(?:md|yaml))", comments)
                 if not (ROOT / p).is_file()]
    assert not problems, f"{path.relative_to(ROOT)}: " + "; ".join(problems)


def test_help_texts_hold():
    problems = []
    for argv, _cmd in commands():
        text = " ".join(help_text(argv).split())
        problems += [f"lexiflow {' '.join(argv)} --help: {p}" for p in
                     terms_in(text) + dead_references(text, ROOT / "README.md", markdown_links=False)]
    assert not problems, "\n".join(problems)


def test_the_environment_page_lists_every_variable_the_code_reads():
    code = set()
    for package in ("lexiflow", "flows", "tasks", "storage", "models"):
        for path in (ROOT / package).rglob("*.py"):
            code |= set(re.findall(r"\bLEXIFLOW_[A-Z_]*[A-Z]\b", path.read_text(encoding="utf-8")))
    code |= set(re.findall(r"\bLEXIFLOW_[A-Z_]*[A-Z]\b", (ROOT / "prefect.yaml").read_text(encoding="utf-8")))
    page = set(re.findall(r"\bLEXIFLOW_[A-Z_]*[A-Z]\b",
                          (ROOT / "docs" / "reference" / "environment.md").read_text(encoding="utf-8")))
    code.discard("LEXIFLOW_LABEL")  # the prefix in flows/serve.py's docstring ("LEXIFLOW_LABEL_*")
    assert code - page == set(), f"read by the code, missing from docs/reference/environment.md: {code - page}"
    assert page - code == set(), f"on docs/reference/environment.md, read by no code: {page - code}"
