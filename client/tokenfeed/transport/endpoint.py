"""Checking a data endpoint before any socket is made.

ZeroMQ refuses a malformed endpoint only inside ``connect``, after the socket exists,
and a socket left open then makes the context hang at exit. Checking the string first
turns a typo into a :class:`~tokenfeed.errors.ConfigError` that shows the expected form.
One endpoint at a time: a caller with several (replicas, :mod:`tokenfeed.transport.replicas`)
checks each.
"""

from __future__ import annotations

import re

import zmq

from tokenfeed.errors import ConfigError

#: what a message shows as the expected form
FORM = "tcp://host:port (e.g. tcp://127.0.0.1:7400)"

# host: a DNS name or IPv4 address, or an IPv6 address in brackets
_TCP = re.compile(r"tcp://(?P<host>\[[0-9A-Fa-f:.%\w]+\]|[A-Za-z0-9._-]+):(?P<port>[0-9]{1,5})")


def check_endpoint(endpoint: object) -> str:
    """``endpoint`` if it is ``tcp://host:port`` (or ``ipc://path`` where supported).

    Raises:
        ConfigError: naming the endpoint and the expected form.
    """
    if not isinstance(endpoint, str):
        raise ConfigError(
            f"endpoint must be a string of the form {FORM}, got {type(endpoint).__name__}"
        )
    if endpoint.startswith("ipc://") and zmq.has("ipc"):
        if len(endpoint) == len("ipc://"):
            raise ConfigError(f"endpoint {endpoint!r} names no path; expected ipc://path")
        return endpoint
    match = _TCP.fullmatch(endpoint)
    if match is None:
        hint = "" if "://" in endpoint else f"; did you mean 'tcp://{endpoint}'?"
        raise ConfigError(f"endpoint {endpoint!r} is not of the form {FORM}{hint}")
    port = int(match["port"])
    if not 1 <= port <= 65535:
        raise ConfigError(f"endpoint {endpoint!r}: port {port} is outside [1, 65535]")
    return endpoint


def split_tcp(endpoint: str) -> tuple[str, int]:
    """The host (IPv6 in brackets, as written) and port of a checked ``tcp://`` endpoint."""
    match = _TCP.fullmatch(endpoint)
    if match is None:
        raise ConfigError(f"endpoint {endpoint!r} is not of the form {FORM}")
    return match["host"], int(match["port"])
