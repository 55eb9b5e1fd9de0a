"""Render a :class:`~graphdeck.server.views.GraphView` as SVG with Graphviz ``dot``.

:func:`render_graph_svg` is pure: the same view gives the same bytes (nodes, clusters and edges
are emitted in sorted order; colours come from a hash of the op category, not from a random
palette walk). The DOT is built with the ``graphviz`` package and laid out by the ``dot``
executable in a subprocess with a timeout.

What the frontend can rely on in the output:

* the root ``<svg>`` has ``width="100%" height="100%"`` and keeps its ``viewBox`` (pan/zoom);
* node ``idx`` is drawn as ``<g id="node-<idx>" class="node cat-<category>">`` (Graphviz writes
  the ``-`` as ``&#45;``, which the DOM decodes), and the FX node name is its tooltip
  (``<a xlink:title="...">``);
* a module path ``a/b/c`` is a ``<g class="cluster ns">`` nested inside ``a/b`` inside ``a``,
  labelled ``c``, with the full path as tooltip;
* edge ``k`` (in (src idx, dst idx, arg_pos) order) is ``<g id="edge-<k>" class="edge">``;
* an edge spanning more than :data:`MAX_EDGE_SPAN` ranks is cut (see NOTE: [Long edges]): no
  ``edge-<k>``, but a ``<g id="stub-in-<idx>" class="node stub">`` above its consumer and a
  ``<g id="stub-out-<idx>" class="node stub">`` below its producer name the far ends.

Everything that comes from user code (node names, targets, module paths, parameter names) passes
through :func:`_text`: control characters dropped, long strings truncated as
``…[total_len=N]``, backslashes disabled and ``<...>`` marked as not-HTML, so it can neither
change the DOT (no record or HTML labels are used) nor inject markup (Graphviz XML-escapes text
and attributes in SVG output).

# NOTE: [Long edges]
FX graphs have edges that span most of the graph: a forward graph returns activations saved for
backward from every layer to its one ``output`` node; a backward graph reads them deep down.
``dot`` routes each such edge through one virtual node per rank it crosses, and its x-placement
(network simplex) on GPT-2's AOT forward graph (1,166 nodes) grows to 255,143 virtual nodes and
does not finish in minutes. So, before layout, ranks are estimated by longest path (a source is
pulled down to just above its first consumer) and every edge spanning more than
:data:`MAX_EDGE_SPAN` ranks is drawn as a pair of stubs instead; the JSON view keeps every edge.
With that and ``newrank=true`` (Graphviz 2.43 fails "merge2 ... rank has only N nodes" and
stalls on nested clusters with the old ranking) GPT-2's 12-block graphs lay out in 0.3–1.7 s,
where FxGraphDrawer's ``dot`` runs 244 s to over 300 s (``bench/RESULTS.md``).

# NOTE: [Large graphs]
``dot`` is super-linear in nodes and in nested clusters: GPT-2 with 36 blocks has a 4,531-node
AOT backward graph that lays out in about 5 s with clusters two levels deep and does not finish
in 150 s with every level. Above :data:`LARGE_GRAPH_NODES` nodes the view is drawn *collapsed*:
placeholders bound to parameters are folded into their consumers (``+N params`` on the
consumer, their names in its tooltip) and clusters are nested at most
:data:`LARGE_GRAPH_MAX_DEPTH` deep. Above :data:`MAX_RENDER_NODES` nodes, or when ``dot`` runs
past ``timeout_s``, the result is a small SVG note that says so and points at the JSON twin and
at ``?max_depth=``; a request never hangs.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import threading
from collections import OrderedDict, defaultdict
from html import escape as _xml_escape
from typing import Any

import graphviz

from graphdeck.server.render.palette import hash_slots
from graphdeck.server.views import CATEGORIES, GraphView, ViewEdge, ViewNode

#: Above this many nodes the graph is drawn collapsed (see NOTE: [Large graphs]).
LARGE_GRAPH_NODES = 3000
#: Clusters nest at most this deep in a collapsed view.
LARGE_GRAPH_MAX_DEPTH = 2
#: Above this many nodes (after collapsing) no layout is attempted; a note SVG is returned.
MAX_RENDER_NODES = 20_000
#: Edges spanning more ranks than this are cut into stubs (see NOTE: [Long edges]).
MAX_EDGE_SPAN = 16
#: Default wall-clock budget for one ``dot`` run.
DEFAULT_TIMEOUT_S = 60.0
#: Longest piece of user text drawn on a node before it is truncated.
MAX_TEXT_CHARS = 60

# Pastel fills, none grey (grey is reserved for placeholders and outputs).
_PALETTE = ("#a6cee3", "#b2df8a", "#fb9a99", "#fdbf6f", "#cab2d6", "#ffff99", "#8dd3c7", "#fccde5")
_PLACEHOLDER_FILL = "#eeeeee"
_OUTPUT_FILL = "#d9d9d9"
_CLUSTER_FILLS = ("#f7f7fb", "#eef0f7")  # alternate by depth so nesting stays readable


def _category_colors(categories: tuple[str, ...]) -> dict[str, str]:
    """Each category's palette slot comes from a hash of its name, probing forward (in
    :data:`CATEGORIES` order) past slots already taken so no two categories share a colour."""
    return {c: _PALETTE[slot] for c, slot in hash_slots(categories, len(_PALETTE)).items()}


_OP_CATEGORIES = tuple(c for c in CATEGORIES if c not in ("placeholder", "get_attr", "output"))
CATEGORY_COLORS: dict[str, str] = _category_colors(_OP_CATEGORIES)

_DTYPE_SHORT = {
    "float32": "f32", "float": "f32", "float16": "f16", "half": "f16", "bfloat16": "bf16",
    "float64": "f64", "double": "f64", "int64": "i64", "long": "i64", "int32": "i32", "int": "i32",
    "int16": "i16", "short": "i16", "int8": "i8", "uint8": "u8", "bool": "b8",
    "complex64": "c64", "complex128": "c128", "float8_e4m3fn": "f8e4m3fn", "float8_e5m2": "f8e5m2",
}
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_ROOT_SIZE = re.compile(r'<svg width="[^"]*" height="[^"]*"')


def render_graph_svg(view: GraphView, *, max_depth: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
    """Lay out ``view`` top to bottom and return the SVG document as text.

    Args:
        view: the graph to draw.
        max_depth: nest module-path clusters at most this deep (``0``: no clusters; ``None``:
            all levels). Deeper namespaces are drawn in their depth-``max_depth`` ancestor.
        timeout_s: wall-clock budget for ``dot``; past it a note SVG is returned.

    Returns:
        An SVG document (UTF-8 text) whose root has ``width/height="100%"``.

    Raises:
        graphviz.ExecutableNotFound: the ``dot`` executable is not installed.
        ValueError: ``max_depth`` is negative.
    """
    if max_depth is not None and max_depth < 0:
        raise ValueError(f"max_depth must be >= 0, got {max_depth}")
    collapsed = len(view.nodes) > LARGE_GRAPH_NODES
    nodes, edges, folded = _collapse(view) if collapsed else (view.nodes, view.edges, {})
    if len(nodes) > MAX_RENDER_NODES:
        return note_svg(
            f"{view.name}: {len(view.nodes)} nodes is too many to lay out "
            f"(limit {MAX_RENDER_NODES}); see /api/graphs/{view.graph_id}/view"
        )
    if collapsed:
        max_depth = LARGE_GRAPH_MAX_DEPTH if max_depth is None else min(max_depth, LARGE_GRAPH_MAX_DEPTH)
    dot = build_dot(nodes, edges, folded=folded, max_depth=max_depth)
    try:
        proc = subprocess.run(
            ["dot", "-Tsvg"], input=dot.source.encode("utf-8"), capture_output=True, timeout=timeout_s, check=False
        )
    except FileNotFoundError as exc:
        raise graphviz.ExecutableNotFound(["dot"]) from exc
    except subprocess.TimeoutExpired:
        return note_svg(
            f"{view.name}: layout of {len(nodes)} nodes took longer than {timeout_s:g} s; "
            f"try ?max_depth=1, or see /api/graphs/{view.graph_id}/view"
        )
    if proc.returncode != 0:
        raise graphviz.CalledProcessError(proc.returncode, ["dot", "-Tsvg"], output=proc.stdout, stderr=proc.stderr)
    return _fill_viewport(proc.stdout.decode("utf-8"))


def build_dot(
    nodes: list[ViewNode],
    edges: list[ViewEdge],
    *,
    folded: dict[str, list[str]] | None = None,
    max_depth: int | None = None,
    max_edge_span: int = MAX_EDGE_SPAN,
) -> graphviz.Digraph:
    """The DOT graph for ``nodes`` and ``edges`` (see :func:`render_graph_svg`)."""
    graph_attr = {
        "rankdir": "TB", "newrank": "true", "fontname": "Helvetica", "fontsize": "10",
        "nodesep": "0.25", "ranksep": "0.3",
    }
    dot = graphviz.Digraph(
        name="graph",
        graph_attr=graph_attr,
        node_attr={"fontname": "Helvetica", "fontsize": "10", "height": "0.3", "margin": "0.08,0.03"},
        edge_attr={"arrowsize": "0.5", "color": "#777777"},
    )
    nodes = sorted(nodes, key=lambda n: n.idx)
    index = {n.id: n.idx for n in nodes}
    names = {n.idx: n.id for n in nodes}
    ordered = sorted((index[e.src], index[e.dst], e.arg_pos) for e in edges if e.src in index and e.dst in index)
    ranks = _estimate_ranks(list(names), [(src, dst) for src, dst, _ in ordered])
    cut_in: dict[int, list[int]] = defaultdict(list)
    cut_out: dict[int, list[int]] = defaultdict(list)
    for src, dst, _pos in ordered:
        if ranks[dst] - ranks[src] > max_edge_span:
            cut_in[dst].append(src)
            cut_out[src].append(dst)

    by_namespace: dict[tuple[str, ...], list[ViewNode]] = defaultdict(list)
    for node in nodes:
        by_namespace[_namespace_key(node.namespace, max_depth)].append(node)
    children: dict[tuple[str, ...], set[tuple[str, ...]]] = defaultdict(set)
    for key in list(by_namespace):
        for depth in range(1, len(key) + 1):
            children[key[: depth - 1]].add(key[:depth])
    cluster_ids = {key: i for i, key in enumerate(sorted(k for keys in children.values() for k in keys))}

    def emit(g: graphviz.Digraph, key: tuple[str, ...]) -> None:
        for node in by_namespace.get(key, ()):
            g.node(f"n{node.idx}", **_node_attrs(node, (folded or {}).get(node.id, ())))
            if node.idx in cut_in:
                g.node(f"s{node.idx}i", **_stub_attrs(f"stub-in-{node.idx}", "\u2191", [names[i] for i in cut_in[node.idx]]))
            if node.idx in cut_out:
                g.node(f"s{node.idx}o", **_stub_attrs(f"stub-out-{node.idx}", "\u2193", [names[i] for i in cut_out[node.idx]]))
        for child in sorted(children.get(key, ())):
            with g.subgraph(name=f"cluster_{cluster_ids[child]}") as sub:
                sub.attr(
                    id=f"cluster-{cluster_ids[child]}",
                    label=_text(child[-1]),
                    tooltip=_text("/".join(child), limit=400),
                    style="rounded,filled",
                    fillcolor=_CLUSTER_FILLS[(len(child) - 1) % len(_CLUSTER_FILLS)],
                    color="#b0b0c0",
                    fontsize="9",
                    labeljust="l",
                    **{"class": "ns"},
                )
                emit(sub, child)

    emit(dot, ())
    for k, (src, dst, _pos) in enumerate(ordered):
        if ranks[dst] - ranks[src] <= max_edge_span:
            dot.edge(f"n{src}", f"n{dst}", id=f"edge-{k}")
    stub_edge = {"style": "dashed", "arrowhead": "none"}
    for dst in sorted(cut_in):
        dot.edge(f"s{dst}i", f"n{dst}", **stub_edge)
    for src in sorted(cut_out):
        dot.edge(f"n{src}", f"s{src}o", **stub_edge)
    return dot


def _estimate_ranks(idxs: list[int], edges: list[tuple[int, int]]) -> dict[int, int]:
    """Longest-path layering in ``idx`` order (FX graph order is topological); a source node is
    then pulled down to one rank above its nearest consumer, as ``dot``'s ranking would."""
    preds: dict[int, list[int]] = defaultdict(list)
    succs: dict[int, list[int]] = defaultdict(list)
    for src, dst in edges:
        preds[dst].append(src)
        succs[src].append(dst)
    ranks: dict[int, int] = {}
    for idx in sorted(idxs):
        ranks[idx] = max((ranks[p] + 1 for p in preds[idx] if p in ranks), default=0)
    for idx in idxs:
        if not preds[idx] and succs[idx]:
            ranks[idx] = min(ranks[c] for c in succs[idx]) - 1
    return ranks


