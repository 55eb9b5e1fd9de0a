"""Partial Flight Recorder evidence (issue 38, item 4; NOTE: [One-sided collectives] in
analysis/ranks/partial.py).

One real torchrun job (``tests/programs/fsdp2_full_tensor.py``, 2 gloo ranks, FSDP2, compiled):
at the end of step 0 rank 0 alone calls ``full_tensor()`` on an optimizer state while rank 1 is in
step 1's FSDP all-gather; gloo aborts rank 1, which writes no dump. From rank 0's dump alone the
verdict is FAIL, naming the gather, its stack and the branch. The rank-condition reader itself is
checked on small sources (fast).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

PROGRAM = REPO / "tests" / "programs" / "fsdp2_full_tensor.py"
LINES = PROGRAM.read_text().splitlines()
BRANCH = next(i for i, t in enumerate(LINES, 1) if "RANK0_ONLY" in t)
CALL = next(i for i, t in enumerate(LINES, 1) if "# FULL_TENSOR" in t)


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict:
    import sqlite3

    store = tmp_path_factory.mktemp("full_tensor") / "ft.db"
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1")
    env.pop("TORCH_FR_BUFFER_SIZE", None)  # the agent turns the recorder on
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(PROGRAM), str(store)], capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    with sqlite3.connect(store) as db:  # the case as reported: rank 1 (aborted by gloo) left no dump
        dumps = dict(db.execute("SELECT rank, count(*) FROM compile_events WHERE name = 'flight_recorder' "
                                "GROUP BY rank").fetchall())
        db.execute("DELETE FROM compile_events WHERE name = 'flight_recorder' AND rank = 1")
    ranks, js = _graphdeck("check-ranks", store), _graphdeck("check-ranks", store, "--json")
    return {"store": store, "proc": proc, "dumps": dumps, "ranks": ranks, "json": js}


def _graphdeck(command: str, store: Path, *more: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("graphdeck")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "graphdeck.cli"]
    return subprocess.run([*cmd, command, str(store), "--run", "full_tensor", *more], capture_output=True, text=True,
                          timeout=300, cwd=REPO)


@pytest.mark.slow
def test_rank_0_only_full_tensor_fails_from_rank_0s_dump_alone(job):
    proc, out = job["proc"], job["ranks"].stdout
    assert proc.returncode != 0, "the all-gathers differ in size: the job must fail"
    assert job["dumps"].get(0), f"rank 0 dumped into the store: {job['dumps']} {proc.stdout[-2000:]}"
    assert job["ranks"].returncode == 1, out + job["ranks"].stderr
    assert out.strip().splitlines()[-1].startswith("FAIL"), out
    assert "INCOMPLETE group" not in out and "predicted: no hang" not in out, out
    (hang,) = [ln for ln in out.splitlines() if ln.startswith("HANG")]
    # the gather, by op and sizes, issued only by rank 0, by full_tensor, and the branch that decides it
    assert "gloo:all_gather [[32, 8]] issued only by ranks [0] (full_tensor): ranks [1] skip it" in hang, hang
    assert f"fsdp2_full_tensor.py:{BRANCH} in main: `if rank == 0 and step == 0:`" in hang, hang
    assert "told from the dumps of ranks [0] alone; no dump from ranks [1]" in hang
    (stack,) = [ln for ln in out.splitlines() if "why: stack:" in ln]
    assert f"fsdp2_full_tensor.py:{CALL} in main -> " in stack and "_api.py" in stack and "in full_tensor" in stack
    assert "in all_gather_single" in stack, stack
    assert "INCOMPLETE: rank 1: no Flight Recorder dump" in out, "the missing dump is still said"
    data = json.loads(job["json"].stdout)
    assert data["verdict"] == "FAIL"
    (m,) = data["flight"]["mismatches"]
    assert (m["kind"], m["reached"], m["not_reached"], m["no_dump"]) == ("one-sided", [0], [1], [1])
    assert m["branch"].endswith(f"fsdp2_full_tensor.py:{BRANCH} in main: `if rank == 0 and step == 0:`")
    assert data["flight"]["groups_incomplete"] == {}


@pytest.mark.slow
def test_every_surface_says_fail_and_the_map_marks_rank_1(job):
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from graphdeck.server.routes.parallel_map import parallel_map
    from graphdeck.store.db import open_engine
    from graphdeck.store.schema import Run
    from tests.verdict_surfaces import disagreements

    with Session(open_engine(job["store"], read_only=True)) as s:
        run = s.scalars(select(Run).where(Run.name == "full_tensor")).one()
        hang = next(c for c in parallel_map(s, run, checks=["hang"])["checks"] if c["key"] == "hang")
    assert hang["verdict"] == "FAIL", hang
    assert not disagreements(job["store"], ["full_tensor"])


def _stack(src: Path, line: int) -> list[str]:
    lib = "/usr/lib/python3/site-packages/torch/distributed/tensor/_api.py:774 in full_tensor"
    return [lib, f"{src}:{line} in f", f"{src}:40 in <module>"]


@pytest.mark.parametrize("code, line, skip", [
    ("def f(rank, step, t):\n    if rank == 0 and step == 0:\n        t.full_tensor()\n", 3, {1, 2, 3}),
    ("def f(rank, t):\n    if dist.get_rank() != 0:\n        t.full_tensor()\n", 3, {0}),
    ("def f(rank, t):\n    if not is_main_process:\n        t.full_tensor()\n", 3, {0}),
    ("def f(rank, t):\n    if rank in (0, 1):\n        t.full_tensor()\n", 3, {2, 3}),
    ("def f(rank, t):\n    if rank != 0:\n        return\n    t.full_tensor()\n", 4, {1, 2, 3}),
    ("def f(rank, t):\n    for x in t:\n        if rank > 1:\n            continue\n        x.full_tensor()\n", 5, {2, 3}),
    ("def f(rank, t):\n    y = (t.full_tensor()\n         if rank == 0 else None)\n", 2, {1, 2, 3}),
    ("def f(rank, t):\n    if rank == 0:\n        pass\n    else:\n        t.full_tensor()\n", 5, {0}),
    # nothing to claim: the other arm may issue a matching collective; a condition on data; a
    # coordinate (self.rank may be a mesh rank); get_rank of a group
    ("def f(rank, t):\n    if rank == 0:\n        t.full_tensor()\n    else:\n        u.full_tensor()\n", 3, None),
    ("def f(rank, t):\n    if t.numel() > 0:\n        t.full_tensor()\n", 3, None),
    ("def f(self, t):\n    if self.rank == 0:\n        t.full_tensor()\n", 3, None),
    ("def f(g, t):\n    if dist.get_rank(g) == 0:\n        t.full_tensor()\n", 3, None),
    ("def f(rank, t):\n    if rank == 0:\n        log()\n    t.full_tensor()\n", 4, None),
])
def test_rank_conditions_decide_which_ranks_issue_a_collective(tmp_path, code, line, skip):
    from graphdeck.analysis.ranks.partial import skippers

    src = tmp_path / f"prog{abs(hash(code))}.py"
    src.write_text(code)
    got = skippers(_stack(src, line), [0, 1, 2, 3])
    assert (got[1] if got else None) == skip, (code, got)
    if got:
        assert got[0].startswith(f"{src}:") and " in f: `if " in got[0]


MOE = REPO / "tests" / "programs" / "moe_zero_token.py"
MOE_LINES = MOE.read_text().splitlines()


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """The zero-token MoE job (issue 38 item 5): both ranks dump at exit; its rank report."""
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from graphdeck.analysis.ranks.core import rank_report
    from graphdeck.store.db import open_engine
    from graphdeck.store.schema import Run

    store = tmp_path_factory.mktemp("moe") / "moe.db"
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1")
    env.pop("TORCH_FR_BUFFER_SIZE", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(MOE), str(store)], capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    with Session(open_engine(store, read_only=True)) as s:
        return proc, rank_report(s, s.scalar(select(Run).where(Run.name == "moe")))


@pytest.mark.slow
def test_zero_token_rank_why_is_its_branch_not_the_expert_slice(moe):
    proc, rep = moe
    assert "rank 0: timed out" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    (m,) = [x for x in rep.flight.mismatches if x.desc == "dp"]
    assert (m.reached, m.not_reached, m.kind) == ([0], [1], "missing")
    why = m.why[1]
    branch = next(i for i, t in enumerate(MOE_LINES, 1) if "ZERO_TOKEN_BRANCH" in t)
    sliced = next(i for i, t in enumerate(MOE_LINES, 1) if "self.gates[self.lo:" in t)
    # the cause first: rank 1's recompile for its empty batch, the all-reduce its graph lacks, the branch
    assert why[0].startswith("ranks [1] recompiled frame forward") and "expected 4, actual 0" in why[0], why
    assert any("issues no all_reduce where ranks [0]' graph" in w for w in why), why
    assert any(f"moe_zero_token.py:{branch} in forward: `if x.shape[0] > 0:" in w for w in why), why
    # the expert slice: named, as not the cause, last
    assert not any(w.startswith("graph differs") for w in why), why
    assert why[-1].startswith("not the cause: compile 0/0's graphs of ranks [1] and [0] differ only in per-rank "
                              "constants (getitem (_operator.getitem) args[1].start: 0 vs 2"), why
    assert f"moe_zero_token.py:{sliced} in forward" in why[-1]


@pytest.mark.slow
@pytest.mark.browser
def test_ranks_page_shows_what_check_ranks_says(job, browser):
    """The rank-consistency page in Chromium over the real app: the one-sided gather's HANG line,
    rank 1's account and its why lines, the missing dump and the verdict, as check-ranks prints them."""
    from tests.conftest import LiveServer

    text = job["ranks"].stdout.splitlines()
    with LiveServer(job["store"]) as srv:
        page = browser.new_page()
        page.goto(f"{srv.url}/#/runs/full_tensor/ranks")
        page.wait_for_selector("[data-testid=recorded-hang]")
        (hang,) = [ln for ln in text if ln.startswith("HANG ")]
        assert page.get_by_test_id("fr-headline").inner_text() == hang
        assert f"fsdp2_full_tensor.py:{BRANCH} in main: `if rank == 0 and step == 0:`" in hang
        rank1 = page.locator("[data-testid=fr-rank][data-rank='1']")
        (account,) = [ln.strip() for ln in text if ln.strip().startswith("rank 1: ")]
        assert rank1.evaluate("e => e.childNodes[1].textContent + e.childNodes[2].textContent") == \
            f" (skipped it): {account.removeprefix('rank 1: ')}"
        why = [w.inner_text() for w in rank1.get_by_test_id("fr-why").all()]
        assert why == [ln.strip().removeprefix("why: ") for ln in text if ln.strip().startswith("why: ")]
        assert any(w.startswith("stack: ") and f"fsdp2_full_tensor.py:{CALL} in main -> " in w for w in why), why
        missing = [x.inner_text() for x in page.get_by_test_id("missing-evidence").all()]
        assert [f"INCOMPLETE: {x}" for x in missing] == [ln for ln in text if ln.startswith("INCOMPLETE: ")]
        assert text[-1] == "FAIL: ranks diverge"
        assert page.get_by_test_id("rank-verdict").locator("strong").inner_text() == "ranks diverge"
        page.close()
