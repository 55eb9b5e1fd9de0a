"""Every error graphdeck raises on purpose, in one hierarchy.

Each class carries the HTTP status the server answers with and the exit code the CLI returns::

    GraphdeckError (500, exit 1)
    ├── UsageError (400, exit 2)
    │   └── BadInputError (400, exit 2)           malformed file or request body
    │       ├── TruncatedInputError (400, exit 2) a file that ends mid-record
    │       ├── PayloadTooLargeError (413, exit 2)
    │       └── ConflictError (409, exit 2)       a request that contradicts stored state (upload chunks)
    ├── NotFoundError (404, exit 2)               run, rank, graph, node or trace not in the store
    ├── StoreError (500, exit 1)                  the store cannot be used (server/database trouble)
    │   ├── NotAStoreError (400, exit 2)          the path is not a graphdeck store (another file,
    │   │                                         another SQLite database, a folder)
    │   ├── UnsafePathError (403, exit 2)         a symlink or another user's file/folder where the store
    │   │                                         or the server's upload folder would be (never retried)
    │   ├── SchemaVersionError (500, exit 2)      store schema newer than this graphdeck, or not yet migrated
    │   └── StoreFullError (507, exit 1)          disk full or the store's size quota reached
    └── CheckFailed (422, exit 1)                 a check (e.g. gradient paths) found problems

The server renders any of them as ``{"ok": false, "error": message, "status": code}``.
"""

from __future__ import annotations


class GraphdeckError(Exception):
    status_code = 500
    exit_code = 1

    def __init__(self, message: str, **details):
        super().__init__(message)
        self.message = message
        self.details = details


class UsageError(GraphdeckError):
    status_code = 400
    exit_code = 2


class BadInputError(UsageError):
    status_code = 400


class TruncatedInputError(BadInputError):
    status_code = 400


class PayloadTooLargeError(BadInputError):
    status_code = 413


class ConflictError(BadInputError):
    """The request contradicts what the server already holds (e.g. an upload chunk resent with
    other bytes, or completing an upload with chunks missing)."""

    status_code = 409


class NotFoundError(GraphdeckError):
    status_code = 404
    exit_code = 2


class StoreError(GraphdeckError):
    status_code = 500
    exit_code = 1


class NotAStoreError(StoreError):
    """The path given as a store is not a graphdeck store: not a database at all, a database
    without graphdeck's tables, or a folder. Bad input (exit 2), so a CI gate never reads a
    broken artifact as a failed check (exit 1)."""

    status_code = 400
    exit_code = 2


class UnsafePathError(StoreError):
    """A path the store or the server would write through is a symbolic link or not ours alone
    (a ``-wal``/``-shm``/``-journal`` beside a SQLite store, the upload folder): refused, naming
    it. 403, not a 5xx: retrying cannot help until someone removes it (``graphdeck upload`` stops
    at once, exit 2)."""

    status_code = 403
    exit_code = 2


class SchemaVersionError(StoreError):
    """The store's schema is newer than this graphdeck knows (``details``: ``store_version``,
    ``known_version``), or older and a read-only open cannot migrate it. Exit 2: the input cannot
    be read by this graphdeck, which is not a check's failure."""

    exit_code = 2


class StoreFullError(StoreError):
    """A write failed because the disk is full or the store reached its size quota; the
    transaction was rolled back (nothing of it is visible)."""

    status_code = 507


class CheckFailed(GraphdeckError):
    status_code = 422
    exit_code = 1
