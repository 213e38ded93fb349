"""Connections that passed the handshake but never said ``hello``: counted, capped and
timed out.

The ROUTER socket has no per-peer close, and a connection that never sends a message is
invisible to the data plane (it has no routing id in any message), so 4,000 of them held
4,000 descriptors while ``/v1/status`` said ``connections: 0``. libzmq's socket monitor
reports every accepted connection and every disconnection with the connection's file
descriptor, and every message carries the descriptor it came from (``ZMQ_SRCFD``), so the
data plane can tell which descriptors have attached (answered hello) and which have not.

An unattached connection is closed with ``shutdown(2)`` on a duplicate of its descriptor:
libzmq's I/O thread then reads end of file and closes it the ordinary way (no descriptor
is closed under libzmq). The risk is a descriptor that was closed and reused before the
monitor told us: before every shutdown the peer address recorded at accept time is
compared with the descriptor's peer now, and a mismatch only forgets the record.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from tokenfeed_server.logbudget import LogBudget

__all__ = ["Unattached"]

log = logging.getLogger(__name__)

_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
_MONITOR_DRAIN_MAX = 4096  # events read per turn


def _peer_of(fd: int) -> object | None:
    """The peer address of socket descriptor ``fd``, or None if it is not a connected socket
    (or the process is out of descriptors for the duplicate)."""
    try:
        dup = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        peer: object = dup.getpeername()
        return peer
    except OSError:
        return None
    finally:
        dup.close()


def _shutdown(fd: int) -> None:
    try:
        dup = socket.socket(fileno=os.dup(fd))
    except OSError:
        return
    try:
        dup.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already gone: nothing to close
    finally:
        dup.close()  # the duplicate only: libzmq closes its own descriptor at end of file


class Unattached:
    """The data socket's connections by descriptor, and which have not said hello yet.

    Args:
        sock: the ROUTER socket (a monitor is attached to it here).
        max_count: unattached connections allowed at once; beyond it the oldest is closed
            (a trainer's new connection says hello at once: a flood of silent ones
            must not lock it out until they time out).
        timeout_s: an unattached connection is closed this long after it was accepted.
        counters: the data plane's counters (``unattached_closed``, ``unattached_refused``).
    """

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        *,
        max_count: int,
        timeout_s: float,
        counters: collections.Counter[str],
        log_budget: LogBudget,
    ) -> None:
        self.monitor = sock.get_monitor_socket(_EVENTS)
        self.max_count = max_count
        self.timeout_s = timeout_s
        self._counters = counters
        self._log_budget = log_budget
        #: fd -> (accepted at, peer address), oldest first
        self._pending: dict[int, tuple[float, object]] = {}
        #: fd -> peer address of connections whose hello came before the monitor's
        #: ACCEPTED (two pipes, no order between them): that event then adds nothing
        self._early: dict[int, object] = {}

    @property
    def count(self) -> int:
        """Connections accepted that have not said hello (as far as the monitor told)."""
        return len(self._pending)

    def events(self) -> None:
        """Read what the monitor reported: new connections and ended ones."""
        for _ in range(_MONITOR_DRAIN_MAX):
            # Ask first: most turns have no event, and a raised zmq.Again costs more.
            if not int(self.monitor.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                return
            frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            event = parse_monitor_message(frames)
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._pending.pop(fd, None)
                self._early.pop(fd, None)
            elif event["event"] == zmq.EVENT_ACCEPTED:
                self._pending.pop(fd, None)  # a reused descriptor: the old one has gone
                peer = _peer_of(fd)
                if fd in self._early and self._early.pop(fd) == peer:
                    continue  # it said hello already
                self._pending[fd] = (time.monotonic(), peer)
                if len(self._pending) > self.max_count:
                    self._close(next(iter(self._pending)), "unattached_refused")
                    if self._log_budget.take():
                        log.warning(
                            "data port: %d connections have not said hello "
                            "(--max-unattached-connections): closing the oldest",
                            self.max_count,
                        )

    def attach(self, fd: int) -> None:
        """The connection on ``fd`` said hello: it is no longer unattached."""
        if self._pending.pop(fd, None) is None:  # its ACCEPTED may not be read yet
            self._early[fd] = _peer_of(fd)

    def expire(self, now: float) -> None:
        """Close the connections that have not said hello within ``timeout_s``."""
        while self._pending:
            fd, (since, _) = next(iter(self._pending.items()))
            if now - since < self.timeout_s:
                return
            self._close(fd, "unattached_timed_out")

    def _close(self, fd: int, counter: str) -> None:
        _, peer = self._pending.pop(fd)
        if peer is None or _peer_of(fd) != peer:
            return  # not the connection we saw accepted (or unknown): leave it alone
        self._counters[counter] += 1
        _shutdown(fd)

    def close(self) -> None:
        """Close the monitor socket (the data socket's owner disables the monitor)."""
        self.monitor.close(linger=0)
