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

import dataclasses
from typing import TYPE_CHECKING, TypeVar, cast

from pydantic import ConfigDict, Field, ValidationError
from pydantic.dataclasses import dataclass
from typing_extensions import dataclass_transform  # in typing from Python 3.11; pydantic requires the backport

if TYPE_CHECKING:
    from pydantic.dataclasses import PydanticDataclass

_SECTION = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the offending key."""


_Section = TypeVar("_Section")


# dataclass_transform: to a type checker a section is the dataclass it is at run time
# (its fields are __init__'s keywords, dataclasses.replace takes it). A field's default
# is Field(default=...): a type checker reads no positional default from a field specifier.
@dataclass_transform(field_specifiers=(dataclasses.field, Field))
def section(cls: type[_Section]) -> type[_Section]:
    """``cls`` as a config section: a dataclass whose fields pydantic checks when it is built."""
    # pydantic types what it returns as its dataclass protocol; it is cls (or, for a
    # stdlib dataclass, a subclass of it).
    return cast("type[_Section]", dataclass(config=_SECTION)(cls))


# How a failed bound reads, by pydantic's error type and the bound's value.
_BOUNDS = {
    "greater_than": lambda bound: "must be positive" if bound == 0 else f"must be greater than {bound}",
    "greater_than_equal": lambda bound: "must be non-negative" if bound == 0 else f"must be at least {bound}",
    "less_than_equal": lambda bound: f"must be at most {bound}",
}


def section_error(name: str, section_type: type[PydanticDataclass], error: ValidationError) -> ConfigError:
    """The first of ``error``'s complaints about the ``name`` section, as one line naming
    the key (and the list item): ``rollout.group_size must be at least 2 (...), got 1``,
    ``train.steps: Input should be a valid integer, got 'many'``."""
    first = error.errors()[0]
    where = name + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in first["loc"])
    context = first.get("ctx", {})
    if first["type"] == "literal_error":
        return ConfigError(f"{where} must be one of {context['expected']}, got {first['input']!r}")
    if first["type"] in _BOUNDS:
        # A section is built from keywords: its errors' locations start with the field's name.
        field = section_type.__pydantic_fields__[str(first["loc"][0])]
        said = f"must be {field.description}" if field.description else _BOUNDS[first["type"]](*context.values())
        return ConfigError(f"{where} {said}, got {first['input']!r}")
    return ConfigError(f"{where}: {first['msg']}, got {first['input']!r}")
