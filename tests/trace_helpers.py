"""Shared inputs of the trace tests: the GPT-2 Inductor store from one H200 (tests/data/gpt2_inductor,
see its README.md) unpacked once per session, with kernel → node links built."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import pytest

GPT2_DIR = Path(__file__).parent / "data" / "gpt2_inductor"
GPT2_TRACE = GPT2_DIR / "gpt2_rank0.pt.trace.json.gz"


@pytest.fixture(scope="session")
def gpt2_store(tmp_path_factory) -> Path:
    """A private copy of the H200 run's store (run ``gpt2``, trace 1) with ``kernel_nodes`` written."""
    from graphdeck.analysis.traces.mapping import link_kernels
    from graphdeck.store.db import open_engine

    path = tmp_path_factory.mktemp("gpt2") / "gpt2.db"
    with gzip.open(GPT2_DIR / "gpt2.db.gz", "rb") as src, open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    _upgrade(path)
    engine = open_engine(path)
    link_kernels(engine, 1)
    engine.dispose()
    return path


def _upgrade(path: Path) -> None:
    """Bring the shipped store (schema version 1, 2026-11-29) to the current schema: nullable columns
    added since are added, the version row follows SCHEMA_VERSION, new tables come from
    ``open_engine``. The store is test input, not a migration path for users."""
    import sqlite3

    from graphdeck.store.schema import SCHEMA_VERSION, Base

    con = sqlite3.connect(path)
    try:
        for table in Base.metadata.sorted_tables:
            have = {row[1] for row in con.execute(f"PRAGMA table_info({table.name})")}
            if not have:
                continue
            for col in table.columns:
                if col.name not in have and col.nullable:
                    con.execute(f"ALTER TABLE {table.name} ADD COLUMN {col.name} {col.type.compile()}")
        con.execute("UPDATE store_meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),))
        con.commit()
    finally:
        con.close()
