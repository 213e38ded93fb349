"""``--max-partial-read-bytes``: the bound on rows kept between the rounds of a request
too big for a small cache (:mod:`tokenfeed_server.store.cache_rounds`) is a server
setting with a documented default, handed to the piece cache the remote datasets read
through, and named where hitting it is logged."""

from __future__ import annotations

import pydantic
import pytest

from tokenfeed_server import config
from tokenfeed_server.config import CacheSettings, ServerConfig
from tokenfeed_server.store import cache_rounds
from tokenfeed_server.store.cache_rounds import DEFAULT_MAX_PARTIAL_READ_BYTES, Rounds


def test_the_bound_is_a_setting_with_its_default() -> None:
    (setting,) = [
        s for s in config.settings_of(ServerConfig) if s.flag == "--max-partial-read-bytes"
    ]
    assert setting.env == "TOKENFEED_MAX_PARTIAL_READ_BYTES"
    assert setting.field.default == DEFAULT_MAX_PARTIAL_READ_BYTES == 64 << 20
    default = ServerConfig(store="s3://b/p").cache.cache_options()
    assert default["max_partial_read_bytes"] == DEFAULT_MAX_PARTIAL_READ_BYTES
    assert Rounds().limit_bytes == DEFAULT_MAX_PARTIAL_READ_BYTES


def test_a_size_is_accepted_and_reaches_the_cache_options() -> None:
    settings = CacheSettings(max_partial_read_bytes="8MiB")  # type: ignore[arg-type]
    assert settings.cache_options()["max_partial_read_bytes"] == 8 << 20
    assert CacheSettings(max_partial_read_bytes=0).max_partial_read_bytes == 0
    with pytest.raises(pydantic.ValidationError):
        CacheSettings(max_partial_read_bytes=-1)


def test_the_piece_cache_hands_it_to_the_datasets_rounds() -> None:
    """PieceCache keeps it (RemoteDataset builds its Rounds from it), and the message
    logged when the bound is hit names the setting."""
    import inspect

    from tokenfeed_server.store.cache import PieceCache
    from tokenfeed_server.store.remote import RemoteDataset

    parameter = inspect.signature(PieceCache).parameters["max_partial_read_bytes"]
    assert parameter.default == DEFAULT_MAX_PARTIAL_READ_BYTES
    assert "Rounds(cache.max_partial_read_bytes)" in inspect.getsource(RemoteDataset.__init__)
    assert "--max-partial-read-bytes" in inspect.getsource(cache_rounds.Rounds._keep)
