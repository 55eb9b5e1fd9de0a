"""TORCH_TRACE import: graphs and bindings that give gradient verdicts, lenient/strict counting,
rank from file name vs envelope, file discovery, provenance links, the CLI and the upload API.

Inputs: ``../shared/data/torch_trace`` (SOURCES.md there says what each log holds); corrupt
variants are made from a real log in ``tmp_path``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from graphdeck.analysis.gradients.core import gradient_report
from graphdeck.errors import BadInputError, UsageError
from graphdeck.store.db import open_engine
from graphdeck.store.fx_text import parse_fx_text
from graphdeck.store.schema import Graph, GraphIO, InternedString, KernelNode, Node, Partition, Rank, Run
from graphdeck.store.torch_trace import import_torch_trace
from tests.conftest import LiveServer, shared_path

GEN = ("data", "torch_trace", "generated_torch2.13_cpu_gloo")
INPUTS = ("data", "torch_trace", "tlparse_tests", "inputs")
CLIENT = {"X-Graphdeck-Client": "1"}  # graphdeck's clients send it: the server refuses writes a web page could send


def _report(engine, name):
    with Session(engine) as s:
        return gradient_report(s, s.scalar(select(Run).where(Run.name == name)))


@pytest.fixture(scope="module")
def gen_store(tmp_path_factory):
    """The four generated 2-rank DDP scenarios, imported strictly (they have no drops)."""
    engine = open_engine(tmp_path_factory.mktemp("gen") / "gen.db")
    results = {sc: import_torch_trace(engine, shared_path(*GEN, sc), run_name=sc, strict=True)
               for sc in ("ddp", "detach", "unused", "graphbreak")}
    return engine, results


def test_detach_verdict(gen_store):
    """detach/: blk2's gradient is cut by ``.detach()`` → NO_GRAD for blk2.weight/bias on both
    ranks (the aot_backward graph returns None for PlainAOTInput idx 1 and 2); the rest OK."""
    engine, _ = gen_store
    rep = _report(engine, "detach")
    bad = sorted((p.rank, p.fqn, p.status) for p in rep.params if p.status != "OK")
    assert bad == [(r, f, "NO_GRAD") for r in (0, 1) for f in ("blk2.bias", "blk2.weight")], bad
    assert rep.summary["OK"] == 16, "8 other parameters x 2 ranks get a gradient"


def test_ddp_and_graphbreak_all_ok(gen_store):
    engine, results = gen_store
    for sc in ("ddp", "graphbreak"):
        rep = _report(engine, sc)
        assert rep.summary["OK"] == 20 and sum(rep.summary.values()) == 20, (sc, rep.summary)
    assert results["ddp"].stats["graphs_ddp_partition"] == 6, "3 DDP buckets per rank"
    assert results["graphbreak"].stats["graphs_ddp_partition"] == 4, "frame 4 split in 2, resume frame unsplit"


def test_unused_params_invisible_in_log(gen_store):
    """unused/: aux is never traced, so the log names only the 8 used parameters (no
    describe_source, no placeholder for aux); all of them get gradients."""
    engine, results = gen_store
    rep = _report(engine, "unused")
    assert rep.summary["OK"] == 16 and sum(rep.summary.values()) == 16, rep.summary
    assert "aux.weight" not in {p.fqn for p in rep.params}


def test_ddp_bindings_and_partitions(gen_store):
    engine, _ = gen_store
    with Session(engine) as s:
        run = s.scalar(select(Run).where(Run.name == "detach"))
        parts = s.scalars(select(Partition).where(Partition.run_id == run.id, Partition.rank == 0)
                          .order_by(Partition.index)).all()
        assert [json.loads(p.params_json) for p in parts] == [
            ["emb.weight", "emb.bias"], ["blk1.weight", "blk1.bias"],
            ["blk2.weight", "blk2.bias", "head.weight", "head.bias", "aux.weight", "aux.bias"]]
        assert parts[0].size_bytes == (512 * 32 + 512) * 4, "bucket bytes from the parameters' shapes"
        bw = s.scalars(select(Graph).where(Graph.run_id == run.id, Graph.rank == 0, Graph.kind == "aot_backward",
                                           Graph.parent_id == parts[2].graph_id)).one()
        grads = s.execute(select(GraphIO.position, GraphIO.param_fqn, GraphIO.has_grad)
                          .where(GraphIO.graph_id == bw.id, GraphIO.direction == "grad")
                          .order_by(GraphIO.position)).all()
        assert [(p, f, g) for p, f, g in grads][:3] == [(0, None, True), (1, "blk2.weight", False),
                                                        (2, "blk2.bias", False)]


def test_graph_break_and_attempt(gen_store):
    """graphbreak/: frame 4 restarts (attempt 1) after the print() break at line 17; its graph
    has compile id 4/0_1 and the break reason; the resume frame is 5/0."""
    engine, _ = gen_store
    with Session(engine) as s:
        run = s.scalar(select(Run).where(Run.name == "graphbreak"))
        dyn = s.execute(select(Graph.compile_id, Graph.break_reason, Graph.frame_name)
                        .where(Graph.run_id == run.id, Graph.rank == 0, Graph.kind == "dynamo")
                        .order_by(Graph.ordinal)).all()
    assert [d.compile_id for d in dyn] == ["4/0_1", "5/0"]
    assert "ddp_trace.py:17" in dyn[0].break_reason
    assert dyn[0].frame_name == "forward (ddp_trace.py:13)", "attempt 1 keeps attempt 0's frame"


def test_fx_text_shapes_and_sources():
    text = '''class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[16, 512][512, 1]cpu", tangents_1: "f32[16, 8][8, 1]cpu"):
        # File: /home/user/job/ddp_trace.py:21 in forward, code: out = s.head(h2)
        permute: "f32[8, 16][1, 8]cpu" = torch.ops.aten.permute.default(tangents_1, [1, 0])
        mm: "f32[8, 512][512, 1]cpu" = torch.ops.aten.mm.default(permute, primals_1);  permute = None
        return (
            mm,  # GradAOTOutput(grad_of=PlainAOTInput(idx=0))
            None,  # GradAOTOutput(grad_of=PlainAOTInput(idx=1))
        )
'''
    g = parse_fx_text(text)
    mm = next(n for n in g.nodes if n.name == "mm")
    assert (mm.shape, mm.dtype, mm.stride, mm.device, mm.size_bytes) == ([8, 512], "float32", [512, 1], "cpu",
                                                                          8 * 512 * 4)
    assert mm.target == "aten.mm.default" and "line 21" in mm.stack_trace
    assert g.outputs == ["mm", None]
    assert g.output_descs[1] == "GradAOTOutput(grad_of=PlainAOTInput(idx=1))"
    assert {(g.nodes[e.src_idx].name, g.nodes[e.dst_idx].name) for e in g.edges} >= {("tangents_1", "permute"),
                                                                                       ("permute", "mm")}


def _corrupt_copy(tmp_path):
    """A copy of detach/'s rank-0 log with: one bad-JSON envelope, one payload changed (md5
    mismatch), one unknown record kind and one line from another rank."""
    src = sorted(shared_path(*GEN, "detach").glob("*rank_0*.log"))[0]
    lines = src.read_text().split("\n")
    out, changed = [], False
    for line in lines:
        if not changed and line.startswith("\t") and "relu" in line:
            line += " "
            changed = True
        out.append(line)
    first = next(i for i, x in enumerate(out) if x.startswith("V") and '"dynamo_start"' in x)
    prefix = out[first].split("] ", 1)[0]
    out.insert(first, prefix + '] {"dynamo_start": {"stack": [}')
    out.insert(first, prefix + '] {"brand_new_kind": {}, "rank": 0}')
    out.insert(first, prefix + '] {"dynamo_start": {"stack": []}, "rank": 1, "frame_id": 9, "frame_compile_id": 0}')
    dst = tmp_path / "dedicated_log_torch_trace_rank_0_x.log"
    dst.write_text("\n".join(out))
    return dst


def test_lenient_counts_and_strict_keeps_nothing(tmp_path):
    log = _corrupt_copy(tmp_path)
    engine = open_engine(tmp_path / "s.db")
    with pytest.raises(BadInputError) as err:
        import_torch_trace(engine, log, run_name="strict", strict=True)
    assert err.value.details["stats"], "the error carries the counters"
    with Session(engine) as s:
        assert s.scalar(select(func.count()).select_from(Run)) == 0, "a failed strict import keeps nothing"
    res = import_torch_trace(engine, log, run_name="lenient")
    st = res.stats
    assert (st["bad_json"], st["md5_mismatch"], st["unknown_kind"], st["other_rank"]) == (1, 1, 1, 1), st
    assert res.dropped == 3 and res.unverified == 1, "an md5 mismatch is kept (unverified), not dropped"
    assert st["graphs"] >= 20, "every good record kept"
    with pytest.raises(UsageError):
        import_torch_trace(engine, log, run_name="lenient")


def test_rank_mismatch_flagged(tmp_path):
    """multi_rank_runtime/: rank_5 and rank_6 files say "rank": 1 in their envelopes."""
    engine = open_engine(tmp_path / "m.db")
    res = import_torch_trace(engine, shared_path(*INPUTS, "multi_rank_runtime"), run_name="mr")
    assert res.ranks == list(range(7))
    flagged = sorted((f["rank"], f["envelope_rank"]) for f in res.files if f["rank_mismatch"])
    assert flagged == [(5, 1), (6, 1)]
    with Session(engine) as s:
        meta = json.loads(s.scalar(select(Rank.meta_json).where(Rank.rank == 5)))
    assert meta["rank_mismatch"] and meta["envelope_rank"] == 1


def test_messy_folder(tmp_path):
    """An empty another.log and an empty non-log file are skipped and listed; ranks 0 and 1 kept."""
    engine = open_engine(tmp_path / "m.db")
    res = import_torch_trace(engine, shared_path(*INPUTS, "multi_rank_messy_input"), run_name="messy", strict=True)
    assert res.ranks == [0, 1]
    assert res.skipped_files == ["another.log: empty", "some_other_file.txt: empty"]


@pytest.mark.parametrize("log,source", [("inductor_provenance_jit_debug_handle_log.txt", "inductor_provenance_v2"),
                                        ("inductor_provenance_aot_log_old.txt", "inductor_provenance_v1")])
def test_provenance_kernel_links(tmp_path, log, source):
    engine = open_engine(tmp_path / "p.db")
    import_torch_trace(engine, shared_path(*INPUTS, log), run_name="p")
    with Session(engine) as s:
        rows = s.execute(select(KernelNode.kernel_name, KernelNode.node_name, KernelNode.pre_grad_node,
                                KernelNode.source, KernelNode.graph_id)).all()
    assert rows and {r.source for r in rows} >= {source}
    assert not any(re.search(r":\d+$", r.kernel_name) for r in rows), "debug handles stripped from kernel names"
    assert not any(r.kernel_name.startswith("extern_kernels.") for r in rows), "extern calls named as the profiler does"
    assert all(r.graph_id is not None for r in rows), "each link names the graph holding the node"
    with Session(engine) as s:
        found = s.scalar(select(func.count()).select_from(KernelNode).join(
            Node, (Node.graph_id == KernelNode.graph_id) & (Node.name == KernelNode.node_name)))
    assert found == len(rows), "every linked node exists in the post-grad graph the code was generated from"


def test_cli_and_upload_share_one_path(tmp_path):
    folder = shared_path(*GEN, "detach")
    store = tmp_path / "c.db"
    proc = subprocess.run([sys.executable, "-m", "graphdeck.cli", "import", str(folder), "--store", str(store),
                           "--run", "cli", "--strict", "--no-progress"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "ranks [0, 1]" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "graphdeck.cli", "import", str(tmp_path), "--store", str(store),
                          "--run", "x"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no TORCH_TRACE log" in bad.stderr
    with LiveServer(store) as srv:
        files = [("files", (p.name, p.read_bytes(), "text/plain")) for p in sorted(folder.glob("*.log"))]
        r = httpx.post(f"{srv.url}/api/runs/up/torch-trace", files=files, headers=CLIENT, timeout=120)
        assert r.status_code == 201, r.text
        body = r.json()
        assert body["ranks"] == [0, 1] and body["dropped"] == 0
        cli_run = httpx.get(f"{srv.url}/api/runs/cli/compile-index").json()
        up_run = httpx.get(f"{srv.url}/api/runs/up/compile-index").json()
        strip = lambda idx: [[(e["compile_id"], e["status"], len(e["graphs"])) for e in v]  # noqa: E731
                             for v in idx["ranks"].values()]
        assert strip(cli_run) == strip(up_run), "CLI and upload store the same"
        entry = next(e for e in up_run["ranks"]["0"] if e["output_code"])
        ev = httpx.get(f"{srv.url}/api/compile-events/{entry['output_code'][0]['event_id']}").json()
        assert "def call(" in ev["payload"] or "kernel" in ev["payload"]
        kern = httpx.get(f"{srv.url}/api/graphs/{ev['graph_id']}/kernels").json()
        assert kern["kernels"], "output code's graph has kernel links"
        empty = httpx.post(f"{srv.url}/api/runs/e/torch-trace", files=[("files", ("x.log", b"", "text/plain"))],
                           headers=CLIENT)
        assert empty.status_code == 400 and empty.json()["ok"] is False


CA_SCRIPT = r"""
import torch, torch.nn as nn
torch._dynamo.config.compiled_autograd = True
m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
@torch.compile(backend="aot_eager")
def step(x):
    loss = m(x).sum()
    loss.backward()
    return loss
