"""Activation-checkpoint and autocast regions as labelled boxes of the graph view.

A region (``analysis/parallel/regions.py``, NOTE: [Graph regions]) becomes one more cluster of the view's
cluster tree: its nodes' namespaces get a *region segment* ``⟨label⟩`` inserted, so the layout
(``layout.py``) places them together in one box that opens and closes like a module cluster,
and edges never cross its border (NOTE: [Edges between clusters]).

# NOTE: [Region clusters]
Where the segment goes, for a region whose non-placeholder nodes share the module prefix ``P``:
* when the region holds every non-placeholder node under ``P`` (a checkpointed block), the box
  wraps ``P``'s cluster: every node under ``P`` moves to ``P[:-1] + (segment,) + P[-1:] + rest``
  (so ``layers/⟨activation checkpoint: layers.1⟩/1/fc``), parameters of the block included;
* otherwise the box sits inside ``P``: the region's nodes move to ``P + (segment,) + rest``.
Regions are applied outermost first, so a region inside another is a box inside its box; two
regions that overlap without nesting are drawn as the first one's box split where the second
cuts it. A higher-order node's region (Dynamo's ``tag_activation_checkpoint``) is first placed
at its body's module path. The segment is the label in angle brackets (``/`` replaced by
``∕``), numbered ``#2``, ``#3``… when siblings share a label; which paths are regions is known from
:attr:`RegionView.regions`, never guessed from the text.
"""

from __future__ import annotations

import os
from html import escape as _esc

from pydantic import BaseModel, Field
from sqlalchemy.orm import Session

from graphdeck.analysis.graphs.view import GraphView, ViewNode
from graphdeck.analysis.parallel.regions import Region, graph_regions
from graphdeck.server.render.xmltext import attr as _attr
from graphdeck.server.render.xmltext import clean as _text

_PLACED = ("placeholder", "get_attr", "output")
#: Box styles per region kind: (fill, stroke, dash).
STYLES = {
    "autocast": ("#fff6e0", "#c77c02", "6 3"),
    "activation_checkpoint": ("#f1e9f7", "#7b3294", "6 3"),
    "activation_checkpoint_recomputed": ("#f8eefb", "#7b3294", "2 2"),
}


class ViewRegion(BaseModel):
    """One region of a :class:`RegionView`: ``path`` is its cluster path in the view (the SVG's
    ``data-path`` of its box), ``nodes`` the FX node names it holds (graph order)."""

    kind: str = Field(description="autocast | activation_checkpoint | activation_checkpoint_recomputed")
    label: str = Field(description="drawn on the box, e.g. 'autocast cpu bfloat16'")
    path: str = Field(description="the box's cluster path 'a/⟨label⟩' (the SVG's data-path)")
    nodes: list[str] = Field(default_factory=list)
    detail: str = ""


class RegionView(GraphView):
    """A :class:`GraphView` whose namespaces hold region segments (NOTE: [Region clusters])."""

    regions: list[ViewRegion] = Field(default_factory=list)


def segment(label: str) -> str:
    return "\u27e8" + label.replace("/", "\u2215") + "\u27e9"


def with_regions(session: Session, graph_id: int, view: GraphView) -> GraphView:
    """``view`` of stored graph ``graph_id`` with its regions as clusters (the view itself when
    it has none)."""
    regions = graph_regions(session, graph_id)
    return apply_regions(view, regions) if regions else view


def _split(ns: str | None) -> tuple[str, ...]:
    return tuple(p for p in (ns or "").split("/") if p)



