"""What a new user hit in one afternoon (issue 24): one test per point, on real inputs."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.store.db import open_engine
from graphdeck.store.schema import Rank, Run
from graphdeck.store.torch_trace import import_torch_trace, torch_version_of
from tests.conftest import shared_path

DETACH = ("data", "torch_trace", "generated_torch2.13_cpu_gloo", "detach")


def test_imported_ranks_carry_the_runs_world_size_and_a_plain_torch_version(tmp_path):
    """Item 3: each rank of an imported 2-rank log said world size 1 and showed the raw JSON of the
    ``torch_version`` artifact (``{"pytorch_version": "2.13.0+cpu", "commit": "cf30…``)."""
    folder = shared_path(*DETACH)
    engine = open_engine(tmp_path / "s.db")
    import_torch_trace(engine, sorted(folder.glob("*.log")), run_name="detach")
    with Session(engine) as s:
        run = s.scalars(select(Run)).one()
        ranks = s.scalars(select(Rank).order_by(Rank.rank)).all()
    assert run.world_size == 2
    assert [(r.rank, r.world_size, r.torch_version) for r in ranks] == [(0, 2, "2.13.0+cpu"), (1, 2, "2.13.0+cpu")]


def test_torch_version_artifact_forms():
    assert torch_version_of('{\n"pytorch_version": "2.9.1+cu128",\n"commit": "abc"\n}') == "2.9.1+cu128"
    assert torch_version_of("2.4.0\n") == "2.4.0"
    assert torch_version_of('"2.5.0"') == "2.5.0"


HTA_TRACE = ("data", "traces", "hta", "trace_filter", "sampled_rank-0.json.gz")


def test_the_same_trace_twice_is_refused_or_replaced_by_content(tmp_path):
    """Item 7: a second ingest of the same file silently added a second trace for that rank."""
    import pytest

    from graphdeck.errors import ConflictError
    from graphdeck.store.schema import Trace
    from graphdeck.store.traces import ingest_trace

    path = shared_path(*HTA_TRACE)
    engine = open_engine(tmp_path / "s.db")
    first = ingest_trace(engine, path, run_name="r")
    with pytest.raises(ConflictError, match=rf"already holds this trace .* as trace #{first.trace_id} of rank 0"):
        ingest_trace(engine, path, run_name="r")
    with open(path, "rb") as fh:  # an upload's file object: the same bytes are the same trace
        with pytest.raises(ConflictError):
            ingest_trace(engine, fh, run_name="r")
    again = ingest_trace(engine, path, run_name="r", duplicate="replace")
    with Session(engine) as s:
        assert s.scalars(select(Trace.id)).all() == [again.trace_id], "the older copy is gone, the new one kept"
    other = ingest_trace(engine, path, run_name="another run")  # another run may hold it
    assert other.trace_id != again.trace_id


def test_ingest_trace_prints_one_summary_line(tmp_path):
    """Item 8: a 30-key JSON of mostly-zero counters and "N events stored of M read" (read as loss)."""
    from click.testing import CliRunner

    from graphdeck.cli import main

    path = shared_path(*HTA_TRACE)
    res = CliRunner().invoke(main, ["ingest-trace", "--store", str(tmp_path / "s.db"), "--run", "r", str(path)])
    assert res.exit_code == 0, res.output
    assert "kept 4,811 events (X 4,811); not stored by design (metadata, flows, counters…): 44 (M 44); " \
           "dropped/changed: none" in res.output
    assert "{" not in res.output and "skipped_not_object" not in res.output
    res = CliRunner().invoke(main, ["ingest-trace", "--store", str(tmp_path / "s.db"), "--run", "r", str(path)])
    assert res.exit_code == 2 and "already holds this trace" in res.output
    res = CliRunner().invoke(main, ["ingest-trace", "--store", str(tmp_path / "s.db"), "--run", "r", "--replace",
                                    "--json", str(path)])
    assert res.exit_code == 0 and '"skipped_not_object": 0' in res.output


def test_serving_a_missing_store_is_an_error_unless_create(tmp_path):
    """Item 6: ``graphdeck serve mistyped.db`` created an empty store and served ``[]``."""
    from click.testing import CliRunner

    from graphdeck.cli import main

    missing = tmp_path / "mistyped.db"
    res = CliRunner().invoke(main, ["serve", str(missing)])
    assert res.exit_code == 2 and f"no store at {missing}" in res.output and "--create" in res.output
    assert not missing.exists(), "nothing is created by a mistyped name"


def test_demo_finds_a_taken_port_before_training():
    """Item 5: the demo trained for minutes, then failed on ``address already in use``."""
    import socket

    from graphdeck.cli import port_free

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        taken = sock.getsockname()[1]
        assert port_free("127.0.0.1", taken) == 0
        other = port_free("127.0.0.1", 0)
        assert other and other != taken


def test_a_bad_filter_pattern_is_a_400_without_re2_noise_on_stderr(tmp_path):
    """Item 15: RE2 wrote ``absl::InitializeLog()`` warnings and ``re2.cc`` errors to the server log."""
    from tests.conftest import run_python

    proc = run_python("""
import sys
from graphdeck.errors import UsageError
from graphdeck.server.render.filters import compile_patterns
try:
    compile_patterns(["(unclosed"])
except UsageError as exc:
    print("usage:", exc)
""")
    assert "usage: filter_by_op '(unclosed' is not a valid regular expression" in proc.stdout
    assert "re2.cc" not in proc.stderr and "absl" not in proc.stderr, proc.stderr


def test_a_trace_only_run_is_incomplete_not_failing_in_the_summary(tmp_path):
    """Newcomer re-run: a run holding one ingested trace showed "FAIL … 1 failing parameter(s) and
    error finding(s)" on the overview: nothing was checked, which is missing evidence."""
    from graphdeck.analysis.summary import run_summary
    from graphdeck.store.traces import ingest_trace

    engine = open_engine(tmp_path / "s.db")
    ingest_trace(engine, shared_path(*HTA_TRACE), run_name="hta")
    with Session(engine) as s:
        rep = run_summary(s, s.scalars(select(Run)).one())
    grads = next(c for c in rep.checks if c.key == "gradients")
    assert grads.verdict == "INCOMPLETE" and "nothing to check" in grads.headline, grads
