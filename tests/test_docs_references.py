"""The code and the docs cite the repository's own docs: never an issue or review-item
number, nor reference notes kept outside the repository, which a reader of the
repository cannot follow; and every path they name in backquotes exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("hadw_kernels", "csrc", "trainer", "bench", "tests", "scripts", "docs")
SUFFIXES = {".py", ".cpp", ".h", ".md", ".yaml", ".sh", ".toml"}
OUTSIDE_CITATION = re.compile(
    r"\.\./shared|\b(?:SPEC|LAYOUT)\.md\b|\bCPU-NOTES\b|\b[Ii]ssues? #?\d|\b[Ii]tems? \d|\breview item")
# A path named as it was, where the line records its move, is history, not a reference.
NAMED_PATH = re.compile(
    r"`((?:hadw_kernels|trainer|csrc|bench|tests|docs|scripts)/[\w./-]+\.(?:py|md|h|cpp|sh|yaml))`(?!\s+moved)")


def files():
    yield from (ROOT / name for name in ("README.md", "CHANGELOG.md", "setup.py", "pyproject.toml"))
    for directory in SOURCES:
        for path in sorted((ROOT / directory).rglob("*")):
            if path.suffix in SUFFIXES and path.is_file() and path != Path(__file__).resolve():
                yield path


def test_nothing_cites_an_issue_an_item_or_notes_outside_the_repository():
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in files() for number, line in enumerate(path.read_text().splitlines(), 1)
             if OUTSIDE_CITATION.search(line)]
    assert not found, "\n".join(found)


def test_every_path_named_in_backquotes_exists():
    missing = [f"{path.relative_to(ROOT)}: {named}" for path in files()
               for named in NAMED_PATH.findall(path.read_text()) if not (ROOT / named).exists()]
    assert not missing, "\n".join(missing)
