"""The docs as a user reads them, README.md and the docs/ pages it links: their Python examples
run as printed, and every relative link leads to a file (and a heading) that exists."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import FENCED, ROOT, doc_blocks, linked_docs, markdown_links


def examples() -> dict[str, str]:
    """Each ```python block once (README.md repeats two of docs/'s), by an id naming the first
    page that prints it and its place there."""
    found: dict[str, str] = {}
    on_page: dict[Path, int] = {}
    for page, code in doc_blocks("python"):
        on_page[page] = on_page.get(page, 0) + 1
        found.setdefault(code, f"{page.as_posix()}:{on_page[page]}")
    return found


EXAMPLES = examples()


def anchors(text: str) -> set[str]:
    """The ids GitHub gives a page's headings: lower case, punctuation dropped, spaces as
    hyphens, a repeated one suffixed -1, -2, ..."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} +(.+?)\s*$", FENCED.sub("", text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        if seen[slug]:
            seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def test_the_readme_has_examples_of_its_own() -> None:
    assert sum(page == Path("README.md") for page, _ in doc_blocks("python")) >= 2


def test_every_docs_page_is_reached_from_the_readme() -> None:
    # So that every page's examples run here, and a reader can find every page.
    pages = {path.relative_to(ROOT) for path in (ROOT / "docs").glob("*.md")}
    assert pages - set(linked_docs()) == set()


def test_every_relative_link_leads_somewhere() -> None:
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in markdown_links(page.read_text()):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            name = f"{page.relative_to(ROOT)}: {target}"
            if not linked.exists():
                broken.append(f"{name} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text()):
                broken.append(f"{name} (no such heading)")
    assert broken == []


@pytest.mark.parametrize("code", list(EXAMPLES), ids=list(EXAMPLES.values()))
def test_the_docs_example_runs(code: str, tmp_path: Path) -> None:
    script = tmp_path / "example.py"  # as a user runs it: a file, so its __main__ has a path
    script.write_text(code)
    try:  # within the test's own timeout, so that a hang still shows what the example printed
        result = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=100
        )
    except subprocess.TimeoutExpired as hung:
        output = (hung.stdout or b"")[-3000:], (hung.stderr or b"")[-3000:]
        pytest.fail(f"the example did not finish in 100 s; stdout, stderr: {output}")
    # What it printed too: an example's own lines (its rounds) say how it got there.
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-2000:])