def _stub_attrs(stub_id: str, arrow: str, far_ends: list[str]) -> dict[str, str]:
    """A small text node naming the far ends of cut edges: ``↑ a, b (+3)``."""
    shown = ", ".join(far_ends[:2]) + (f" (+{len(far_ends) - 2})" if len(far_ends) > 2 else "")
    return {
        "id": stub_id,
        "label": graphviz.nohtml(f"{arrow} " + _text(shown)),
        "tooltip": _text(", ".join(far_ends), limit=2000),
        "shape": "plaintext",
        "fontsize": "8",
        "fontcolor": "#555555",
        "height": "0.2",
        "class": "stub",
    }


_NOTE_MARK = 'class="graph note"'


def note_svg(message: str) -> str:
    """A one-line SVG note (used instead of a layout that cannot be made)."""
    text = _xml_escape(_CONTROL.sub("", message), quote=True)
    width = max(200, 7 * len(message) + 20)
    return (
        '<?xml version="1.0" encoding="UTF-8" standalone="no"?>\n'
        f'<svg width="100%" height="100%" viewBox="0 0 {width} 40" xmlns="http://www.w3.org/2000/svg">\n'
        f'<g id="graph0" {_NOTE_MARK}><text x="10" y="25" font-family="Helvetica" font-size="12">{text}</text></g>\n'
        "</svg>\n"
    )


