"""Render a :class:`~graphdeck.analysis.graphs.view.GraphView` as SVG: module clusters that open and close,
edges weighted by bytes, op-category colours, filters, overlays and diff marks.

:func:`render_graph_svg` is pure: the same view and view state give the same bytes (members,
clusters and edges are emitted in sorted order, coordinates rounded to 0.1 px, colours from a hash
of the category name). What is laid out is only what is visible (``layout.py``: a collapsed
cluster is one box; each open cluster is laid out on its own by igraph's Sugiyama layout and
cached), so the cost follows the view, not the graph.

What the frontend can rely on in the output:

* the root ``<svg>`` has ``width="100%" height="100%"``, a ``viewBox`` (pan/zoom) and
  ``data-visible-nodes``, ``data-open-clusters`` (``|``-separated paths), ``data-matches`` /
  ``data-on-path`` (how many nodes the filter matched / keeps on paths between matches) and
  ``data-legend-h`` (drawing units the legend takes at the top);
* paint order: open cluster boxes, then edges, then nodes and collapsed boxes, so no edge is drawn
  over a node; arrowheads are sized in drawing units (:data:`ARROW_PX`), not stroke widths;
* labels longer than 40 characters end in ``…`` (``labels.py``), the ``<title>`` has the full text;
* node ``idx`` is ``<g id="node-<idx>" class="node cat-<category> …" data-name="<FX name>">``
  with a ``<title>`` (name and target); extra classes: ``collective``, ``recomputed``,
  ``dtype-change``, ``match`` / ``on-path`` / ``faded`` (filter), ``diff-added`` /
  ``diff-removed`` / ``diff-changed`` (marks);
* an open module cluster ``a/b`` is ``<g id="cluster-<k>" class="cluster open" data-path="a/b">``
  (``k``: its index among all of the graph's module paths, sorted), drawn before what it holds;
  a collapsed one is ``<g id="cluster-<k>" class="cluster collapsed" data-path="a/b"
  data-nodes="N">`` whose text says its node count, parameter bytes and overlay value (the sum
  of its nodes' values, or their maximum for an overlay whose ``aggregate`` is ``"max"``);
  a region box (``regions.py``) is such a cluster with classes ``region region-<kind>`` and
  ``data-region`` / ``data-label``;
* edge ``k`` is ``<g id="edge-<k>" class="edge [heavy]" data-src=… data-dst=… data-bytes=…>``
  where an end is a node name or ``cluster:<path>``; width and colour follow the bytes it
  carries (``palette.py``), the heaviest :data:`HEAVY_EDGES` are red; ``<g id="legend">`` says
  the scale. Edges have no labels.

Every string from user code passes through :func:`_text` (control characters and the characters
XML forbids dropped, long strings truncated as ``…[total_len=N]``: ``xmltext.py``) and is
XML-escaped as text or attribute; the finished document is :func:`~.xmltext.xml_safe` too, so a
name holding NUL or U+FFFF never makes an SVG that does not parse.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from html import escape as _esc

from graphdeck.analysis.graphs.view import CATEGORIES, GraphView
from graphdeck.analysis.parallel.overlays import Overlay
from graphdeck.server.render import layout as lay
from graphdeck.server.render.filters import compile_patterns, filter_nodes, neighbourhood
from graphdeck.server.render.labels import ellipsize, short_dtype, tensor_label  # noqa: F401 - tensor_label re-exported
from graphdeck.server.render.palette import (
    EDGE_BINS,
    EDGE_HEAVY,
    HEAT,
    QUALITATIVE,
    bin_floor,
    edge_bin,
    edge_width,
    fmt_bytes,
    fmt_ns,
    hash_slots,
    heat,
)
from graphdeck.server.render.regions import open_region_svg, region_attrs, region_map
from graphdeck.server.render.xmltext import MAX_TEXT_CHARS, XML_FORBIDDEN, xml_safe  # noqa: F401 - re-exported
from graphdeck.server.render.xmltext import attr as _attr
from graphdeck.server.render.xmltext import clean as _text

#: Above this many visible items no layout is attempted; the k-hop fallback is drawn instead.
MAX_VISIBLE_ITEMS = 6000
#: Default wall-clock budget for one render before the fallback view is answered.
DEFAULT_TIMEOUT_S = 10.0
#: Arrowhead size in drawing units (1 unit is 1 screen px at 1x zoom; a node is 20-30 units tall).
ARROW_PX = 10.0
#: How many of the heaviest edges are highlighted.
HEAVY_EDGES = 5
#: Hops around the focus node in the fallback view, and the most nodes it draws.
FALLBACK_HOPS = 2
FALLBACK_MAX_NODES = 1500

# Pastel fills, none grey (grey is reserved for placeholders and outputs).
_PALETTE = ("#a6cee3", "#b2df8a", "#fb9a99", "#fdbf6f", "#cab2d6", "#ffff99", "#8dd3c7", "#fccde5")
_PLACEHOLDER_FILL = "#eeeeee"
_OUTPUT_FILL = "#d9d9d9"
_CLUSTER_FILLS = ("#f7f7fb", "#eef0f7")
_COLLAPSED_FILL = "#dfe3f0"
_DARK_FILLS = frozenset(HEAT[-3:])  # white text on these


def _category_colors(categories: tuple[str, ...]) -> dict[str, str]:
    """Each category's palette slot comes from a hash of its name, probing forward (in
    :data:`CATEGORIES` order) past slots already taken so no two categories share a colour."""
    return {c: _PALETTE[slot] for c, slot in hash_slots(categories, len(_PALETTE)).items()}


_OP_CATEGORIES = tuple(c for c in CATEGORIES if c not in ("placeholder", "get_attr", "output"))
CATEGORY_COLORS: dict[str, str] = _category_colors(_OP_CATEGORIES)

_NOTE_MARK = 'class="graph note"'


def render_graph_svg(
    view: GraphView,
    *,
    max_depth: int | None = None,
    expand: tuple[str, ...] | list[str] = (),
    collapse: tuple[str, ...] | list[str] = (),
    filter_by_op: tuple[str, ...] | list[str] = (),
    focus: str | None = None,
    overlay: Overlay | None = None,
    marks: dict[str, str] | None = None,
    prep: lay.Prepared | None = None,
    layout_cache: lay.LayoutCache | None = None,
    graph_key: str | None = None,
    max_items: int = MAX_VISIBLE_ITEMS,
) -> str:
    """Lay out the visible part of ``view`` top to bottom and return the SVG document as text.

    Args:
        view: the graph.
        max_depth: module clusters up to this depth are open, deeper ones collapsed (``0``: every
            top-level cluster collapsed); ``None``: the deepest depth showing at most
            :data:`~graphdeck.server.render.layout.AUTO_VISIBLE_ITEMS` items.
        expand / collapse: module paths (``a/b``) opened / closed on top of ``max_depth``
            (collapse wins; opening a path opens its ancestors).
        filter_by_op: op patterns (``server/render/filters.py``): matches and the paths between
            them are drawn, the rest faded.
        focus: an FX node name whose clusters are opened (a selection, a search hit).
        overlay: per-node values drawn as fill colour instead of the op category.
        marks: node id → ``added`` / ``removed`` / ``changed`` (graph diff) or ``linked``.
        prep, layout_cache, graph_key: reuse the cluster tree and cached cluster layouts
            (``graph_key`` must change whenever the graph does).
        max_items: past this many visible items, the k-hop neighbourhood of ``focus`` (or of the
            first filter match, or of the busiest node) is drawn instead, with a note.

    Returns:
        An SVG document (UTF-8 text) whose root has ``width/height="100%"``.

    Raises:
        ValueError: ``max_depth`` is negative.
        UsageError: a ``filter_by_op`` pattern is not a valid regular expression.
    """
    if max_depth is not None and max_depth < 0:
        raise ValueError(f"max_depth must be >= 0, got {max_depth}")
    patterns = compile_patterns(filter_by_op)
    prep = prep or lay.prepare(view)
    if max_depth is None:
        max_depth = lay.auto_depth(prep)
    opened = lay.open_clusters(prep, max_depth, expand, collapse, focus)
    matched, on_path = filter_nodes(view, patterns)
    visible = sum(len(prep.clusters[p].nodes) + sum(1 for c in prep.clusters[p].children if c not in opened)
                  for p in opened)
    if visible > max_items:
        return fallback_svg(view, focus or (min(matched, key=prep.by_name.get) if matched else None),
                            f"{visible} items are too many to lay out (limit {max_items})")
    writer = _Writer(prep, opened, overlay, marks or {}, matched, on_path, bool(patterns))
    edges_at = lay.cluster_edges(prep, opened)
    root = lay.layout_cluster(prep, (), opened, edges_at, writer.node_lines, writer.collapsed_size,
                              layout_cache, graph_key or _view_digest(view))
    return xml_safe(writer.document(view, root))


def fallback_svg(view: GraphView, centre: str | None, why: str) -> str:
    """The ``FALLBACK_HOPS``-hop neighbourhood of ``centre`` (default: the node with most edges),
    every cluster open, under a note saying ``why``."""
    if centre is None or centre not in {n.id for n in view.nodes}:
        degree: dict[str, int] = {}
        for e in view.edges:
            degree[e.src] = degree.get(e.src, 0) + 1
            degree[e.dst] = degree.get(e.dst, 0) + 1
        centre = min(degree, key=lambda n: (-degree[n], n)) if degree else (view.nodes[0].id if view.nodes else None)
    if centre is None:
        return note_svg(f"{view.name}: {why}")
    keep = neighbourhood(view, centre, FALLBACK_HOPS)
    if len(keep) > FALLBACK_MAX_NODES:  # a huge fan-in/out: one hop, then the first nodes in graph order
        keep = neighbourhood(view, centre, 1)
        if len(keep) > FALLBACK_MAX_NODES:
            order = {n.id: n.idx for n in view.nodes}
            keep = set(sorted(keep - {centre}, key=order.__getitem__)[: FALLBACK_MAX_NODES - 1]) | {centre}
    sub = type(view).model_construct(graph_id=view.graph_id, name=view.name, kind=view.kind,
                                     nodes=[n for n in view.nodes if n.id in keep],
                                     edges=[e for e in view.edges if e.src in keep and e.dst in keep],
                                     **({"regions": view.regions} if hasattr(view, "regions") else {}))
    svg = render_graph_svg(sub, max_depth=99, marks={centre: "linked"}, max_items=10**9)
    note = (f"{why}: showing the neighbourhood of {centre} ({len(keep)} nodes); "
            "collapse clusters or filter to see more")
    return xml_safe(svg.replace('<g id="graph0"', f'<text class="fallback-note" x="4" y="-6" font-size="11" '
                                f'fill="#a00">{_esc(_text(note, limit=300))}</text>\n<g id="graph0"', 1))


def _view_digest(view: GraphView) -> str:
    try:
        text = view.model_dump_json()
    except ValueError:  # a lone surrogate in a name (pydantic's serialisation error is a ValueError)
        text = json.dumps(view.model_dump(), ensure_ascii=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


class _Writer:
    """Styles and SVG text of one render (the layout comes from ``layout.py``)."""

    def __init__(self, prep, opened, overlay, marks, matched, on_path, filtering):
        self.prep, self.opened, self.overlay, self.marks = prep, opened, overlay, marks
        self.matched, self.on_path, self.filtering = matched, on_path, filtering
        self.numeric = overlay is not None and not overlay.categorical and bool(overlay.values)
        vals = [float(v) for v in overlay.values.values()] if self.numeric else []
        self.lo, self.hi = (min(vals), max(vals)) if vals else (0.0, 0.0)
        cats = sorted({str(v) for v in overlay.values.values()}) if overlay is not None and overlay.categorical else []
        self.cat_fill = {c: QUALITATIVE[s] for c, s in hash_slots(cats, len(QUALITATIVE)).items()}
        self.out: list[str] = []
        self.back: list[str] = []  # open cluster boxes (drawn under the edges)
        self.edge_k = 0
        self._totals: dict[int, dict] = {}
        self._sums: dict | None = None
        self._kept_names = matched | on_path
        self.regions = region_map(prep.view)  # cluster path -> region box (render/regions.py)

    # ---------------------------------------------------------------- sizes (used by the layout)
    def node_lines(self, node) -> list[str]:
        head = node.param_fqn if node.op == "placeholder" and node.param_fqn else node.label
        if node.recomputed:
            head = "\u21bb " + head
        lines = [ellipsize(_text(head, limit=400))]
        tensor = tensor_label(node.shape, node.dtype)
        if node.dtype_change:
            tensor = f"{short_dtype(node.dtype_change.split(chr(0x2192))[0])}\u2192{tensor}"
        if tensor:
            lines.append(ellipsize(_text(tensor, limit=400)))
        return lines

    def collapsed_lines(self, path) -> list[str]:
        c = self.prep.clusters[path]
        facts = [f"{c.total_nodes} nodes"]
        if c.param_bytes:
            facts.append(f"{fmt_bytes(c.param_bytes)} params")
        total = self._cluster_value(path)
        if total is not None:
            facts.append(fmt_ns(total) if self.overlay.unit == "ns" else fmt_bytes(total) if self.overlay.unit == "bytes" else f"{total:g}")
        hits = self._count(path, self.matched) if self.filtering else 0
        if hits:
            facts.append(f"{hits} match")
        region = self.regions.get(path)
        return [_text("\u25b8 " + (region.label if region else path[-1])), " · ".join(facts)]

    def collapsed_size(self, path) -> tuple[float, float]:
        lines = self.collapsed_lines(path)
        return max(60.0, max(len(t) for t in lines) * lay.CHAR_W + 20), 34.0

    def _count(self, path, names: set[str]) -> int:
        """How many nodes of cluster ``path`` (at any depth) are in ``names``; per-prefix totals
        are built once per set, so a view with hundreds of boxes stays linear."""
        key = id(names)
        totals = self._totals.get(key)
        if totals is None:
            totals = self._totals[key] = self._per_prefix({self.prep.by_name[n]: 1 for n in names if n in self.prep.by_name})
        return int(totals.get(path, 0))

    def _cluster_value(self, path):
        if not self.numeric:
            return None
        if self._sums is None:
            self._sums = self._per_prefix({self.prep.by_name[k]: float(v) for k, v in self.overlay.values.items()
                                           if k in self.prep.by_name}, combine=self.overlay.aggregate)
        return self._sums.get(path)

    def _per_prefix(self, by_idx: dict[int, float], combine: str = "sum") -> dict[tuple[str, ...], float]:
        """Per module-path prefix, the sum (``combine="sum"``) or maximum (``"max"``) of the
        values of the nodes under it."""
        out: dict[tuple[str, ...], float] = {}
        for idx, value in by_idx.items():
            p = self.prep.node_path[idx]
            for d in range(1, len(p) + 1):
                if combine == "max":
                    out[p[:d]] = max(out[p[:d]], value) if p[:d] in out else value
                else:
                    out[p[:d]] = out.get(p[:d], 0) + value
        return out

    # ---------------------------------------------------------------- drawing
    def document(self, view: GraphView, root: lay.Box) -> str:
        all_edges = []
        self._collect_edges(root, 0.0, 0.0, (), all_edges)
        max_bytes = max((e[2] for e in all_edges), default=0)
        heavy = {id(e) for e in sorted((e for e in all_edges if e[2] > 0), key=lambda e: -e[2])[:HEAVY_EDGES]}
        legend, legend_h = self._legend(max_bytes)
        self._cluster(root, 0.0, legend_h, ())
        boxes_and_nodes, self.out = self.out, []
        for e in all_edges:
            if id(e) not in heavy:
                self._edge(e, max_bytes, False, legend_h)
        for e in all_edges:
            if id(e) in heavy:
                self._edge(e, max_bytes, True, legend_h)
        # open cluster boxes, then edges, then nodes and collapsed boxes: no edge is drawn over a node
        self.out = self.back + self.out + boxes_and_nodes
        width = max(root.w, 520.0)
        height = root.h + legend_h
        opened = "|".join("/".join(p) for p in sorted(self.opened) if p)
        visible = sum(1 for s in self.out if s.startswith('<g id="node-'))
        head = (
            '<?xml version="1.0" encoding="UTF-8" standalone="no"?>\n'
            f'<svg xmlns="http://www.w3.org/2000/svg" width="100%" height="100%" viewBox="0 -16 {width:.1f} {height + 16:.1f}" '
            f'class="graphdeck-graph" data-graph-id="{view.graph_id}" data-visible-nodes="{visible}" '
            f'data-matches="{len(self.matched)}" data-on-path="{len(self.on_path)}" data-legend-h="{legend_h:g}" '
            f'data-open-clusters="{_attr(opened)}" font-family="Helvetica,Arial,sans-serif" font-size="10">\n'
            # arrowheads in drawing units (not stroke widths): as big as the drawing at any zoom
            '<defs><marker id="arrow" viewBox="0 0 8 8" refX="7" refY="4" markerUnits="userSpaceOnUse" '
            f'markerWidth="{ARROW_PX:g}" markerHeight="{ARROW_PX:g}" orient="auto-start-reverse"><path d="M0,0 L8,4 L0,8 z" fill="context-stroke"/></marker></defs>\n'
            f'<title>{_esc(_text(view.name, limit=200))}</title>\n'
        )
        return head + legend + '<g id="graph0" class="graph">\n' + "".join(self.out) + "</g>\n</svg>\n"

    def _collect_edges(self, box, ox, oy, path, acc):
        for (u, v), (points, nbytes, count) in box.edges.items():
            acc.append(((u, v), [(x + ox, y + oy) for x, y in points], nbytes, count))
        for child, sub in sorted(box.children.items()):
            x, y, _w, _h = box.members[("c", child)]
            self._collect_edges(sub, ox + x, oy + y, child, acc)

    def _cluster(self, box, ox, oy, path):
        region = self.regions.get(path)
        if region is not None:
            self.back.append(open_region_svg(region, self.prep.clusters[path], "/".join(path), ox, oy, box.w, box.h))
        elif path:
            c = self.prep.clusters[path]
            depth_fill = _CLUSTER_FILLS[(len(path) - 1) % 2]
            self.back.append(
                f'<g id="cluster-{c.key}" class="cluster open" data-path="{_attr("/".join(path))}" data-nodes="{c.total_nodes}">'
                f'<title>{_esc(_text("/".join(path), limit=400))} ({c.total_nodes} nodes; click to collapse)</title>'
                f'<rect x="{ox:.1f}" y="{oy:.1f}" width="{box.w:.1f}" height="{box.h:.1f}" rx="6" fill="{depth_fill}" stroke="#b0b0c0"/>'
                f'<text x="{ox + 6:.1f}" y="{oy + 13:.1f}" font-size="9" fill="#445">\u25be {_esc(_text(path[-1]))}</text></g>\n')
        for member, (x, y, w, h) in box.members.items():
            if isinstance(member, int):
                self._node(self.prep.by_idx[member], ox + x, oy + y, w, h)
            elif member[1] in box.children:
                self._cluster(box.children[member[1]], ox + x, oy + y, member[1])
            else:
                self._collapsed(member[1], ox + x, oy + y, w, h)

    def _collapsed(self, path, x, y, w, h):
        c = self.prep.clusters[path]
        lines = self.collapsed_lines(path)
        classes = ["cluster", "collapsed"]
        region = self.regions.get(path)
        if region is not None:
            classes += ["region", f"region-{region.kind}"]
        if self.filtering:
            classes.append("has-match" if self._count(path, self.matched) else
                           "on-path" if self._count(path, self.on_path) else "faded")
        fill = _COLLAPSED_FILL
        total = self._cluster_value(path)
        if total is not None:
            fill = heat(total, 0.0, max(self.hi, total))
        ink = ' fill="#fff"' if fill in _DARK_FILLS else ""
        self.out.append(
            f'<g id="cluster-{c.key}" class="{" ".join(classes)}" data-path="{_attr("/".join(path))}" '
            f'data-nodes="{c.total_nodes}" data-param-bytes="{c.param_bytes}"{_fade(classes)}'
            f'{region_attrs(region, _attr) if region else ""}>'
            f'<title>{_esc(_text("/".join(path), limit=400))} ({c.total_nodes} nodes; click to expand)</title>'
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" rx="4" fill="{fill}" stroke="#5a6690" stroke-width="1.5"/>'
            f'<rect x="{x + 3:.1f}" y="{y + 3:.1f}" width="{w - 6:.1f}" height="{h - 6:.1f}" rx="3" fill="none" stroke="#5a6690" stroke-width="0.5"/>'
            f'<text x="{x + w / 2:.1f}" y="{y + 14:.1f}" text-anchor="middle" font-weight="bold"{ink}>{_esc(lines[0])}</text>'
            f'<text x="{x + w / 2:.1f}" y="{y + 26:.1f}" text-anchor="middle" font-size="9"{ink}>{_esc(lines[1])}</text></g>\n')

    def _node(self, node, x, y, w, h):
        classes = ["node", f"cat-{node.category}"]
        stroke, dash, sw = "#555555", "", 1.0
        if node.category == "collective":
            classes.append("collective")
            stroke, sw = "#000000", 3.0
        if node.recomputed:
            classes.append("recomputed")
            stroke, dash = "#7b3294", ' stroke-dasharray="4 2"'
        if node.dtype_change or node.category == "cast":
            classes.append("dtype-change")
            stroke, sw = "#e6550d", 2.0
        if self.filtering:
            classes.append("match" if node.id in self.matched else "on-path" if node.id in self.on_path else "faded")
            if node.id in self.matched:
                stroke, sw = "#d62728", 2.5
        mark = self.marks.get(node.id)
        if mark:
            classes.append(f"diff-{mark}")
            stroke, sw = {"added": "#1a9850", "removed": "#d73027", "changed": "#fdae61"}.get(mark, "#2c7bb6"), 3.0
        fill = self._fill(node)
        lines = self.node_lines(node)
        rx = 10 if node.op in ("placeholder", "get_attr") else 3
        head = node.param_fqn if node.op == "placeholder" and node.param_fqn else node.label
        title = (f"{head}\n" if lines[0].endswith("\u2026") else "") + f"{node.id}\n{node.target}" + (f"\nmodule {node.namespace} (from its {node.namespace_from})" if node.namespace_from else "")
        if self.overlay is not None and node.id in self.overlay.values:
            v = self.overlay.values[node.id]
            title += f"\n{self.overlay.kind}: " + (fmt_ns(v) if self.overlay.unit == "ns" else fmt_bytes(v) if self.overlay.unit == "bytes" else str(v))
        text_y = [y + 12.5, y + 24.5] if len(lines) > 1 else [y + 13.5]
        dark = fill in _DARK_FILLS
        small = ' font-size="9" fill="#fff"' if dark else ' font-size="9" fill="#333"'
        big = ' fill="#fff"' if dark else ""
        texts = "".join(f'<text x="{x + w / 2:.1f}" y="{ty:.1f}" text-anchor="middle"{small if i else big}>{_esc(t)}</text>'
                        for i, (t, ty) in enumerate(zip(lines, text_y)))
        self.out.append(
            f'<g id="node-{node.idx}" class="{" ".join(classes)}" data-name="{_attr(node.id)}"{_fade(classes)}>'
            f'<title>{_esc(_text(title, limit=2000, newlines=True))}</title>'
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" rx="{rx}" fill="{fill}" stroke="{stroke}" stroke-width="{sw:g}"{dash}/>'
            f'{texts}</g>\n')

    def _fill(self, node) -> str:
        if self.overlay is not None:
            v = self.overlay.values.get(node.id)
            if v is None:
                return "#f4f4f4"
            return self.cat_fill.get(str(v), "#cccccc") if self.overlay.categorical else heat(float(v), self.lo, self.hi)
        if node.op in ("placeholder", "get_attr"):
            return _PLACEHOLDER_FILL
        if node.op == "output":
            return _OUTPUT_FILL
        return CATEGORY_COLORS.get(node.category, _PALETTE[0])

    def _edge(self, e, max_bytes, heavy, oy):
        (u, v), points, nbytes, count = e
        k = self.edge_k
        self.edge_k += 1
        colour = EDGE_HEAVY if heavy else EDGE_BINS[edge_bin(nbytes, max_bytes)]
        faded = self.filtering and not (self._kept(u) and self._kept(v))
        d = "M" + " L".join(f"{x:.1f},{y + oy:.1f}" for x, y in points)
        src, dst = self._end(u), self._end(v)
        cls = "edge heavy" if heavy else "edge"
        faded_attr = ' opacity="0.2"' if faded else ""
        self.out.append(
            f'<g id="edge-{k}" class="{cls}{" faded" if faded else ""}" data-src="{_attr(src)}" data-dst="{_attr(dst)}" '
            f'data-bytes="{nbytes}"{faded_attr}><title>{_esc(_text(src, limit=200))} \u2192 '
            f'{_esc(_text(dst, limit=200))}: {fmt_bytes(nbytes)}{f" in {count} edges" if count > 1 else ""}</title>'
            f'<path d="{d}" fill="none" stroke="{colour}" stroke-width="{edge_width(nbytes, max_bytes):g}" marker-end="url(#arrow)"/></g>\n')

    def _end(self, member) -> str:
        return self.prep.by_idx[member].id if isinstance(member, int) else "cluster:" + "/".join(member[1])

    def _kept(self, member) -> bool:
        if isinstance(member, int):
            name = self.prep.by_idx[member].id
            return name in self.matched or name in self.on_path
        return bool(self._count(member[1], self._kept_names))

    def _legend(self, max_bytes: int) -> tuple[str, float]:
        parts = ['<g id="legend" class="legend" font-size="9">']
        x = 4.0
        for cat in _OP_CATEGORIES:
            parts.append(f'<rect x="{x:.1f}" y="2" width="10" height="10" fill="{CATEGORY_COLORS[cat]}" stroke="#555"/>'
                         f'<text x="{x + 13:.1f}" y="11">{cat}</text>')
            x += 18 + len(cat) * 5.4
        x, y = 4.0, 26.0
        parts.append(f'<text x="{x:.1f}" y="{y:.1f}">edge bytes:</text>')
        x += 56
        for b, colour in enumerate(EDGE_BINS):
            label = f"\u2265{fmt_bytes(bin_floor(b, max_bytes))}"
            parts.append(f'<line x1="{x:.1f}" y1="{y - 3:.1f}" x2="{x + 18:.1f}" y2="{y - 3:.1f}" stroke="{colour}" '
                         f'stroke-width="{edge_width(max(1, bin_floor(b, max_bytes)), max_bytes):g}"/>'
                         f'<text x="{x + 21:.1f}" y="{y:.1f}">{label}</text>')
            x += 30 + len(label) * 5.4
        parts.append(f'<line x1="{x:.1f}" y1="{y - 3:.1f}" x2="{x + 18:.1f}" y2="{y - 3:.1f}" stroke="{EDGE_HEAVY}" stroke-width="4"/>'
                     f'<text x="{x + 21:.1f}" y="{y:.1f}">{HEAVY_EDGES} heaviest (max {fmt_bytes(max_bytes)})</text>')
        height = 34.0
        if self.overlay is not None:
            y = 44.0
            what = f"overlay {self.overlay.kind}"
            if self.numeric:
                lo = fmt_ns(self.lo) if self.overlay.unit == "ns" else fmt_bytes(self.lo) if self.overlay.unit == "bytes" else f"{self.lo:g}"
                hi = fmt_ns(self.hi) if self.overlay.unit == "ns" else fmt_bytes(self.hi) if self.overlay.unit == "bytes" else f"{self.hi:g}"
                what += f": {lo} \u2192 {hi} (log scale)"
            elif self.cat_fill:
                what += ": " + ", ".join(self.cat_fill)
            else:
                what += ": no values" + (f" ({self.overlay.note})" if self.overlay.note else "")
            if self.overlay.label:
                what = f"{self.overlay.label} · {what}"
            parts.append(f'<text x="4" y="{y:.1f}" class="overlay-legend">{_esc(_text(what, limit=300))}</text>')
            height = 52.0
        parts.append("</g>\n")
        return "".join(parts), height


def _fade(classes: list[str]) -> str:
    return ' opacity="0.25"' if "faded" in classes else ""


def note_svg(message: str) -> str:
    """A one-line SVG note (used instead of a layout that cannot be made)."""
    text = _esc(XML_FORBIDDEN.sub("", message), quote=True)
    width = max(200, 7 * len(message) + 20)
    return (
        '<?xml version="1.0" encoding="UTF-8" standalone="no"?>\n'
        f'<svg width="100%" height="100%" viewBox="0 0 {width} 40" xmlns="http://www.w3.org/2000/svg">\n'
        f'<g id="graph0" {_NOTE_MARK}><text x="10" y="25" font-family="Helvetica" font-size="12">{text}</text></g>\n'
        "</svg>\n"
    )


class SvgCache:
    """Rendered SVGs keyed by graph key + view state, least recently used first out; renders run
    on a worker thread with a deadline (NOTE: [Render deadline]).

    # NOTE: [Render deadline]
    A render past ``timeout_s`` is not awaited: the request gets the k-hop fallback view at once,
    the render goes on in the background and fills the caches (so reloading the same view later
    is served from them). The server never blocks on a layout. Fallbacks and notes are not cached.
    """

    def __init__(self, max_bytes: int = 64 * 1024**2, workers: int = 2):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple, str] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="graphdeck-layout")
        self._preps: OrderedDict[str, lay.Prepared] = OrderedDict()
        self.layouts = lay.LayoutCache()

    def clear(self) -> None:
        """Forget every render, view and layout (a deleted run's graph ids may be reused)."""
        with self._lock:
            self._entries.clear()
            self._preps.clear()
            self._size = 0
        self.layouts = lay.LayoutCache()

    def lookup(self, graph_key: str, state: dict) -> str | None:
        """A cached SVG for this graph key and view state, without loading the graph."""
        key = (graph_key, json.dumps(state, sort_keys=True, default=str))
        with self._lock:
            svg = self._entries.get(key)
            if svg is not None:
                self._entries.move_to_end(key)
            return svg

    def view(self, graph_key: str, load) -> GraphView:
        """The view of ``graph_key``, from ``load()`` the first time (then kept with its cluster
        tree, so a new view state of the same graph never reads the store again)."""
        with self._lock:
            prep = self._preps.get(graph_key)
            if prep is not None:
                self._preps.move_to_end(graph_key)
                return prep.view
        return self.prepared(graph_key, load()).view

    def prepared(self, graph_key: str, view: GraphView) -> lay.Prepared:
        with self._lock:
            prep = self._preps.get(graph_key)
            if prep is not None:
                self._preps.move_to_end(graph_key)
                return prep
        prep = lay.prepare(view)
        with self._lock:
            self._preps[graph_key] = prep
            while len(self._preps) > 8:
                self._preps.popitem(last=False)
        return prep

    def render(self, view: GraphView, state: dict, *, graph_key: str | None = None,
               timeout_s: float = DEFAULT_TIMEOUT_S, **extra) -> str:
        """:func:`render_graph_svg` of ``view`` with ``state`` (its keyword arguments) and
        ``extra`` (overlay, marks: must be described in ``state`` for the key), cached."""
        graph_key = graph_key or _view_digest(view)
        cached = self.lookup(graph_key, state)
        if cached is not None:
            return cached
        compile_patterns(state.get("filter_by_op", ()))  # a bad pattern is a 400 now, not in the worker
        prep = self.prepared(graph_key, view)
        kwargs = {k: v for k, v in state.items() if k in ("max_depth", "expand", "collapse", "filter_by_op", "focus")}
        future = self._pool.submit(render_graph_svg, view, prep=prep, layout_cache=self.layouts,
                                   graph_key=graph_key, **kwargs, **extra)
        future.add_done_callback(lambda f: self._store(graph_key, state, f))
        try:
            return future.result(timeout=timeout_s)
        except FutureTimeout:
            return fallback_svg(view, state.get("focus"), f"the layout took longer than {timeout_s:g} s")

    def _store(self, graph_key: str, state: dict, future) -> None:
        if future.exception() is not None:
            return
        svg = future.result()
        if _NOTE_MARK in svg[:1000] or "fallback-note" in svg[:4000] or len(svg) > self.max_bytes:
            return
        key = (graph_key, json.dumps(state, sort_keys=True, default=str))
        with self._lock:
            if key not in self._entries:
                self._entries[key] = svg
                self._size += len(svg)
            while self._size > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self._size -= len(old)
