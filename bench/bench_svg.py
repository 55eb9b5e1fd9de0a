"""Bench: graphdeck's ``render_graph_svg`` against torch's ``FxGraphDrawer`` on GPT-2 graphs.

Builds ``GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768))`` with random weights (no
download), compiles it with a backend that keeps Dynamo's GraphModule and, through
AOTAutograd, the forward and backward graphs; then renders each graph both ways in this process
and prints node count, seconds each and the ratio. ``--append`` adds the table to
``bench/RESULTS.md`` under "Graph SVG".

Run::

    python bench/bench_svg.py [--layers 12] [--repeat 3] [--append]

Needs torch, transformers, graphviz (``dot``) and, for the baseline, ``pydot``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import re
import subprocess
import time
from pathlib import Path

import torch
from torch.fx.node import _get_qualified_name

from graphdeck.server.render.svg import render_graph_svg
from graphdeck.server.views import GraphView, ViewEdge, ViewNode, node_label, op_category

RESULTS = Path(__file__).with_name("RESULTS.md")
_INDEX = re.compile(r"\[['\"]?([^\]'\"]+)['\"]?\]")


def capture_gpt2(layers: int, seq_len: int = 16) -> dict[str, torch.fx.GraphModule]:
    """The largest Dynamo, AOT forward and AOT backward GraphModules of a random-weight GPT-2
    (the loss may be a separate, small graph after a graph break)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=768, n_head=12))
    graphs: dict[str, torch.fx.GraphModule] = {}

    def keep(kind):
        def compiler(gm, _inputs):
            _keep_largest(graphs, kind, gm)
            return make_boxed_func(gm.forward)

        return compiler

    aot = aot_autograd(fw_compiler=keep("aot_forward"), bw_compiler=keep("aot_backward"))

    def backend(gm, inputs):
        _keep_largest(graphs, "dynamo", gm)
        return aot(gm, inputs)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    ids = torch.randint(0, model.config.vocab_size, (1, seq_len))
    compiled(input_ids=ids, labels=ids).loss.backward()
    return graphs


def _keep_largest(graphs: dict, kind: str, gm: torch.fx.GraphModule) -> None:
    if kind not in graphs or len(gm.graph.nodes) > len(graphs[kind].graph.nodes):
        graphs[kind] = gm


def view_from_graph_module(gm: torch.fx.GraphModule, name: str) -> GraphView:
    """A bench-local adapter (the capture agent writes the store; this skips it)."""
    nodes, edges = [], []
    for idx, node in enumerate(gm.graph.nodes):
        target = node.target if isinstance(node.target, str) else _target_name(node.target)
        val = node.meta.get("val", node.meta.get("example_value"))
        shape = list(val.shape) if isinstance(val, torch.Tensor) else None
        nodes.append(
            ViewNode(
                id=node.name, idx=idx, label=node_label(node.op, target), op=node.op, target=target,
                category=op_category(node.op, target), namespace=_namespace(node.meta.get("nn_module_stack")),
                shape=[int(s) if str(s).isdigit() else str(s) for s in shape] if shape is not None else None,
                dtype=str(val.dtype) if isinstance(val, torch.Tensor) else None,
            )
        )
        for pos, arg in enumerate(node.all_input_nodes):
            edges.append(ViewEdge(src=arg.name, dst=node.name, arg_pos=pos))
    return GraphView(graph_id=0, name=name, kind=name, nodes=nodes, edges=edges)


def _target_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    try:
        return _get_qualified_name(target)
    except Exception:
        return str(target)


def _namespace(stack) -> str | None:
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = _INDEX.sub(r".\1", path)
    return "/".join(p for p in path.split(".") if p) or None


