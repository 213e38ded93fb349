"""Wire protocol v2: message types, their fields, and the encoding of their frames.

Every message is a multipart ZeroMQ message whose first frame is a small msgpack map
with ``v`` (protocol version, :data:`VERSION`) and ``t`` (message type) plus the fields of
that type. Token data never goes inside msgpack: a ``chunk`` carries it as raw
little-endian frames after the header, so both ends send and receive it without copying.

Messages
--------
=========  =========  ==============================================================
type       direction  meaning
=========  =========  ==============================================================
hello      c -> s     attach to a job (dataset + plan inputs), ask for a credit window
welcome    s -> c     job id, server instance, dataset fingerprint and sizes, limits
get        c -> s     idempotent: rank ``rank``'s rows of ``count`` global batches at
                      stream positions ``pos``, ``pos + stride*G``, ...
chunk      s -> c     answer to one ``get``: header, tokens ``[rows, cols]``, then
                      provenance ``int64 [len(provenance), rows]`` (one named row each)
err        s -> c     a code from :data:`ERROR_CODES`, a message, whether to retry
ping/pong  both       application-level liveness
bye        c -> s     this connection is done: the server forgets it at once
=========  =========  ==============================================================

A ``get`` names everything it wants, so the server keeps no cursor: any server
instance can answer it at any time, and re-sending it after a reconnect is harmless.

Fields (``*``: optional, with the default shown; every other field is required)
-------------------------------------------------------------------------------
=======  ====================================================================================
hello    dataset: str, seq_len: int, batch_size: int, seed: int, world_size: int, rank: int,
         worker: int, window: int, client: str, fingerprint*: str = "" (when set, the
         dataset the client expects: a server serving another build answers
         ``dataset_changed`` saying both fingerprints),
         sources*: list[str] = [], schedule*: list[list[int]] = [],
         fingerprints*: list[str] = [] (a mixture, see "Mixtures" below),
         shuffle*: str = "global", region_windows*: int = 0, block_regions*: int = 0
         (the order, see "Shuffle" below), run*: str = "" (the launch, see "Runs" below)
welcome  server: str, job: str, fingerprint: str, n_tokens: int, n_windows: int, dtype: str,
         window: int, max_count: int, eos_id: int,
         region_windows*: int = 0, block_regions*: int = 0 (a single dataset's block sizes),
         source_fingerprints*: list[str] = [], source_tokens*: list[int] = [],
         source_windows*: list[int] = [], source_region_windows*: list[int] = [],
         source_block_regions*: list[int] = [] (a mixture's sources, in ``sources`` order)
get      req: int, job: str, rank: int, pos: int, count: int, stride: int,
         consumed*: int = -1 (the trainer's consumed position, see "Progress" below;
         -1: not known)
chunk    req: int, rows: int, cols: int, dtype: str, provenance: list[str] (names of the
         provenance rows, in frame order: ``window`` and ``epoch``, and ``source`` for a
         mixture)
err      code: str, message: str, retry: bool, req: int (-1: answers no particular request)
bye      consumed*: int = -1 (as in ``get``: the last word of a closing connection)
=======  ====================================================================================

Mixtures
--------
A ``hello`` with ``sources`` attaches to a mixture of datasets (see
:class:`tokenfeed.mixture.Mixture`): ``sources`` are the dataset names in the mixture's
``names`` order (non-empty, valid names, no duplicates), ``dataset`` is then ``""``, and
``schedule`` is ``Mixture.to_wire()``: rows ``[start, w_0, ..., w_{n-1}]`` of
``len(sources) + 1`` non-negative ints (the server decodes them with
``Mixture.from_wire`` and refuses a bad schedule with ``bad_request``). ``fingerprints``
is empty or one expected build per source (``""``: none for that source); a source that
is another build is refused with ``dataset_changed`` naming it. A mixture's
``fingerprint``, when set, is the whole build the client expects (the ``welcome``'s
:func:`mixture_fingerprint`, e.g. on a reconnect), refused with ``dataset_changed``
when it differs. Every source must be readable by the tenant (a refusal names the
source) and all must share one tokenizer.

The ``welcome`` of a mixture carries one entry per source in each ``source_*`` list:
its build (``source_fingerprints``), tokens, windows of ``seq_len``, and block sizes
(``source_region_windows``/``source_block_regions``, 0 under ``shuffle="global"``).
Its ``fingerprint`` is :func:`mixture_fingerprint` of the source fingerprints,
``n_tokens``/``n_windows`` the sums over the sources, ``dtype``/``eos_id`` the shared
ones, and ``region_windows``/``block_regions`` 0.

Row ``p`` of the stream comes from source ``s`` at that source's own stream position
``q`` (``Mixture.locate``); source ``s`` walks its own plan (the job's ``seq_len``,
``batch_size``, ``world_size``, shuffle, and seed ``mixture.source_seed(seed, name)``),
so a chunk's ``window`` and ``epoch`` rows are that source's window and source-local
epoch, and its ``source`` row (:data:`ROW_SOURCE`) the index into ``sources``. A
single-dataset chunk has no ``source`` row.

Shuffle
-------
``shuffle`` is ``"global"`` (a permutation of all windows per epoch; then
``region_windows`` and ``block_regions`` must be 0) or ``"block"`` (regions of
``region_windows`` consecutive windows, visited ``block_regions`` regions at a time, see
:class:`tokenfeed.plan.Plan`). Under ``"block"`` a size of 0 asks the server to derive it
from the dataset's shards (``default_block_sizes``); the ``welcome`` says the sizes used
(``region_windows``/``block_regions`` for one dataset, ``source_region_windows``/
``source_block_regions`` per source of a mixture). A size the hello sets applies to every
source of a mixture; one left at 0 is derived per source. Derived sizes are a pure
function of the build's shard sizes and ``seq_len`` (never of a server's cache), so a
pinned build keeps them; a single-dataset client resuming a run may send them back to
pin them outright.

Runs
----
The server names a job by a hash of its inputs: the dataset builds, the plan inputs, the
order, the tenant and ``run`` (``tokenfeed_server.dataplane.jobs.job_id``). ``run`` is
the launch's run id: one value made once per training launch and sent by every rank and
worker of it (and saved in its resume state, so a resumed run re-attaches to its own
job), so two launches with the same inputs are two jobs, each with its own progress. It
is empty or 1-128 characters of letters, digits, ``.``, ``_``, ``:`` or ``-``
(:data:`RUN_ID`), starting with a letter or digit. An empty ``run`` (a client from before
run ids, or one that has none) names the job exactly as before: same inputs, same job.
``run`` changes no token: a get's answer is a function of the job's inputs without it.
``allow_read_amplification`` on ``hello`` (default false, left out) accepts what a server
refuses otherwise: a global shuffle of a dataset in object storage whose cache cannot
hold it, which fetches a whole piece for nearly every row (the refusal gives the figures
and the fixes: ``shuffle="block"``, or a cache that fits).
``skipped`` on ``hello`` lists the stream ranges the run skipped on purpose at a resume
(``[position, samples]`` pairs from its state, the latest 1024 at most): the server shows
them on the job's page; they are not part of the job's key and change no token.

Rings
-----
A client on the server's own host may ask for a shared-memory ring (``hello.ring``);
a server that offers rings answers with ``welcome.ring_door`` (the path of its ring
door, a Unix socket) and ``welcome.ring_key`` (64 hex digits). The client connects to
the door, sends the key's first half and gets back ``ok`` plus the key's second half
(proof that this is the server's door) with the ring's descriptor (``SCM_RIGHTS``).
From then on a ``chunk`` whose ``ring_offset`` is not 0 carries an empty token frame:
its tokens are in the ring at that byte offset; the client copies them out and writes
``ring_end`` into the ring's ``released`` word. The layout and flow control are in
``tokenfeed_server.dataplane.rings``. A ring changes no token: the same chunk over TCP
is byte for byte the same.

Progress
--------
The server sends ahead of the trainer (the request window, the DataLoader's prefetch), so
what it served says little about how far training is. ``consumed`` on ``get`` and ``bye``
is the stream position (global samples from the stream's start, the same on every rank)
up to which the rank's training loop has taken batches, read from a counter the loader
shares with its workers when the message is sent. It is information only: the server
keeps the largest value reported per job and never serves differently because of it.
The loader reports a value that no message carried for a few seconds (a pause, the end of
the loop) on a short connection of its own: ``hello`` then ``bye``.

Values and bounds
-----------------
A field is an ``int`` (in ``[-1, 2**63)``; ``bool`` is not an int here), a ``str`` (at
most :data:`MAX_STR` = 512 bytes of UTF-8, not characters), a ``bool``, a list
(``tuple[T, ...]``, at most :data:`MAX_ITEMS` items) or a map with string keys
(``dict[str, T]``, at most :data:`MAX_ITEMS` entries) of those. Field types nest at
most :data:`MAX_DEPTH` levels (checked for every message type at import). A header frame is at most
:data:`MAX_HEADER_BYTES` (64 KiB: room for a list of a thousand 40-byte names; equal to
the server's default ``max_message_bytes``, which bounds the whole message, header and
any other frames together). Sizes are checked *before* anything is
unpacked: the frame length first, then msgpack's own per-container limits, so a hostile
header never allocates more than its few kilobytes.

Evolution
---------
* **Optional fields** carry a default. The encoder leaves a field out when it holds its
  default, and the decoder fills the default in for a missing one. A field whose default
  means "today's behaviour" can therefore be added without a version bump: an older peer
  never sees it unless it is used.
* **Unknown fields are refused**, naming them and saying the peer is newer. Ignoring one
  would be silent wrong data: a server that skipped an ``fingerprint`` or a mixture
  schedule it did not understand would serve data the trainer did not ask for. A refusal
  says "upgrade"; silence trains on the wrong tokens.
* **hello.run is dropped on refusal.** A server from before run ids refuses a hello
  with ``run`` (``bad_request``: "unexpected fields ['run']"). The client then says hello
  again without it, once per client, with a warning: ``run`` only names the job (its
  bookkeeping), never what is served, so an older server serves the same tokens and the
  run shares its job with identical runs, as every run did before. **hello.skipped**
  (the ranges a run skipped on purpose, for the job's page) is dropped the same way,
  for the same reason: it is bookkeeping, never part of what is served.
  **hello.allow_read_amplification** is dropped the same way: a server from before it
  never refused read amplification, so without it that server serves what the trainer
  asked for, the same tokens. **hello.ring** is dropped the same way: a server from
  before rings sends every chunk over TCP. No other field may be dropped this way.
* **Provenance rows** are named: a receiver reads the rows it knows and ignores the
  others (extra per-row metadata cannot change the tokens it gets), so a new row such
  as a mixture's ``source`` is added without touching old clients.
* **The version** changes only for a change old peers cannot be told about in a field:
  each end refuses another version with a message that says to install matching versions
  of ``tokenfeed`` and ``tokenfeed-server`` (a server answers an ``err``, a client raises).

Decoding is strict: a header that is not a map, has the wrong version, misses a
required field, has an unknown one, or a value of the wrong type or out of bounds raises
:class:`~tokenfeed.errors.ProtocolError` with a message fit for an ``err`` reply.

Modules
-------
Everything above is importable from here; the code lives in :mod:`.constants` (version,
row names, error codes), :mod:`.bounds` (sizes and the value check), :mod:`.messages`
(the types and their encoding), :mod:`.codec` (decoding a header), :mod:`.chunks` (the
token and provenance frames) and :mod:`.curve` (CURVE keys from a token).
"""

