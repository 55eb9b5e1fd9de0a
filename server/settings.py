"""Server settings: plain values, built by the caller and handed to :func:`create_app`.

Nothing here reads the environment or opens a file at import time, so a test can point an app at
its own SQLite file::

    >>> Settings(store="runs.db")
    Settings(store=PosixPath('runs.db'), max_upload_bytes=2147483648, frontend_dir=None)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

#: Default cap on one request body (an uploaded trace or store), 2 GiB.
DEFAULT_MAX_UPLOAD_BYTES = 2 * 1024**3


@dataclass(frozen=True)
class Settings:
    """What one server instance serves.

    Attributes:
        store: path of the SQLite store (created with the current schema if missing).
        max_upload_bytes: requests whose ``Content-Length`` exceeds this are answered 413.
        frontend_dir: folder holding ``index.html`` and the dashboard's assets; ``None`` means the
            installed ``graphdeck.frontend`` package.
    """

    store: Path
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES
    frontend_dir: Path | None = field(default=None)

    def __post_init__(self) -> None:
        # Accept str / os.PathLike for convenience; store a Path.
        object.__setattr__(self, "store", Path(os.fspath(self.store)))
        if self.frontend_dir is not None:
            object.__setattr__(self, "frontend_dir", Path(os.fspath(self.frontend_dir)))
        if self.max_upload_bytes <= 0:
            raise ValueError(f"max_upload_bytes must be positive, got {self.max_upload_bytes}")
