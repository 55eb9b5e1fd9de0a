"""The kept kernel links' event fingerprint taken from the ingest's own writes (NOTE: [Fingerprint
at write] in store/trace_write.py) equals the counting query it replaces.

Inputs are real corpus traces (../shared/data/traces) ingested into one real SQLite store, in
several batches each: an NCCL job whose stored events mix ``X`` with instant events and kept
forward-backward flows (``s``/``f``), then a second trace after it (its ids follow the first's).
"""

from __future__ import annotations

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

import graphdeck.analysis.traces.export_map as export_map
from graphdeck.analysis.traces.export_map import _fingerprint
from graphdeck.store.db import open_engine
from graphdeck.store.schema import TraceLinks
from graphdeck.store.traces import ingest_trace
from tests.conftest import shared_path


@pytest.mark.parametrize("batch_size", [1000, 5000])
def test_fingerprint_from_the_writes_equals_the_query(tmp_path, monkeypatch, batch_size):
    calls = []
    real = export_map._fingerprint
    monkeypatch.setattr(export_map, "_fingerprint", lambda s, tid: calls.append(tid) or real(s, tid))
    engine = open_engine(tmp_path / "s.db")
    ids = []
    for rel in ("hta/nccl_parser_config/nccl_data.json.gz", "tracelens/b200/eager_trace.json.gz"):
        result = ingest_trace(engine, shared_path("data", "traces", *rel.split("/")), run_name="r",
                              batch_size=batch_size)
        ids.append(result.trace_id)
        if rel.startswith("hta/nccl"):  # not every stored event is X: the ends are told apart
            by_ph = result.stats["by_ph"]
            assert by_ph["i"] and result.stats["fwdbwd_flows"] and by_ph["X"] < result.stats["stored"]
    assert calls == []  # the ingest did not count
    with Session(engine) as s:
        for tid in ids:
            row = s.scalar(select(TraceLinks).where(TraceLinks.trace_id == tid))
            assert row is not None
            assert (row.events_count, row.first_event_id, row.last_event_id) == _fingerprint(s, tid)
        assert _fingerprint(s, ids[1])[1] > _fingerprint(s, ids[0])[2]
