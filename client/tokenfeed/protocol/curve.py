"""CURVE client keys: their form, and the one derivation the server and its operator share.

A tenant's CURVE secret key is ``HMAC-SHA256(server secret key, "tokenfeed-client-v2" +
SHA-256 hex of the tenant's token)``: 32 bytes, which Curve25519 takes as a secret key
(it clamps any 32 bytes). Only the server's secret key turns a token into a client key,
so a bearer token sniffed on clear HTTP does not open the encrypted data port; yet the
server needs nothing per tenant beyond the token digest it already keeps. The operator
hands each tenant its key (``tokenfeed-server client-key``); a client only ever holds the
Z85 key it was given (``ClientOptions.client_secret_key``).

Version 1 derived the key pair from the token alone (:func:`legacy_keypair_from_token`):
anyone who saw the token had the key. The server keeps that derivation only to recognise
an old client and tell its operator to upgrade; it never admits such a key.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import struct

import zmq
from zmq.utils import z85

from tokenfeed.errors import ConfigError

__all__ = [
    "CLIENT_KEY_CONTEXT",
    "check_curve_options",
    "client_secret_key",
    "curve_keypair",
    "is_z85_key",
    "legacy_keypair_from_token",
]

#: what the server's secret key is keyed with to make a client key (version 2)
CLIENT_KEY_CONTEXT = b"tokenfeed-client-v2"

_Z85_KEY = re.compile(rb"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")

#: what a tenant runs when it has the server's public key but no client key
_ASK_THE_OPERATOR = (
    "ask the operator for your client key (they run `tokenfeed-server client-key "
    "--curve-secret-key server.key --token-file YOUR_TOKEN_FILE`) and pass it as "
    "client_secret_key= or TOKENFEED_CLIENT_KEY"
)


def is_z85_key(key: str | bytes) -> bool:
    """True for a Z85-encoded 32-byte key (40 characters that decode)."""
    raw = key.encode() if isinstance(key, str) else key
    if not _Z85_KEY.fullmatch(raw):
        return False
    try:
        z85.decode(raw)
    except (KeyError, ValueError, struct.error):  # a group past 2**32
        return False
    return True


def client_secret_key(server_secret: bytes, token_sha256: str) -> bytes:
    """The Z85 CURVE secret key of the tenant whose token has this SHA-256 hex digest,
    under the server whose Z85 secret key is ``server_secret``."""
    message = CLIENT_KEY_CONTEXT + token_sha256.encode()
    return z85.encode(hmac.new(z85.decode(server_secret), message, hashlib.sha256).digest())


def curve_keypair(secret: str | bytes) -> tuple[bytes, bytes]:
    """The Z85 (public, secret) key pair of a Z85 secret key."""
    raw = secret.encode() if isinstance(secret, str) else secret
    return zmq.curve_public(raw), raw


def legacy_keypair_from_token(token: str) -> tuple[bytes, bytes]:
    """Version 1's key pair, from the token alone: recognised by the server, never admitted."""
    seed = hashlib.blake2b(token.encode(), digest_size=32, person=b"tokenfeed-curve").digest()
    secret = z85.encode(seed)
    return zmq.curve_public(secret), secret


def check_curve_options(server_public_key: str | None, client_secret_key: str | None) -> None:
    """Refuse keys a CURVE handshake could not use, saying what to do (never echoing a
    secret key)."""
    if server_public_key is not None and not (
        isinstance(server_public_key, str) and is_z85_key(server_public_key)
    ):
        raise ConfigError(
            "server_public_key must be the 40-character Z85 key in the server's "
            f"server.key.pub, got {server_public_key!r}"
        )
    if client_secret_key is not None and not (
        isinstance(client_secret_key, str) and is_z85_key(client_secret_key)
    ):
        raise ConfigError(
            "client_secret_key must be the 40-character Z85 key that `tokenfeed-server "
            "client-key` prints; this one is not"
        )
    if server_public_key is not None and client_secret_key is None:
        raise ConfigError(
            "server_public_key= needs a client key: the server no longer accepts CURVE keys "
            "derived from the token alone; " + _ASK_THE_OPERATOR
        )
    if client_secret_key is not None and server_public_key is None:
        raise ConfigError(
            "client_secret_key= is a CURVE key: give the server's public key as "
            "server_public_key= too (the contents of server.key.pub)"
        )