for i in range(2):
    step(torch.randn(4, 8))
"""


@pytest.mark.slow
def test_compiled_autograd_ids(tmp_path):
    """A real compiled-autograd run under TORCH_TRACE: its graphs get ids "!0", "!0/1/0", ..., the
    Dynamo trace of a compiled-autograd graph is its child, and tlparse lists the same ids."""
    import os
    import shutil

    from graphdeck.analysis.compilation.index import compile_index

    trace_dir = tmp_path / "ca"
    proc = subprocess.run([sys.executable, "-c", CA_SCRIPT], env={**os.environ, "TORCH_TRACE": str(trace_dir)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    engine = open_engine(tmp_path / "ca.db")
    import_torch_trace(engine, trace_dir, run_name="ca", strict=True)
    with Session(engine) as s:
        graphs = {g.compile_id + ":" + g.kind: g for g in s.scalars(select(Graph))}
        ids = [e["compile_id"] for e in compile_index(s, s.scalar(select(Run)))[0]]
    assert graphs["!0/1/0:dynamo"].parent_id == graphs["!0:compiled_autograd"].id
    if shutil.which("tlparse"):
        from tests.test_torch_trace_tlparse import _tl, tlparse_facts

        want = tlparse_facts(shutil.which("tlparse"), next(trace_dir.glob("*.log")), tmp_path / "tl")
        assert {_tl(i) for i in ids} == want["compile_ids"]


def test_plain_text_recompile_reasons(tmp_path):
    """torch 2.13 logs ``recompile_reasons`` as plain text (one per line) under "encoding": "json"
    (seen in a 2-rank run of gen_ddp_traces.py's ``diverge`` scenario); both forms are read."""
    from graphdeck.analysis.compilation.index import compile_index
    from tests.test_torch_trace_browser import _record

    art = {"artifact": {"name": "recompile_reasons", "encoding": "json"}, "rank": 1, "frame_id": 4,
           "frame_compile_id": 1, "attempt": 0}
    log = tmp_path / "dedicated_log_torch_trace_rank_1_x.log"
    log.write_text(_record(art, "4/0: tensor 'x' size mismatch at index 0. expected 16, actual 24")
                   + _record({**art, "frame_compile_id": 2}, '[\n"4/1: ___check_obj_id(fn, 1)"\n]'))
    engine = open_engine(tmp_path / "r.db")
    import_torch_trace(engine, log, run_name="r", strict=True)
    with Session(engine) as s:
        index = compile_index(s, s.scalar(select(Run)))
    assert [e["recompile_reasons"] for e in index[1]] == [
        ["4/0: tensor 'x' size mismatch at index 0. expected 16, actual 24"], ["4/1: ___check_obj_id(fn, 1)"]]


def test_upload_over_the_cap_is_413(tmp_path):
    log = sorted(shared_path(*GEN, "detach").glob("*rank_0*.log"))[0]
    with LiveServer(tmp_path / "u.db", max_upload_bytes=100_000) as srv:
        r = httpx.post(f"{srv.url}/api/runs/big/torch-trace", files=[("files", (log.name, log.read_bytes()))], headers=CLIENT,
                       timeout=60)
        assert r.status_code == 413 and r.json()["status"] == 413
        assert httpx.get(f"{srv.url}/api/runs/big").status_code == 404, "nothing stored"


def test_two_rankless_logs_refused(tmp_path):
    engine = open_engine(tmp_path / "two.db")
    logs = [shared_path(*INPUTS, "simple.log"), shared_path(*INPUTS, "comp_failure.log")]
    with pytest.raises(UsageError, match="same rank"):
        import_torch_trace(engine, logs, run_name="two")
    assert import_torch_trace(engine, logs[0], run_name="one").ranks == [0], "one rankless log is rank 0"


def test_fx_text_joint_graph():
    """A joint graph takes (primals, tangents) and flattens them with fx_pytree; its placeholders
    are the flattened names, with their declared metadata and AOT descriptors."""
    text = """class inner_f(torch.nn.Module):
    def forward(
        self,
        primals,
        tangents,
    ):
        primals_1: "f32[16, 32][32, 1]cpu"  # PlainAOTInput(idx=0)
        tangents_1: "f32[16, 512][512, 1]cpu"  # TangentAOTInput(output=PlainAOTOutput(idx=0))
        primals_1, tangents_1, = fx_pytree.tree_flatten_spec([primals, tangents], self._in_spec)
        mm: "f32[512, 32][32, 1]cpu" = torch.ops.aten.mm.default(tangents_1, primals_1);  tangents_1 = None
        return pytree.tree_unflatten([
            primals_1,  # PlainAOTOutput(idx=0)
            mm,  # GradAOTOutput(grad_of=PlainAOTInput(idx=0))
        ], self._out_spec)
"""
    g = parse_fx_text(text)
    assert [(n.name, n.shape, n.desc) for n in g.placeholders()] == [
        ("primals_1", [16, 32], "PlainAOTInput(idx=0)"),
        ("tangents_1", [16, 512], "TangentAOTInput(output=PlainAOTOutput(idx=0))")]
    assert g.outputs == ["primals_1", "mm"] and g.output_descs[1] == "GradAOTOutput(grad_of=PlainAOTInput(idx=0))"
    assert g.bad_statements == 0


def test_gzipped_logs(tmp_path):
    """A folder of gzipped rank logs imports like the plain one."""
    import gzip

    for log in shared_path(*GEN, "detach").glob("*.log"):
        with gzip.open(tmp_path / (log.name + ".gz"), "wb") as out:
            out.write(log.read_bytes())
    engine = open_engine(tmp_path / "gz.db")
    res = import_torch_trace(engine, tmp_path, run_name="gz", strict=True, progress=True)
    assert res.ranks == [0, 1] and res.stats["graphs"] == 44


def test_inferred_module_paths(gen_store):
    """Printed graphs carry no nn_module_stack: an op reading a parameter, the other ops of its
    '# File:' line, and a backward op producing a parameter's gradient take that module's path
    (marked as inferred), so the graph view can cluster imported graphs."""
    engine, _ = gen_store
    with Session(engine) as s:
        run = s.scalar(select(Run).where(Run.name == "detach"))
        dyn = s.scalar(select(Graph.id).where(Graph.run_id == run.id, Graph.rank == 0, Graph.kind == "dynamo"))
        rows = dict(s.execute(select(Node.name, InternedString.value)
                              .join(InternedString, InternedString.id == Node.module_path_id)
                              .where(Node.graph_id == dyn)).all())
        meta = s.scalar(select(Node.meta_json).where(Node.graph_id == dyn, Node.name == "h"))
    assert (rows["linear"], rows["h"], rows["h2"], rows["out"]) == ("emb", "emb", "blk2", "head")
    assert json.loads(meta) == {"module_path": "inferred"}


def test_strict_upload_is_400_with_counters(tmp_path):
    log = _corrupt_copy(tmp_path)
    with LiveServer(tmp_path / "st.db") as srv:
        files = [("files", (log.name, log.read_bytes()))]
        r = httpx.post(f"{srv.url}/api/runs/st/torch-trace", params={"strict": "true"}, files=files, headers=CLIENT,
                       timeout=120)
        body = r.json()
        assert r.status_code == 400 and body["ok"] is False and "dropped records" in body["error"], body
        assert body["stats"]["records"] > 0, "the counters up to the first drop come with the error"
        ok = httpx.post(f"{srv.url}/api/runs/st/torch-trace", files=files, headers=CLIENT, timeout=120).json()
        assert ok["dropped"] == 3 and ok["unverified"] == 1 and ok["stats"]["bad_json"] == 1, \
            "lenient: kept, with the counters (the md5 mismatch kept unverified)"
