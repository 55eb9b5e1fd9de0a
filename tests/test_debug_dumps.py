"""torch's debug server's periodic dump folder as an import source (issue 38 item 1; NOTE:
[Debug-server dumps] in store/debug_dumps.py).

One real 2-rank gloo job (tests/debug_server_job.py) under ``start_debug_server(dump_dir=...,
dump_interval=1)`` hangs (rank 1 waits for a file, rank 0 waits in an all-reduce); the folder as
it is during the hang is copied, the job released, and ``graphdeck import FOLDER`` stores each
rank's latest stacks: the same place the live watch's report names (rank 0 at the all-reduce line,
rank 1 at its waiting line, with their source text), and for how many dumps it has not moved.
torch 2.13 writes no Flight Recorder dump there on gloo (its builder raises KeyError on gloo's
empty pg_config): asserted, so a torch that starts writing them is noticed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.store.db import open_engine
from graphdeck.store.debug_dumps import dump_kind, parse_stacks
from graphdeck.store.schema import CompileEvent, Run
from tests.conftest import REPO, free_port, require

JOB = REPO / "tests" / "debug_server_job.py"
_LINES = JOB.read_text().splitlines()
WAITS = next(i for i, t in enumerate(_LINES, 1) if "# RANK1_WAITS" in t)
REDUCE = next(i for i, t in enumerate(_LINES, 1) if "# RANK0_WAITS" in t)


def _hung(path: Path) -> bool:
    """Whether a stacks dump shows rank 0 in the all-reduce and rank 1 at its waiting line."""
    ranks, _failed = parse_stacks(path.read_text(errors="replace"))
    where = {r: [f"{f[0]}:{f[1]}" for th in st["threads"] if th["main"] for f in th["frames"]] for r, st in ranks.items()}
    return f"{JOB}:{REDUCE}" in where.get(0, []) and f"{JOB}:{WAITS}" in where.get(1, [])


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    import importlib.util

    require(importlib.util.find_spec("tabulate") is not None,
            "tabulate is missing: torch.distributed.debug's handlers import it (graphdeck[test])")
    out = tmp_path_factory.mktemp("dbg")
    dumps, release, copy = out / "dumps", out / "release", out / "copy"
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_FR_BUFFER_SIZE="2000")
    port = free_port()
    watched = out / "watched.db"  # graphdeck watch --debug-server, on the same job while it hangs
    with open(out / "job.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                                 str(JOB), str(dumps), str(release), str(port)], stdout=log,
                                stderr=subprocess.STDOUT, env=env, cwd=REPO)
    watch = subprocess.Popen([sys.executable, "-m", "graphdeck.cli", "watch", str(watched), "--run", "dbg",
                              "--debug-server", f"http://localhost:{port}", "--threshold-s", "3", "--poll-s", "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    job_running_at_report = None
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:  # two dumps taken during the hang, the watch done
            if watch.poll() is not None and job_running_at_report is None:
                job_running_at_report = proc.poll() is None
            if sum(_hung(p) for p in dumps.glob("stacks_*.txt")) >= 2 and watch.poll() is not None:
                break
            time.sleep(0.5)
        shutil.copytree(dumps, copy)  # the folder as it is while the job hangs
    finally:
        release.write_text("go")
        proc.wait(timeout=120)
        if watch.poll() is None:
            watch.kill()
    w_out, w_err = watch.communicate(timeout=30)
    store = out / "s.db"
    res = subprocess.run([sys.executable, "-m", "graphdeck.cli", "import", str(copy), "--store", str(store),
                          "--run", "dbg"], capture_output=True, text=True, timeout=120, cwd=REPO)
    return {"proc": proc, "log": (out / "job.log").read_text(), "dumps": dumps, "copy": copy, "store": store,
            "import": res, "watch": (watch.returncode, w_out, w_err), "job_running_at_report": job_running_at_report,
            "watched": watched}


@pytest.mark.slow
def test_watch_collects_stacks_and_flight_recorder_from_the_debug_servers_endpoints(dumped):
    """``graphdeck watch --debug-server URL`` on the hung job (no graphdeck agent in it): from the
    server's /stacks and /fr_trace_json pages it finds the ranks still past the threshold with a
    collective in flight, stores both ranks' recorders and stacks, and writes the hang report while
    the job still hangs (the job ran on until the test released it)."""
    code, out, err = dumped["watch"]
    assert code == 1, out + err
    assert dumped["job_running_at_report"] is True and dumped["proc"].returncode == 0, dumped["log"][-2000:]
    lines = out.splitlines()
    assert "HANG (live: the job is still running)" in out, out
    assert "  group 1 (grads): collective #2 gloo:all_reduce [[8]] issued by ranks [0], not by ranks [1]" in lines, out
    assert any(ln.startswith(f"  rank 0 (step ?): now at {JOB}:{REDUCE} in main: dist.all_reduce(t, group=grads)")
               for ln in lines), out
    assert any(ln.startswith(f"  rank 1 (step ?): now at {JOB}:{WAITS} in main: time.sleep(0.1)") for ln in lines), out
    with Session(open_engine(dumped["watched"], read_only=True)) as s:
        run = s.scalar(select(Run).where(Run.name == "dbg"))
        rows = s.execute(select(CompileEvent.rank, CompileEvent.name, CompileEvent.metadata_json).where(
            CompileEvent.run_id == run.id)).all()
    by = {(r, n) for r, n, _m in rows}
    assert {(0, "flight_recorder"), (1, "flight_recorder"), (0, "graphdeck_stacks"), (1, "graphdeck_stacks"),
            (0, "graphdeck_hang_report")} <= by, by
    assert all(json.loads(m)["reason"] == "debug server" for _r, n, m in rows if n == "flight_recorder")
    assert run.world_size == 2


@pytest.mark.slow
def test_import_reads_each_ranks_latest_stack_from_the_debug_server_folder(dumped):
    res, store = dumped["import"], dumped["store"]
    assert dumped["proc"].returncode == 0, dumped["log"][-3000:]
    assert res.returncode == 0, res.stdout + res.stderr
    stacks = sorted(dumped["copy"].glob("stacks_*.txt"))
    assert sum(_hung(p) for p in stacks) >= 2 and all(dump_kind(p) == "stacks" for p in stacks)
    lines = res.stdout.splitlines()
    assert lines[0].startswith(f"torch.distributed.debug stacks: ranks [0, 1], the latest of {len(stacks)} periodic "
                               f"dump(s) ({stacks[0].name} to {stacks[-1].name})"), res.stdout
    # the latest dump was taken during the hang (the copy was made before the release)
    assert lines[1].startswith(f"  rank 0: now at {JOB}:{REDUCE} in main: dist.all_reduce(t, group=grads)  # RANK0_WAITS"
                               " (the same in the last "), res.stdout
    assert lines[2].startswith(f"  rank 1: now at {JOB}:{WAITS} in main: time.sleep(0.1)  # RANK1_WAITS (the same in "
                               "the last "), res.stdout
    with Session(open_engine(store, read_only=True)) as s:
        run = s.scalar(select(Run).where(Run.name == "dbg"))
        rows = s.execute(select(CompileEvent.rank, CompileEvent.payload).where(
            CompileEvent.run_id == run.id, CompileEvent.name == "graphdeck_stacks")).all()
        from graphdeck.analysis.ranks.live import live_hang

        now = live_hang(s, run.id)
    assert sorted(r for r, _p in rows) == [0, 1] and run.world_size == 2
    for _r, p in rows:
        st = json.loads(p)
        assert st["same_for"]["snapshots"] >= 2 and st["same_for"]["seconds"] >= 1
        assert st["source"] == f"torch.distributed.debug {stacks[-1].name}"
        main = [th for th in st["threads"] if th["main"]]
        assert len(main) == 1 and main[0]["frames"][0][2] == "<module>", "outermost first, the script's thread"
    # the hang report's reading of the stored stacks (the live watch's form) names the same frames
    assert now.ranks[0].frame == f"{JOB}:{REDUCE} in main" and now.ranks[1].frame == f"{JOB}:{WAITS} in main"
    assert now.ranks[0].innermost.endswith("in all_reduce"), now.ranks[0].innermost


@pytest.mark.slow
def test_no_flight_recorder_dump_on_gloo_and_other_files_named(dumped):
    names = sorted(p.name for p in dumped["dumps"].iterdir())
    assert not [n for n in names if n.startswith("fr_trace_")], names  # torch 2.13, gloo: none (module docstring)
    assert "Failed to dump fr_trace" in dumped["log"] and "KeyError" in dumped["log"]
    (dumped["copy"] / "fr_trace_20260101_000000.txt").write_text("=== FR Trace ===\n")
    res = subprocess.run([sys.executable, "-m", "graphdeck.cli", "import", str(dumped["copy"]), "--store",
                          str(dumped["store"]), "--run", "dbg2"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "skipped fr_trace_20260101_000000.txt: torch.distributed.debug's fr_trace dump, not read" in res.stderr


def test_parse_stacks_ranks_that_did_not_answer_and_threads():
    text = ("PARTIAL DATA: 1/2 workers responded\n  Rank 1: timed out\n\n"
            "=== Rank 0: http://h:1/handler/dump_traceback? ===\n"
            "Current thread 0x01 (most recent call first):\n  <no Python frame>\n\n"
            "Thread 0x02 (most recent call first):\n"
            '  File "/usr/lib/python3.11/threading.py", line 9 in _bootstrap\n\n'
            "Thread 0x03 (most recent call first):\n"
            '  File "/job/a.py", line 7 in step\n  File "/job/a.py", line 20 in <module>\n'
            "=== Rank 1: http://h:2/handler/dump_traceback? ===\nError: 500\n")
    ranks, failed = parse_stacks(text)
    assert failed == {1: "Error: 500"} and list(ranks) == [0]
    main = [th for th in ranks[0]["threads"] if th["main"]]
    assert [th["name"] for th in main] == ["0x03"] and [f[:3] for f in main[0]["frames"]] == \
        [["/job/a.py", 20, "<module>"], ["/job/a.py", 7, "step"]]


def test_a_dump_without_a_stack_never_fails_the_other_files(tmp_path):
    """A stacks file cut while the dumper wrote it (empty) beside real Flight Recorder dumps: the
    dumps are imported, the file named as skipped (exit 0); alone, it is bad input (exit 2)."""
    folder = tmp_path / "job"
    folder.mkdir()
    for r in (0, 1):
        shutil.copy(REPO / "tests" / "data" / "flight" / f"fr_dump_{r}", folder / f"fr_dump_{r}")
    (folder / "stacks_20260101_000000.txt").write_text("")

    def cli(path, run):
        return subprocess.run([sys.executable, "-m", "graphdeck.cli", "import", str(path), "--store",
                               str(tmp_path / "s.db"), "--run", run], capture_output=True, text=True, timeout=120, cwd=REPO)

    res = cli(folder, "fr")
    assert res.returncode == 0 and "Flight Recorder: ranks [0, 1]" in res.stdout, res.stdout + res.stderr
    assert "skipped torch.distributed.debug files: no torch.distributed.debug stacks dump with a rank's stack found " \
           "(skipped: stacks_20260101_000000.txt: no rank's stack in it)" in res.stderr
    alone = cli(folder / "stacks_20260101_000000.txt", "empty")
    assert alone.returncode == 2 and "no torch.distributed.debug stacks dump" in alone.stderr, alone.stderr


def test_watch_refuses_a_debug_server_that_is_not_an_http_url_or_never_answers(tmp_path):
    def watch(url, *more):
        return subprocess.run([sys.executable, "-m", "graphdeck.cli", "watch", str(tmp_path / "w.db"), "--run", "x",
                               "--debug-server", url, *more], capture_output=True, text=True, timeout=120, cwd=REPO)

    bad = watch("ftp://host:1")
    assert bad.returncode == 2 and "--debug-server must be an http(s) URL" in bad.stderr and "'ftp://host:1'" in bad.stderr
    gone = watch(f"http://127.0.0.1:{free_port()}", "--wait-s", "1", "--poll-s", "0.2")
    assert gone.returncode == 2, gone.stdout + gone.stderr
    assert "did not answer within 1 s" in gone.stderr and "Connection refused" in gone.stderr, gone.stderr
