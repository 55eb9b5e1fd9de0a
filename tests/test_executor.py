"""The bundled executor on the captured 1-layer GPT-2 (conftest ``captured_store``): rebuilding its
Dynamo, AOT forward and AOT backward graphs, synthetic inputs, profiled runs whose trace maps onto
nodes by name, refusals that name the node, the partitioner, and the executor routes over HTTP."""

from __future__ import annotations

import json
import sqlite3

import httpx
import pytest
import torch
from sqlalchemy import select, text
from sqlalchemy.orm import Session

from graphdeck.errors import BadInputError, UsageError
from graphdeck.replay.executor import execute_graph, instrument, load_stored_graph, rebuild
from graphdeck.replay.partition import _layer_key, partition, plan_for_graph
from graphdeck.replay.synth import integer_bound, synth_inputs
from graphdeck.store.db import open_engine
from graphdeck.store.schema import Graph, Trace
from tests.conftest import LiveServer


@pytest.fixture(scope="module")
def store(captured_store, tmp_path_factory):
    """A private copy: these tests write executor traces into it."""
    path = tmp_path_factory.mktemp("executor") / "tiny.db"
    copy_store(captured_store, path)
    return path


def copy_store(src, dst) -> None:
    """Copy a store through SQLite's backup API (a WAL store's recent pages live in its -wal file)."""
    with sqlite3.connect(src) as a, sqlite3.connect(dst) as b:
        a.backup(b)


def graph_ids(path) -> dict[str, int]:
    with Session(open_engine(path)) as s:
        return {kind: gid for gid, kind in s.execute(select(Graph.id, Graph.kind))}


def flat(out):
    return list(out) if isinstance(out, (list, tuple)) else [out]


def same(a, b) -> bool:
    return len(flat(a)) == len(flat(b)) and all(
        (x is None and y is None) or torch.equal(x, y) for x, y in zip(flat(a), flat(b)))


@pytest.mark.parametrize("kind", ["dynamo", "aot_forward", "aot_backward"])
def test_rebuilt_graph_runs_and_instrumenting_keeps_outputs(store, kind):
    gid = graph_ids(store)[kind]
    with Session(open_engine(store)) as s:
        stored = load_stored_graph(s, gid)
    rebuilt = rebuild(stored)
    inputs = synth_inputs(stored, seed=3)
    assert len(inputs) == len(rebuilt.placeholders), "one synthetic tensor per placeholder"
    for t, p in zip(inputs, rebuilt.placeholders):
        assert list(t.shape) == p.shape and str(t.dtype) == "torch." + p.dtype, f"{p.name}: recorded meta kept"
    with torch.no_grad():
        plain = rebuilt.gm(*inputs)
        timed = instrument(rebuilt.gm, gid)(*inputs)
    assert same(plain, timed), "record_function ranges must not change any output"
    assert not any(torch.isnan(o).any() for o in flat(plain) if isinstance(o, torch.Tensor) and o.is_floating_point()), \
        "synthetic inputs give no NaN (a causal mask's -inf is expected)"


def test_integer_inputs_bounded_by_their_indexing_use(store):
    ids = graph_ids(store)
    with Session(open_engine(store)) as s:
        fw, bw = load_stored_graph(s, ids["aot_forward"]), load_stored_graph(s, ids["aot_backward"])
    assert integer_bound(fw, "primals_1") == 256, "token ids feed embedding(wte [256, 32]) and nll_loss over 256"
    assert integer_bound(bw, "unsqueeze") == 32, "positions feed embedding_dense_backward(num_weights=32)"
    ids_tensor = synth_inputs(fw)[0]
    assert ids_tensor.dtype == torch.int64 and 0 <= int(ids_tensor.min()) and int(ids_tensor.max()) < 256


