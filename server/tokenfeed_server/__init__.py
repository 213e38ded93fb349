"""tokenfeed-server: the data store, the prepare pipeline and the streaming data server."""

from __future__ import annotations

__version__ = "0.1.0"
