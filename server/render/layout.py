"""Which part of a graph is visible, and where it goes: module clusters, expansion, layered layout.

A :class:`~graphdeck.analysis.graphs.view.GraphView` is turned into a *cluster tree* once
(:class:`Prepared`: one :class:`Cluster` per module-path prefix, with node counts and parameter
bytes); a view state (``max_depth``, clusters expanded or collapsed by hand, a node that must be
shown) then picks the *open* clusters. Only what is visible is laid out: a collapsed cluster is one
box, an open cluster is laid out on its own (its direct nodes and its child clusters as boxes) and
then placed as one box in its parent. Each open cluster's layout is cached by graph key + cluster +
the open clusters below it, so expanding one block re-lays out only the block and its ancestors.

# NOTE: [Layout engine]
Graphviz ``dot`` (2.43) needs ~1 s for 500 nodes and minutes past 2,000, and fails on forward and
backward nodes sharing clusters; a layout per open cluster keeps every layout small, and each is
computed by igraph's Sugiyama layout (``Graph.layout_sugiyama``, C: longest-path layers given here,
barycenter crossing reduction; long edges are chains of dummy vertices made here, NOTE: [Edge
routes] in :func:`layered`). igraph places unit-width vertices;
widths are applied here by pushing each layer's boxes right in igraph's order (order, and so the
crossings, are igraph's). Numbers in ``bench/RESULTS.md``.

# NOTE: [Edges between clusters]
An edge is drawn in the lowest open cluster holding both ends, between the members of that
cluster that hold them (a node, a collapsed cluster or an open cluster's box), with the bytes of
every edge it stands for summed. So an edge never crosses a cluster border, and 300 saved
activations from 12 blocks into one ``output`` node are 12 edges, not 300.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field

import igraph

from graphdeck.analysis.graphs.view import GraphView, ViewNode

#: With no ``max_depth`` given, open clusters level by level while at most this many items show.
AUTO_VISIBLE_ITEMS = 400
#: Layout units (SVG px).
CHAR_W = 6.2
NODE_H = 30.0
HGAP = 14.0
VGAP = 26.0
PAD = 10.0
LABEL_H = 16.0
UNIT = 46.0  # igraph's x unit
DUMMY_W = 6.0
MAX_LABEL_CHARS = 40
#: More members than this and no edge between any two: laid out as a grid (``_grid``).
GRID_MIN = 12


@dataclass
class Cluster:
    """One module-path prefix ``a/b`` (the root is ``()``)."""

    path: tuple[str, ...]
    key: int  # index in the sorted list of all paths: the SVG's ``cluster-<key>``
    children: list[tuple[str, ...]] = field(default_factory=list)
    nodes: list[int] = field(default_factory=list)  # direct node idxs, sorted
    total_nodes: int = 0
    param_bytes: int = 0


@dataclass
class Prepared:
    """The cluster tree and adjacency of one view; independent of any view state."""

    view: GraphView
    by_idx: dict[int, ViewNode]
    by_name: dict[str, int]
    edges: list[tuple[int, int, int]]  # (src idx, dst idx, bytes)
    clusters: dict[tuple[str, ...], Cluster]
    node_path: dict[int, tuple[str, ...]]


def split_path(namespace: str | None) -> tuple[str, ...]:
    return tuple(p for p in (namespace or "").split("/") if p)


def prepare(view: GraphView) -> Prepared:
    """Build the cluster tree of ``view`` (O(nodes + edges + clusters × depth))."""
    by_idx = {n.idx: n for n in view.nodes}
    by_name = {n.id: n.idx for n in view.nodes}
    edges = sorted((by_name[e.src], by_name[e.dst], e.size_bytes or 0) for e in view.edges
                   if e.src in by_name and e.dst in by_name)
    spaces: dict[str | None, tuple[str, ...]] = {}
    node_path = {}
    for n in view.nodes:
        p = spaces.get(n.namespace)
        if p is None:
            p = spaces[n.namespace] = split_path(n.namespace)
        node_path[n.idx] = p
    paths = {()}
    for p in spaces.values():
        paths.update(p[:d] for d in range(1, len(p) + 1))
    ordered = sorted(paths)
    clusters = {p: Cluster(p, k) for k, p in enumerate(ordered)}
    for p in ordered:
        if p:
            clusters[p[:-1]].children.append(p)
    for idx in sorted(node_path):
        c = clusters[node_path[idx]]
        c.nodes.append(idx)
        node = by_idx[idx]
        c.total_nodes += 1
        if node.param_fqn:
            c.param_bytes += node.size_bytes or 0
    for p in sorted(ordered, key=len, reverse=True):  # children before parents
        c = clusters[p]
        for child in c.children:
            c.total_nodes += clusters[child].total_nodes
            c.param_bytes += clusters[child].param_bytes
    return Prepared(view, by_idx, by_name, edges, clusters, node_path)


def auto_depth(prep: Prepared, budget: int = AUTO_VISIBLE_ITEMS) -> int | None:
    """The deepest ``max_depth`` whose view shows at most ``budget`` items (``None``: all fit)."""
    deepest = max((len(p) for p in prep.clusters), default=0)
    best = 0
    for depth in range(deepest + 1):
        nodes = sum(1 for p in prep.node_path.values() if len(p) <= depth)
        boxes = sum(1 for p in prep.clusters if len(p) == depth + 1)
        if nodes + boxes > budget:
            return best
        best = depth
    return None


def open_clusters(prep: Prepared, max_depth: int | None, expand=(), collapse=(), focus: str | None = None) -> frozenset:
    """The open cluster paths: depth ≤ ``max_depth`` (all when ``None``), plus every cluster in
    ``expand`` and the clusters of ``focus`` (with their ancestors), minus ``collapse`` and
    whatever lies under a closed cluster. Unknown paths are ignored."""
    wanted = {p for p in prep.clusters if max_depth is None or len(p) <= max_depth}
    extra = [split_path(p) for p in expand]
    if focus is not None and focus in prep.by_name:
        extra.append(prep.node_path[prep.by_name[focus]])
    for p in extra:
        wanted.update(p[:d] for d in range(len(p) + 1) if p[:d] in prep.clusters)
    wanted -= {split_path(p) for p in collapse if split_path(p)}
    wanted.add(())
    return frozenset(p for p in wanted if all(p[:d] in wanted for d in range(len(p))))


def item_of(path: tuple[str, ...], opened: frozenset) -> tuple[str, ...] | None:
    """The collapsed cluster that hides a node of ``path``, or ``None`` when the node shows."""
    for d in range(1, len(path) + 1):
        if path[:d] not in opened:
            return path[:d]
    return None


@dataclass
class Box:
    """A laid-out open cluster in its own coordinates (top-left 0, 0)."""

    w: float
    h: float
    # member id → (x, y, w, h) of its top-left corner; "n<idx>" nodes, ("c", path) clusters
    members: dict
    # (member u, member v) → (points [(x, y)], bytes, count)
    edges: dict
    children: dict = field(default_factory=dict)  # open child path → its Box


def node_size(node: ViewNode, lines: list[str]) -> tuple[float, float]:
    width = max(len(t) for t in lines) * CHAR_W + 16
    return max(36.0, min(width, MAX_LABEL_CHARS * CHAR_W + 16)), NODE_H if len(lines) > 1 else 20.0


def cluster_edges(prep: Prepared, opened: frozenset) -> dict[tuple, dict[tuple, list[int]]]:
    """Per open cluster: (member u, member v) → [bytes, count] of the edges drawn there
    (see NOTE: [Edges between clusters]). The lift is computed once per pair of module paths."""
    out: dict[tuple, dict[tuple, list[int]]] = defaultdict(dict)
    memo: dict[tuple, tuple] = {}
    node_path = prep.node_path
    for src, dst, nbytes in prep.edges:
        key = (node_path[src], node_path[dst])
        lift = memo.get(key)
        if lift is None:
            lift = memo[key] = _lift(key[0], key[1], opened)
        lca, mu, mv = lift
        mu = src if mu is None else mu
        mv = dst if mv is None else mv
        if mu == mv:
            continue
        slot = out[lca].get((mu, mv))
        if slot is None:
            slot = out[lca][(mu, mv)] = [0, 0]
        slot[0] += nbytes
        slot[1] += 1
    return out


def _lift(ps: tuple[str, ...], pd: tuple[str, ...], opened: frozenset) -> tuple:
    """(lowest open cluster holding both ends, member there for the source or ``None`` for the
    node itself, same for the destination)."""
    hs, hd = item_of(ps, opened), item_of(pd, opened)
    cs = hs[:-1] if hs is not None else ps  # the open cluster holding the visible item
    cd = hd[:-1] if hd is not None else pd
    common = 0
    while common < min(len(cs), len(cd)) and cs[common] == cd[common]:
        common += 1
    mu = ("c", cs[: common + 1]) if len(cs) > common else (("c", hs) if hs is not None else None)
    mv = ("c", cd[: common + 1]) if len(cd) > common else (("c", hd) if hd is not None else None)
    return cs[:common], mu, mv


def _layers(n: int, edges: list[tuple[int, int]]) -> list[int]:
    """Longest-path layers after dropping a feedback arc set (Eades–Lin–Smyth, igraph), then every
    source pulled down to just above its nearest consumer (a saved activation sits by its use)."""
    dag = igraph.Graph(n=n, edges=edges, directed=True)
    dropped = set(dag.feedback_arc_set(method="eades")) if not dag.is_dag() else set()
    preds: dict[int, list[int]] = defaultdict(list)
    succs: dict[int, list[int]] = defaultdict(list)
    for k, (u, v) in enumerate(edges):
        if k not in dropped and u != v:
            preds[v].append(u)
            succs[u].append(v)
    indeg = {m: len(preds[m]) for m in range(n)}
    ready = sorted(m for m in range(n) if indeg[m] == 0)
    layer = [0] * n
    topo = []
    while ready:
        m = ready.pop()
        topo.append(m)
        for c in succs[m]:
            layer[c] = max(layer[c], layer[m] + 1)
            indeg[c] -= 1
            if indeg[c] == 0:
                ready.append(c)
    for m in reversed(topo):
        if not preds[m] and succs[m]:
            layer[m] = max(0, min(layer[c] for c in succs[m]) - 1)
    return layer


def _grid(sizes: list[tuple[float, float]]) -> tuple[list, list, float, float]:
    """Members without any edge between them (the parameters' boxes of an optimizer step) in rows
    of about ``sqrt(3 n)``, in member order, instead of one layer thousands of px wide."""
    cols = max(1, math.ceil(math.sqrt(3 * len(sizes))))
    corners, x, y, row_h, width = [], 0.0, 0.0, 0.0, 0.0
    for i, (w, h) in enumerate(sizes):
        if i and i % cols == 0:
            x, y, row_h = 0.0, y + row_h + VGAP, 0.0
        corners.append((x, y))
        x += w + HGAP
        row_h = max(row_h, h)
        width = max(width, x - HGAP)
    return corners, [], width, y + row_h


def layered(sizes: list[tuple[float, float]], edges: list[tuple[int, int]]) -> tuple[list, list, float, float]:
    """Lay out members ``0..n-1`` (sizes ``(w, h)``) top to bottom.

    Layers from :func:`_layers` (from the edges alone, not graph order: placeholders sit at the top
    of every FX graph); igraph orders each layer (barycenter), long edges pass through dummy
    vertices (NOTE: [Edge routes]); members without any edge form a grid (:func:`_grid`).
    Returns (top-left corner per member, points per edge from its source to its destination,
    width, height).
    """
    n = len(sizes)
    if n == 0:
        return [], [], 0.0, 0.0
    if not edges and n > GRID_MIN:
        return _grid(sizes)
    layer = _layers(n, edges)
    # NOTE: [Edge routes]: a long edge is a chain of our own dummy vertices, one per layer it
    # passes (igraph's own edge_routing misses layers for edges against the layering); igraph
    # orders every layer with them. Through a layer an edge then runs straight down its dummy's
    # column (kept clear of the boxes), slanting only across the gaps between layers, where no box
    # is: so it never cuts through a box beside it, however tall.
    chain, vlayer, dummies = [], list(layer), {}
    for k, (u, v) in enumerate(edges):
        if layer[u] == layer[v]:
            continue
        a, b = (u, v) if layer[u] < layer[v] else (v, u)
        prev, ds = a, []
        for lv in range(layer[a] + 1, layer[b]):
            ds.append(len(vlayer))
            vlayer.append(lv)
            chain.append((prev, ds[-1]))
            prev = ds[-1]
        chain.append((prev, b))
        dummies[k] = ds
    g = igraph.Graph(n=len(vlayer), edges=chain, directed=True)
    coords = g.layout_sugiyama(layers=vlayer, hgap=1, vgap=1, maxiter=30).coords
    nlayers = max(layer) + 1
    layer_h = [0.0] * nlayers
    for m in range(n):
        layer_h[layer[m]] = max(layer_h[layer[m]], sizes[m][1])
    top = [0.0] * nlayers
    for lv in range(1, nlayers):
        top[lv] = top[lv - 1] + layer_h[lv - 1] + VGAP
    bottom = [top[lv] + layer_h[lv] for lv in range(nlayers)]
    # per layer: (igraph x, width, kind, vertex) sorted by x; pushed right so widths never overlap
    rows: dict[int, list] = defaultdict(list)
    for m, lv in enumerate(vlayer):
        rows[lv].append((coords[m][0], sizes[m][0], 0, m) if m < n else (coords[m][0], DUMMY_W, 1, m))
    left: dict = {}
    min_left = float("inf")
    for lv, row in rows.items():
        row.sort(key=lambda r: (r[0], r[2], r[3]))
        edge_right = -float("inf")
        for x, w, kind, m in row:
            x0 = max(x * UNIT - w / 2, edge_right + (HGAP if kind == 0 else 2))
            left[m] = x0
            edge_right = x0 + w
            min_left = min(min_left, x0)
    shift = -min_left
    corners = []
    width = 0.0
    for m in range(n):
        x0 = left[m] + shift
        y0 = top[layer[m]]  # top-aligned: a tall open cluster must not push its layer-mates down
        corners.append((x0, y0))
        width = max(width, x0 + sizes[m][0])
    for m in range(n, len(vlayer)):
        width = max(width, left[m] + shift + DUMMY_W)
    height = top[-1] + layer_h[-1]
    points = []
    for k, (u, v) in enumerate(edges):
        (ux, uy), (vx, vy) = corners[u], corners[v]
        uw, uh = sizes[u]
        vw, vh = sizes[v]
        if layer[u] == layer[v]:  # same layer: side to side
            points.append([(ux + uw, uy + uh / 2), (vx, vy + vh / 2)] if ux < vx else [(ux, uy + uh / 2), (vx + vw, vy + vh / 2)])
            continue
        (a, ax, ay, aw, ah), (b, bx, by, bw, _bh) = sorted(((u, ux, uy, uw, uh), (v, vx, vy, vw, vh)), key=lambda t: layer[t[0]])
        down = [(ax + aw / 2, ay + ah)] + ([(ax + aw / 2, bottom[layer[a]])] if ay + ah < bottom[layer[a]] else [])
        for d in dummies[k]:
            x = left[d] + shift + DUMMY_W / 2
            down += [(x, top[vlayer[d]]), (x, bottom[vlayer[d]])]
        down.append((bx + bw / 2, by))
        points.append(down if a == u else down[::-1])  # an edge against the layering is drawn from its lower end up
    return corners, points, width, height


class LayoutCache:
    """Laid-out open clusters keyed by (graph key, cluster path, open clusters below it); LRU."""

    def __init__(self, max_entries: int = 4096):
        self.max_entries = max_entries
        self._entries: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key):
        with self._lock:
            box = self._entries.get(key)
            if box is not None:
                self._entries.move_to_end(key)
            return box

    def put(self, key, box: Box) -> None:
        with self._lock:
            self._entries[key] = box
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)


def layout_cluster(prep: Prepared, path: tuple[str, ...], opened: frozenset, edges_at: dict,
                   node_lines, collapsed_size, cache: LayoutCache | None, graph_key: str) -> Box:
    """Lay out open cluster ``path`` (recursively its open children first)."""
    below = tuple(sorted(p for p in opened if p[: len(path)] == path and p != path))
    key = (graph_key, path, below)
    if cache is not None:
        box = cache.get(key)
        if box is not None:
            return box
    cluster = prep.clusters[path]
    members: list = list(cluster.nodes)
    sizes: list[tuple[float, float]] = [node_size(prep.by_idx[i], node_lines(prep.by_idx[i])) for i in cluster.nodes]
    child_boxes = {}
    for child in cluster.children:
        if child in opened:
            box = layout_cluster(prep, child, opened, edges_at, node_lines, collapsed_size, cache, graph_key)
            child_boxes[child] = box
            sizes.append((box.w, box.h))
        else:
            sizes.append(collapsed_size(child))
        members.append(("c", child))
    index = {m: i for i, m in enumerate(members)}
    pairs = sorted(edges_at.get(path, {}).items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1])))
    e_list = [(index[u], index[v]) for (u, v), _ in pairs if u in index and v in index]
    corners, points, w, h = layered(sizes, e_list)
    top = LABEL_H if path else 0.0
    members_out = {m: (corners[i][0] + PAD, corners[i][1] + PAD + top, sizes[i][0], sizes[i][1]) for i, m in enumerate(members)}
    edges_out = {}
    k = 0
    for (u, v), (nbytes, count) in pairs:
        if u in index and v in index:
            edges_out[(u, v)] = ([(x + PAD, y + PAD + top) for x, y in points[k]], nbytes, count)
            k += 1
    box = Box(w=w + 2 * PAD, h=h + 2 * PAD + top, members=members_out, edges=edges_out)
    if path:
        box.w = max(box.w, len(path[-1]) * CHAR_W + 2 * PAD)
    box.children = child_boxes
    if cache is not None:
        cache.put(key, box)
    return box
