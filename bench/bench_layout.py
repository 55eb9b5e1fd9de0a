"""The parallel map and the per-mesh-dimension rank check at 1,024 ranks (issue 20 benchmark).

Input, generated from a real capture: ``tests/programs/nd_fsdp_tp.py`` runs under torchrun (4 gloo
ranks, a 2 x 2 ``("dp", "tp")`` mesh, FSDP2 x ``ColwiseParallel``/``RowwiseParallel``, compiled
with ``aot_eager``, captured by the Agent) — or ``--source STORE`` reuses such a store. Its run is
generalised to a 8 pp x 16 dp x 8 tp job (1,024 ranks, run ``bench_1024``): rank r at (pp, dp, tp)

* gets the captured rank ``tp % 2``'s graphs (rows, nodes, edges, bindings), its collectives'
  group name rewritten to r's tp group (``tp.<pp>.<dp>``) and each graph's structural hash
  re-derived from (captured hash, that name), so TP groups and stages hold distinct graphs as a
  real job's do; its parameter rows and compile records (``graphdeck_process_groups`` and
  ``graphdeck_comm_groups`` rewritten for the 1,024-rank world);
* gets a layout record (``graphdeck_parallel_layout``) built from the captured rank's: the
  ``(pp, dp, tp)`` mesh with each dimension's group, the same parameters with their global
  shapes scaled so the local shapes are the captured ones, the same FSDP2 groups, TP styles and
  regions, and a pipeline record (stage ``pp`` of 8, ``Schedule1F1B``, 16 microbatches).

Flight Recorder dumps and traces are not generalised (the hang and straggler badges say
unknown): bench_flight.py measures Flight Recorder at 1,024 ranks.

Timed, each ``--repeats`` times in a fresh session (CPU s from ``time.process_time``, wall s):
``load_layout``; the layout's peer sets (``program_peers``, ``replica_peers``, ``dim_groups``);
the map's first picture (``parallel_map(checks=["layout"])``); ``rank_report`` (check-ranks,
per mesh dimension); ``gradient_report`` (check-grads); the full map (every check). Then the page in Chromium (``--browser``):
per repeat a fresh page of ``#/runs/bench_1024/map`` (and ``?expand=1``, every replica row: 1,024
cells); the renderer's main-thread task time (CDP ``Performance.getMetrics`` ``TaskDuration``), and
from the page's own clock the time from the first answer's last byte to the drawn picture (layout
forced), and from the full answer's to the complete one (see :func:`bench_browser`).

    python bench/bench_layout.py [--source STORE] [--repeats 3] [--full-repeats 3] [--no-check]
                                 [--browser] [--keep DIR [--reuse]]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
MESH = (8, 16, 8)  # pp, dp, tp
DIMS = ("pp", "dp", "tp")
RUN = "bench_1024"
#: Compile records copied as they are (the others are rewritten or left out).
COPIED_EVENTS = ("compilation_metrics", "bwd_compilation_metrics", "dynamo_start", "dynamo_graph_break_reason",
                 "graphdeck_watch", "graphdeck_grads_observed", "graphdeck_evidence_off")


def capture(store: Path) -> None:
    """The 4-rank FSDP2 x TP job, captured into ``store`` (run ``nd_fsdp_tp``)."""
    # The repository on the ranks' path too (an editable install's finder may point elsewhere).
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           str(REPO / "tests" / "programs" / "nd_fsdp_tp.py"), str(store)]
    subprocess.run(cmd, check=True, env=env, cwd=REPO, capture_output=True, timeout=900)


def _groups(arr: np.ndarray, coord: tuple) -> list[dict]:
    out = []
    for axis, name in enumerate(DIMS):
        idx = list(coord)
        idx[axis] = slice(None)
        members = arr[tuple(idx)].tolist()
        rest = ".".join(str(c) for a, c in enumerate(coord) if a != axis)
        out.append({"dim": name, "name": f"{name}.{rest}", "desc": f"mesh_{name}", "ranks": members})
    return out


def layout_for(src: dict, rank: int, arr: np.ndarray, coord: tuple) -> dict:
    """The captured rank's record ``src`` generalised to ``rank`` at ``coord`` of mesh ``arr``."""
    old = {d: n for m in src["meshes"] for d, n in zip(m["dim_names"], m["shape"])}
    new = dict(zip(DIMS, arr.shape))
    params = []
    for p in src.get("params") or []:
        glob = list(p["global_shape"])
        for dim, pl in zip(p["mesh_dims"], p["placements"]):
            if str(pl).startswith("Shard("):  # scale the sharded size: the local shape stays the captured one
                d = int(str(pl)[6:-1]) % len(glob)
                glob[d] = glob[d] * new[dim] // old[dim]
        params.append({**p, "mesh": "mesh0", "global_shape": glob})
    pp, dp, tp = coord
    stage_ranks = arr[:, dp, tp].tolist()
    return {"version": 1, "rank": rank, "world_size": int(arr.size),
            "meshes": [{"key": "mesh0", "device_type": src["meshes"][0].get("device_type"), "shape": list(arr.shape),
                        "dim_names": list(DIMS), "ranks": arr.tolist(), "coord": list(coord),
                        "dim_groups": _groups(arr, coord)}],
            "params": params,
            "fsdp_groups": [{**g, "mesh": "mesh0"} for g in src.get("fsdp_groups") or []],
            "tp": [{**t, "mesh": "mesh0"} for t in src.get("tp") or []],
            "pipeline": {"stage_index": pp, "num_stages": arr.shape[0], "stage_ranks": stage_ranks,
                         "group": f"pp.{dp}.{tp}", "schedule": "Schedule1F1B", "n_microbatches": 16,
                         "params": [p["fqn"] for p in params]},
            "regions": src.get("regions") or []}


