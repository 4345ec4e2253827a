"""Name -> function lookup shared by every variant table in `algos`."""

from collections.abc import Mapping
from typing import TypeVar

T = TypeVar("T")


def pick(table: Mapping[str, T], name: str, what: str) -> T:
    """Return `table[name]`, or raise a ValueError that lists the valid names."""
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown {what} {name!r}; choose one of {sorted(table)}") from None
