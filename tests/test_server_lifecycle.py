"""serve(): whatever way it returns, it leaves nothing running behind."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

from shard_data import BYTE, random_docs
from tokenfeed_server.config import ServerConfig
from tokenfeed_server.server import serve
from tokenfeed_server.store import write_dataset


def test_a_failed_http_bind_returns_2_and_stops_what_was_started(tmp_path: Path) -> None:
    write_dataset(tmp_path, "d", random_docs(5), tokenizer=BYTE, shuffle_seed=0)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        before = set(threading.enumerate())
        config = ServerConfig(
            store=tmp_path, host="127.0.0.1", zmq_port=0, http_port=port, insecure=True
        )
        assert serve(config) == 2
    # The store watcher, the data plane's thread and ZAP are joined, the context is gone.
    assert [t.name for t in set(threading.enumerate()) - before if t.is_alive()] == []
