"""The AOT graphs taken from the inner backend's own compile (NOTE: [Graphs from the inner
compile] in capture/aot.py) are the shadow trace's graphs, and a backend whose compilers are not
known still gets the shadow trace. aot_eager on a small MLP: seconds."""

from __future__ import annotations

import json

import torch
import torch.nn as nn
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.capture import Agent
from graphdeck.capture.aot import Handover, recording_backend, shadow_trace
from graphdeck.capture.fxrecord import record_graph
from graphdeck.store.db import open_engine
from graphdeck.store.schema import Graph


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def _sig(g):
    rec = record_graph(g)
    return len(rec.nodes), rec.structural_hash


def test_inner_compile_hands_over_the_shadow_traces_graphs():
    seen = {}

    def backend(gm, example_inputs, **kwargs):
        seen["shadow"] = shadow_trace(gm, example_inputs, inner="aot_eager")
        h = seen["handover"] = Handover()
        compiled = recording_backend("aot_eager", torch._dynamo.lookup_backend("aot_eager"), h)(gm, example_inputs)
        seen["at_compile"] = (h.graphs.forward, h.graphs.backward)
        h.graphs.backward = None  # what the backward compiler hands over at the first backward
        h._seen.discard("backward")
        h.when_backward(lambda g: seen.setdefault("lazy", g))
        return compiled

    torch._dynamo.reset()
    x = torch.randn(4, 8)
    torch.compile(_mlp(), backend=backend)(x).sum().backward()
    torch._dynamo.reset()
    fw, bw = seen["at_compile"]
    assert fw is not None and bw is not None, "forward and the partitioner's backward arrive with the compile"
    assert _sig(fw) == _sig(seen["shadow"].forward)
    assert _sig(bw) == _sig(seen["shadow"].backward) == _sig(seen["lazy"]), \
        "the partitioner's backward is the one the backward compiler gets, and the shadow's"


def test_agent_records_inner_graphs_and_shadow_for_unknown_backends(tmp_path):
    from torch._dynamo.backends.debugging import aot_eager

    for name, inner, source in (("inner", "aot_eager", "inner"), ("custom", aot_eager, "shadow")):
        torch._dynamo.reset()
        store = tmp_path / f"{name}.db"
        agent = Agent(store=store, run=name)
        model = agent.watch(_mlp())
        torch.compile(model, backend=agent.backend(inner))(torch.randn(4, 8)).sum().backward()
        agent.close()
        torch._dynamo.reset()
        with Session(open_engine(store, read_only=True)) as s:
            rows = s.execute(select(Graph.kind, Graph.meta_json, Graph.num_nodes, Graph.structural_hash)
                             .order_by(Graph.ordinal)).all()
        assert [r.kind for r in rows] == ["dynamo", "aot_forward", "aot_backward"], rows
        assert json.loads(rows[0].meta_json)["aot_source"] == source
        if name == "inner":
            first = [r[2:] for r in rows]
        else:
            assert [r[2:] for r in rows] == first, "the shadow trace and the inner compile record the same graphs"


def test_backward_handed_over_at_the_first_backward_is_written_then(tmp_path, monkeypatch):
    """Without the partitioner's backward, the backward compiler's (called at the first backward)
    is written when it arrives, with its gradient bindings."""
    import graphdeck.capture.agent as agent_mod
    from graphdeck.store.schema import GraphIO

    class NoPartition(Handover):
        partitioned = property(lambda self: None, lambda self, value: None)

    monkeypatch.setattr(agent_mod, "Handover", NoPartition)
    torch._dynamo.reset()
    store = tmp_path / "late.db"
    agent = Agent(store=store, run="late")
    model = agent.watch(_mlp())
    out = torch.compile(model, backend=agent.backend("aot_eager"))(torch.randn(4, 8)).sum()
    with Session(open_engine(store, read_only=True)) as s:
        assert [k for (k,) in s.execute(select(Graph.kind).order_by(Graph.ordinal))] == ["dynamo", "aot_forward"]
    out.backward()
    agent.close()
    torch._dynamo.reset()
    with Session(open_engine(store, read_only=True)) as s:
        bw = s.scalar(select(Graph).where(Graph.kind == "aot_backward"))
        grads = {io.param_fqn for io in s.scalars(select(GraphIO).where(GraphIO.graph_id == bw.id,
                                                                         GraphIO.direction == "grad"))}
    assert {"0.weight", "2.weight"} <= grads, grads
