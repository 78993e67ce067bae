"""The docs as a reader meets them (issue 55): README opens with the five-line probe, the task guides
are short and start with a contents list, every page's code is under test, and every link between
pages lands on a page and a heading that exist."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from ._inputs import REPO
from ._snippets import extract
from .test_docs import DOCS

#: task guides: the most lines each may have (issue 55's floor for docs/probe.md and docs/fuzz.md)
LINE_LIMITS = {"docs/probe.md": 600, "docs/fuzz.md": 600}
#: pages that open with a contents list linking every one of their ``##`` sections
WITH_CONTENTS = (
    "docs/probe.md",
    "docs/integrations.md",
    "docs/calibration.md",
    "docs/fuzz.md",
    "docs/fuzz-reference.md",
    "docs/microbenchmark.md",
    "docs/microbenchmark-reference.md",
    "docs/study.md",
    "docs/training.md",
    "docs/weights.md",
)

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose_lines(text: str) -> list[str]:
    """The page's lines outside fenced code blocks (a ``# comment`` in code is not a heading)."""
    lines, fence = [], None
    for line in text.splitlines():
        marker = re.match(r"^(```+|~~~+)", line)
        if marker and (fence is None or marker.group(1).startswith(fence)):
            fence = None if fence else marker.group(1)
            continue
        if fence is None:
            lines.append(line)
    return lines


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    """Every heading anchor of a page, repeated headings numbered as GitHub numbers them."""
    seen: Counter[str] = Counter()
    anchors = set()
    for line in _prose_lines(page.read_text(encoding="utf-8")):
        if (found := re.match(r"^#{1,6} (.+)$", line)) is not None:
            slug = _slug(found.group(1))
            anchors.add(f"{slug}-{seen[slug]}" if seen[slug] else slug)
            seen[slug] += 1
    return anchors


def _pages() -> list[str]:
    return ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]


def test_slug_matches_githubs_anchors() -> None:
    assert _slug("Rules compared: `python -m lab.rules`") == "rules-compared-python--m-labrules"
    assert _slug("Direct calls: flash-attn, FlashAttention-3/4, FlashInfer, `varlen_attn`") == (
        "direct-calls-flash-attn-flashattention-34-flashinfer-varlen_attn"
    )
    assert _slug("with torch.compile") == "with-torchcompile"


def test_readme_opens_with_the_five_line_probe() -> None:
    """README's first code block is a five-line ``probe(model)`` snippet, under its own heading near the
    top, and tests/docs runs it (README.md is one of the pages whose Python blocks run)."""
    assert "README.md" in DOCS
    first = extract(REPO, "README.md")[0]
    assert first.block == 0 and first.kind == "python", first
    code = [line for line in first.text.splitlines() if line.strip()]
    assert len(code) == 5, code
    assert "probe(model)" in first.text and "verdict" in first.text
    text = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    headings = [line for line in text[: first.line] if line.startswith("## ")]
    assert headings == ["## Probe your model in five lines"], headings
    assert first.line <= 15, f"the five lines start at line {first.line}: one or two sentences first"


@pytest.mark.parametrize("doc", sorted(LINE_LIMITS))
def test_task_guide_is_short(doc: str) -> None:
    lines = len((REPO / doc).read_text(encoding="utf-8").splitlines())
    assert lines <= LINE_LIMITS[doc], f"{doc} has {lines} lines (at most {LINE_LIMITS[doc]})"


@pytest.mark.parametrize("doc", WITH_CONTENTS)
def test_page_opens_with_a_contents_list(doc: str) -> None:
    """Within its first 30 lines the page has a list of links to its own sections, covering every ``##``."""
    lines = _prose_lines((REPO / doc).read_text(encoding="utf-8"))
    start = next((i for i, line in enumerate(lines[:30]) if line.strip() == "**Contents**"), None)
    assert start is not None, f"{doc}: no **Contents** in its first 30 lines"
    contents = []
    for line in lines[start + 1 :]:
        if line.startswith("## "):
            break
        contents += [t[1:] for t in _LINK.findall(line) if t.startswith("#")]
    sections = {_slug(line[3:]) for line in lines if line.startswith("## ")}
    missing = sorted(sections - set(contents))
    assert sections and not missing, f"{doc}: the contents list misses {missing}"


def test_every_page_is_under_test() -> None:
    """A page of docs/ with code is one of tests/docs' pages, so its snippets run."""
    untested = [p for p in _pages() if p not in DOCS and extract(REPO, p)]
    assert not untested, f"add {untested} to DOCS in tests/docs/test_docs.py"


@pytest.mark.parametrize("doc", _pages())
def test_links_land_on_a_page_and_heading(doc: str) -> None:
    page = REPO / doc
    broken = []
    for line in _prose_lines(page.read_text(encoding="utf-8")):
        for target in _LINK.findall(line):
            if re.match(r"^[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{target} (no file)")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{target} (no heading #{anchor} in {linked.relative_to(REPO)})")
    assert not broken, f"{doc}: " + "; ".join(broken)
