"""The loop's side of the ROUTER socket: send without blocking, answer refusals.

A send that fails (the peer is gone, or stopped reading past its window) drops that
connection and nothing else: sends use ``ROUTER_MANDATORY`` and ``NOBLOCK``.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any

import zmq

from tokenfeed import protocol
from tokenfeed.errors import ServerError
from tokenfeed_server.dataplane.auth import ANONYMOUS
from tokenfeed_server.dataplane.registry import Registry
from tokenfeed_server.logbudget import LogBudget

__all__ = ["Wire", "tenant_of"]

log = logging.getLogger(__name__)


class Wire:
    """Frames out of the bound socket ``sock``, for the loop thread only."""

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        registry: Registry,
        counters: collections.Counter[str],
        log_budget: LogBudget,
        redact: Callable[[str], str] = str,
    ) -> None:
        #: applied to every error message sent (no store location, no endpoint URL)
        self.redact = redact
        self.sock = sock
        self.registry = registry
        self.counters = counters
        self._log_budget = log_budget

    def send(self, ident: bytes, frames: list[Any]) -> bool:
        """Send ``frames`` to connection ``ident``; False (and the connection dropped) if
        it cannot take them now."""
        try:
            self.sock.send_multipart([ident, *frames], zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            # EHOSTUNREACH: the peer is gone; EAGAIN: it stopped reading past its window.
            if self._log_budget.take():
                log.info("dropping connection %s: %s", ident.hex()[:16], exc.strerror)
            self.registry.forget_peer(ident)
            return False
        return True

    def refuse(self, ident: bytes, error: ServerError) -> None:
        """Answer a message that cannot be taken with ``err`` (no request id), counted
        under its code; logged unless ``error.quiet`` (an expected refusal)."""
        code, message = error.code, str(error)
        self.counters[f"err_{code}"] += 1
        if error.quiet:
            log.debug("answered %s from %s: %s", code, ident.hex()[:16], message)
        elif self._log_budget.take():
            log.warning("refused a request from %s: %s: %s", ident.hex()[:16], code, message)
        self.send_error(ident, error, req=-1)

    def send_error(self, ident: bytes, error: ServerError, *, req: int) -> None:
        """Answer request ``req`` of connection ``ident`` with ``err``."""
        message = self.redact(str(error))
        err = protocol.Err(code=error.code, message=message, retry=error.retry, req=req)
        self.send(ident, [err.header()])


def tenant_of(frame: zmq.Frame) -> str:
    """The tenant that sent ``frame``: the identity ZAP authenticated, else anonymous."""
    # ZAP puts the authenticated identity on every frame; without ZAP there is none.
    try:
        user = frame.get("User-Id")
    except zmq.ZMQError:
        return ANONYMOUS
    return str(user) if user else ANONYMOUS
