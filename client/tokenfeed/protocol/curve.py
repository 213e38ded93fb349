"""CURVE keys from a tenant's token: the one derivation client and server share.

Deriving the key pair from the token lets one secret do both jobs under CURVE: the
server knows each tenant's public key from its token and identifies the tenant in the
handshake, while the token itself never crosses the wire. Both ends must derive it
alike, so it is part of the protocol.
"""

from __future__ import annotations

import hashlib

import zmq
from zmq.utils import z85


def curve_keypair_from_token(token: str) -> tuple[bytes, bytes]:
    """The CURVE (public, secret) key pair, Z85-encoded, that a token implies."""
    seed = hashlib.blake2b(token.encode(), digest_size=32, person=b"tokenfeed-curve").digest()
    secret = z85.encode(seed)
    return zmq.curve_public(secret), secret