def test_execute_graph_matches_direct_call_and_maps_trace_onto_nodes(store):
    engine = open_engine(store)
    gid = graph_ids(store)["aot_forward"]
    res = execute_graph(engine, gid, iters=2, seed=5)
    with Session(engine) as s:
        stored = load_stored_graph(s, gid)
        trace = s.get(Trace, res.trace_id)
    direct = rebuild(stored, seed=5).gm(*synth_inputs(stored, seed=5))
    assert same(res.outputs, direct), "one worker: executor outputs == a direct call of the rebuilt GraphModule"
    assert trace.name == f"executor graph {gid}" and trace.rank == stored.rank and trace.status == "ok"
    compute = {n.name for n in stored.nodes if n.op.startswith("call_")}
    assert set(res.node_cpu_ns) == compute, "every compute node has its own range in the trace, no other name"
    again = execute_graph(engine, gid, iters=2, seed=5)
    assert again.recorded_trace_id == res.trace_id, "the earlier executor trace is the recorded one to compare"
    assert set(again.ratio) == compute and all(r > 0 for r in again.ratio.values())


@pytest.mark.parametrize("sql, message", [
    ("UPDATE strings SET value = '__main__.<lambda>' WHERE id = (SELECT target_id FROM nodes WHERE graph_id = {g} "
     "AND name = 'addmm')", "node 'addmm': target '__main__.<lambda>' is an opaque Python callable"),
    ("INSERT INTO strings (value) VALUES ('mylib.fused_thing.default'); UPDATE nodes SET target_id = "
     "(SELECT id FROM strings WHERE value = 'mylib.fused_thing.default') WHERE graph_id = {g} AND name = 'tanh'",
     "node 'tanh': op 'mylib.fused_thing.default' is not registered"),
    ("UPDATE nodes SET op = 'call_module' WHERE graph_id = {g} AND name = 'mm'", "node 'mm': call_module"),
    ("UPDATE nodes SET args_json = '{{\"args\": [{{\"node\": \"slice_1\"}}], \"kwargs\": {{\"memory_format\": "
     "{{\"repr\": \"<object at 0x1>\"}}}}}}' WHERE graph_id = {g} AND name = 'clone_3'",
     "node 'clone_3': argument '<object at 0x1>'"),
])
def test_what_cannot_be_rebuilt_is_refused_naming_the_node(store, tmp_path, sql, message):
    gid = graph_ids(store)["aot_forward"]
    path = tmp_path / "broken.db"
    copy_store(store, path)
    engine = open_engine(path)
    with engine.begin() as conn:
        for stmt in sql.format(g=gid).split("; "):
            conn.execute(text(stmt))
    with Session(engine) as s:
        stored = load_stored_graph(s, gid)
    with pytest.raises(BadInputError) as err:
        rebuild(stored)
    assert message in str(err.value)


def _check_plan(stored, plan, k):
    order = [n.name for n in stored.nodes]
    stages = [plan.assignment[n] for n in order if stored.by_name()[n].op.startswith("call_")]
    assert stages == sorted(stages), "stages are contiguous runs of node order"
    assert set(stages) == set(range(k)), f"{k} non-empty stages"
    by = stored.by_name()
    for n in stored.nodes:
        if n.target == "_operator.getitem":
            assert plan.assignment[n.name] == plan.assignment[n.inputs()[0]], "a tuple never crosses stages"
    for st in plan.stages:
        for b in st.send:
            assert b.src == st.index < b.dst and by[b.name].op.startswith("call_")
    assert plan.stages[-1].send == [] and plan.assignment["output"] == k - 1


