"""Every fenced ```python block of README.md and docs/**/*.md runs, as written.

Each block runs alone, as a reader copies it: in a fresh namespace holding only
``snippet_setup()``'s names, the rollout batch README.md's "Use" says the snippets take
from the reader's trainer (its names are listed there); a block never reads what an
earlier block defined. A block that cannot run here (it downloads a model, needs a GPU or a launcher) is marked
by an HTML comment on the line before its fence, ``<!-- snippet: not run: <reason> -->``:
it is only compiled, and its test is skipped with that reason.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
NOT_RUN = re.compile(r"<!-- snippet: not run: (.+?) -->\n$")


def _label(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name


def python_blocks(path: Path) -> list[tuple[str, str | None]]:
    """(code, the reason it is not run or None) of each ```python block of ``path``."""
    text = path.read_text()
    blocks = []
    for match in FENCE.finditer(text):
        marker = NOT_RUN.search(text, 0, match.start())
        reason = marker.group(1) if marker and marker.end() == match.start() else None
        blocks.append((match.group(1), reason))
    return blocks


SNIPPETS = [(path, index) for path in DOCUMENTS for index in range(len(python_blocks(path)))]


def snippet_setup() -> dict:
    """The names the snippets use without defining them: one rollout batch of B = 8
    responses (2 prompts x G = 4, each group's responses contiguous) of up to T = 6
    tokens, hidden size H = 16, vocabulary V = 32.

    ``torch``; ``G``; ``rewards`` [B] (0/1, no group all equal); ``logprobs`` [B, T]
    (requires grad), ``old_logprobs``, ``ref_logprobs``; ``response_mask`` [B, T] bool
    (lengths 1 to T); ``hidden_states`` [B, T, H] (requires grad), ``labels`` [B, T]
    (token ids), ``model`` (``model.lm_head``, a [V, H] linear layer); ``uids`` [B]
    (each row's group id); ``prompt_ids`` (each row's prompt token ids, a list a row, a
    group's rows alike); ``belief`` (an anchor's belief, 0.4)."""
    generator = torch.Generator().manual_seed(0)
    prompts, group, width, hidden, vocab = 2, 4, 6, 16, 32
    batch = prompts * group
    lengths = torch.tensor([6, 3, 1, 5, 6, 2, 4, 6])
    model = torch.nn.Module()
    model.lm_head = torch.nn.Linear(hidden, vocab, bias=False)
    old_logprobs = -2 - torch.rand(batch, width, generator=generator)
    return dict(
        torch=torch,
        G=group,
        rewards=torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0]),
        logprobs=(old_logprobs + 0.1 * torch.randn(batch, width, generator=generator)).requires_grad_(),
        old_logprobs=old_logprobs,
        ref_logprobs=old_logprobs + 0.05 * torch.randn(batch, width, generator=generator),
        response_mask=torch.arange(width)[None, :] < lengths[:, None],
        hidden_states=torch.randn(batch, width, hidden, generator=generator, requires_grad=True),
        labels=torch.randint(0, vocab, (batch, width), generator=generator),
        model=model,
        uids=torch.arange(batch) // group,
        prompt_ids=[[1, 5 + row // group, 9] for row in range(batch)],
        belief=0.4,
    )


def run_alone(path: Path, index: int) -> None:
    """Runs block ``index`` of ``path`` in a namespace of its own."""
    code, _ = python_blocks(path)[index]
    exec(compile(code, f"{_label(path)}, python block {index}", "exec"), snippet_setup())


@pytest.mark.parametrize("path, index", SNIPPETS, ids=[f"{_label(p)}-{i}" for p, i in SNIPPETS])
def test_the_snippet_runs_as_written(path, index, tmp_path, monkeypatch):
    code, reason = python_blocks(path)[index]
    compile(code, f"{_label(path)}, python block {index}", "exec")  # marked or not: valid Python
    if reason is not None:
        pytest.skip(f"marked in the document: {reason}")
    monkeypatch.chdir(tmp_path)  # away from the repository: what a snippet writes lands there
    run_alone(path, index)


def test_the_snippets_are_found_and_rarely_marked():
    """The collection reads the fences it should (a regex that found nothing would pass
    every test), and few blocks are exempt."""
    assert len(python_blocks(REPO / "README.md")) >= 3
    marked = [(path, index) for path, index in SNIPPETS if python_blocks(path)[index][1] is not None]
    assert len(marked) <= 2, marked


def test_a_broken_snippet_fails(tmp_path):
    """The runner runs what the document says: a block that raises fails its test, a block
    that reads a name only an earlier block defines fails, and a marker only exempts the
    block right after it."""
    document = tmp_path / "doc.md"
    document.write_text(
        "<!-- snippet: not run: needs the network -->\n```python\nraise SystemExit('not run')\n```\n\n"
        "Some text.\n\n```python\nvalue = G + 1\n```\n\n```python\nassert value == 5\n"
        "loss = fused(logprobs)\n```\n"
    )
    assert [reason for _, reason in python_blocks(document)] == ["needs the network", None, None]
    run_alone(document, 1)
    with pytest.raises(NameError, match="value"):
        run_alone(document, 2)
