"""A real ``tokenfeed-server serve`` process for tests, with HTTP helpers.

Start-up waits on the server's ``ready`` line (see :mod:`tokenfeed_server.launch`);
every wait has a timeout so a broken server fails the test instead of hanging it.
"""

from __future__ import annotations

from typing import Any

import httpx

from tokenfeed_server.auth import token_digest
from tokenfeed_server.launch import ServerProcess


class LiveServer(ServerProcess):
    """One server process on loopback with OS-assigned (or given) ports."""

    def start(self, timeout: float = 30.0) -> LiveServer:
        super().start(timeout)
        return self

    def __enter__(self) -> LiveServer:
        return self.start()

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.get(self.http + path, timeout=10.0, **kwargs)

    def get_at(self, host: str, path: str) -> httpx.Response:
        """GET through another address of this server (for one bound to 0.0.0.0)."""
        return httpx.get(f"http://{host}:{self.http_port}{path}", timeout=10.0)


def tenants_toml(admin: str | None, tenants: dict[str, tuple[str, list[str]]]) -> str:
    """A tenants file: ``{name: (token, dataset patterns)}``, and an admin token if given."""
    out = [f'admin_token_sha256 = "{token_digest(admin)}"\n'] if admin is not None else []
    for name, (token, patterns) in tenants.items():
        datasets = ", ".join(f'"{p}"' for p in patterns)
        out.append(
            f'[[tenant]]\nname = "{name}"\ntoken_sha256 = "{token_digest(token)}"\n'
            f"datasets = [{datasets}]\n"
        )
    return "\n".join(out)
