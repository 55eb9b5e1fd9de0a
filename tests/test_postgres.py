"""The store on PostgreSQL: the same schema, writers and readers as on SQLite."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.store.db import get_or_create_run, open_engine, write_session
from graphdeck.store.schema import Run


def test_open_engine_creates_and_reads_back(store_url):
    engine = open_engine(store_url)
    with write_session(engine) as s:
        get_or_create_run(s, "r1", world_size=2)
    reader = open_engine(store_url, read_only=True)
    with Session(reader) as s:
        assert s.scalars(select(Run.name)).all() == ["r1"], "the run written is read back"
    engine.dispose()
    reader.dispose()