def apply_regions(view: GraphView, regions: list[Region]) -> RegionView:
    """``view`` with each region's nodes moved into a region cluster (NOTE: [Region clusters]);
    nodes not in ``view`` are ignored, a region with none left is dropped. ``regions`` outermost
    first (as :func:`~graphdeck.analysis.parallel.regions.graph_regions` returns them)."""
    path = {n.id: _split(n.namespace) for n in view.nodes}
    ops = {n.id: n.op for n in view.nodes}
    for r in regions:  # a higher-order node's region sits at its body's module
        if r.module:
            for name in r.nodes:
                if name in path:
                    path[name] = _split(r.module)
    region_segments: set[tuple[str, ...]] = set()
    used: set[tuple[str, ...]] = {p[:d] for p in path.values() for d in range(1, len(p) + 1)}
    out: list[ViewRegion] = []
    for r in regions:
        members = [n for n in r.nodes if n in path and ops[n] != "output"]
        if not members:
            continue
        marks = set(r.markers)
        counted = ([n for n in members if ops[n] not in _PLACED and n not in marks]
                   or [n for n in members if ops[n] not in _PLACED] or members)
        prefix = tuple(os.path.commonprefix([path[n] for n in counted]))
        inside = {n for n in path if path[n][: len(prefix)] == prefix and ops[n] not in _PLACED}
        wrap = bool(prefix) and prefix not in region_segments and inside <= set(members)
        at = prefix[:-1] if wrap else prefix
        seg, k = segment(r.label), 1
        while at + (seg,) in used:
            k += 1
            seg = segment(f"{r.label} #{k}")
        box = at + (seg,)
        moved = members
        if wrap:
            moved = [n for n in path if (path[n][: len(prefix)] == prefix or n in marks) and ops[n] != "output"]
        for name in moved:
            p = path[name]
            path[name] = box + p[len(at):] if p[: len(at)] == at else box
        used.update(p[:d] for name in moved for p in (path[name],) for d in range(1, len(p) + 1))
        region_segments.add(box)
        out.append(ViewRegion(kind=r.kind, label=r.label, path="/".join(box), nodes=[n for n in r.nodes if n in path],
                              detail=r.detail))
    nodes: list[ViewNode] = []
    for n in view.nodes:
        ns = "/".join(path[n.id]) or None
        nodes.append(n if ns == n.namespace else n.model_copy(update={"namespace": ns}))
    return RegionView.model_construct(graph_id=view.graph_id, name=view.name, kind=view.kind, nodes=nodes,
                                      edges=view.edges, regions=out)


def region_map(view: GraphView) -> dict[tuple[str, ...], ViewRegion]:
    """Cluster path → region, for the views :func:`apply_regions` made (``{}`` for others)."""
    return {_split(r.path): r for r in getattr(view, "regions", None) or []}


def region_attrs(region: ViewRegion, attr) -> str:
    """The extra attributes of a region cluster's ``<g>`` (``attr``: the SVG's attribute escaper)."""
    return f' data-region="{attr(region.kind)}" data-label="{attr(region.label)}"'


def region_style(region: ViewRegion) -> tuple[str, str, str]:
    """(fill, stroke, dash) of a region box."""
    return STYLES.get(region.kind, ("#f4f4f4", "#666666", "4 2"))


def open_region_svg(region: ViewRegion, cluster, path: str, x: float, y: float, w: float, h: float) -> str:
    """The ``<g>`` of an open region box (``svg.py``'s open cluster markup, plus ``region``,
    ``region-<kind>`` classes, ``data-region`` / ``data-label``, a dashed border and the label
    drawn): drawn before what it holds. Every user string escaped."""
    fill, stroke, dash = region_style(region)
    return (
        f'<g id="cluster-{cluster.key}" class="cluster open region region-{region.kind}" data-path="{_attr(path)}"'
        f'{region_attrs(region, _attr)} data-nodes="{cluster.total_nodes}">'
        f'<title>{_esc(_text(region.label, limit=300))} ({cluster.total_nodes} nodes; click to collapse)\n'
        f'{_esc(_text(region.detail, limit=400))}</title>'
        f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" rx="6" fill="{fill}" stroke="{stroke}" '
        f'stroke-width="1.5" stroke-dasharray="{dash}"/>'
        f'<text x="{x + 6:.1f}" y="{y + 13:.1f}" font-size="9" font-weight="bold" fill="{stroke}">'
        f'\u25be {_esc(_text(region.label))}</text></g>\n')
