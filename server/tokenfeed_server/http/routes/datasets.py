"""``/v1/datasets``: the datasets a caller may read with their storage health, one
dataset's summary, and the tokenizer file it was prepared with."""

from __future__ import annotations

import hashlib

from fastapi import APIRouter, HTTPException, Response

from tokenfeed.errors import DatasetNotFound, InvalidDatasetName, StoreError
from tokenfeed.protocol.bounds import brief
from tokenfeed_server.http.access import Reader, Viewer
from tokenfeed_server.http.dataset_health import DatasetEntry
from tokenfeed_server.http.error_docs import errors, json_errors
from tokenfeed_server.http.models import BrokenDatasetView, DatasetView, ObjectFaultView
from tokenfeed_server.http.state import ServerState, State
from tokenfeed_server.store import Dataset, summary

__all__ = ["router"]

router = APIRouter()

_TOKENIZER_FILE = {
    "description": "The Hugging Face `tokenizer.json` the dataset was prepared "
    "with, byte for byte (load it with `tokenizers.Tokenizer.from_str`).",
    "content": {"application/json": {"schema": {"type": "object"}}},
}


@router.get("/v1/datasets", responses=errors(401))
def datasets(state: State, who: Reader) -> list[DatasetView | BrokenDatasetView]:
    """Summaries of the datasets the caller may read, each with its storage health
    (`ok`, `degraded`, `unavailable` with the error and the objects named); datasets that
    fail to open are listed with their error."""
    return [
        view(entry, state, who)
        for entry in state.dataset_health.entries()
        if who.sees_dataset(entry.name)
    ]


@router.get("/v1/datasets/{name}", responses=errors(400, 401, 404, 409))
def dataset(name: str, state: State, who: Reader) -> DatasetView:
    """Manifest summary of one dataset, with its storage health."""
    ds = _open_dataset(state, name, who)
    entry = state.dataset_health.entry(name)
    if entry is None or not entry.opened:  # replaced or removed since: its summary alone
        entry = DatasetEntry(name, summary(ds))
    shown = view(entry, state, who)
    assert isinstance(shown, DatasetView)
    return shown


def view(entry: DatasetEntry, state: ServerState, who: Viewer) -> DatasetView | BrokenDatasetView:
    """``entry`` as this caller may see it (store paths only for the admin)."""

    def shown(text: str) -> str:
        return text if who.admin else state.redact(text)

    health = {
        "ok": entry.serves if entry.opened else False,
        "status": entry.status,
        "error": shown(entry.error) if entry.error is not None else None,
        "since": entry.since,
        "objects": [
            ObjectFaultView(url=shown(url), kind="damaged" if kind == "damaged" else "missing")
            for url, kind in sorted(entry.objects.items())
        ],
        "fix": shown(entry.fix) if entry.fix is not None else None,
    }
    if entry.opened:
        return DatasetView.model_validate({**entry.summary, **health})
    return BrokenDatasetView.model_validate(
        {**entry.summary, **health, "error": health["error"] or ""}
    )


@router.get(
    "/v1/datasets/{name}/tokenizer.json",
    response_class=Response,
    responses={200: _TOKENIZER_FILE, **json_errors(400, 401, 404, 409)},
)
def tokenizer_file(name: str, state: State, who: Reader) -> Response:
    """The dataset's tokenizer file; a 404 for a byte-tokenized dataset says how to
    decode its ids instead."""
    ds = _open_dataset(state, name, who)
    info = ds.manifest.tokenizer
    if info.file is None:
        raise HTTPException(404, _no_tokenizer_file(name, info.kind, info.eos_id))
    try:
        data = ds.read_extra_file(info.file)
    except (OSError, ValueError) as exc:
        message = f"dataset {name!r}: cannot read its tokenizer file: {exc}"
        raise HTTPException(409, message if who.admin else state.redact(message)) from None
    digest = "blake2b-128:" + hashlib.blake2b(data, digest_size=16).hexdigest()
    if digest != info.file_hash:  # the manifest requires a hash with the file
        # The dataset was replaced between its opening and this read: the store's
        # watcher opens the new build shortly, and the client asks again.
        raise HTTPException(409, f"dataset {name!r} is being replaced; ask again in a second")
    return Response(
        data,
        media_type="application/json",
        headers={"ETag": f'"{digest}"', "X-Tokenfeed-Fingerprint": ds.fingerprint},
    )


def _open_dataset(state: ServerState, name: str, who: Viewer) -> Dataset:
    """The open dataset ``name``, or the HTTP error this caller may see."""
    # A tenant gets the same answer for a dataset it may not read and for one that does
    # not exist, and never the store's message (its path and every name in it).
    # (cut: the name is the caller's, maybe 5,000 characters of it)
    missing = f"no dataset {brief(name)!r}" + ("" if who.sees_all else " for this token")
    if not who.sees_dataset(name):
        raise HTTPException(404, missing)
    try:
        return state.store.get(name)
    except InvalidDatasetName as exc:
        raise HTTPException(400, str(exc)) from None
    except DatasetNotFound as exc:
        raise HTTPException(404, str(exc) if who.admin else missing) from None
    except StoreError as exc:
        raise HTTPException(409, str(exc) if who.admin else state.redact(str(exc))) from None


def _no_tokenizer_file(name: str, kind: str, eos_id: int) -> str:
    """The 404 of a dataset without a tokenizer file, with the way to decode it."""
    if kind == "byte":
        return (
            f"dataset {name!r} has no tokenizer file: it is byte-tokenized. Ids 0-255 are the "
            f"UTF-8 bytes of the text and id {eos_id} ends each document (tokenizer.eos_id at "
            f"/v1/datasets/{name}); decode with "
            "bytes(i for i in ids if i < 256).decode('utf-8', 'replace')"
        )
    return (
        f"dataset {name!r} has no tokenizer file (tokenizer kind {kind!r}, EOS id {eos_id}); "
        "use the tokenizer it was prepared with"
    )