def time_it(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def fx_graph_drawer_svg(gm: torch.fx.GraphModule, name: str, timeout_s: float) -> bytes | None:
    """What ``FxGraphDrawer(gm, name).get_dot_graph().create_svg()`` does (pydot writes the DOT
    and runs ``dot -Tsvg`` on it), with a timeout; ``None`` when ``dot`` runs past it."""
    from torch.fx.passes.graph_drawer import FxGraphDrawer

    source = FxGraphDrawer(gm, name).get_dot_graph().to_string()
    try:
        proc = subprocess.run(["dot", "-Tsvg"], input=source.encode(), capture_output=True, timeout=timeout_s, check=True)
    except subprocess.TimeoutExpired:
        return None
    return proc.stdout


def bench(layers: int, repeat: int, timeout_s: float) -> list[dict]:
    rows = []
    for kind, gm in sorted(capture_gpt2(layers).items()):
        view = view_from_graph_module(gm, kind)
        ours = time_it(lambda: render_graph_svg(view, timeout_s=timeout_s), repeat)
        size = len(render_graph_svg(view, timeout_s=timeout_s))
        start = time.perf_counter()
        finished = fx_graph_drawer_svg(gm, kind, timeout_s) is not None
        theirs = time.perf_counter() - start
        if finished and repeat > 1:
            theirs = min(theirs, time_it(lambda: fx_graph_drawer_svg(gm, kind, timeout_s), repeat - 1))
        rows.append({"kind": kind, "nodes": len(view.nodes), "ours_s": ours, "fx_s": theirs,
                     "fx_finished": finished, "svg_bytes": size})
        fx = f"{theirs:7.2f}s" if finished else f">{timeout_s:g}s (killed)"
        print(f"{kind:13s} nodes={len(view.nodes):5d} ours={ours:7.2f}s FxGraphDrawer={fx} "
              f"ratio={'' if finished else '>'}{theirs / ours:5.1f}x svg={size / 1e6:.1f}MB", flush=True)
    return rows


def append_results(rows: list[dict], layers: int, repeat: int, timeout_s: float) -> None:
    """Append one table to ``RESULTS.md``, under a "Graph SVG" heading added once."""
    dot_version = subprocess.run(["dot", "-V"], capture_output=True, text=True).stderr.strip()
    existing = RESULTS.read_text(encoding="utf-8") if RESULTS.exists() else ""
    lines = [] if "\n## Graph SVG\n" in existing else ["", "## Graph SVG", ""]
    lines += [
        f"`python bench/bench_svg.py --layers {layers} --repeat {repeat} --timeout-s {timeout_s:g} --append` on "
        f"{_dt.date.today().isoformat()}: GPT-2 (n_layer={layers}, n_embd=768, random weights, batch 1 × 16 "
        f"tokens), torch {torch.__version__}, {dot_version}, {platform.machine()}, {os.cpu_count()} CPUs; best "
        f"of {repeat}. \">\" = FxGraphDrawer's `dot` was killed at the timeout.",
        "",
        "| graph | nodes | render_graph_svg s | FxGraphDrawer.create_svg s | ratio | our SVG MB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        more = "" if r["fx_finished"] else ">"
        fx = f"{r['fx_s']:.2f}" if r["fx_finished"] else f">{r['fx_s']:.0f} (killed)"
        lines.append(
            f"| {r['kind']} | {r['nodes']:,} | {r['ours_s']:.2f} | {fx} | "
            f"{more}{r['fx_s'] / r['ours_s']:.1f}x | {r['svg_bytes'] / 1e6:.2f} |"
        )
    with RESULTS.open("a", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12, help="GPT-2 transformer blocks")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per renderer; best is kept")
    parser.add_argument("--timeout-s", type=float, default=600, help="kill a dot run after this many seconds")
    parser.add_argument("--append", action="store_true", help="append the table to bench/RESULTS.md")
    args = parser.parse_args()
    rows = bench(args.layers, args.repeat, args.timeout_s)
    if args.append:
        append_results(rows, args.layers, args.repeat, args.timeout_s)


if __name__ == "__main__":
    main()
