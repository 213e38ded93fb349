"""How big and how deep a value on the wire may be, and the check that holds it there.

Every field of every message is checked against its declared type and these bounds
before a message object exists (see "Values and bounds" in :mod:`tokenfeed.protocol`).
"""

from __future__ import annotations

import typing
from typing import Any

from tokenfeed.errors import ProtocolError

#: Largest header frame either end accepts (see "Values and bounds" in :mod:`tokenfeed.protocol`).
MAX_HEADER_BYTES = 64 * 1024
#: Largest string value in UTF-8 bytes, not characters (dataset names, ids, messages).
MAX_STR = 512
#: Most items of one list or entries of one map.
MAX_ITEMS = 1024
#: Deepest nesting of a field's type (``dict[str, tuple[int, ...]]`` is 2).
MAX_DEPTH = 3
#: Most named provenance rows one chunk may carry.
MAX_PROVENANCE_ROWS = 16
#: Integers on the wire are >= -1 and fit int64 (stream positions are int64).
MAX_INT = (1 << 63) - 1


def brief(value: object, limit: int = 80) -> str:
    """``value`` for an error message, cut to ``limit`` characters (it may be hostile).

    Control and non-ASCII characters are escaped (``\\n``, ``\\x1b``, ``\\u2028``): the
    message goes to the server's log, where a raw newline would let a client forge lines.
    """
    if isinstance(value, str):
        text = value.encode("unicode_escape").decode("ascii")
    else:
        text = repr(value).encode("ascii", "backslashreplace").decode("ascii")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_value(where: str, value: object, hint: object) -> Any:
    """``value`` if it has type ``hint`` within the bounds, else ProtocolError."""
    if hint is int:
        # bool is an int subclass; a JSON-ish client sending true for a count is a bug
        if type(value) is not int or not (-1 <= value <= MAX_INT):
            raise ProtocolError(f"{where} must be an integer in [-1, 2**63), got {brief(value)}")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise ProtocolError(f"{where} must be a string, got {type(value).__name__}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ProtocolError(f"{where} must be a boolean, got {type(value).__name__}")
        return value
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple:
        if not isinstance(value, tuple):
            raise ProtocolError(f"{where} must be a list, got {type(value).__name__}")
        return tuple(check_value(f"{where}[{i}]", item, args[0]) for i, item in enumerate(value))
    if not isinstance(value, dict):  # depth() admits only tuple and dict containers
        raise ProtocolError(f"{where} must be a map, got {type(value).__name__}")
    return {k: check_value(f"{where}[{k!r}]", v, args[1]) for k, v in value.items()}


def depth(hint: object) -> int:
    """How deeply a field type nests (a scalar is 0); refuses types with no wire check."""
    if hint in (int, str, bool):
        return 0
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return 1 + depth(args[0])
    if origin is dict and len(args) == 2 and args[0] is str:
        return 1 + depth(args[1])
    raise TypeError(f"no wire encoding for field type {hint!r}")
