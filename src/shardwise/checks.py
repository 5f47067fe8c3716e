"""What every technique's config checks share: the value tests and the shape of an "unused field" rule.

Each technique keeps its own rules beside its code (``parallel/tensor/checks.py``, ``ps/checks.py``, ...):
a ``check(cfg)`` that raises :class:`~shardwise.config.ConfigError` naming the dotted field, its value and
what would be valid, and an ``unused(cfg)`` listing the fields it owns that the resolved layout would not
read. :mod:`shardwise.config_resolve` fills the derived fields and calls them all in one list. Nothing here
imports more than :mod:`shardwise.config`.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from shardwise.config import CHOICES, ConfigError


class Unused(NamedTuple):
    """A field (``section.key``) that, set away from its default while ``read`` is false, is refused with
    ``"{field}={value!r} {why}"``: a setting that silently does nothing misleads."""

    field: str
    read: Any
    why: str


def choice(dotted: str, value: Any, options: tuple | None = None) -> None:
    """``value`` must be one of ``options`` (default: ``CHOICES[dotted]``)."""
    options = CHOICES[dotted] if options is None else options
    if value not in options:
        raise ConfigError(f"{dotted}={value!r} is not valid; use one of {', '.join(map(repr, options))}")


def positive(dotted: str, value: float | int | None, allow_zero: bool = False) -> None:
    """``value`` (when set) must be a finite number above zero (or at least zero)."""
    if value is None:
        return
    if (value < 0) or (value == 0 and not allow_zero) or (isinstance(value, float) and not math.isfinite(value)):
        what = "a non-negative" if allow_zero else "a positive"
        raise ConfigError(f"{dotted}={value!r} must be {what} number")


def divisors(n: int) -> str:
    """The divisors of ``n`` as text, for "use one of ..." suggestions."""
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