def generalise(source: Path, out: Path) -> int:
    """Copy ``source`` to ``out`` and add run ``bench_1024`` (see the module docstring); returns
    its run id."""
    src_db = sqlite3.connect(source)
    db = sqlite3.connect(out)
    src_db.backup(db)
    src_db.close()
    run_id, created, meta = db.execute("SELECT id, created_at, meta_json FROM runs ORDER BY id LIMIT 1").fetchone()
    ws = int(np.prod(MESH))
    arr = np.arange(ws).reshape(MESH)
    new_run = db.execute("INSERT INTO runs (name, world_size, created_at, meta_json) VALUES (?, ?, ?, ?)",
                         (RUN, ws, created, meta)).lastrowid
    rank_cols = [c[1] for c in db.execute("PRAGMA table_info(ranks)") if c[1] not in ("id", "run_id", "rank",
                                                                                     "world_size", "hostname")]
    graph_cols = [c[1] for c in db.execute("PRAGMA table_info(graphs)")
                  if c[1] not in ("id", "run_id", "rank", "parent_id", "structural_hash")]
    node_cols = [c[1] for c in db.execute("PRAGMA table_info(nodes)") if c[1] not in ("id", "graph_id", "args_json")]
    edge_cols = [c[1] for c in db.execute("PRAGMA table_info(edges)") if c[1] not in ("id", "graph_id")]
    io_cols = [c[1] for c in db.execute("PRAGMA table_info(graph_io)") if c[1] not in ("id", "graph_id")]
    param_cols = [c[1] for c in db.execute("PRAGMA table_info(params)") if c[1] not in ("id", "run_id", "rank")]
    layouts = {r: json.loads(p) for r, p in db.execute(
        "SELECT rank, payload FROM compile_events WHERE run_id = ? AND name = 'graphdeck_parallel_layout' ORDER BY id",
        (run_id,))}
    src_tp_group = {}
    for r, rec in layouts.items():
        src_tp_group[r] = next(g["name"] for g in rec["meshes"][0]["dim_groups"] if g["dim"] == "tp")
    graphs = {r: db.execute(f"SELECT id, parent_id, structural_hash, {', '.join(graph_cols)} FROM graphs "
                            "WHERE run_id = ? AND rank = ? ORDER BY id", (run_id, r)).fetchall() for r in (0, 1)}
    events = {r: db.execute(f"SELECT name, compile_id, metadata_json, payload FROM compile_events WHERE run_id = ? "
                            f"AND rank = ? AND name IN ({', '.join('?' * len(COPIED_EVENTS))}) ORDER BY id",
                            (run_id, r, *COPIED_EVENTS)).fetchall() for r in (0, 1)}
    comm = {r: json.loads(db.execute("SELECT payload FROM compile_events WHERE run_id = ? AND rank = ? "
                                     "AND name = 'graphdeck_comm_groups' ORDER BY id DESC", (run_id, r)).fetchone()[0])
            for r in (0, 1)}
    for rank in range(ws):
        coord = tuple(int(x) for x in np.argwhere(arr == rank)[0])
        pp, dp, tp = coord
        src = tp % 2
        tp_name = f"tp.{pp}.{dp}"
        db.execute(f"INSERT INTO ranks (run_id, rank, world_size, hostname, {', '.join(rank_cols)}) "
                   f"SELECT ?, ?, ?, ?, {', '.join(rank_cols)} FROM ranks WHERE run_id = ? AND rank = ?",
                   (new_run, rank, ws, f"node{rank // 8}", run_id, src))
        ids: dict[int, int] = {}
        for row in graphs[src]:
            gid, parent, digest, rest = row[0], row[1], row[2], row[3:]
            new_hash = None if digest is None else hashlib.sha256(f"{digest}|{tp_name}".encode()).hexdigest()[:len(digest)]
            new = db.execute(f"INSERT INTO graphs (run_id, rank, parent_id, structural_hash, {', '.join(graph_cols)}) "
                             f"VALUES (?, ?, ?, ?, {', '.join('?' * len(graph_cols))})",
                             (new_run, rank, ids.get(parent), new_hash, *rest)).lastrowid
            ids[gid] = new
            old_name = json.dumps(src_tp_group[src])
            db.execute(f"INSERT INTO nodes (graph_id, args_json, {', '.join(node_cols)}) SELECT ?, "
                       f"replace(args_json, ?, ?), {', '.join(node_cols)} FROM nodes WHERE graph_id = ?",
                       (new, f", {old_name}]", f", {json.dumps(tp_name)}]", gid))
            db.execute(f"INSERT INTO edges (graph_id, {', '.join(edge_cols)}) SELECT ?, {', '.join(edge_cols)} "
                       "FROM edges WHERE graph_id = ?", (new, gid))
            db.execute(f"INSERT INTO graph_io (graph_id, {', '.join(io_cols)}) SELECT ?, {', '.join(io_cols)} "
                       "FROM graph_io WHERE graph_id = ?", (new, gid))
        db.execute(f"INSERT INTO params (run_id, rank, {', '.join(param_cols)}) SELECT ?, ?, {', '.join(param_cols)} "
                   "FROM params WHERE run_id = ? AND rank = ?", (new_run, rank, run_id, src))
        rows = [(new_run, rank, name, cid, md, payload) for name, cid, md, payload in events[src]]
        groups = [{"name": "0", "desc": "default_pg", "backend": "gloo", "ranks": list(range(ws)), "timeout_s": 120.0}]
        groups += [{"name": g["name"], "desc": g["desc"], "backend": "gloo", "ranks": g["ranks"], "timeout_s": 1800.0}
                   for g in _groups(arr, coord)]
        rows.append((new_run, rank, "graphdeck_process_groups", None, "{}", json.dumps({"groups": groups})))
        rows.append((new_run, rank, "graphdeck_comm_groups", None, "{}", json.dumps({**comm[src], "world_size": ws})))
        rows.append((new_run, rank, "graphdeck_parallel_layout", None, "{}",
                     json.dumps(layout_for(layouts[src], rank, arr, coord))))
        db.executemany("INSERT INTO compile_events (run_id, rank, name, compile_id, metadata_json, payload) "
                       "VALUES (?, ?, ?, ?, ?, ?)", rows)
    db.commit()
    db.close()
    return new_run


