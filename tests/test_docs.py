"""README.md and docs/*.md: every relative link names a file or folder of this repository, and
every ``#anchor`` names a heading of the page it points into (GitHub's heading slugs).  Links in
code blocks and code spans are text, not links, and are left alone; web addresses are not
fetched.  Pure file reading: the whole file runs in well under a second.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1(?!`)", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # https:, mailto:, ...


def prose(text: str) -> str:
    """The page without its code blocks and code spans (blanked, so line numbers stay)."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return CODE_SPAN.sub(lambda m: " " * len(m.group(0)), text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the visible text, lower case, punctuation dropped (``-``
    and ``_`` kept), spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor of a page: its headings' slugs, a repeated one numbered as GitHub numbers it
    (``x``, ``x-1``, ``x-2``), and explicit ``<a name=...>`` / ``id=...`` targets."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), page.read_text())
    seen: dict[str, int] = {}
    found = set()
    for match in HEADING.finditer(text):
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    found |= set(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", text))
    return found


def targets(text: str) -> list[tuple[int, str]]:
    """``(line, target)`` of every link of a page's prose, inline and reference-style."""
    body = prose(text)
    found = [(m.start(), m.group(1)) for m in LINK.finditer(body)]
    found += [(m.start(), m.group(1)) for m in REFERENCE.finditer(body)]
    return sorted((body.count("\n", 0, at) + 1, target) for at, target in found)


def broken_links(page: Path, root: Path = REPO) -> list[str]:
    """``page:line: target (why)`` for every relative link that does not resolve inside ``root``."""
    problems = []
    for line, target in targets(page.read_text()):
        if EXTERNAL.match(target):
            continue
        path, _, anchor = target.partition("#")
        where = f"{page.relative_to(root)}:{line}: {target}"
        resolved = (page.parent / path).resolve() if path else page
        if path and not resolved.exists():
            problems.append(f"{where} (no such file)")
            continue
        if root not in resolved.parents and resolved != root:
            problems.append(f"{where} (outside the repository)")
            continue
        if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{where} (no heading with anchor #{anchor})")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_relative_links_and_anchors_resolve(page):
    assert broken_links(page) == []


def test_the_checker_finds_what_is_broken(tmp_path):
    """The checker itself: a missing file, a missing anchor (here and on another page) and a
    link that leaves the repository are reported; a good link, a repeated heading's numbered
    anchor, a web address and links inside code are not."""
    tmp_path = tmp_path / "repo"
    (tmp_path / "docs").mkdir(parents=True)
    (tmp_path / "docs" / "other.md").write_text("# Other page\n\n## Horovod's API on `Keras 3`\n")
    page = tmp_path / "README.md"
    page.write_text(
        "# Title\n\n## Setup\n\n## Setup\n\n"
        "[ok](docs/other.md) [ok](#setup-1) [ok](docs/other.md#horovods-api-on-keras-3)\n"
        "[ok](https://example.org/missing) `[code](nowhere.md)`\n"
        "```\n[fenced](nowhere.md)\n# not a heading\n```\n"
        "[gone](docs/missing.md)\n"
        "[no anchor](#not-a-heading) [no anchor there](docs/other.md#setup)\n"
        "[outside](../elsewhere)\n")
    (tmp_path.parent / "elsewhere").touch()
    assert broken_links(page, root=tmp_path) == [
        "README.md:13: docs/missing.md (no such file)",
        "README.md:14: #not-a-heading (no heading with anchor #not-a-heading)",
        "README.md:14: docs/other.md#setup (no heading with anchor #setup)",
        "README.md:15: ../elsewhere (outside the repository)",
    ]


def test_readme_states_the_test_command_ci_runs():
    """.ci/run runs exactly README's test command: README says `make test`, and .ci/run runs it."""
    assert re.search(r"^make test\b", (REPO / ".ci" / "run").read_text(), re.M)
    assert "make test" in (REPO / "README.md").read_text()
