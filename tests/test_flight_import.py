"""Flight Recorder dumps in (store/fr_import.py) and the recorded half of the hang report
(analysis/ranks/flight.py) on the real dumps of tests/flight_job.py kept in tests/data/flight/ (see its
README): pickle and JSON by content whatever their names, gzipped too, a record dropped and named
(INCOMPLETE, never agree), a rank without a dump named, files that are no dump skipped with why."""

from __future__ import annotations

import gzip
import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.ranks.core import rank_report
from graphdeck.errors import BadInputError, UsageError
from graphdeck.store.db import open_engine
from graphdeck.store.fr_import import import_flight_dumps, load_bytes, sniff
from graphdeck.store.schema import Run

DATA = Path(__file__).resolve().parent / "data" / "flight"
REPO = Path(__file__).resolve().parents[1]


def _report(store: Path, run: str):
    with Session(open_engine(store, read_only=True)) as s:
        return rank_report(s, s.scalar(select(Run).where(Run.name == run)))


def test_pickle_and_gzipped_json_with_any_names(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    shutil.copy(DATA / "fr_dump_0", d / "trainer-host7.bin.0")
    with gzip.open(d / "x_1.json.gz", "wb") as fh:
        fh.write((DATA / "rank1-trace.json.1").read_bytes())
    (d / "README.txt").write_text("hello")
    (d / "kineto_0.json").write_text(json.dumps({"schemaVersion": 1, "traceEvents": []}))
    res = import_flight_dumps(open_engine(tmp_path / "s.db"), d, run_name="r")
    assert (res.ranks, res.entries, res.dropped, res.missing_ranks) == ([0, 1], 20, 0, [])
    assert sorted(x.split(":")[0] for x in res.skipped) == ["README.txt", "kineto_0.json"]
    rep = _report(tmp_path / "s.db", "r")
    by = {m.desc: m for m in rep.flight.mismatches}
    m = by["loss_sync"]
    assert (m.seq, m.reached, m.not_reached, m.primary, m.cause) == (3, [0], [1], True, {1: "skipped"})
    assert m.issued[0].line.endswith("flight_job.py:67 in main")
    assert m.instead[1] is None and m.last_completed[1].seq == 2
    assert m.doing[1].group == by["grad_sync"].group
    assert [x.primary for x in rep.flight.mismatches] == [True, True, False, False]
    assert rep.verdict == "FAIL" and "no compile records for this run" in rep.to_text()


def _healthy_pair(folder: Path, drop_field_of: int | None = None) -> None:
    """Rank 0's real dump as both ranks (they agree), rank 1's written as JSON; optionally one
    entry of rank 1 loses its ``profiling_name`` (a record the import must drop and name)."""
    folder.mkdir()
    shutil.copy(DATA / "fr_dump_0", folder / "fr_dump_0")
    d = pickle.loads((DATA / "fr_dump_0").read_bytes())
    if drop_field_of is not None:
        del d["entries"][drop_field_of]["profiling_name"]
    (folder / "dump.json.1").write_text(json.dumps(d))


def test_agreeing_dumps_are_ok_and_a_dropped_entry_makes_it_incomplete(tmp_path):
    _healthy_pair(tmp_path / "ok")
    import_flight_dumps(open_engine(tmp_path / "ok.db"), tmp_path / "ok", run_name="ok")
    rep = _report(tmp_path / "ok.db", "ok")
    assert rep.verdict == "OK" and rep.flight.mismatches == [] and len(rep.flight.groups_agree) == 4

    _healthy_pair(tmp_path / "bad", drop_field_of=6)
    res = import_flight_dumps(open_engine(tmp_path / "bad.db"), tmp_path / "bad", run_name="bad")
    assert res.dropped == 1 and res.dropped_records == ["dump.json.1 entry #6 (record_id 6): no profiling_name"]
    rep = _report(tmp_path / "bad.db", "bad")
    assert rep.verdict == "INCOMPLETE" and not rep.ok
    assert rep.missing_evidence == ["Flight Recorder entry dropped: dump.json.1 entry #6 (record_id 6): "
                                    "no profiling_name"]
    text = rep.to_text()
    assert "OK: all ranks agree" not in text and text.splitlines()[-1].startswith("INCOMPLETE")
    proc = subprocess.run([sys.executable, "-m", "graphdeck.cli", "check-ranks", str(tmp_path / "bad.db"), "--run",
                           "bad", "--format", "json"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 3 and json.loads(proc.stdout)["verdict"] == "INCOMPLETE"
    with pytest.raises(BadInputError, match="strict import"):
        import_flight_dumps(open_engine(tmp_path / "strict.db"), tmp_path / "bad", run_name="s", strict=True)


def test_a_member_without_a_dump_is_named(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    raw = pickle.loads((DATA / "fr_dump_0").read_bytes())
    raw["pg_config"] = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2]"}}
    (d / "fr_dump_0").write_bytes(pickle.dumps(raw, protocol=2))
    res = import_flight_dumps(open_engine(tmp_path / "s.db"), d, run_name="r")
    assert res.missing_ranks == [1, 2]
    rep = _report(tmp_path / "s.db", "r")
    assert rep.flight.no_dump == [1, 2] and rep.verdict == "INCOMPLETE"
    assert "ranks [1, 2]: no Flight Recorder dump" in rep.missing_evidence  # one line for all (issue 26)


def test_files_that_are_no_dump_and_hostile_pickles(tmp_path):
    assert load_bytes(b"I1201 12:00:00.0 1 f.py:1] {}")[0] is None
    assert "no 'entries'" in load_bytes(json.dumps({"a": 1}).encode())[1]
    evil = pickle.dumps({"version": "2.10", "entries": [], "x": Path("/")})  # a class: refused, not run
    dump, why = load_bytes(evil)
    assert dump is None and why.startswith("refused") and "names a class" in why
    assert sniff(DATA / "fr_dump_0") and sniff(DATA / "rank1-trace.json.1")
    d = tmp_path / "in"
    d.mkdir()
    shutil.copy(DATA / "fr_dump_0", d / "norank")
    (d / "empty_0").write_bytes(b"")
    with pytest.raises(BadInputError, match="no Flight Recorder dump found"):
        import_flight_dumps(open_engine(tmp_path / "s.db"), d, run_name="r")
    shutil.copy(DATA / "fr_dump_0", d / "a_0")
    shutil.copy(DATA / "fr_dump_0", d / "b_0")
    with pytest.raises(UsageError, match="same rank"):
        import_flight_dumps(open_engine(tmp_path / "s.db"), d, run_name="r")


def test_fr_trace_cannot_read_these_gloo_dumps_and_we_can(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    for r in (0, 1):
        shutil.copy(DATA / f"fr_dump_{r}", d / f"fr_dump_{r}")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(d), "-p",
                           "fr_dump_"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "KeyError" in proc.stderr
    res = import_flight_dumps(open_engine(tmp_path / "s.db"), d, run_name="r")
    assert res.ranks == [0, 1] and len(_report(tmp_path / "s.db", "r").flight.mismatches) == 4


def test_import_takes_dumps_and_kineto_traces_of_one_run_together(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    shutil.copy(DATA / "fr_dump_0", d / "fr_dump_0")
    shutil.copy(DATA / "fr_dump_1", d / "fr_dump_1")
    shutil.copy(DATA.parent / "ddp_h200x2" / "ddp_rank0.pt.trace.json.gz", d / "profile.json.gz")
    store = tmp_path / "s.db"
    proc = subprocess.run([sys.executable, "-m", "graphdeck.cli", "import", str(d), "--store", str(store), "--run",
                           "both"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Flight Recorder: ranks [0, 1], 20 entries, 0 dropped" in proc.stdout
    assert "Kineto trace profile.json.gz: rank 0" in proc.stdout
    from graphdeck.store.schema import Trace

    with Session(open_engine(store, read_only=True)) as s:
        assert [t.rank for t in s.scalars(select(Trace))] == [0]
    assert len(_report(store, "both").flight.mismatches) == 4


def test_a_cut_dump_beside_a_good_one_is_missing_evidence_never_agreement(tmp_path):
    """A fresh user's check: rank 1's dump cut at 3,000 bytes beside rank 0's good one was skipped
    without a word and check-ranks said "OK: all ranks agree" (exit 0)."""
    import shutil

    from click.testing import CliRunner

    from graphdeck.cli import main

    src = Path(__file__).parent / "data" / "flight"
    folder = tmp_path / "dumps"
    folder.mkdir()
    shutil.copy(src / "fr_dump_0", folder / "fr_dump_0")
    (folder / "fr_dump_1").write_bytes((src / "fr_dump_1").read_bytes()[:3000])
    store = str(tmp_path / "s.db")
    res = CliRunner().invoke(main, ["import", str(folder), "--store", store, "--run", "cut", "--no-progress"])
    assert res.exit_code == 0 and "no dump from ranks [1]" in res.output, res.output
    assert "unreadable dump fr_dump_1" in res.output, res.output
    res = CliRunner().invoke(main, ["check-ranks", store, "--run", "cut"])
    assert res.exit_code == 3, res.output
    assert "rank 1: Flight Recorder dump unreadable: fr_dump_1" in res.output and "agree" not in res.output.splitlines()[-1]
    strict = CliRunner().invoke(main, ["import", str(folder), "--store", str(tmp_path / "t.db"), "--run", "cut",
                                       "--strict", "--no-progress"])
    assert strict.exit_code == 2 and "unreadable Flight Recorder dump(s): fr_dump_1" in strict.output, strict.output


def test_a_readme_named_beside_dumps_is_no_rank_0_log(tmp_path):
    """A fresh user's check: a README.md given with the dumps was read as rank 0's TORCH_TRACE log
    (27 bad lines dropped) and check-ranks still said the ranks agree."""
    import sqlite3

    from click.testing import CliRunner

    from graphdeck.cli import main

    d = Path(__file__).parent / "data" / "flight_torch2.11"
    store = str(tmp_path / "s.db")
    res = CliRunner().invoke(main, ["import", str(d / "gloo_ws2_pickle_0"), str(d / "gloo_ws2_pickle_1"),
                                    str(d / "README.md"), "--store", store, "--run", "g", "--no-progress"])
    assert res.exit_code == 0 and "README.md: not a TORCH_TRACE log" in res.output, res.output
    con = sqlite3.connect(store)
    try:
        assert con.execute("select count(*) from compile_events where name != 'flight_recorder'").fetchone()[0] == 0
    finally:
        con.close()
