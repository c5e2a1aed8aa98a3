"""Argument checks shared by every layer (plain Python: ``parallel/`` uses them too).

One way to say "an integer in a range", with one error wording that names the argument, instead of the hand-written
``isinstance(value, bool) or not isinstance(value, int) or value < 1`` each constructor used to repeat; and one way to
ask whether a file a user hands in leaves its directory through a link (:func:`escapes_directory`).
"""

from __future__ import annotations

import numbers
import os
from pathlib import Path
from typing import Any

__all__ = ["escapes_directory", "is_integer", "require_int"]


def is_integer(value: Any) -> bool:
    """An integral number that is not a ``bool`` (``True`` is an ``int`` in Python, never a degree or a count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def require_int(
    name: str, value: Any, minimum: int = 1, maximum: int | None = None, *, also: tuple = (), hint: str = ""
) -> Any:
    """``int(value)`` if ``value`` is an integer in ``[minimum, maximum]``, ``value`` itself if it is one of the
    ``also`` values (``None``, ``"auto"``, ...), else ``ValueError("<name> must be an integer >= <minimum>[ and <=
    <maximum>][ or <also>...][ (<hint>)], got <value>")``.

    ``require_int("every", 0, hint="optimizer steps between syncs")`` raises ``every must be an integer >= 1
    (optimizer steps between syncs), got 0``.
    """
    for other in also:  # None, a word such as "auto", or an integer alias such as -1 (numpy integers too)
        if value is other or (isinstance(other, str) and isinstance(value, str) and value == other):
            return value
        if is_integer(other) and is_integer(value) and value == other:
            return int(value)
    if is_integer(value) and value >= minimum and (maximum is None or value <= maximum):
        return int(value)
    bound = f">= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
    alternatives = "".join(f" or {other!r}" for other in also)
    raise ValueError(
        f"{name} must be an integer {bound}{alternatives}" + (f" ({hint})" if hint else "") + f", got {value!r}"
    )


def escapes_directory(path: str | os.PathLike, directory: str | os.PathLike) -> Path | None:
    """Where ``path`` really is (links and ``..`` resolved) when that lies outside ``directory`` (resolved too, so a
    directory that is itself a link is fine), else None. Nothing a user hands in (a shard, a checkpoint file, a
    tokenizer) is read through a link that leaves its directory."""
    try:
        target, root = Path(path).resolve(), Path(directory).resolve()
    except (OSError, RuntimeError):  # (a link loop: nowhere a reader could get to)
        return Path(path)
    return None if target == root or root in target.parents else target
