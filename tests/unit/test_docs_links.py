"""The repository stands alone: it cites only its own docs, and every docs page and anchor it cites exists.

- No file a user clones cites the project's internal notes (the design notes and the harness observations kept
  beside the repository while it was built): their facts live in `docs/` (docs/architecture.md, "Where the facts
  live"). The needles are built from parts, so this file does not match itself.
- Every `docs/<page>.md` named in code, tests, configs or docs exists.
- Every relative markdown link in `docs/*.md` and `README.md` points at an existing file, and its `#anchor`, if
  any, at a heading of that file (GitHub's rule: lowercase, punctuation dropped, spaces to hyphens).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("gyre", "docs", "tests", "benchmarks", "conf", "launch", "README.md", "pyproject.toml")
SKIPPED_DIRS = {"__pycache__", ".pytest_cache", ".hypothesis", "outputs", "multirun"}
INTERNAL_NOTES = ("DESIGN" + ".md", "HARNESS" + "-NOTES")
DOCS_PAGE = re.compile(r"(?<![\w.-])docs/([\w-]+)\.md")
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def text_files() -> Iterator[tuple[Path, str]]:
    """(path, text) of every text file under the scanned paths; binary files (a NUL byte) are skipped."""
    for name in SCANNED:
        top = ROOT / name
        paths = [top] if top.is_file() else sorted(top.rglob("*"))
        for path in paths:
            if not path.is_file() or SKIPPED_DIRS.intersection(path.relative_to(ROOT).parts):
                continue
            data = path.read_bytes()
            if b"\0" not in data:
                yield path, data.decode("utf-8", errors="replace")


def where(path: Path, text: str, offset: int) -> str:
    return f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, offset) + 1}"


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings of a page (outside fenced code), duplicates numbered -1, -2, ..."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    in_fence = False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            continue
        match = None if in_fence else HEADING.match(line)
        if match is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def test_no_file_cites_the_internal_notes():
    hits = [
        f"{where(path, text, match.start())}: {match.group(0)}"
        for path, text in text_files()
        for needle in INTERNAL_NOTES
        for match in re.finditer(re.escape(needle), text)
    ]
    assert not hits, "cite the docs/ page that holds the fact instead:\n" + "\n".join(hits)


def test_every_cited_docs_page_exists():
    missing = [
        f"{where(path, text, match.start())}: {match.group(0)}"
        for path, text in text_files()
        for match in DOCS_PAGE.finditer(text)
        if not (ROOT / "docs" / f"{match.group(1)}.md").is_file()
    ]
    assert not missing, "cited docs pages that do not exist:\n" + "\n".join(missing)


def test_markdown_links_in_docs_resolve_to_files_and_headings():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for match in MARKDOWN_LINK.finditer(text):
            target = match.group(1)
            if re.match(r"[a-z][a-z+.-]*:", target):  # http:, https:, mailto: ...
                continue
            file_part, _, anchor = target.partition("#")
            linked = (page.parent / file_part).resolve() if file_part else page
            if not linked.exists():
                broken.append(f"{where(page, text, match.start())}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in github_anchors(linked.read_text("utf-8")):
                broken.append(f"{where(page, text, match.start())}: {target} (no heading with that anchor)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_github_anchors_follow_githubs_rule():
    page = "# Top\n## Group creation order (`gyre.distributed.groups`)\n```\n# not a heading\n```\n## Top\n"
    assert github_anchors(page) == {"top", "group-creation-order-gyredistributedgroups", "top-1"}


def test_the_docs_index_lists_every_page_once():
    """docs/index.md names every page of docs/ (and the READMEs beside the code) with a link: a new page is listed."""
    index = (ROOT / "docs" / "index.md").read_text()
    linked = re.findall(r"\]\(([^)#]+\.md)\)", index)
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name != "index.md")
    assert sorted({link for link in linked if "/" not in link}) == pages
    for readme in ("../launch/README.md", "../conf/experiment/README.md"):
        assert readme in linked, readme
