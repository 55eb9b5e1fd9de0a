"""Issue 40 item 4: activation checkpointing's recomputations named at the backward peak.

One real CPU job (``aot_eager``), two runs: two checkpointed blocks traversed twice in ONE compiled
graph ("one"), and the same model with a graph break between the traversals ("break"). The memory
view must say which live tensors at the backward peak are recomputations of which checkpointed
regions, and suggest the break only where one module is recomputed for several traversals in one
graph (NOTE: [Recomputation at the peak])."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.memory.core import graph_memory, step_memory
from graphdeck.store.db import open_engine
from graphdeck.store.schema import Graph, Run
from tests.conftest import LiveServer, run_python

JOB = r"""
import sys, torch
from torch.utils.checkpoint import checkpoint
from graphdeck.capture import Agent

class Block(torch.nn.Module):
    def __init__(s):
        super().__init__(); s.a = torch.nn.Linear(256, 1024); s.b = torch.nn.Linear(1024, 256)
    def forward(s, x):
        return s.b(torch.relu(s.a(x)))

class Twice(torch.nn.Module):
    def __init__(s, brk):
        super().__init__(); s.blocks = torch.nn.ModuleList([Block() for _ in range(2)]); s.brk = brk
    def half(s, x):
        for blk in s.blocks:
            x = checkpoint(blk, x, use_reentrant=False)
        return x
    def forward(s, x):
        x = s.half(x)
        if s.brk:
            torch._dynamo.graph_break()
        return s.half(x)

for run in ("one", "break"):
    torch._dynamo.reset()
    torch.manual_seed(0)
    agent = Agent(store=sys.argv[1], run=run)
    model = agent.watch(Twice(run == "break"))
    torch.compile(model, backend=agent.backend("aot_eager"))(torch.randn(256, 256)).sum().backward()
    agent.close()
"""


@pytest.fixture(scope="module")
def ac_store(tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("recompute") / "ac.db"
    run_python(JOB, str(store))
    return store


def _backwards(s: Session, run: str) -> list[int]:
    return list(s.scalars(select(Graph.id).join(Run, Graph.run_id == Run.id)
                          .where(Run.name == run, Graph.kind == "aot_backward").order_by(Graph.id)))


def test_recomputation_at_the_backward_peak_is_named_and_the_break_suggested(ac_store, browser):
    with Session(open_engine(ac_store, read_only=True)) as s:
        (one,) = _backwards(s, "one")
        broken = _backwards(s, "break")
        assert len(broken) == 2
        curve = graph_memory(s, one)
        rec = curve.recomputation
        # The peak holds a recomputed tensor of a checkpointed block that this graph recomputes twice.
        assert rec and rec["bytes"] > 0 and rec["regions"], rec
        top = rec["regions"][0]
        assert top["module"] in ("blocks.0", "blocks.1") and top["traversals"] == 2 and top["tensors"], rec
        assert top["ac_graph_id"] is not None
        assert rec["repeated"] and "graph break" in rec["advice"] and top["module"] in rec["advice"]
        # where to put the break: between unrolled traversals, not inside the loop (Dynamo then skips
        # the whole frame: no graph at all; issue 40 item 4, newcomer report)
        assert "unrolled" in rec["advice"] and "Not inside a loop" in rec["advice"], rec["advice"]
        # Each live tensor named there really is live at the peak, and its bytes are counted once.
        live = {t.name: t for t in curve.tensors if t.birth_idx <= curve.peak_index <= t.death_idx}
        assert sum(live[n].size_bytes for r in rec["regions"] for n in r["tensors"]) == rec["bytes"]
        # The step view (forward then backward) tells the same.
        fw = s.scalar(select(Graph.id).where(Graph.run_id == s.get(Graph, one).run_id, Graph.kind == "aot_forward"))
        assert step_memory(s, fw, one).recomputation["advice"] == rec["advice"]
        # With the break each backward recomputes each block once: recomputation may still be at
        # the peak, but no break is suggested, and each graph's peak is below the one graph's.
        for b in broken:
            other = graph_memory(s, b)
            assert other.peak_bytes < curve.peak_bytes
            assert other.recomputation is None or other.recomputation["advice"] is None
            assert all(r["traversals"] == 1 for r in (other.recomputation or {"regions": []})["regions"])
        one_gid = one
    # The same fact on the CLI and in the API.
    out = subprocess.run([sys.executable, "-m", "graphdeck.cli", "memory", "one", str(one_gid), "--store",
                          str(ac_store)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "recomputed at the peak" in out.stdout and f"{top['module']} (checkpointed region" in out.stdout
    assert "advice:" in out.stdout and "graph break" in out.stdout
    from fastapi.testclient import TestClient

    from graphdeck.server.app import create_app
    from graphdeck.server.settings import Settings

    with TestClient(create_app(Settings(store=str(ac_store)))) as api:
        body = api.get(f"/api/graphs/{one_gid}/memory?scope=graph").json()
        assert body["recomputation"] == rec
    # ... and on the memory page (its default scope: the step).
    with LiveServer(ac_store) as srv:
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(f"{srv.url}/#/graphs/{one_gid}/memory")
        page.wait_for_selector("[data-testid=memory-recomputed]")
        box = page.get_by_test_id("memory-recomputed").inner_text()
        assert top["module"] in box and "Recomputed at the peak" in box, box
        assert "graph break" in page.get_by_test_id("memory-recompute-advice").inner_text()
        page.close()
