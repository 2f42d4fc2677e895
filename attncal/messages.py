"""How attncal words another library's exception in its own one-line messages."""

from __future__ import annotations


def first_line(exc: BaseException) -> str:
    """The first line of `exc`'s message (libraries' messages run to pages), or its type's name when it has none."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
