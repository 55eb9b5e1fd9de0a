"""Bench: the graph view against torch's ``FxGraphDrawer`` (pydot + the same ``dot``).

Two parts, one command:

1. **Server** (``--store``, repeatable; stores made by ``bench/capture_graphs.py``): requests to
   the real app (``create_app`` through Starlette's TestClient, so DB load, cluster tree, layout
   and SVG are all in): the default (depth-limited) view cold, the same request again (cached),
   one more transformer block expanded (cold), fully expanded (cold), and search → reveal of the
   last node (the ``node=`` request the page makes). Each store gets a fresh app.
2. **Anchor** (``--anchor-layers``, repeatable): a random-weight GPT-2 (``GPT2Config(n_layer=L)``,
   n_embd 768, default dropout) compiled in this process with a backend that keeps the AOT
   forward and backward GraphModules; for each: graphdeck's default view (``GraphVisualizer(gm)``:
   view from the GraphModule + layout + SVG) and fully expanded, against
   ``FxGraphDrawer(gm).get_dot_graph()`` + ``dot -Tsvg`` with a timeout; prints the ratio.

Run::

    python bench/capture_graphs.py ...   # see its docstring, once
    python bench/bench_svg.py --store /tmp/graphdeck-bench-gpt2-12.db --store /tmp/graphdeck-bench-deep-200.db \\
        --anchor-layers 2 --anchor-layers 12 --timeout-s 120 [--write-results]
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

RESULTS = Path(__file__).with_name("RESULTS.md")
SECTION = "## Graph view"


def _get(client, url: str) -> tuple[float, str]:
    start = time.perf_counter()
    cpu = time.process_time()
    res = client.get(url)
    took = time.perf_counter() - start
    _get.cpu_s = time.process_time() - cpu  # CPU of this process (all threads): the cost without the shared host's queueing
    assert res.status_code == 200, f"{url}: {res.status_code} {res.text[:300]}"
    return took, res.text


def cold_repeats(store: Path, graph_id: int, repeat: int) -> list[tuple[float, float]]:
    """(wall s, CPU s) of the default view's first request in ``repeat`` fresh apps (one process,
    so from the second on the label/shape caches are warm, as in a server that has drawn any graph)."""
    from fastapi.testclient import TestClient

    from graphdeck.server.app import create_app
    from graphdeck.server.settings import Settings

    out = []
    for _ in range(repeat):
        client = TestClient(create_app(Settings(store=store)))
        client.get("/api/runs")
        took, _svg = _get(client, f"/api/graphs/{graph_id}/svg")
        out.append((took, _get.cpu_s))
    return out


def bench_store(store: Path, cold_repeat: int = 1) -> list[dict]:
    from fastapi.testclient import TestClient

    from graphdeck.server.app import create_app
    from graphdeck.server.settings import Settings

    client = TestClient(create_app(Settings(store=store)))
    rows = []
    run = client.get("/api/runs").json()[0]["name"]
    graphs = [g for g in client.get(f"/api/runs/{run}").json()["graphs"] if g["kind"].startswith("aot_")]
    full_total = 0.0
    for g in sorted(graphs, key=lambda g: g["kind"], reverse=True):
        base = f"/api/graphs/{g['id']}/svg"
        cold, svg = _get(client, base)
        cold_cpu = _get.cpu_s
        cached, again = _get(client, base)
        assert again == svg
        shown = int(re.search(r'data-visible-nodes="(\d+)"', svg).group(1)) + svg.count('class="cluster collapsed')
        # one transformer block opened with everything in it, from the view with blocks collapsed
        _get(client, f"{base}?max_depth=2")
        spaces = {n["namespace"] for n in client.get(f"/api/graphs/{g['id']}/view").json()["nodes"] if n["namespace"]}
        blocks = sorted({m.group(0) for ns in spaces if (m := re.match(r".*?/h/\d+", ns))},
                        key=lambda p: int(p.rsplit("/", 1)[1]))
        expand_s = expand_cpu = None
        if blocks:
            block = blocks[len(blocks) // 2]
            inside = sorted(p for p in spaces if p == block or p.startswith(block + "/"))
            expand_s, _ = _get(client, f"{base}?max_depth=2&" + "&".join(f"expand={p}" for p in inside))
            expand_cpu = _get.cpu_s
        nodes = client.get(f"/api/graphs/{g['id']}/nodes").json()
        reveal_s, _ = _get(client, f"{base}?node={nodes[-2]['name']}")
        full_s = None
        if g["num_nodes"] <= 5000:
            full_s, _ = _get(client, f"{base}?max_depth=99")
            full_total += full_s
        rows.append({"store": store.name, "graph": g["kind"], "nodes": g["num_nodes"], "shown": shown,
                     "cold_s": cold, "cold_cpu_s": cold_cpu, "expand_cpu_s": expand_cpu, "cached_s": cached, "expand_s": expand_s, "reveal_s": reveal_s, "full_s": full_s,
                     "svg_kb": len(svg) / 1024})
        if cold_repeat > 1:
            runs = cold_repeats(store, g["id"], cold_repeat)
            print(f"{store.name} {g['kind']:12s} default view in {cold_repeat} fresh apps (wall/CPU s): "
                  + ", ".join(f"{w:.3f}/{c:.3f}" for w, c in runs)
                  + f"; best {min(w for w, _ in runs):.3f}/{min(c for _, c in runs):.3f}", flush=True)
        print(f"{store.name} {g['kind']:12s} nodes={g['num_nodes']:6d} shown={shown:4d} default={cold:6.3f}s "
              f"(cpu {cold_cpu:.3f}s) "
              f"cached={cached * 1000:6.1f}ms expand-block={_fmt(expand_s)} reveal={reveal_s:6.3f}s full={_fmt(full_s)}",
              flush=True)
    if full_total:
        print(f"{store.name} fully expanded forward + backward: {full_total:.2f} s", flush=True)
    return rows


def _fmt(v: float | None) -> str:
    return "    —  " if v is None else f"{v:6.3f}s"


def capture_gpt2(layers: int, seq_len: int = 16) -> dict:
    """The largest AOT forward and backward GraphModules of a random-weight GPT-2."""
    import torch
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=768, n_head=12))
    model.loss_type = "ForCausalLM"
    graphs: dict = {}

    def keep(kind):
        def compiler(gm, _inputs):
            if kind not in graphs or len(gm.graph.nodes) > len(graphs[kind].graph.nodes):
                graphs[kind] = gm
            return make_boxed_func(gm.forward)
        return compiler

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=keep("aot_forward"), bw_compiler=keep("aot_backward")))
    ids = torch.randint(0, model.config.vocab_size, (1, seq_len))
    compiled(input_ids=ids, labels=ids).loss.backward()
    return graphs


def fx_graph_drawer(gm, name: str, timeout_s: float) -> float | None:
    """Seconds for ``FxGraphDrawer(gm, name).get_dot_graph()`` + ``dot -Tsvg`` (what
    ``create_svg`` runs); ``None`` when ``dot`` is killed at ``timeout_s``."""
    from torch.fx.passes.graph_drawer import FxGraphDrawer

    start = time.perf_counter()
    source = FxGraphDrawer(gm, name).get_dot_graph().to_string()
    left = max(1.0, timeout_s - (time.perf_counter() - start))
    try:
        subprocess.run(["dot", "-Tsvg"], input=source.encode(), capture_output=True, timeout=left, check=True)
    except subprocess.TimeoutExpired:
        return None
    return time.perf_counter() - start


def bench_anchor(layers: int, timeout_s: float) -> list[dict]:
    from graphdeck.server.render.svg import render_graph_svg
    from graphdeck.visualize import GraphVisualizer

    rows = []
    for kind, gm in sorted(capture_gpt2(layers).items()):
        start = time.perf_counter()
        vis = GraphVisualizer(gm, name=kind)
        vis.render()
        ours = time.perf_counter() - start
        start = time.perf_counter()
        render_graph_svg(vis.view, max_depth=99)
        full = time.perf_counter() - start
        theirs = fx_graph_drawer(gm, kind, timeout_s)
        ratio = f"{theirs / ours:.0f}x" if theirs else f">{timeout_s / ours:.0f}x"
        rows.append({"layers": layers, "graph": kind, "nodes": len(gm.graph.nodes), "ours_s": ours, "full_s": full,
                     "fx_s": theirs, "timeout_s": timeout_s, "ratio": ratio})
        print(f"GPT-2 {layers}L {kind:12s} nodes={len(gm.graph.nodes):5d} ours default={ours:6.3f}s full={full:6.3f}s "
              f"FxGraphDrawer={'>%gs (killed)' % timeout_s if theirs is None else f'{theirs:.2f}s'} ratio={ratio}",
              flush=True)
    return rows


def bench_engines(store: Path) -> list[dict]:
    """igraph (what ``layout.py`` runs) against ``dot`` on the *same* per-cluster graphs of each AOT
    graph's fully expanded view: every open cluster's members (nodes and child boxes, fixed sizes)
    and its edges, laid out one cluster at a time, summed."""
    from sqlalchemy.orm import Session

    from graphdeck.analysis.graphs.view import graph_view
    from graphdeck.server.render import layout as lay
    from graphdeck.server.render.svg import _Writer
    from graphdeck.store.db import open_engine

    engine = open_engine(store, read_only=True)
    rows = []
    with Session(engine) as session:
        from graphdeck.store.schema import Graph

        for g in session.query(Graph).filter(Graph.kind.like("aot_%")).order_by(Graph.kind.desc()):
            view = graph_view(session, g.id)
            prep = lay.prepare(view)
            opened = lay.open_clusters(prep, None)
            writer = _Writer(prep, opened, None, {}, set(), set(), False)
            edges_at = lay.cluster_edges(prep, opened)
            jobs = []
            for path in sorted(opened):
                c = prep.clusters[path]
                members = list(c.nodes) + [("c", ch) for ch in c.children]
                sizes = [lay.node_size(prep.by_idx[i], writer.node_lines(prep.by_idx[i])) for i in c.nodes]
                sizes += [(200.0, 120.0)] * len(c.children)
                index = {m: i for i, m in enumerate(members)}
                e = [(index[u], index[v]) for (u, v) in sorted(edges_at.get(path, {}), key=str) if u in index and v in index]
                jobs.append((sizes, e))
            start = time.perf_counter()
            for sizes, e in jobs:
                lay.layered(sizes, e)
            ours = time.perf_counter() - start
            start = time.perf_counter()
            for sizes, e in jobs:
                dot = ["digraph g { node [shape=box, fixedsize=true];"]
                dot += [f'n{i} [width={w / 72:.2f}, height={hgt / 72:.2f}];' for i, (w, hgt) in enumerate(sizes)]
                dot += [f"n{u} -> n{v};" for u, v in e] + ["}"]
                subprocess.run(["dot", "-Tplain"], input="\n".join(dot).encode(), capture_output=True, check=True)
            theirs = time.perf_counter() - start
            rows.append({"graph": g.kind, "nodes": g.num_nodes, "clusters": len(jobs), "igraph_s": ours, "dot_s": theirs})
            print(f"engines {store.name} {g.kind:12s} nodes={g.num_nodes} clusters={len(jobs)} igraph={ours:.3f}s "
                  f"dot={theirs:.3f}s ({theirs / ours:.0f}x)", flush=True)
    engine.dispose()
    return rows


def write_results(store_rows: list[dict], anchor_rows: list[dict], engine_rows: list[dict], command: str) -> None:
    """Replace the "Graph view" section of RESULTS.md (and the older "Graph SVG" one it supersedes)."""
    import torch

    dot_version = subprocess.run(["dot", "-V"], capture_output=True, text=True).stderr.strip()
    import igraph

    lines = [SECTION, "",
             f"`{command}` on {_dt.date.today().isoformat()}: {platform.machine()}, {os.cpu_count()} CPUs (shared "
             f"with 3 other developers' jobs; load average {os.getloadavg()[0]:.1f} at the end), torch {torch.__version__}, igraph {igraph.__version__}, {dot_version}. "
             "Server rows: one request each through the real app (DB load + cluster tree + layout + SVG), a fresh "
             "app per store; \"cached\" is the same request again.", "",
             "| store | graph | nodes | items drawn (nodes + boxes) | default view s (CPU s) | cached ms | one block expanded s (CPU s) | "
             "reveal a node s | fully expanded s | default SVG KiB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in store_rows:
        expand = "—" if r["expand_s"] is None else f"{r['expand_s']:.3f} ({r['expand_cpu_s']:.3f})"
        lines.append(f"| {r['store']} | {r['graph']} | {r['nodes']:,} | {r['shown']} | {r['cold_s']:.3f} ({r['cold_cpu_s']:.3f}) | "
                     f"{r['cached_s'] * 1000:.1f} | {expand} | {r['reveal_s']:.3f} | {_cell(r['full_s'])} | "
                     f"{r['svg_kb']:.0f} |")
    lines += ["", "Anchor (same GraphModules, same process): graphdeck's default view from a live GraphModule "
              "(`GraphVisualizer(gm).render()`) and fully expanded, against `FxGraphDrawer(gm).get_dot_graph()` + "
              "`dot -Tsvg`.", "",
              "| GPT-2 | graph | nodes | graphdeck default s | graphdeck fully expanded s | FxGraphDrawer s | ratio (default) |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for r in anchor_rows:
        fx = f">{r['timeout_s']:g} (killed)" if r["fx_s"] is None else f"{r['fx_s']:.2f}"
        lines.append(f"| {r['layers']} layers | {r['graph']} | {r['nodes']:,} | {r['ours_s']:.3f} | {r['full_s']:.3f} | "
                     f"{fx} | {r['ratio']} |")
    if engine_rows:
        lines += ["", "Layout engines on the same input: every open cluster of the fully expanded view laid out "
                  "on its own (members at their drawn sizes, child clusters as 200×120 boxes), summed; `dot -Tplain` "
                  "per cluster (process start included, as a server would pay it) against igraph's Sugiyama in "
                  "process (`layout.layered`).", "",
                  "| store | graph | nodes | open clusters | igraph s | dot s | ratio |", "|---|---|---:|---:|---:|---:|---:|"]
        for r in engine_rows:
            lines.append(f"| {r['store']} | {r['graph']} | {r['nodes']:,} | {r['clusters']} | {r['igraph_s']:.3f} | "
                         f"{r['dot_s']:.2f} | {r['dot_s'] / r['igraph_s']:.0f}x |")
    text = RESULTS.read_text(encoding="utf-8") if RESULTS.exists() else "# Benchmark results\n"
    notes = ""
    if SECTION in text:
        start = text.index(SECTION)
        end = text.find("\n## ", start + 1)
        block = text[start:] if end < 0 else text[start:end]
        if "### Why igraph" in block:
            notes = "\n" + block[block.index("### Why igraph"):].rstrip() + "\n"
        text = text[:start] + (text[end + 1:] if end >= 0 else "")
    if "\n## Graph SVG\n" in text:  # the dot renderer's numbers, superseded by this section
        start = text.index("\n## Graph SVG\n") + 1
        end = text.find("\n## ", start + 1)
        text = text[:start] + (text[end + 1:] if end >= 0 else "")
    RESULTS.write_text(text.rstrip() + "\n\n" + "\n".join(lines) + "\n" + notes, encoding="utf-8")


def _cell(v: float | None) -> str:
    return "—" if v is None else f"{v:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path, action="append", default=[], help="a store from capture_graphs.py")
    parser.add_argument("--anchor-layers", type=int, action="append", default=[], help="GPT-2 blocks for the anchor")
    parser.add_argument("--timeout-s", type=float, default=120, help="kill FxGraphDrawer's dot after this many seconds")
    parser.add_argument("--cold-repeat", type=int, default=1, help="also the default view in N fresh apps")
    parser.add_argument("--engines", action="store_true", help="also igraph vs dot on each store's per-cluster graphs")
    parser.add_argument("--write-results", action="store_true", help="replace the section in bench/RESULTS.md")
    args = parser.parse_args()
    store_rows = [r for s in args.store for r in bench_store(s, args.cold_repeat)]
    engine_rows = [dict(r, store=s.name) for s in args.store if args.engines for r in bench_engines(s)]
    anchor_rows = [r for n in args.anchor_layers for r in bench_anchor(n, args.timeout_s)]
    if args.write_results:
        cmd = "python bench/bench_svg.py " + " ".join(
            [f"--store {s}" for s in args.store] + [f"--anchor-layers {n}" for n in args.anchor_layers]
            + [f"--timeout-s {args.timeout_s:g}"] + (["--engines"] if args.engines else []) + ["--write-results"])
        write_results(store_rows, anchor_rows, engine_rows, cmd)


if __name__ == "__main__":
    main()
