"""Gradient-path check speed: graph mode on a generated deep network (≥100,000 backward nodes)
and eager mode on GPT-2 (12 layers, transformers, random weights).

Graph mode. A store holds one run: a Dynamo-style forward graph of LAYERS ``linear`` + ``relu``
blocks (one ``detach`` after block 3, so blocks 0–3 are NO_GRAD and the cut search runs) and an
AOT-style backward graph with, per block, ``threshold_backward``, two ``mm``, ``sum``, views and
an ``all_reduce`` + ``wait_tensor`` per gradient (so the collective checks walk the whole
backward graph), gradient outputs bound to the parameters. The graphs are real ``torch.fx``
graphs built node by node and written with the capture's own writer. Timed:
``validate_backward(store, run)`` (target < 1 s). Anchor: loading the backward graph's node rows
through the ORM (what the API's node list does).

Eager mode. Timed: ``validate_backward(gpt2, batch, loss)`` on 1 × 64 tokens (target < 10 s).
Anchor: one plain eager forward + backward of the same batch.

    python bench/bench_gradients.py [--layers 7200] [--repeat 3] [--store PATH (reused if present)]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.fx

D = 16


def build_graphs(layers: int, detach_after: int = 3):
    aten = torch.ops.aten
    funcol = torch.ops._c10d_functional
    fw = torch.fx.Graph()
    x = fw.placeholder("l_x_")
    params, h = [], x
    for i in range(layers):
        w, b = fw.placeholder(f"w{i}"), fw.placeholder(f"b{i}")
        params += [(w.name, f"layers.{i}.weight"), (b.name, f"layers.{i}.bias")]
        lin = fw.call_function(torch._C._nn.linear, (h, w, b))
        h = fw.call_function(torch.relu, (lin,))
        if i == detach_after:
            h = fw.call_method("detach", (h,))
    fw.output((h,))
    bw = torch.fx.Graph()
    grad = bw.placeholder("tangents_1")
    outs = []
    for i in reversed(range(layers)):
        w, act, inp = bw.placeholder(f"w{i}"), bw.placeholder(f"relu_{i}"), bw.placeholder(f"x_{i}")
        g = bw.call_function(aten.threshold_backward.default, (grad, act, 0))
        t = bw.call_function(aten.permute.default, (g, [1, 0]))
        gw = bw.call_function(aten.mm.default, (t, inp))
        gb = bw.call_function(aten.sum.dim_IntList, (g, [0], True))
        gbv = bw.call_function(aten.view.default, (gb, [D]))
        ar_w = bw.call_function(funcol.all_reduce.default, (gw, "sum", "0"))
        ar_b = bw.call_function(funcol.all_reduce.default, (gbv, "sum", "0"))
        ww = bw.call_function(funcol.wait_tensor.default, (ar_w,))
        wb = bw.call_function(funcol.wait_tensor.default, (ar_b,))
        wt = bw.call_function(aten.permute.default, (w, [1, 0]))
        grad = bw.call_function(aten.mm.default, (g, wt))
        has = i > detach_after
        outs.append((i, ww if has else None, wb if has else None))
    flat = []
    for i, ww, wb in sorted(outs):
        flat += [ww, wb]
    bw.output(tuple(flat))
    return torch.fx.GraphModule(torch.nn.Module(), fw), torch.fx.GraphModule(torch.nn.Module(), bw), params


def make_store(path: Path, layers: int) -> None:
    from graphdeck.capture.fxrecord import record_graph
    from graphdeck.capture.writer import IOBinding, StoreWriter

    fw, bw, params = build_graphs(layers)
    writer = StoreWriter(path, "deep", rank=0, world_size=1)
    writer.write_params([{"fqn": fqn, "kind": "parameter", "storage_key": fqn, "shape": [D, D], "dtype": "float32",
                          "numel": D * D, "size_bytes": 4 * D * D, "requires_grad": True} for _, fqn in params])
    by_node = dict(params)
    fw_io = [IOBinding("in", k, n.name, by_node[n.name])
             for k, n in enumerate(x for x in fw.graph.nodes if x.op == "placeholder") if n.name in by_node]
    fid = writer.write_graph(record_graph(fw), kind="dynamo", name="deep forward", compile_id="0/0",
                             io=fw_io, param_by_node=by_node)
    out = next(n for n in bw.graph.nodes if n.op == "output")
    grad_io = [IOBinding("grad", k, v.name if v is not None else None, params[k][1], has_grad=v is not None,
                         desc=f"GradAOTOutput(grad_of=PlainAOTInput(idx={k + 1}))") for k, v in enumerate(out.args[0])]
    writer.write_graph(record_graph(bw), kind="aot_backward", name="deep backward", compile_id="0/0",
                       parent_id=fid, io=grad_io)


def best(fn, repeat: int) -> tuple[float, object]:
    """Best wall time of ``repeat`` runs (and the result); the CPU time of that run in ``LAST_CPU``."""
    global LAST_CPU
    times, result = [], None
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        result = fn()
        times.append((time.perf_counter() - t0, time.process_time() - c0))
    wall, LAST_CPU = min(times)
    return wall, result


LAST_CPU = 0.0


def graph_mode(args) -> dict:
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from graphdeck import validate_backward
    from graphdeck.store.db import open_engine
    from graphdeck.store.schema import Graph, Node

    path = Path(args.store) if args.store else Path(tempfile.mkdtemp()) / "deep.db"
    t0 = time.perf_counter()
    if not path.exists():
        make_store(path, args.layers)
    build_s = time.perf_counter() - t0
    engine = open_engine(path, read_only=True)
    with Session(engine) as s:
        sizes = dict(s.execute(select(Graph.kind, Graph.num_nodes)).all())
        bw_id = s.scalar(select(Graph.id).where(Graph.kind == "aot_backward"))

    def anchor():
        with Session(engine) as s:
            return len(s.scalars(select(Node).where(Node.graph_id == bw_id)).all())

    anchor_s, _ = best(anchor, args.repeat)
    check_s, rep = best(lambda: validate_backward(engine, "deep"), args.repeat)
    check_cpu_s = LAST_CPU
    return {"check_cpu_s": check_cpu_s, "layers": args.layers, "backward_nodes": sizes.get("aot_backward"), "forward_nodes": sizes.get("dynamo"),
            "params": len(rep), "summary": {k: v for k, v in rep.summary.items() if v},
            "findings": len(rep.findings), "store_build_s": build_s, "check_s": check_s, "anchor_s": anchor_s}


def eager_mode(args) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel

    from graphdeck import validate_backward

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=12))
    model.loss_type = "ForCausalLM"
    tokens = torch.randint(0, model.config.vocab_size, (1, 64))
    batch = {"input_ids": tokens, "labels": tokens}

    def anchor():
        model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)

    anchor()  # warm-up
    anchor_s, _ = best(anchor, args.repeat)
    check_s, rep = best(lambda: validate_backward(model, batch, lambda out: out.loss), args.repeat)
    return {"check_cpu_s": LAST_CPU, "params": len(rep), "summary": {k: v for k, v in rep.summary.items() if v}, "check_s": check_s,
            "anchor_s": anchor_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=7200, help="blocks of the generated network (14 backward nodes each)")
    parser.add_argument("--repeat", type=int, default=3, help="best of N")
    parser.add_argument("--store", default=None, help="store path (generated once, then reused)")
    parser.add_argument("--skip-eager", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (a shared host: wall times stretch with it)")
    g = graph_mode(args)
    print(f"graph mode: {g['backward_nodes']:,} backward + {g['forward_nodes']:,} forward nodes, {g['params']:,} "
          f"params {g['summary']}, {g['findings']} findings; store built in {g['store_build_s']:.1f}s")
    print(f"  validate_backward(store, run) {g['check_s']:.3f} s wall, {g['check_cpu_s']:.3f} s CPU (target < 1 s); anchor: ORM load of the "
          f"backward graph's nodes {g['anchor_s']:.3f} s; ratio {g['check_s'] / g['anchor_s']:.2f}x")
    if not args.skip_eager:
        e = eager_mode(args)
        print(f"eager mode: GPT-2 12 layers, {e['params']} params {e['summary']}")
        print(f"  validate_backward(model, batch, loss) {e['check_s']:.3f} s wall, {e['check_cpu_s']:.3f} s CPU (target < 10 s); anchor: eager "
              f"forward+backward {e['anchor_s']:.3f} s; ratio {e['check_s'] / e['anchor_s']:.2f}x")


if __name__ == "__main__":
    main()