def timed(fn, repeats: int) -> tuple[list[float], list[float], object]:
    """``fn()`` ``repeats`` times: (CPU s list, wall s list, last result)."""
    cpu, wall, out = [], [], None
    for _ in range(repeats):
        c0, w0 = time.process_time(), time.perf_counter()
        out = fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return cpu, wall, out


def fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}–{max(xs):.3f})"


def bench_analysis(store: Path, repeats: int, full_repeats: int, check: bool = True) -> dict:
    from sqlalchemy.orm import Session

    from graphdeck.analysis.gradients.core import gradient_report
    from graphdeck.analysis.parallel.layout import load_layout
    from graphdeck.analysis.ranks.core import rank_report
    from graphdeck.server.routes.parallel_map import parallel_map
    from graphdeck.store.db import open_engine
    from graphdeck.store.schema import Run

    engine = open_engine(store, read_only=True)

    def in_session(fn):
        def go():
            with Session(engine) as s:
                return fn(s, s.query(Run).filter_by(name=RUN).one())
        return go

    def peers(s, run):
        lay = load_layout(s, run.id)
        return (len(lay.program_peers()), len(lay.replica_peers()), {d: len(lay.dim_groups(d)) for d in DIMS})

    results = {}
    for label, fn, n in [
        ("load_layout", lambda s, run: load_layout(s, run.id).world_size, repeats),
        ("load_layout + program_peers, replica_peers, dim_groups", peers, repeats),
        ("map, first picture (parallel_map checks=layout)",
         lambda s, run: len(json.dumps(parallel_map(s, run, checks=["layout"]))), repeats),
        ("rank_report = check-ranks per mesh dimension", lambda s, run: rank_report(s, run).verdict,
         repeats if check else 0),
        ("gradient_report = check-grads (the map's missing-gradient badge)",
         lambda s, run: gradient_report(s, run).verdict, repeats if check else 0),
        ("map, every check (parallel_map)", lambda s, run: parallel_map(s, run), full_repeats),
    ]:
        if not n:
            continue
        cpu, wall, out = timed(in_session(fn), n)
        results[label] = (cpu, wall, out)
        print(f"{label}: CPU {fmt(cpu)} s, wall {fmt(wall)} s", flush=True)
    full = results["map, every check (parallel_map)"][2]
    print("  full map:", len(json.dumps(full)), "bytes;", [(c["key"], c["counts"], c["message"][:160]) for c in full["checks"]])
    print("  peer sets:", results["load_layout + program_peers, replica_peers, dim_groups"][2])
    if check:
        print("  rank_report verdict:", results["rank_report = check-ranks per mesh dimension"][2],
              "gradient_report verdict:", results["gradient_report = check-grads (the map's missing-gradient badge)"][2],
              flush=True)
    return full


