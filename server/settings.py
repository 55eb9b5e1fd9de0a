"""Server settings: plain values, built by the caller and handed to :func:`create_app`.

Nothing here reads the environment or opens a file at import time, so a test can point an app at
its own SQLite file::

    >>> Settings(store="runs.db")
    Settings(store=PosixPath('runs.db'), max_upload_bytes=2147483648, frontend_dir=None, data_dir=None, max_decompressed_bytes=17179869184, max_decompress_ratio=200.0, upload_ttl_s=604800)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path

#: Default cap on one request body (an uploaded trace or store), 2 GiB.
DEFAULT_MAX_UPLOAD_BYTES = 2 * 1024**3
#: Default cap on what one gzip upload may decompress to, 16 GiB, and on its inflation ratio.
DEFAULT_MAX_DECOMPRESSED_BYTES = 16 * 1024**3
DEFAULT_MAX_DECOMPRESS_RATIO = 200.0


@dataclass(frozen=True)
class Settings:
    """What one server instance serves.

    Attributes:
        store: path of the SQLite store (a ``Path``), or a SQLAlchemy URL such as
            ``postgresql+psycopg://user:pw@db:5432/graphdeck`` (kept as ``str``); created with the
            current schema if missing, migrated if older (:func:`graphdeck.store.db.open_engine`).
        max_upload_bytes: requests whose ``Content-Length`` exceeds this are answered 413.
        frontend_dir: folder holding ``index.html`` and the dashboard's assets; ``None`` means the
            installed ``graphdeck.frontend`` package.
        write_tokens: bearer tokens that may write (every non-GET route); empty means writes are
            taken only from loopback clients (:mod:`graphdeck.server.auth`).
        read_tokens: when non-empty, reads need one of these (or a write token); empty means
            reads are open.
        data_dir: where resumable uploads keep their chunks (server-generated names only; made
            private, or refused: :func:`graphdeck.server.upload_area.private_dir`); ``None``
            means ``<store>.uploads`` beside a SQLite store; a URL store's is filled in here with
            its per-store folder under the user's data dir
            (:func:`graphdeck.server.upload_area.default_data_dir`), never the shared temp dir.
        max_decompressed_bytes: cap on the bytes a gzip upload may inflate to (413 above it).
        max_decompress_ratio: cap on inflated / compressed size, checked once more than 64 MiB
            came out (413 above it).
        allowed_hosts: extra ``Host`` names a request that came in over loopback may carry
            (besides localhost, loopback addresses and this machine's name; see
            :mod:`graphdeck.server.auth`, NOTE: [DNS rebinding]), e.g. the name a local reverse
            proxy passes on.
        link_gbps: the peak bandwidth of the link between ranks, GB/s (``--link-gbps``,
            ``GRAPHDECK_LINK_GBPS``): each collective's bus bandwidth is shown as a share of it
            (NOTE: [Bus bandwidth]); ``None``: no share (graphdeck assumes no device's peak).
        upload_ttl_s: an upload untouched this long (open, failed or done) is removed from
            ``data_dir`` (a done one stays ingested once: the store remembers it).
    """

    store: Path | str
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES
    frontend_dir: Path | None = field(default=None)
    write_tokens: tuple[str, ...] = field(default=(), repr=False)  # secrets: kept out of logs
    read_tokens: tuple[str, ...] = field(default=(), repr=False)
    data_dir: Path | None = None
    max_decompressed_bytes: int = DEFAULT_MAX_DECOMPRESSED_BYTES
    max_decompress_ratio: float = DEFAULT_MAX_DECOMPRESS_RATIO
    upload_ttl_s: float = 7 * 24 * 3600
    allowed_hosts: tuple[str, ...] = field(default=(), repr=False)
    link_gbps: float | None = None

    def __repr__(self) -> str:  # the dataclass repr, but a store URL's password never reaches a log
        from graphdeck.store.db import display_url

        def shown(f):
            value = getattr(self, f.name)
            return display_url(value) if f.name == "store" and isinstance(value, str) else value

        return f"Settings({', '.join(f'{f.name}={shown(f)!r}' for f in fields(self) if f.repr)})"

    def __post_init__(self) -> None:
        # Accept str / os.PathLike for convenience; store a Path, or a URL (``://``) as str.
        store = os.fspath(self.store)
        object.__setattr__(self, "store", store if "://" in store else Path(store))
        if self.frontend_dir is not None:
            object.__setattr__(self, "frontend_dir", Path(os.fspath(self.frontend_dir)))
        object.__setattr__(self, "write_tokens", tuple(self.write_tokens))
        object.__setattr__(self, "read_tokens", tuple(self.read_tokens))
        object.__setattr__(self, "allowed_hosts", tuple(self.allowed_hosts))
        if self.data_dir is not None:
            object.__setattr__(self, "data_dir", Path(os.fspath(self.data_dir)))
        elif "://" in store:  # a URL store: a private per-store folder in the user's data dir (issue 18)
            from graphdeck.server.upload_area import default_data_dir

            object.__setattr__(self, "data_dir", default_data_dir(store))
        if self.max_upload_bytes <= 0:
            raise ValueError(f"max_upload_bytes must be positive, got {self.max_upload_bytes}")
