"""What a failed handshake means: a verdict on our credentials, or just a failed attempt.

libzmq retries a failed handshake silently; the socket monitor reports it. Only two
events are verdicts: the server refused the token (AUTH), or a ZMTP peer announced
another security mechanism (PROTOCOL with MECHANISM_MISMATCH). libzmq reports NO_DETAIL
(and other PROTOCOL errors) whenever the connection closes before the greeting: a
replica shutting down, or an ``ssh -L``, ``kubectl port-forward`` or L4 balancer that
accepts for a dead server. That is a failed attempt like silence; ``hello`` moves on and
decides at its deadline, or sooner when every replica cut it several times in a row
(:class:`Attempts`).
"""

from __future__ import annotations

from dataclasses import dataclass

import zmq

from tokenfeed.errors import AuthenticationFailed

__all__ = ["DISAGREE", "HANDSHAKE_FAILURES", "Attempts", "verdict"]

#: the monitor events a connection listens to
HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)

#: What a handshake that failed on security means, and what to check.
DISAGREE = (
    "the server and this client disagree on security (the server may need a token "
    "(token= or TOKENFEED_TOKEN) or a CURVE key (server_public_key=), or not accept one)"
)

# Handshakes cut in a row, per replica, that count as a verdict on security.
_CUTS_PER_REPLICA = 3


def verdict(event: int, value: int, endpoint: str) -> AuthenticationFailed | None:
    """The error a monitor event proves about our credentials, or None (not a verdict)."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return AuthenticationFailed(
            f"the server at {endpoint} refused the token; check token= or "
            "TOKENFEED_TOKEN (under CURVE: client_secret_key= or TOKENFEED_CLIENT_KEY) "
            "against what the operator gave you"
        )
    if (
        event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
    ):
        return AuthenticationFailed(f"handshake with {endpoint} failed: {DISAGREE}")
    return None


@dataclass
class Attempts:
    """The attempts of one ``hello``: those that reached an address, and those of them
    cut during the handshake. When every one was cut, the deadline's error is about
    security, not silence."""

    reached: int = 0
    cut: int = 0
    #: cuts with nothing else between: past a few per replica it is a verdict (a server
    #: of another mechanism may cut before its greeting is read, so one cut is no proof)
    cuts_in_a_row: int = 0

    def note(self, *, answered: bool, cut: bool, in_time: bool) -> None:
        """Count one attempt; silence cut short by the deadline says nothing either way."""
        self.reached += cut or answered or in_time
        self.cut += cut
        self.cuts_in_a_row = self.cuts_in_a_row + 1 if cut else 0

    def every_replica_cut(self, replicas: int) -> bool:
        """True when every one of ``replicas`` addresses cut us several times in a row."""
        return self.cuts_in_a_row >= _CUTS_PER_REPLICA * max(1, replicas)

    def security_error(self, where: str, seconds: float) -> AuthenticationFailed:
        """The error for a hello whose every attempt was cut in the handshake."""
        return AuthenticationFailed(
            f"every connection to {where} closed during the handshake "
            f"for {seconds:.0f}s: either {DISAGREE}, or something in "
            "between (ssh -L, kubectl port-forward, a load balancer) accepts "
            "connections for a server that is down"
        )
