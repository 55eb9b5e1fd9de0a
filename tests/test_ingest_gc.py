"""The ingest's loop runs with the cyclic garbage collector paused (NOTE: [Ingest without the
cyclic collector] in store/trace_rows.py) and leaves it as it found it, also when ingests run in
threads of one process (the server) and when one fails.

Inputs are real: corpus traces ingested into real SQLite stores, two at once in threads."""

from __future__ import annotations

import gc
import threading

import pytest

from graphdeck.errors import GraphdeckError
from graphdeck.store.db import open_engine
from graphdeck.store.trace_rows import gc_paused
from graphdeck.store.traces import ingest_trace
from tests.conftest import shared_path


def test_the_loop_runs_paused_and_the_collector_is_back_after(tmp_path, monkeypatch):
    import graphdeck.store.traces as traces

    seen, real = [], traces._Ingest._consume
    monkeypatch.setattr(traces._Ingest, "_consume",
                        lambda self, reader: seen.append(gc.isenabled()) or real(self, reader))
    assert gc.isenabled()
    ingest_trace(open_engine(tmp_path / "s.db"),
                 shared_path("data", "traces", "tracelens", "b200", "eager_trace.json.gz"), run_name="r")
    assert seen == [False] and gc.isenabled()


def test_concurrent_ingests_and_a_failing_one_leave_the_collector_on(tmp_path):
    paths = [shared_path("data", "traces", "hta", "nccl_parser_config", "nccl_data.json.gz"),
             shared_path("data", "traces", "tracelens", "b200", "eager_trace.json.gz")]
    errors = []

    def run(i, path):
        try:
            ingest_trace(open_engine(tmp_path / f"s{i}.db"), path, run_name="r", batch_size=500)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(paths)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and gc.isenabled()
    bad = tmp_path / "cut.json"
    bad.write_text('{"traceEvents": [{"ph": "X", "name": "a", "ts": 1, "dur": 2, "pid": 1, "tid": 1}, {"ph": "X", "na')
    with pytest.raises(GraphdeckError):
        ingest_trace(open_engine(tmp_path / "s3.db"), bad, run_name="r", strict=True)
    assert gc.isenabled()
    gc.disable()
    try:
        gc_paused(lambda: None)
        assert not gc.isenabled()  # off before: left off
    finally:
        gc.enable()
