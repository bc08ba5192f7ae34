"""Every document the tree cites exists, and so does every section it cites.

Code, protos, SQL and docs point readers at the project's documents: `docs/DESIGN.md, "Trust"`,
`DESIGN.md ("The job and its lease")`, `docs/BENCHMARKS.md's "Chaos"`. A citation that leads
nowhere sends a newcomer looking for a file their clone does not have, so each one is checked:
the document must be in the repository and the quoted section must be one of its headings.

A bare name (`DESIGN.md`) is looked for at the repository root, then in `docs/`: applied SQL
migrations cite the design document that way and can never be edited (their text is
checksummed, `lorafleet.ledger.database.migrate`), so the rule has to accept them as they are.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Where citations live: the sources, protos, SQL, scripts and documents of the project.
_SCANNED_DIRS = ("core", "clients", "services", "protos", "docs", "tests", "bench", "scripts")
_SCANNED_FILES = ("README.md", "pyproject.toml")
_SUFFIXES = {".py", ".pyi", ".proto", ".sql", ".md", ".sh", ".toml", ".yaml", ".yml"}
_SKIPPED_PARTS = {".venv", "node_modules", "__pycache__", ".lorafleet", ".git"}

# `X.md` then its section in quotes: `X.md, "S"`, `X.md: "S"`, `X.md's "S"`, `X.md ("S")`.
# The project's documents are named in capitals (README.md, docs/DESIGN.md); lower-case `.md`
# names in the tests are user files (captions, uploads). Not inside a URL or a longer path.
_DOCUMENT = r"(?<![\w/.-])(?P<doc>(?:[\w.-]+/)*[A-Z][A-Z0-9_]*\.md)\b"
_SECTION = r"""(?:(?:,|:|'s)\s+|\s+\()["“](?P<section>[^"”\n]+)["”]"""
_CITATION = re.compile(_DOCUMENT + r"(?:" + _SECTION + r")?")
_HEADING = re.compile(r"^#{1,6}\s+(?P<title>.+?)\s*#*\s*$", re.MULTILINE)


@dataclass(frozen=True)
class Citation:
    source: str  # file:line that cites
    document: str
    section: str | None


def _scanned_files() -> list[Path]:
    files = [ROOT / name for name in _SCANNED_FILES]
    for folder in _SCANNED_DIRS:
        for path in sorted((ROOT / folder).rglob("*")):
            if not path.is_file() or path.suffix not in _SUFFIXES:
                continue
            if _SKIPPED_PARTS.intersection(path.relative_to(ROOT).parts):
                continue
            if path == Path(__file__).resolve():
                continue  # its examples are made up
            files.append(path)
    return files


def citations() -> list[Citation]:
    found: list[Citation] = []
    for path in _scanned_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for match in _CITATION.finditer(text):
            document = match.group("doc")
            line = text.count("\n", 0, match.start()) + 1
            found.append(
                Citation(
                    source=f"{path.relative_to(ROOT)}:{line}",
                    document=document,
                    section=match.group("section"),
                )
            )
    return found


def resolve(document: str, source: str) -> Path | None:
    """The file a citation names: relative to the repository root; a bare name also in
    `docs/`; a relative link in a document also beside the citing file."""
    candidates = [ROOT / document]
    if "/" not in document:
        candidates.append(ROOT / "docs" / document)
    candidates.append((ROOT / source.rsplit(":", 1)[0]).parent / document)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    return None


def headings(document: Path) -> set[str]:
    """The names a section may be cited by: its heading, and the heading's short name, the text
    before its first colon, comma or parenthesis (`"Chaos"` for "Chaos: 1000 jobs through a
    faulty fleet", `"On a GPU"` for "On a GPU, 2026-11-24 (...)")."""
    text = document.read_text(encoding="utf-8")
    # Headings inside fenced code blocks (shell comments in examples) are not sections.
    text = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    names = set()
    for match in _HEADING.finditer(text):
        title = match.group("title").strip()
        names.add(title)
        names.add(re.split(r"[:,]| \(", title, maxsplit=1)[0].strip())
    return names


def test_the_tree_cites_its_design_document() -> None:
    """The scan finds citations at all (a regex that matches nothing would pass everything)."""
    cited = {(c.document, c.section) for c in citations()}
    assert ("docs/DESIGN.md", "Trust") in cited
    assert ("DESIGN.md", "The job and its lease") in cited  # the first migration's


def test_every_cited_document_exists() -> None:
    missing = sorted(
        f"{c.source}: {c.document}" for c in citations() if resolve(c.document, c.source) is None
    )
    assert not missing, "cited documents not in the repository:\n" + "\n".join(missing)


def test_every_cited_section_exists() -> None:
    missing = []
    for c in citations():
        if c.section is None:
            continue
        document = resolve(c.document, c.source)
        if document is not None and c.section not in headings(document):
            missing.append(f'{c.source}: {c.document}, "{c.section}"')
    assert not missing, "cited sections that are no heading of their document:\n" + "\n".join(
        sorted(missing)
    )


@pytest.mark.parametrize(
    ("text", "document", "section"),
    [
        ('see docs/DESIGN.md, "Trust".', "docs/DESIGN.md", "Trust"),
        ('follow DESIGN.md ("The job and its lease")', "DESIGN.md", "The job and its lease"),
        ('is DESIGN.md\'s "Trust" section', "DESIGN.md", "Trust"),
        ('(docs/BENCHMARKS.md: "Chaos")', "docs/BENCHMARKS.md", "Chaos"),
        ("`docs/THREAT_MODEL.md` lists", "docs/THREAT_MODEL.md", None),
    ],
)
def test_citation_forms(text: str, document: str, section: str | None) -> None:
    match = _CITATION.search(text)
    assert match is not None
    assert (match.group("doc"), match.group("section")) == (document, section)


def test_a_missing_section_is_found(tmp_path: Path) -> None:
    """The check fails for a section its document lacks (what a renamed heading leaves)."""
    document = tmp_path / "X.md"
    document.write_text("# X\n\n## Trust\n\n```sh\n# not a heading\n```\n## Chaos: many jobs\n")
    assert headings(document) == {"X", "Trust", "Chaos: many jobs", "Chaos"}
