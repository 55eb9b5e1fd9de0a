"""Capture never ends a job (issue 36, item 8; NOTE: [Capture never ends a job] in
graphdeck.capture.agent): a store that cannot be opened at start-up, or that becomes unusable
while the job runs, costs the capture (one warning naming the store) — never training's exit
status or a traceback after training finished.

Real parts: a training script in a fresh interpreter, torch.distributed up (gloo, world size 1),
torch.compile through the agent's backend (aot_eager), a stored profile, ``agent.close()``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

JOB = r"""
import os, shutil, sys, tempfile, torch, torch.distributed as dist
from graphdeck.capture.agent import Agent

store, mode = sys.argv[1], sys.argv[2]
if mode != "gone":
    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
agent = Agent(store=store, run="faults")
model = agent.watch(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)))
if mode == "gone":  # the store's folder disappears before the first write (a cleaned tmp dir, a lost volume)
    shutil.rmtree(os.path.dirname(store))
if mode == "full":  # another writer fills the store up to its quota (GRAPHDECK_STORE_MAX_BYTES): a full disk
    import sqlite3
    con = sqlite3.connect(store)
    page = con.execute("PRAGMA page_size").fetchone()[0]
    con.execute(f"PRAGMA max_page_count = {int(os.environ['GRAPHDECK_STORE_MAX_BYTES']) // page}")
    con.execute("CREATE TABLE filler (b BLOB)")
    try:
        while True:
            con.execute("INSERT INTO filler VALUES (zeroblob(16384))")
            con.commit()
    except sqlite3.OperationalError:
        pass
    con.close()
compiled = torch.compile(model, backend=agent.backend("aot_eager"))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with agent.profile(wait_steps=0, warmup_steps=0, active_steps=1) as prof:
    for step in range(3):
        compiled(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        prof.step()
agent.close()
if dist.is_initialized():
    dist.destroy_process_group()
print("TRAINING DONE")
"""


def run_job(store: str, mode: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1", "GRAPHDECK_STORE_MAX_BYTES": str(4 << 20)}
    return subprocess.run([sys.executable, "-c", JOB, store, mode], capture_output=True, text=True, timeout=300,
                          env=env)


def assert_job_went_on(proc: subprocess.CompletedProcess, store: str) -> None:
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "TRAINING DONE" in proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert f"graphdeck: capture is off for this process: cannot open store {store}" in proc.stderr, proc.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("what", ["a folder", "no such folder"])
def test_a_store_that_cannot_be_opened_at_start_up(tmp_path, what):
    store = str(tmp_path) if what == "a folder" else str(tmp_path / "missing" / "s.db")
    assert_job_went_on(run_job(store), store)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full", "gone"])
def test_a_store_that_becomes_unusable_mid_run(tmp_path, mode):
    """``full``: the store opened and took the parameters (watch() under torch.distributed), then
    filled up: the compile records and the profile's trace (written inside ``prof.step()``) are
    lost with warnings. ``gone``: its folder went away before the first write, so the store is
    first opened in ``close()``. Either way the job exits 0."""
    folder = tmp_path / "vol"
    folder.mkdir()
    store = str(folder / "s.db")
    proc = run_job(store, mode)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "TRAINING DONE" in proc.stdout and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    lost = "StoreFullError" if mode == "full" else "capture is off for this process"
    assert "graphdeck:" in proc.stderr and lost in proc.stderr, proc.stderr[-4000:]
