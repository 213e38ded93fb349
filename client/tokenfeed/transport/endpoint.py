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
        raise ConfigError(f"endpoint {endpoint!r} is not of the form {FORM}{_hint(endpoint)}")
    port = int(match["port"])
    if not 1 <= port <= 65535:
        raise ConfigError(f"endpoint {endpoint!r}: port {port} is outside [1, 65535]")
    return endpoint


def _hint(endpoint: str) -> str:
    """What the user probably meant: ``tcp://`` for a bare ``host:port``, and for an
    ``http(s)://`` URL (the HTTP port serves the console and the API, not batches) the
    data port, which is the HTTP port minus one by default (7400 next to 7401)."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        return f"; did you mean 'tcp://{endpoint}'?"
    if scheme.lower() in ("http", "https"):
        authority = rest.split("/", 1)[0]
        host = authority.rsplit(":", 1)[0] if not authority.endswith("]") else authority
        return (
            f"; trainers speak ZeroMQ, not HTTP: did you mean 'tcp://{host or 'HOST'}:7400'? "
            "(the server's data port, --zmq-port, 7400 by default; its HTTP port, "
            "--http-port, serves the API and the console)"
        )
    return ""


def split_tcp(endpoint: str) -> tuple[str, int]:
    """The host (IPv6 in brackets, as written) and port of a checked ``tcp://`` endpoint."""
    match = _TCP.fullmatch(endpoint)
    if match is None:
        raise ConfigError(f"endpoint {endpoint!r} is not of the form {FORM}")
    return match["host"], int(match["port"])