def test_partition_strategies(store):
    engine = open_engine(store)
    gid = graph_ids(store)["aot_forward"]
    with Session(engine) as s:
        stored = load_stored_graph(s, gid)
        for strategy in ("layerwise", "memory_aware", "auto"):  # auto: executor traces exist by now
            for k in (2, 3):
                plan = plan_for_graph(s, gid, k, strategy)
                _check_plan(stored, plan, k)
                assert plan.time_balance is not None and plan.time_balance >= 1.0
        layer = plan_for_graph(s, gid, 2, "layerwise")
        compute = [n for n in stored.nodes if n.op.startswith("call_") and n.target != "_operator.getitem"]
        i = next(i for i, n in enumerate(compute) if layer.assignment[n.name] == 1)
        assert _layer_key(compute[i].module_path) != _layer_key(compute[i - 1].module_path), \
            "layerwise cuts only where the layer (module path up to its index) changes"
    with pytest.raises(UsageError, match="needs measured node times"):
        partition(stored, 2, "auto")
    with pytest.raises(UsageError, match="unknown strategy"):
        partition(stored, 2, "random")


def test_executor_routes(store):
    gid = graph_ids(store)["aot_forward"]
    with LiveServer(store) as srv:
        r = httpx.get(f"{srv.url}/api/graphs/{gid}/stages", params={"workers": 2, "strategy": "memory_aware"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["overlay"]["kind"] == "stage" and body["overlay"]["categorical"] is True
        assert len(body["overlay"]["values"]) == len(body["stages"][0]["nodes"]) + len(body["stages"][1]["nodes"])
        assert body["boundaries"] and all(b["src"] == 0 and b["dst"] == 1 for b in body["boundaries"])
        bad = httpx.get(f"{srv.url}/api/graphs/{gid}/stages", params={"strategy": "random"})
        assert bad.status_code == 400 and bad.json()["ok"] is False and "random" in bad.json()["error"]
        ex = httpx.get(f"{srv.url}/api/graphs/{gid}/executor").json()
        assert [t["name"] for t in ex["traces"]][:2] == [f"executor graph {gid}"] * 2
        assert ex["overlay"]["unit"] == "ns" and ex["overlay"]["values"]
        assert httpx.get(f"{srv.url}/api/graphs/99999/stages").status_code == 404
        # The graph view draws stages as a categorical overlay; its time overlay stays the
        # captured run's own trace (the CPU mapping covers aot_eager), never a replay's: the
        # executor traces are in replay runs (issue 36 item 1, NOTE: [Replay runs]).
        stage = httpx.get(f"{srv.url}/api/graphs/{gid}/overlays/stage").json()
        assert set(stage["values"].values()) == {"stage 0", "stage 1"}
        time = httpx.get(f"{srv.url}/api/graphs/{gid}/overlays/time").json()
        assert time["values"] and time["note"] is None, time
        svg = httpx.get(f"{srv.url}/api/graphs/{gid}/svg", params={"overlay": "stage", "max_depth": 9})
        assert svg.status_code == 200 and "<svg" in svg.text[:2000]
    json.dumps(body)


def test_device_ports_match_the_cpu_kernels(store):
    """A CPU-captured graph holds CPU-only SDPA kernels; their portable stand-ins (used off the CPU)
    give the same outputs and layouts, and one range per stored node."""
    ids = graph_ids(store)
    with Session(open_engine(store)) as s:
        for kind in ("aot_forward", "aot_backward"):
            stored = load_stored_graph(s, ids[kind])
            inputs = synth_inputs(stored, seed=1)
            native = rebuild(stored).gm(*inputs)
            ported = rebuild(stored, ports=True)
            assert any(n.name.endswith("_port") for n in ported.gm.graph.nodes), "the SDPA node was swapped"
            out = ported.gm(*inputs)
            for a, b in zip(flat(native), flat(out)):
                assert (a is None and b is None) or torch.allclose(a, b, atol=1e-5, rtol=1e-4), kind
            timed = instrument(ported.gm, stored.id)
            names = [n.args[0] for n in timed.graph.nodes if n.op == "call_function" and n.args
                     and isinstance(n.args[0], str) and n.args[0].startswith("graphdeck.node/")]
            assert sorted(names) == sorted(f"graphdeck.node/{stored.id}/{n.name}" for n in stored.nodes
                                           if n.op.startswith("call_"))
