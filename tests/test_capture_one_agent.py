"""One agent per process and run (issue 39 item 3, NOTE: [One agent per process and run] in
capture/backend.py): a job that makes ``Agent(...)`` (to ``watch`` and ``profile``) and compiles
with ``backend="graphdeck"`` records each compile once, as the ``agent.backend(...)`` job does.
Before, ``backend="graphdeck"`` made a second agent whose log listener stored every compile record
again (the issue's 12 restarts for 8)."""

from __future__ import annotations

import json

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from graphdeck.store.db import open_engine
from graphdeck.store.schema import CompileEvent, Run
from tests.conftest import run_python

JOB = r"""
import json, os, sys
import torch
from graphdeck.capture import Agent
from graphdeck.capture.backend import default_agent

store = sys.argv[1]
os.environ.update(GRAPHDECK_STORE=store, GRAPHDECK_INNER="aot_eager")

def f(x):
    y = x.sin()
    print("break")  # a graph break: two graphs a call
    return y.cos().sum()

def train(backend):
    for n in (4, 5, 6):  # a recompile for the second length (automatic dynamic)
        torch.compile(f, backend=backend)(torch.randn(n, requires_grad=True)).backward()

# the documented Agent path: one agent, its own backend
os.environ["GRAPHDECK_RUN"] = "agent-backend"
agent = Agent(store=store, run="agent-backend")
train(agent.backend("aot_eager"))
agent.close()
torch._dynamo.reset()

# Agent(...) for watch/profile, compiled with the string backend (the issue's 12 vs 8)
os.environ["GRAPHDECK_RUN"] = "string-backend"
mine = Agent(store=store, run="string-backend")
same = {"joined": Agent(store=store, run="string-backend") is mine, "from_env": Agent() is mine}
train("graphdeck")
same["default_agent"] = default_agent() is mine
mine.close()
same["closed_not_joined"] = Agent(store=store, run="string-backend") is not mine
print("SAME", json.dumps(same))
"""


def _records(store, run: str, name: str) -> int:
    with Session(open_engine(store, read_only=True)) as s:
        run_id = s.scalar(select(Run.id).where(Run.name == run))
        return s.scalar(select(func.count()).select_from(CompileEvent).where(
            CompileEvent.run_id == run_id, CompileEvent.name == name))


def test_a_second_agent_joins_the_first(tmp_path):
    store = tmp_path / "s.db"
    out = run_python(JOB, str(store)).stdout
    for name in ("compilation_metrics", "dynamo_graph_break_reason"):  # each compile's records once
        once = _records(store, "agent-backend", name)
        assert once > 0 and _records(store, "string-backend", name) == once, (name, once)
    same = json.loads(next(ln for ln in out.splitlines() if ln.startswith("SAME "))[5:])
    # Agent(...) again joins the live agent of the run; backend="graphdeck" records into it; a
    # closed agent is not joined
    assert same == {"joined": True, "from_env": True, "default_agent": True, "closed_not_joined": True}, same
