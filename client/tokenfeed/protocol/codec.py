"""Decoding a header frame: size first, then msgpack's limits, then every field's type.

The encoder is :meth:`tokenfeed.protocol.messages.Message.header`; this is its strict
inverse (see "Values and bounds" and "Evolution" in :mod:`tokenfeed.protocol`).
"""

from __future__ import annotations

import msgpack

from tokenfeed.errors import ProtocolError
from tokenfeed.protocol.bounds import MAX_HEADER_BYTES, MAX_ITEMS, MAX_STR, brief, check_value
from tokenfeed.protocol.constants import VERSION
from tokenfeed.protocol.messages import DEFAULTS, HINTS, MESSAGE_TYPES, Message


def decode_header(frame: bytes | memoryview) -> Message:
    """Decode and validate one header frame; raise ProtocolError saying what is wrong."""
    if len(frame) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header frame of {len(frame)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        obj = msgpack.unpackb(
            frame,
            raw=False,
            use_list=False,
            strict_map_key=True,
            max_str_len=MAX_STR,
            max_bin_len=0,
            max_ext_len=0,
            max_array_len=MAX_ITEMS,
            max_map_len=MAX_ITEMS,
        )
    except Exception as exc:  # msgpack raises several unrelated types; map them here
        reason = f"{type(exc).__name__}: {exc}"
        raise ProtocolError(f"header frame is not valid msgpack ({brief(reason)})") from None
    if not isinstance(obj, dict):
        raise ProtocolError("header frame must be a msgpack map with 'v' and 't'")
    version = obj.pop("v", None)
    if version != VERSION:
        raise ProtocolError(
            f"protocol version {version!r} is not supported (this end speaks v{VERSION}); "
            "install matching versions of tokenfeed and tokenfeed-server"
        )
    kind = obj.pop("t", None)
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type; expected one of {sorted(MESSAGE_TYPES)}")
    hints, defaults = HINTS[cls], DEFAULTS[cls]
    extra = sorted(brief(k, 40) for k in obj.keys() - hints.keys())
    if extra:
        raise ProtocolError(
            f"{cls.TYPE}: unexpected fields {extra}; the peer speaks a newer protocol "
            "than this end: install matching versions of tokenfeed and tokenfeed-server"
        )
    missing = sorted(hints.keys() - obj.keys() - defaults.keys())
    if missing:
        raise ProtocolError(f"{cls.TYPE}: missing fields {missing}")
    for name, hint in hints.items():
        if name in obj:
            obj[name] = check_value(f"{cls.TYPE}.{name}", obj[name], hint)
    msg = cls(**obj)
    msg.check()
    return msg
