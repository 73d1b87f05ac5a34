"""Every derived file is what its generator writes (hadw_kernels/tools/codegen.py): LossConfig's
option fields, option_types.py, docs/options.md's table of the objectives' options, the
Triton kernels' codes and the C++ headers of a build. On a change of the tables, run ``python -m
hadw_kernels.tools.codegen``."""

import dataclasses
import shutil
import typing
from pathlib import Path

import pytest

from hadw_kernels.config.loss_config import LossConfig
from hadw_kernels.config.option_types import LossOptions
from hadw_kernels.tools import codegen

ROOT = Path(__file__).resolve().parents[1]


def test_every_derived_file_is_fresh():
    assert codegen.stale() == [], f"stale derived files: run {codegen.COMMAND}"


def _copy(tmp_path: Path) -> Path:
    for item in codegen.DERIVED:
        source = ROOT / item.path
        if source.exists():
            (tmp_path / item.path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source, tmp_path / item.path)
    return tmp_path


@pytest.mark.parametrize("path, edit", [
    ("docs/options.md", lambda text: text.replace("| `dual_clip` | `clip`: off |", "| `dual_clip` | `clip`: 2 |")),
    ("hadw_kernels/config/loss_config.py", lambda text: text.replace("    delta: float | None = None\n", "")),
    ("hadw_kernels/config/option_types.py", lambda text: text.replace("    beta: float | None\n", "")),
    ("hadw_kernels/triton/codes.py", lambda text: text.replace("OBJECTIVE_CLIP: tl.constexpr = tl.constexpr(0)\n", "")),
])
def test_an_edited_derived_file_is_stale_and_written_back(tmp_path, path, edit):
    root = _copy(tmp_path)
    text = (root / path).read_text()
    assert edit(text) != text
    (root / path).write_text(edit(text))
    assert codegen.stale(root) == [path]
    assert codegen.write(root) == [path]
    assert (root / path).read_text() == text and codegen.stale(root) == []


def test_a_field_written_by_hand_reaches_the_keywords(tmp_path):
    """option_types.py follows loss_config.py's hand-written fields, read from its text: a new
    field becomes a keyword at its place."""
    root = _copy(tmp_path)
    config = root / "hadw_kernels" / "config" / "loss_config.py"
    config.write_text(config.read_text().replace("    kl_bias_ratio: str = \"objective\"\n",
                                                 "    kl_bias_ratio: str = \"objective\"\n    trial: int | None = None\n"))
    assert codegen.stale(root) == ["hadw_kernels/config/option_types.py"]
    codegen.write(root)
    assert "    kl_bias_ratio: str | None\n    trial: int | None\n" in (root / "hadw_kernels" / "config" / "option_types.py").read_text()


def test_the_keywords_are_the_fields():
    """LossOptions (generated) has a key per LossConfig field and loss_type, each also None."""
    hints = typing.get_type_hints(LossOptions)
    assert list(hints) == ["loss_type", *(field.name for field in dataclasses.fields(LossConfig))]
    assert all(type(None) in typing.get_args(hint) for hint in hints.values())


def test_the_check_mode_lists_stale_files(capsys):
    assert codegen.main(["--check"]) == 0
    assert capsys.readouterr().out == ""
