"""The references the code, the README and the docs make to sections of a Markdown document, and
whether each one lands: ``docs/definitions.md §7`` needs a ``## 7.`` heading there,
``docs/definitions.md#tolerances`` (or ``](#tolerances)`` inside a document) a heading whose GitHub
anchor that is, and a link written ``[…, section 9](docs/definitions.md#…)`` an anchor inside section 9.

A bare ``§N`` means the nearest document named before it on the same line; with none, the document
it stands in when that is Markdown, else docs/definitions.md (the one document the code cites).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

#: What is scanned: the code and scripts under these folders, and every Markdown file of the README
#: and the docs.
CODE_FOLDERS = ("verl_ext", "tests", "scripts", "recipes", "benchmarks")
CODE_SUFFIXES = (".py", ".js", ".html", ".yaml", ".yml", ".sh")
MARKDOWN = ("README.md", "docs")
#: The document a bare ``§N`` in code refers to.
CODE_CITES = "docs/definitions.md"

_DOCUMENT = r"(?<![\w./:-])[\w./-]+\.md"  # not inside a URL
_SECTION = re.compile(r"§(\d+)")
_NAMED_DOCUMENT = re.compile(_DOCUMENT)
_ANCHOR = re.compile(rf"(?P<document>{_DOCUMENT})#(?P<anchor>[\w-]+)")
_ANCHOR_IN_LINK = re.compile(rf"\]\((?P<document>{_DOCUMENT})?#(?P<anchor>[\w-]+)\)")
_SECTION_LINK = re.compile(rf"\[[^\]]*\bsection (?P<section>\d+)[^\]]*\]\((?P<document>{_DOCUMENT})#(?P<anchor>[\w-]+)\)")
_NUMBERED = re.compile(r"(\d+)\.\s")


@dataclass(frozen=True)
class Headings:
    """A Markdown document's numbered sections (``## N. …``) and its headings' anchors, each with
    the section it lies in (None before the first numbered one)."""

    sections: frozenset[int]
    anchors: dict[str, int | None]


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(markdown: str) -> Headings:
    sections, anchors, section, fenced = set(), {}, None, False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced or not (match := re.match(r"(#{1,6})\s+(.*?)\s*#*\s*$", line)):
            continue
        level, text = len(match.group(1)), match.group(2)
        if level == 2 and (number := _NUMBERED.match(text)):
            section = int(number.group(1))
            sections.add(section)
        slug, repeat = anchor(text), 0
        while (f"{slug}-{repeat}" if repeat else slug) in anchors:  # GitHub numbers repeated headings
            repeat += 1
        anchors[f"{slug}-{repeat}" if repeat else slug] = section
    return Headings(frozenset(sections), anchors)


@lru_cache(maxsize=None)
def _headings_of(path: Path) -> Headings | None:
    return headings(path.read_text(encoding="utf-8")) if path.is_file() else None


@dataclass(frozen=True)
class Unresolved:
    path: str  # relative to the scanned root
    line: int
    reference: str
    why: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reference} ({self.why})"


def scanned_files(root: Path) -> list[Path]:
    files = []
    for folder in CODE_FOLDERS:
        files += [p for p in (root / folder).rglob("*") if p.suffix in CODE_SUFFIXES and _plain(p, root)]
    for name in MARKDOWN:
        path = root / name
        files += [path] if path.is_file() else [p for p in path.rglob("*.md") if _plain(p, root)]
    return sorted(files)


def _plain(path: Path, root: Path) -> bool:
    """A regular file, not behind a link, not in a cache or a hidden folder."""
    parts = path.relative_to(root).parts
    return path.is_file() and not any(p.startswith(".") or p == "__pycache__" or p.endswith(".egg-info") for p in parts) and not any(
        (root / Path(*parts[: i + 1])).is_symlink() for i in range(len(parts))
    )


def _target(document: str | None, source: Path, root: Path) -> Path:
    """The file a reference names (relative to its Markdown file, or to the root), or its default."""
    if document is None:
        return source if source.suffix == ".md" else root / CODE_CITES
    if source.suffix == ".md" and (source.parent / document).is_file():
        return source.parent / document
    return root / document


def unresolved(root: Path) -> list[Unresolved]:
    """Every reference under ``root`` (see :func:`scanned_files`) that does not land."""
    found = []
    for source in scanned_files(root):
        where = source.relative_to(root).as_posix()
        for number, line in enumerate(source.read_text(encoding="utf-8").splitlines(), 1):
            found += [Unresolved(where, number, reference, why) for reference, why in _line_problems(line, source, root)]
    return found


def _line_problems(line: str, source: Path, root: Path):
    for match in _SECTION.finditer(line):
        named = _NAMED_DOCUMENT.findall(line[: match.start()])
        target = _target(named[-1] if named else None, source, root)
        known = _headings_of(target)
        if known is None:
            yield match.group(0), f"{_shown(target, root)} does not exist"
        elif int(match.group(1)) not in known.sections:
            yield match.group(0), f"{_shown(target, root)} has no section {match.group(1)}"
    anchors = _ANCHOR_IN_LINK if source.suffix == ".md" else _ANCHOR
    for match in anchors.finditer(line):
        target = _target(match.group("document"), source, root)
        known = _headings_of(target)
        reference = f"{match.group('document') or ''}#{match.group('anchor')}"
        if known is None:
            yield reference, f"{_shown(target, root)} does not exist"
        elif match.group("anchor") not in known.anchors:
            yield reference, f"no heading of {_shown(target, root)} has this anchor"
    for match in _SECTION_LINK.finditer(line):
        known = _headings_of(_target(match.group("document"), source, root))
        section = None if known is None else known.anchors.get(match.group("anchor"))
        if section is not None and section != int(match.group("section")):
            yield match.group(0), f"the heading is in section {section}"


def _shown(path: Path, root: Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return str(path)
