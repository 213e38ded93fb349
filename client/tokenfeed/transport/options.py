"""The settings of a client connection: window, chunk size, timeouts, credentials."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenfeed.errors import ConfigError
from tokenfeed.protocol.constants import TOKEN, TOKEN_RULE
from tokenfeed.protocol.curve import check_curve_options

__all__ = ["ClientOptions"]


@dataclass(frozen=True)
class ClientOptions:
    """Timeouts, window and credentials of a client; one object, passed down."""

    window: int = 4
    #: ask for chunks of about this size (the server may cap it lower)
    chunk_bytes: int = 1 << 20
    request_timeout: float = 10.0
    deadline: float = 120.0
    #: log a warning after this many seconds without an answer (then keep trying)
    warn_after: float = 5.0
    #: after a failover, ask this client's own replica again every this many seconds,
    #: and go back to it once it answers (see :mod:`tokenfeed.transport.homing`)
    return_after: float = 5.0
    token: str | None = field(default=None, repr=False)  # a secret: never in a repr or log
    server_public_key: str | None = None
    #: this tenant's CURVE secret key (Z85), issued by ``tokenfeed-server client-key``;
    #: needed with server_public_key. A secret: never in a repr or log
    client_secret_key: str | None = field(default=None, repr=False)
    #: accept a global shuffle of a remote dataset through a cache smaller than it
    #: (the server refuses it otherwise, giving the read amplification it would cost)
    allow_read_amplification: bool = False
    #: take chunks through a shared-memory ring when the server offers one (None: when
    #: every endpoint is on this host; True: ask anyway, e.g. a container sharing the
    #: server's ring door on a volume; False: always TCP). See :mod:`tokenfeed.transport.ring`.
    shared_memory: bool | None = None

    def __post_init__(self) -> None:
        for name, low in (("window", 1), ("chunk_bytes", 1)):
            value = getattr(self, name)
            if type(value) is not int or value < low:
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.token is not None and not (
            isinstance(self.token, str) and TOKEN.fullmatch(self.token)
        ):
            # never echo the token: it is a secret even when malformed
            raise ConfigError(f"token must be {TOKEN_RULE}; this one is not")
        check_curve_options(self.server_public_key, self.client_secret_key)
        for name in ("request_timeout", "deadline", "warn_after", "return_after"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"{name} must be a number of seconds > 0, got {value!r}")
