"""One run per launch (NOTE: [One run per launch] in capture/launch.py): every rank of one launch
joins one run; another launch reusing the run name gets ``NAME-2`` and a notice, never a silent
merge; ``append`` adds to the named run. Real ranks (gloo), a real SQLite store."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import Ranks, wait_all

JOB = Path(__file__).with_name("run_name_job.py")
REPO = Path(__file__).resolve().parents[1]


def _runs(store) -> dict[str, list[tuple[int, int]]]:
    """run name → [(rank, pid)] of the ranks that registered in it."""
    con = sqlite3.connect(store)
    out: dict[str, list] = {}
    for name, rank, pid in con.execute("SELECT r.name, k.rank, k.pid FROM runs r LEFT JOIN ranks k "
                                       "ON k.run_id = r.id ORDER BY r.name, k.rank"):
        out.setdefault(name, []).append((rank, pid))
    return out


def _alone(store, run, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(JOB), str(store), run], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env}, cwd=REPO)


@pytest.mark.slow
def test_two_launches_with_one_name_stay_apart(tmp_path):
    """Two 2-rank launches reuse run name ``job`` at the same time: one by torchrun's run id
    (``TORCHELASTIC_RUN_ID``), one without it (torchrun's static rendezvous says ``none``; the
    ranks agree through their c10d store). Each launch's two ranks share one run; the runs are
    ``job`` and ``job-2``; rank 0 of the second says so. A third launch with append joins ``job``."""
    store = tmp_path / "s.db"
    elastic = Ranks([JOB, store, "job"], 2)
    static = Ranks([JOB, store, "job"], 2, env={**os.environ, "TORCHELASTIC_RUN_ID": "none"})
    done = wait_all({"elastic": elastic, "static": static}, timeout=300)
    for name, proc in done.items():
        assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
    runs = _runs(store)
    assert sorted(runs) == ["job", "job-2"], runs
    assert [r for r, _ in runs["job"]] == [0, 1] and [r for r, _ in runs["job-2"]] == [0, 1], runs
    pids = {name: {int(ln.split()[1]): ln.split()[3] for ln in proc.stdout.splitlines() if " wrote " in ln}
            for name, proc in done.items()}
    assert {tuple(sorted(set(p.values()))) for p in pids.values()} == {("job",), ("job-2",)}, pids
    second = next(name for name, p in pids.items() if p[0] == "job-2")
    notice = [ln for ln in done[second].stderr.splitlines() if ln.startswith("graphdeck: run 'job'")]
    assert len(notice) == 1, done[second].stderr[-3000:]  # rank 0 only
    assert "this launch records as run 'job-2' so the two jobs stay apart" in notice[0]
    assert "graphdeck: run 'job'" not in done["elastic" if second == "static" else "static"].stderr
    # append: a resumed job adds to the named run on purpose
    again = Ranks([JOB, store, "job"], 2, env={**os.environ, "GRAPHDECK_RUN_APPEND": "1"}).wait(300)
    assert again.returncode == 0 and again.stdout.count("wrote job\n") == 2, again.stdout + again.stderr[-2000:]
    assert "graphdeck: run" not in again.stderr
    assert sorted(_runs(store)) == ["job", "job-2"]


def test_one_process_joins_its_run_and_another_process_does_not(tmp_path):
    """A second Agent in the same process (after the first closed) joins the run; a second process
    with the same run name is another launch: ``solo-2``, with the notice."""
    store = tmp_path / "s.db"
    code = ("import sys; sys.path.insert(0, '.'); import torch; from graphdeck.capture import Agent\n"
            f"a = Agent(store={str(store)!r}, run='solo'); a.watch(torch.nn.Linear(2, 2)); a.writer; a.close()\n"
            f"b = Agent(store={str(store)!r}, run='solo'); assert b is not a; b.watch(torch.nn.Linear(3, 3)); b.writer\n"
            "print('wrote', a.run, b.run); b.close()\n")
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert first.returncode == 0 and "wrote solo solo" in first.stdout, first.stderr[-3000:]
    assert "graphdeck: run" not in first.stderr
    second = _alone(store, "solo")
    assert second.returncode == 0 and "rank 0 wrote solo-2" in second.stdout, second.stderr[-3000:]
    assert "graphdeck: run 'solo' already exists in this store and is another launch's (created " in second.stderr
    third = _alone(store, "solo", GRAPHDECK_RUN_APPEND="1")
    assert "rank 0 wrote solo" in third.stdout and "graphdeck: run" not in third.stderr, third.stderr[-3000:]
    assert sorted(_runs(store)) == ["solo", "solo-2"]


@pytest.mark.slow
def test_graphdeck_run_is_one_launch_whatever_it_starts(tmp_path):
    """Every process one ``graphdeck run`` starts joins its run (two processes, one after the
    other); a second ``graphdeck run --run same`` records as ``same-2``; ``--append`` joins ``same``."""
    store = tmp_path / "s.db"
    cmd = [sys.executable, "-m", "graphdeck.cli", "run", "--store", str(store), "--run", "same"]
    twice = ["--", "bash", "-c", f'"{sys.executable}" {JOB} {store} same && "{sys.executable}" {JOB} {store} same']
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("GRAPHDECK_LAUNCH", None)
    out = subprocess.run(cmd + twice, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert out.returncode == 0 and out.stdout.count("rank 0 wrote same\n") == 2, out.stdout + out.stderr[-3000:]
    out = subprocess.run(cmd + twice, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert out.stdout.count("rank 0 wrote same-2\n") == 2, out.stdout + out.stderr[-3000:]
    assert out.stderr.count("graphdeck: run 'same' already exists") == 2  # each process's rank 0
    out = subprocess.run(cmd[:-2] + ["--run", "same", "--append", "--", sys.executable, str(JOB), str(store), "same"],
                         capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert "rank 0 wrote same\n" in out.stdout and "graphdeck: run" not in out.stderr, out.stderr[-3000:]
    assert sorted(_runs(store)) == ["same", "same-2"]