from __future__ import annotations

from tokenfeed.dtypes import DTYPES
from tokenfeed.protocol.bounds import (
    MAX_DEPTH,
    MAX_HEADER_BYTES,
    MAX_ITEMS,
    MAX_PROVENANCE_ROWS,
    MAX_STR,
)
from tokenfeed.protocol.chunks import chunk_frames, decode_chunk, require_rows
from tokenfeed.protocol.codec import decode_header
from tokenfeed.protocol.constants import (
    ERROR_CODES,
    ROW_EPOCH,
    ROW_SOURCE,
    ROW_WINDOW,
    RUN_ID,
    SHUFFLES,
    TOKEN,
    TOKEN_RULE,
    VERSION,
)
from tokenfeed.protocol.messages import (
    Bye,
    Chunk,
    Err,
    Get,
    Hello,
    JobSpec,
    Message,
    Ping,
    Pong,
    Welcome,
    mixture_fingerprint,
)

__all__ = [
    "DTYPES",  # re-exported: the wire names token dtypes by its keys
    "ERROR_CODES",
    "MAX_DEPTH",
    "MAX_HEADER_BYTES",
    "MAX_ITEMS",
    "MAX_PROVENANCE_ROWS",
    "MAX_STR",
    "ROW_EPOCH",
    "ROW_SOURCE",
    "ROW_WINDOW",
    "RUN_ID",
    "TOKEN",
    "TOKEN_RULE",
    "SHUFFLES",
    "VERSION",
    "Bye",
    "Chunk",
    "Err",
    "Get",
    "Hello",
    "JobSpec",
    "Message",
    "Ping",
    "Pong",
    "Welcome",
    "chunk_frames",
    "decode_chunk",
    "decode_header",
    "mixture_fingerprint",
    "require_rows",
]
