"""Every relative link of README.md, CHANGELOG.md and docs/ reaches its file, and its
anchor a heading there (as GitHub forms anchors: lower case, punctuation dropped, spaces
as hyphens, a repeated heading numbered)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#+)\s+(.*)")


def _slug(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    found, seen, in_code = set(), {}, False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        match = None if in_code else HEADING.match(line)
        if match:
            slug = _slug(match.group(2))
            found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return found


def _text_outside_code(page: Path) -> str:
    """The page without its code blocks and inline code (``kernel[grid](...)`` is no link)."""
    return re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", page.read_text(), flags=re.S))


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in LINK.findall(_text_outside_code(page)):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: no such heading")
    assert not broken, broken


def test_the_slug_follows_github():
    assert _slug("The TRL drop-in's layouts") == "the-trl-drop-ins-layouts"
    assert _slug("`check_values`: one read, 2026-11-28") == "check_values-one-read-2026-11-28"
