"""Optional ``hello`` fields a client leaves out for a server from before them.

A server refuses a field it does not know (see "Evolution" in :mod:`tokenfeed.protocol`):
its decoder answers ``bad_request`` "hello: unexpected fields ['run', ...]; the peer
speaks a newer protocol...", words fixed in every release. A few fields change no token
(they name the job, feed its page, or choose the transport): for those alone the client
says hello again without them, once, and logs what the run loses. A refusal naming any
other field is an error, never retried without it.
"""

from __future__ import annotations

import ast
import logging

from tokenfeed import protocol

__all__ = ["DROPPABLE", "refused_droppable"]

#: field -> (log level, what leaving it out costs); every one changes no token
DROPPABLE: dict[str, tuple[int, str]] = {
    "run": (
        logging.WARNING,
        "older than run ids: this run shares its job with runs of the same dataset, seed "
        "and shapes, as before run ids; the data served is the same. Upgrade "
        "tokenfeed-server to give every launch its own job",
    ),
    "skipped": (
        logging.WARNING,
        "older than skipped ranges: its job page will not show the steps this run "
        "skipped; the data served is the same. Upgrade tokenfeed-server to see them",
    ),
    "allow_read_amplification": (
        logging.INFO,
        "older than allow_read_amplification: it never refused read amplification, so "
        "the data served is the same",
    ),
    "ring": (
        logging.INFO,
        "older than shared-memory rings: every chunk comes over TCP (the same bytes)",
    ),
}
_UNEXPECTED = "hello: unexpected fields ["


def refused_droppable(hello: protocol.Hello, err: protocol.Err) -> list[str]:
    """The fields of ``hello`` that ``err`` refuses as unknown, if every one of them may
    be dropped; else (another refusal, or a field that may not be dropped) none."""
    if err.code != "bad_request" or not err.message.startswith(_UNEXPECTED):
        return []
    listed = err.message[len(_UNEXPECTED) - 1 :].split("]", 1)[0] + "]"
    try:
        names = ast.literal_eval(listed)
    except (SyntaxError, ValueError):
        return []
    if not isinstance(names, list) or not all(n in DROPPABLE for n in names):
        return []
    defaults = protocol.messages.DEFAULTS[protocol.Hello]
    return [n for n in names if getattr(hello, n) != defaults[n]]
