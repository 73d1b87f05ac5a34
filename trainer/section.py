"""How a config section is declared: :func:`section` makes a class a pydantic dataclass
that checks its values when it is built, and :func:`section_error` turns pydantic's first
complaint into one line naming the key. Each part of the trainer declares the sections it
reads with it (the model's in ``models/checks.py``, the data's, eval's and reward's in
``tasks/``, the engine's in ``engine/settings.py``); ``config.py`` composes them.

A section is a dataclass still (``dataclasses.fields``, ``replace`` and ``asdict`` work),
so a saved run's ``config.yaml`` is its fields. pydantic checks, strictly: no value becomes
another type (true is no integer, "5" no number), except an integer where a number is
asked; a number must be finite (``.inf`` once passed and ended the first step in a rank
traceback); an unknown key is refused. ``Literal`` fields name their choices and ``Field``
bounds (``gt``, ``ge``, ``le``) their ranges; a bound's ``description`` is how its message
says it ("at least 2 (a group-relative baseline)").
"""

from __future__ import annotations

from pydantic import ConfigDict, ValidationError
from pydantic.dataclasses import dataclass

_SECTION = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the offending key."""


def section(cls: type) -> type:
    """``cls`` as a config section: a dataclass whose fields pydantic checks when it is built."""
    return dataclass(config=_SECTION)(cls)


# How a failed bound reads, by pydantic's error type and the bound's value.
_BOUNDS = {
    "greater_than": lambda bound: "must be positive" if bound == 0 else f"must be greater than {bound}",
    "greater_than_equal": lambda bound: "must be non-negative" if bound == 0 else f"must be at least {bound}",
    "less_than_equal": lambda bound: f"must be at most {bound}",
}


def section_error(name: str, section_type: type, error: ValidationError) -> ConfigError:
    """The first of ``error``'s complaints about the ``name`` section, as one line naming
    the key (and the list item): ``rollout.group_size must be at least 2 (...), got 1``,
    ``train.steps: Input should be a valid integer, got 'many'``."""
    first = error.errors()[0]
    where = name + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in first["loc"])
    context = first.get("ctx", {})
    if first["type"] == "literal_error":
        return ConfigError(f"{where} must be one of {context['expected']}, got {first['input']!r}")
    if first["type"] in _BOUNDS:
        field = section_type.__pydantic_fields__[first["loc"][0]]
        said = f"must be {field.description}" if field.description else _BOUNDS[first["type"]](*context.values())
        return ConfigError(f"{where} {said}, got {first['input']!r}")
    return ConfigError(f"{where}: {first['msg']}, got {first['input']!r}")
