"""``ingest-trace``'s coverage headline read from the launches alone (NOTE: [Headline mapping from
launches] in analysis/traces/headline_map.py) equals ``map_trace`` on the whole trace.

Inputs are real: corpus GPU traces without a capture (../shared/data/traces: an eager FusedAdam
step with NCCL kernels, Inductor kernels under ``## Call CompiledFxGraph`` ranges, a B200 eager
trace with communication kernels), ingested into a fresh SQLite store; the 2 x H200 DDP store of
tests/data/ddp_h200x2 (kernel tables: the whole trace is read) and the CPU traces of
tests/data/scale_cpu2 (the CPU path: the whole trace is read).
"""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.traces.coverage import coverage
from graphdeck.analysis.traces.data import load_events
from graphdeck.analysis.traces.headline_map import headline_mapping, launch_events
from graphdeck.analysis.traces.mapping import map_trace
from graphdeck.cli import main as cli
from graphdeck.cli_ingest import mapping_headline
from graphdeck.store.db import open_engine
from graphdeck.store.schema import Trace
from graphdeck.store.traces import ingest_trace
from tests.conftest import shared_path

DATA = Path(__file__).resolve().parent / "data"
CORPUS = {  # trace → what it exercises
    "hta/nccl_parser_config/nccl_data.json.gz": "optimizer step and communication kernels",
    "tracelens/torch_compile_triton/trace.json.gz": "kernels launched under compiled-graph wrapper ranges",
    "tracelens/b200/eager_trace.json.gz": "eager and communication kernels, a few under a wrapper range",
}


def _same(a, b) -> None:
    assert vars(a) == vars(b)
    assert vars(coverage(a)) == vars(coverage(b))
    if a.kernel_ns:
        assert mapping_headline(a) == mapping_headline(b)


@pytest.mark.parametrize("rel", sorted(CORPUS))
def test_headline_mapping_equals_map_trace_on_corpus_traces(tmp_path, rel):
    path = shared_path("data", "traces", *rel.split("/"))
    engine = open_engine(tmp_path / "s.db")
    result = ingest_trace(engine, path, run_name="r")
    with Session(engine) as s:
        full = map_trace(s, result.trace_id)
        fast = headline_mapping(s, result.trace_id)
        kept, every = launch_events(s, result.trace_id), load_events(s, result.trace_id, with_args=False)
    _same(full, fast)
    assert full.kernel_ns > 0
    cov = coverage(full)
    assert cov.total_ns or cov.outside  # each input classifies kernels somewhere
    assert len(kept) < len(every) * 0.7  # the point: a part of the trace is read
    if rel.startswith("hta/nccl"):
        assert cov.outside.get("eager optimizer step", 0) > 0 and cov.outside.get("communication and DDP hooks", 0) > 0
    if "torch_compile_triton" in rel:
        assert cov.total_ns == full.kernel_ns  # every kernel is a compiled graph's (no kernel table: unmapped)


def test_ingest_trace_command_prints_the_same_headline(tmp_path):
    path = shared_path("data", "traces", "hta", "nccl_parser_config", "nccl_data.json.gz")
    store = tmp_path / "s.db"
    res = CliRunner().invoke(cli, ["ingest-trace", str(path), "--store", str(store), "--run", "r"])
    assert res.exit_code == 0, res.output
    from graphdeck.analysis.traces.analyze import TraceData
    from graphdeck.analysis.traces.idle import headline, idle_breakdown

    with Session(open_engine(store)) as s:
        tid = s.scalar(select(Trace.id))
        expected = mapping_headline(map_trace(s, tid))
        idle = headline(idle_breakdown(TraceData(s, tid)))  # the whole trace with args and links
    assert expected in res.output and "eager optimizer step" in expected
    assert idle and all(line in res.output for line in idle)  # the command reads less for the same lines


def _copy(src: Path, dst: Path) -> Path:
    with gzip.open(src, "rb") as fin, open(dst, "wb") as fout:
        shutil.copyfileobj(fin, fout)
    return dst


def test_a_rank_with_kernel_tables_reads_the_whole_trace(tmp_path):
    """The DDP store's capture has kernel tables: the command's headline is map_trace's, most
    kernel time on nodes."""
    store = _copy(DATA / "ddp_h200x2" / "ddp.db.gz", tmp_path / "ddp.db")
    trace = DATA / "ddp_h200x2" / "ddp_rank0.pt.trace.json.gz"
    res = CliRunner().invoke(cli, ["ingest-trace", str(trace), "--store", str(store), "--run", "ddp"])
    assert res.exit_code == 0, res.output
    with Session(open_engine(store)) as s:
        tid = s.scalar(select(Trace.id))
        full, fast = map_trace(s, tid), headline_mapping(s, tid)
    _same(full, fast)
    assert coverage(full).fraction > 0.9 and mapping_headline(full) in res.output


def test_cpu_traces_read_the_whole_trace(tmp_path):
    store = _copy(DATA / "scale_cpu2" / "cpu2.db.gz", tmp_path / "cpu2.db")
    with Session(open_engine(store)) as s:
        ids = list(s.scalars(select(Trace.id).order_by(Trace.id)))
        assert ids
        for tid in ids:
            full, fast = map_trace(s, tid), headline_mapping(s, tid)
            _same(full, fast)
            assert full.device == "cpu" and full.node_ns


def test_headline_and_fingerprint_on_postgresql(pg_url):
    """The same SQL on PostgreSQL (``substr``, the correlation subquery); the fingerprint is
    counted there (COPY gives no consecutive-id guarantee: NOTE: [Fingerprint at write])."""
    from graphdeck.analysis.traces.export_map import _fingerprint
    from graphdeck.store.schema import TraceLinks

    path = shared_path("data", "traces", "hta", "nccl_parser_config", "nccl_data.json.gz")
    res = CliRunner().invoke(cli, ["ingest-trace", str(path), "--store", pg_url, "--run", "r"])
    assert res.exit_code == 0, res.output
    with Session(open_engine(pg_url)) as s:
        tid = s.scalar(select(Trace.id))
        full, fast = map_trace(s, tid), headline_mapping(s, tid)
        row = s.scalar(select(TraceLinks).where(TraceLinks.trace_id == tid))
        assert (row.events_count, row.first_event_id, row.last_event_id) == _fingerprint(s, tid)
    _same(full, fast)
    assert mapping_headline(full) in res.output
