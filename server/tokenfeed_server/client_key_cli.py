"""``tokenfeed-server client-key``: the CURVE key the operator hands one tenant.

The key is derived from the server's secret key and the tenant's token digest (see
:mod:`tokenfeed.protocol.curve`), so it is printed, never stored or logged: run it again
to hand it out again. It changes with the server's key or the tenant's token.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from tokenfeed.errors import ConfigError
from tokenfeed_server.config import read_token_file, token_rule

__all__ = ["add_client_key_command"]

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def add_client_key_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Declare ``client-key`` and its arguments."""
    p = subparsers.add_parser(
        "client-key",
        help="print the CURVE client key of one tenant (hand it to that tenant)",
        description="Print, on stdout alone, the Z85 CURVE secret key that a tenant's "
        "clients pass as client_secret_key= (or TOKENFEED_CLIENT_KEY) to a server run with "
        "--curve-secret-key. It is derived from the server's secret key and the tenant's "
        "token, so a token seen in clear does not give it away. A secret: hand it over "
        "like the token. Give the token in a file, or its SHA-256 as in tenants.toml.",
    )
    p.add_argument(
        "--curve-secret-key",
        type=Path,
        required=True,
        metavar="FILE",
        help="the server's secret key file (tokenfeed-server keygen)",
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--token-file", type=Path, metavar="FILE", help="file holding the tenant's token"
    )
    which.add_argument(
        "--token-sha256",
        metavar="HEX",
        help="the SHA-256 hex of the tenant's token (its token_sha256 in tenants.toml)",
    )
    p.set_defaults(handler=_run_client_key)


def _run_client_key(args: argparse.Namespace) -> int:
    # here, not at the top: every other command of the CLI starts without zmq
    from tokenfeed.protocol.curve import client_secret_key
    from tokenfeed_server.dataplane.security import read_secret_key

    digest = _digest(args.token_file, args.token_sha256)
    print(client_secret_key(read_secret_key(args.curve_secret_key), digest).decode())
    return 0


def _digest(token_file: Path | None, token_sha256: str | None) -> str:
    """The tenant's token digest, from whichever the operator gave; refusals never show
    the token."""
    if token_file is not None:
        try:
            token = token_rule(read_token_file(token_file))
        except ValueError as exc:
            raise ConfigError(f"--token-file: {exc}") from None
        from tokenfeed_server.dataplane.auth import token_digest

        return token_digest(token or "")
    assert token_sha256 is not None  # the parser asks for one of the two
    if not _SHA256_HEX.fullmatch(token_sha256):
        raise ConfigError(
            "--token-sha256 must be 64 lowercase hex digits (the SHA-256 of the token)"
        )
    return token_sha256
