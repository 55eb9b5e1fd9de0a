"""Edge crossings of the graph view's layout on the 12-layer GPT-2 graphs (issue 23 item 3).

Usage: ``python bench/bench_crossings.py [STORE]`` (default: tests/data/gpt2_inductor/gpt2.db.gz
unpacked to a temporary file and brought to the current schema). For the AOT forward and backward
graphs, at the default view (``max_depth`` auto) and with every cluster open (``max_depth=99``),
prints per render, read back from the SVG itself:

* ``crossings``: pairs of edge segments of different edges that cross (a shared end point is not
  a crossing);
* ``through boxes``: edge segments passing through the inside of a node box or a cluster box that
  is neither end of the edge nor a cluster holding an end (shrunk by 2 px, so touching a border
  does not count);
* ``upward``: edges drawn against the top-to-bottom data flow (their end above their start);
* the render time (s, wall, one render, no cache).
"""

from __future__ import annotations

import gzip
import shutil
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SVG = "{http://www.w3.org/2000/svg}"


def _segments(svg: str):
    root = ET.fromstring(svg.encode())
    rects: list[tuple[str, tuple[float, float, float, float]]] = []
    for g in root.iter(f"{SVG}g"):
        cls = g.get("class") or ""
        if "node" in cls.split() or "cluster" in cls.split():
            r = g.find(f"{SVG}rect")
            end = g.get("data-name") or "cluster:" + (g.get("data-path") or "")
            x, y, w, h = (float(r.get(k)) for k in ("x", "y", "width", "height"))
            rects.append((end, (x, y, x + w, y + h)))
    edges = []
    for g in root.iter(f"{SVG}g"):
        if "edge" in (g.get("class") or "").split():
            d = g.find(f"{SVG}path").get("d")
            pts = [tuple(map(float, p.split(","))) for p in d.replace("M", "").split(" L")]
            edges.append((g.get("data-src"), g.get("data-dst"), pts))
    return rects, edges


def _cross(a0, a1, b0, b1) -> np.ndarray:
    """Proper intersections between segments a0→a1 (n×2) and b0→b1 (m×2): n×m bool."""
    def orient(p, q, r):
        return np.sign((q[..., 0] - p[..., 0]) * (r[..., 1] - p[..., 1]) - (q[..., 1] - p[..., 1]) * (r[..., 0] - p[..., 0]))
    A0, A1 = a0[:, None, :], a1[:, None, :]
    B0, B1 = b0[None, :, :], b1[None, :, :]
    o1, o2 = orient(A0, A1, B0), orient(A0, A1, B1)
    o3, o4 = orient(B0, B1, A0), orient(B0, B1, A1)
    return (o1 * o2 < 0) & (o3 * o4 < 0)


def measure(svg: str) -> dict:
    rects, edges = _segments(svg)
    seg_a, seg_b, owner = [], [], []
    for k, (_s, _d, pts) in enumerate(edges):
        for p, q in zip(pts, pts[1:]):
            seg_a.append(p)
            seg_b.append(q)
            owner.append(k)
    a0, a1, own = np.array(seg_a), np.array(seg_b), np.array(owner)
    crossings = 0
    for start in range(0, len(a0), 2000):
        hit = _cross(a0[start:start + 2000], a1[start:start + 2000], a0, a1)
        hit &= own[start:start + 2000, None] != own[None, :]
        crossings += int(hit.sum())
    crossings //= 2
    through = 0
    names = [name for name, _ in rects]
    boxes = np.array([r for _, r in rects]) + np.array([2.0, 2.0, -2.0, -2.0])  # shrunk: a touch is no crossing
    c0 = np.concatenate([boxes[:, [0, 1]], boxes[:, [2, 1]], boxes[:, [2, 3]], boxes[:, [0, 3]]])
    c1 = np.concatenate([boxes[:, [2, 1]], boxes[:, [2, 3]], boxes[:, [0, 3]], boxes[:, [0, 1]]])
    nb = len(boxes)
    for src, dst, pts in edges:
        p, q = np.array(pts[:-1]), np.array(pts[1:])
        sides = _cross(p, q, c0, c1).any(axis=0).reshape(4, nb).any(axis=0)
        inside = ((p[:, None, 0] > boxes[None, :, 0]) & (p[:, None, 0] < boxes[None, :, 2])
                  & (p[:, None, 1] > boxes[None, :, 1]) & (p[:, None, 1] < boxes[None, :, 3])).any(axis=0)
        e = np.array([pts[0], pts[-1]])
        holds = ((e[:, None, 0] >= boxes[None, :, 0] - 2) & (e[:, None, 0] <= boxes[None, :, 2] + 2)
                 & (e[:, None, 1] >= boxes[None, :, 1] - 2) & (e[:, None, 1] <= boxes[None, :, 3] + 2)).any(axis=0)
        hit = (sides | inside) & ~holds & (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
        through += int(any(hit[i] and names[i] not in (src, dst) for i in np.flatnonzero(hit)))
    upward = sum(1 for _s, _d, pts in edges if pts[-1][1] < pts[0][1] - 1)
    return {"edges": len(edges), "crossings": crossings, "through_boxes": through, "upward": upward}


def main() -> None:
    from sqlalchemy.orm import Session

    from graphdeck.server.render.svg import render_graph_svg
    from graphdeck.server.routes.graphs import drawn_view
    from graphdeck.store.db import open_engine

    if len(sys.argv) > 1:
        store = Path(sys.argv[1])
    else:
        from tests.trace_helpers import _upgrade

        store = Path(tempfile.mkdtemp()) / "gpt2.db"
        with gzip.open(REPO / "tests/data/gpt2_inductor/gpt2.db.gz", "rb") as src, open(store, "wb") as dst:
            shutil.copyfileobj(src, dst)
        _upgrade(store)
    engine = open_engine(store)
    print("| graph | view | items | edges | crossings | through boxes | upward | render s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    with Session(engine) as session:
        from graphdeck.store.schema import Graph

        for g in session.query(Graph).filter(Graph.kind.in_(("aot_forward", "aot_backward"))).order_by(Graph.id):
            view = drawn_view(session, g.id)
            for depth in (None, 99):
                t = time.perf_counter()
                svg = render_graph_svg(view, max_depth=depth, max_items=10**9)
                took = time.perf_counter() - t
                m = measure(svg)
                items = svg.count('<g id="node-') + svg.count('class="cluster collapsed')
                print(f"| {g.name} ({g.num_nodes} nodes) | {'auto' if depth is None else 'all open'} | {items} | "
                      f"{m['edges']} | {m['crossings']} | {m['through_boxes']} | {m['upward']} | {took:.2f} |")


if __name__ == "__main__":
    main()