#: JS run before the page's own: records when the map is drawn (layout forced) and complete.
_OBSERVER = """
new MutationObserver(() => {
  if (!window.__mapDrawn && document.querySelector('[data-testid="parallel-map"]')) {
    document.body.offsetHeight; window.__mapDrawn = performance.now();
  }
  if (!window.__mapComplete && document.querySelector('[data-complete="true"] [data-testid="parallel-map"]')) {
    document.body.offsetHeight; window.__mapComplete = performance.now();
  }
}).observe(document, {childList: true, subtree: true});
"""


def bench_browser(store: Path, repeats: int, expand: bool, full: dict) -> None:
    """The page, ``repeats`` fresh pages. The first answer (the layout check) comes from the real
    server; the answer with every check is ``full`` (that server's own answer, computed once by
    :func:`bench_analysis`) served by Playwright instead of recomputed per page load, so what is
    timed is the page, not check-ranks again. The expanded page stops at its first picture (its
    full request is aborted): 1,024 cells either way."""
    import re

    sys.path.insert(0, str(REPO))
    from playwright.sync_api import sync_playwright

    from tests.conftest import CHROMIUM, CHROMIUM_ARGS, LiveServer

    suffix = "?expand=1" if expand else ""
    body = json.dumps(full)
    with LiveServer(store) as server, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        task, first, complete, load = [], [], [], []
        for _ in range(repeats):
            ctx = browser.new_context(viewport={"width": 1440, "height": 900})
            page = ctx.new_page()
            if expand:
                page.route(re.compile(r"/parallel-map\?expand=true$"), lambda route: route.abort())
            else:
                page.route(re.compile(r"/parallel-map\?expand=false$"),
                           lambda route: route.fulfill(body=body, content_type="application/json"))
            page.add_init_script(_OBSERVER)
            cdp = ctx.new_cdp_session(page)
            cdp.send("Performance.enable")
            page.goto(f"{server.url}/#/runs/{RUN}/map{suffix}")
            page.wait_for_function("window.__mapDrawn" if expand else "window.__mapComplete", timeout=600_000)
            if expand:
                page.wait_for_selector('[data-testid="map-checks-failed"]')
            metrics = {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}
            t = page.evaluate("""() => {
              const answers = performance.getEntriesByType("resource").filter((e) => e.name.includes("/parallel-map"));
              return {drawn: window.__mapDrawn, complete: window.__mapComplete || null,
                      first_end: answers[0].responseEnd, full_end: answers[answers.length - 1].responseEnd,
                      cells: document.querySelectorAll('[data-testid="map-cell"]').length};
            }""")
            task.append(metrics["TaskDuration"])
            first.append((t["drawn"] - t["first_end"]) / 1e3)
            if t["complete"] is not None:
                complete.append((t["complete"] - t["full_end"]) / 1e3)
            load.append((t["complete"] or t["drawn"]) / 1e3)
            cells = t["cells"]
            ctx.close()
        browser.close()
    print(f"page{suffix or ''} ({cells} cells): renderer main-thread task time {fmt(task)} s; "
          f"first answer → drawn {fmt(first)} s; "
          + (f"full answer → drawn {fmt(complete)} s; " if complete else "")
          + f"navigation → {'complete' if complete else 'first picture'} {fmt(load)} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", type=Path, help="a store holding a captured nd_fsdp_tp run (default: capture one)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--browser", action="store_true", help="also time the page in Chromium")
    ap.add_argument("--full-repeats", type=int, default=3,
                    help="repeats of the map with every check (minutes each at 1,024 ranks on 2 CPUs)")
    ap.add_argument("--no-check", action="store_true", help="do not time rank_report on its own")
    ap.add_argument("--keep", type=Path, help="write the stores here and keep them")
    ap.add_argument("--reuse", action="store_true", help="reuse --keep's generated store when it exists")
    args = ap.parse_args()
    if args.repeats < 3:
        ap.error("--repeats must be at least 3 (a spread, not one time)")
    if args.full_repeats < 1:
        ap.error("--full-repeats must be at least 1")
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench_layout_"))
    work.mkdir(parents=True, exist_ok=True)
    source = args.source
    big = work / "bench_1024.db"
    if args.reuse and big.exists():
        source = big  # not captured again, not generalised again
    elif source is None:
        source = work / "nd_fsdp_tp.db"
        t0 = time.perf_counter()
        capture(source)
        print(f"captured the 4-rank FSDP2 x TP job in {time.perf_counter() - t0:.1f} s", flush=True)
    if source != big:
        big.unlink(missing_ok=True)
        t0 = time.perf_counter()
        generalise(source, big)
        print(f"generalised to {MESH} = 1,024 ranks in {time.perf_counter() - t0:.1f} s "
              f"({big.stat().st_size / 2**20:.1f} MiB)", flush=True)
    full = bench_analysis(big, args.repeats, args.full_repeats, check=not args.no_check)
    if args.browser:
        bench_browser(big, args.repeats, expand=False, full=full)
        bench_browser(big, args.repeats, expand=True, full=full)
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