class SvgCache:
    """Rendered SVGs keyed by a digest of the view and ``max_depth``, least recently used first out.

    Rendering is pure, so equal views give equal SVGs and a stale entry cannot be served: the key
    is the content, not the graph id. Notes (timeouts, too large) are not kept, so a retry on a
    quieter machine can succeed. Thread-safe; at most ``max_bytes`` of SVG text is held.
    """

    def __init__(self, max_bytes: int = 64 * 1024**2):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str, int | None], str] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def render(self, view: GraphView, *, max_depth: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
        """:func:`render_graph_svg` of ``view``, from the cache when the same view was drawn."""
        key = (hashlib.sha256(view.model_dump_json().encode()).hexdigest(), max_depth)
        with self._lock:
            svg = self._entries.get(key)
            if svg is not None:
                self._entries.move_to_end(key)
                return svg
        svg = render_graph_svg(view, max_depth=max_depth, timeout_s=timeout_s)
        if _NOTE_MARK in svg[:1000] or len(svg) > self.max_bytes:
            return svg
        with self._lock:
            if key not in self._entries:
                self._entries[key] = svg
                self._size += len(svg)
            while self._size > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self._size -= len(old)
        return svg


def _node_attrs(node: ViewNode, folded: list[str] | tuple[str, ...]) -> dict[str, str]:
    # A placeholder bound to a parameter is drawn by the parameter's name (Dynamo's own name,
    # "L_self_modules_..._parameters_weight_", stays in the tooltip).
    lines = [_text(node.param_fqn if node.op == "placeholder" and node.param_fqn else node.label)]
    tensor = tensor_label(node.shape, node.dtype)
    if tensor:
        lines.append(_text(tensor))
    tooltip = node.id
    if folded:
        tooltip += "\n+ " + ", ".join(folded)
        lines.append(_text(f"+{len(folded)} params"))
    attrs = {
        "id": f"node-{node.idx}",
        "label": graphviz.nohtml("\\n".join(lines)),
        "tooltip": _text(tooltip, limit=400),
        "class": f"cat-{node.category}",
    }
    if node.op == "placeholder":
        attrs.update(shape="ellipse", style="filled", fillcolor=_PLACEHOLDER_FILL)
    elif node.op == "get_attr":
        attrs.update(shape="ellipse", style="filled,dashed", fillcolor=_PLACEHOLDER_FILL)
    elif node.op == "output":
        attrs.update(shape="box", style="filled,bold", peripheries="2", fillcolor=_OUTPUT_FILL)
    else:
        attrs.update(shape="box", style="rounded,filled", fillcolor=CATEGORY_COLORS.get(node.category, _PALETTE[0]))
    return attrs


def tensor_label(shape: Any, dtype: str | None) -> str:
    """``([8, 64], 'torch.float32')`` → ``'f32[8, 64]'``; a tuple of shapes shows the first and
    how many more: ``'f32[8, 64] (+1 more)'``; no shape and no dtype → ``''``."""
    short = ""
    if dtype:
        name = dtype[len("torch."):] if dtype.startswith("torch.") else dtype
        short = _DTYPE_SHORT.get(name, name)
    if shape is None:
        return short
    if isinstance(shape, list) and shape and all(isinstance(s, list) for s in shape):
        more = f" (+{len(shape) - 1} more)" if len(shape) > 1 else ""
        return f"{short}[{', '.join(map(str, shape[0]))}]{more}"
    if isinstance(shape, list):
        return f"{short}[{', '.join(map(str, shape))}]"
    return f"{short}{shape}"


def _text(value: str, *, limit: int = MAX_TEXT_CHARS) -> str:
    """User text made safe and short for a DOT label or tooltip (see the module docstring)."""
    clean = _CONTROL.sub("", value).replace("\r", "").replace("\t", " ")
    if len(clean) > limit:
        clean = f"{clean[: limit - 20]}…[total_len={len(clean)}]"
    # In our labels "\n" is the DOT line break; a raw newline in user text becomes one too.
    return graphviz.nohtml(graphviz.escape(clean).replace("\n", "\\n"))


def _namespace_key(namespace: str | None, max_depth: int | None) -> tuple[str, ...]:
    if not namespace:
        return ()
    parts = tuple(p for p in namespace.split("/") if p)
    return parts if max_depth is None else parts[:max_depth]


def _collapse(view: GraphView) -> tuple[list[ViewNode], list[ViewEdge], dict[str, list[str]]]:
    """Fold parameter placeholders into their consumers (see NOTE: [Large graphs])."""
    params = {n.id for n in view.nodes if n.op == "placeholder" and n.param_fqn}
    folded: dict[str, list[str]] = defaultdict(list)
    edges = []
    for edge in view.edges:
        if edge.src in params:
            folded[edge.dst].append(edge.src)
        else:
            edges.append(edge)
    nodes = [n for n in view.nodes if n.id not in params]
    return nodes, edges, {k: sorted(v) for k, v in folded.items()}


def _fill_viewport(svg: str) -> str:
    """Replace the root's fixed ``width``/``height`` (in pt) by ``100%``; the viewBox stays."""
    return _ROOT_SIZE.sub('<svg width="100%" height="100%"', svg, count=1)
