"""The fixed names and values of the wire: version, provenance rows, orders, error codes.

Both ends import them from here (through :mod:`tokenfeed.protocol`); see the protocol's
module docstring for what each means on the wire.
"""

from __future__ import annotations

import re

VERSION = 2

#: Provenance row names the server sends: every chunk has ``window`` and ``epoch``; a
#: mixture's chunks also ``source`` (the row's index into the hello's ``sources``).
ROW_WINDOW = "window"
ROW_EPOCH = "epoch"
ROW_SOURCE = "source"

#: The orders ``hello.shuffle`` may name (see "Shuffle" in :mod:`tokenfeed.protocol`).
SHUFFLES = ("global", "block")

#: A dataset name as the store accepts it (tokenfeed_server.store.reader's rule, checked
#: against it by the tests): the wire refuses a bad source name before any look-up.
DATASET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

#: A run id as ``hello.run`` carries it: letters, digits, '.', '_', ':' and '-' (a uuid, a
#: torchrun rendezvous id, a scheduler's job id), at most 128 characters.
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")

#: What a token may hold, on every port: 16-256 visible ASCII characters, no spaces. The
#: same bytes then pass ZeroMQ's PLAIN handshake and an HTTP ``Authorization`` header (a
#: token with a space or a non-ASCII letter worked on one and failed on the other).
TOKEN = re.compile(r"[\x21-\x7e]{16,256}")
TOKEN_RULE = "16-256 visible ASCII characters (letters, digits, punctuation; no spaces)"

#: The fixed list of error codes an ``err`` may carry (see :mod:`tokenfeed.errors`).
ERROR_CODES = frozenset(
    {
        "bad_request",  # malformed or over a limit: fix the request, do not retry
        "unknown_dataset",  # no such dataset in the store
        "unknown_job",  # the server does not know this job (it restarted): say hello again
        "dataset_changed",  # the dataset is another build than the one the job reads
        "auth_failed",
        "forbidden",
        "connection_limit",
        "overloaded",  # try again later
        "internal",  # a bug or an unreadable file on the server: see its log
        "storage_unavailable",  # object storage does not answer: the server retries
        "object_missing",  # an object of the dataset is gone from the bucket
        "object_damaged",  # an object fails its checksum after a refetch
    }
)
