"""What the command-line tools (``python -m hadw_kernels.tools.demo``, ``.plan``, ``.theory``,
``trainer/``'s probe, compare and calibrate) share: argument types that refuse a bad
value while the arguments are parsed, the way argparse users expect (the usage line, one
message naming the flag, exit code 2, no traceback), and a help formatter that shows
every option's default."""

from __future__ import annotations

import argparse
import math
import os
import textwrap
from collections.abc import Callable
from pathlib import Path


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's default after its help, unless the help already says it
    ("(default: ...)"); the description and epilog as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        return help_text if "(default: " in help_text else super()._get_help_string(action)


def summary(docstring: str) -> str:
    """A module docstring's first paragraph on one line: a parser's description (its first
    line alone may stop mid-sentence), wrapped for a terminal."""
    return textwrap.fill(" ".join(docstring.strip().split("\n\n", 1)[0].split()), width=79)


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer no smaller than ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def finite_float(*, minimum: float = -math.inf, above: float | None = None, maximum: float = math.inf
                 ) -> Callable[[str], float]:
    """An argparse ``type``: a finite number in [``minimum``, ``maximum``], and greater
    than ``above`` when given (``above=0``: positive)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if above is not None and not value > above:
            raise argparse.ArgumentTypeError(f"must be greater than {above:g}, got {value:g}")
        if not minimum <= value <= maximum:
            bounds = (f"in [{minimum:g}, {maximum:g}]" if math.isfinite(minimum) and math.isfinite(maximum)
                      else f"at least {minimum:g}" if math.isfinite(minimum) else f"at most {maximum:g}")
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {value:g}")
        return value

    return parse


def output_directory(text: str) -> Path:
    """An argparse ``type``: a directory to write into, existing or to be made; refused
    when the path, or a folder above it, is a file, or when the nearest existing folder
    cannot be written (checked before the tool works, not when it saves)."""
    path = Path(text)
    _require_writable_folder(path, text)
    return path


def output_file(text: str) -> Path:
    """An argparse ``type``: a file to write, in a folder existing or to be made; refused
    when it is a directory, or as :func:`output_directory` refuses its folder."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a directory, not a file")
    _require_writable_folder(path.parent, text)
    return path


def _require_writable_folder(path: Path, text: str) -> None:
    for existing in (path, *path.parents):
        if not existing.exists():
            continue
        if not existing.is_dir():
            where = "" if str(existing) == text else f" (in {text!r})"
            raise argparse.ArgumentTypeError(f"{existing} is a file, not a directory{where}")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise argparse.ArgumentTypeError(f"cannot write in {existing}")
        return


POSITIVE_INT = int_at_least(1)
NON_NEGATIVE_INT = int_at_least(0)
POSITIVE_FLOAT = finite_float(above=0.0)
NON_NEGATIVE_FLOAT = finite_float(minimum=0.0)
