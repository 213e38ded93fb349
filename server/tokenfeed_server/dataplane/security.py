"""The server's security posture, decided once from the config: who must authenticate,
with which ZeroMQ mechanism, and whether traffic is encrypted.

Safe by default: with no tenants file and no token, the server refuses to start on a
non-loopback address unless ``--insecure`` is given (and then says so loudly).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import zmq

from tokenfeed.errors import ConfigError
from tokenfeed.protocol.curve import is_z85_key
from tokenfeed_server.config import ServerConfig
from tokenfeed_server.dataplane.auth import Tenants, ZapHandler

log = logging.getLogger(__name__)


def tenants_for(config: ServerConfig) -> Tenants | None:
    """The tenant table this config asks for; None for an open server. Under CURVE each
    tenant expects the client key issued from the server's secret key."""
    tenants = None
    if config.tenants_file is not None:
        if config.token:
            raise ConfigError("give --tenants or --token, not both")
        tenants = Tenants.load(config.tenants_file, config.admin_token)
    elif config.token:  # its form is checked where the settings are (config.ServerConfig)
        tenants = Tenants.shared_token(config.token, config.admin_token)
    if tenants is not None:
        warn_cleartext(config)
        if config.curve_secret_key_file is not None:
            tenants.use_curve(read_secret_key(config.curve_secret_key_file))
        return tenants
    if config.curve_secret_key_file is not None:
        raise ConfigError("CURVE needs tokens to identify clients: add --token or --tenants")
    if not config.is_loopback():
        if not config.insecure:
            raise ConfigError(
                f"refusing to serve {config.host} without authentication: pass --token "
                "(or TOKENFEED_TOKEN) or --tenants FILE; --insecure serves anyone who can "
                "reach the port"
            )
        log.warning(
            "!!! INSECURE: serving %s WITHOUT AUTHENTICATION; anyone who reaches the port "
            "can read every dataset !!!",
            config.host,
        )
    return None


def warn_cleartext(config: ServerConfig) -> None:
    """Say it at start when tokens would cross a network in clear: the data port speaks
    PLAIN without a CURVE key, the HTTP port plain HTTP without a certificate."""
    if config.is_loopback():
        return
    if config.curve_secret_key_file is None:
        log.warning(
            "serving %s: tokens cross the network in clear on the data port (ZeroMQ PLAIN); "
            "encrypt it with --curve-secret-key (tokenfeed-server keygen)",
            config.host,
        )
    if config.tls_cert_file is None:
        log.warning(
            "serving %s: bearer tokens cross the network in clear on the HTTP port; serve "
            "HTTPS with --tls-cert-file and --tls-key-file, or put a TLS proxy in front",
            config.host,
        )


def start_zap(
    context: zmq.Context[zmq.Socket[bytes]], tenants: Tenants | None
) -> ZapHandler | None:
    """Start the ZAP handler in ``context`` when there is anyone to authenticate."""
    if tenants is None:
        return None
    zap = ZapHandler(context, tenants)
    zap.start()
    return zap


def socket_setup(
    config: ServerConfig, tenants: Tenants | None
) -> Callable[[zmq.Socket[bytes]], None] | None:
    """What to set on the ROUTER before it binds: PLAIN or CURVE server, ZAP domain."""
    if tenants is None:
        return None
    secret = read_secret_key(config.curve_secret_key_file) if config.curve_secret_key_file else None

    def setup(sock: zmq.Socket[bytes]) -> None:
        sock.zap_domain = b"tokenfeed"
        if secret is not None:
            sock.curve_server = True
            sock.curve_secretkey = secret
        else:
            sock.plain_server = True

    return setup


def keygen(directory: Path) -> tuple[Path, Path]:
    """Write a CURVE key pair: ``server.key`` (secret, mode 0600) and ``server.key.pub``."""
    public, secret = zmq.curve_keypair()
    directory.mkdir(parents=True, exist_ok=True)
    secret_path, public_path = directory / "server.key", directory / "server.key.pub"
    fd = os.open(secret_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret.decode() + "\n")
    public_path.write_text(public.decode() + "\n")
    return secret_path, public_path


def read_secret_key(path: Path) -> bytes:
    """A Z85 CURVE secret key from a file written by :func:`keygen`."""
    try:
        key = path.read_text().strip().encode()
    except OSError as exc:
        raise ConfigError(f"cannot read CURVE secret key {path}: {exc}") from None
    if not is_z85_key(key):
        raise ConfigError(
            f"{path} is not a Z85 CURVE key (40 characters); "
            "make one with `tokenfeed-server keygen`"
        )
    return key
