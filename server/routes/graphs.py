"""Graph routes: a graph, its nodes, one node in full (and its forward/backward counterparts), its
view as JSON and SVG, overlays, a diff against another graph, and Model Explorer export."""

from __future__ import annotations

import json

from fastapi import APIRouter, Depends, Path, Query
from fastapi.responses import Response
from sqlalchemy import select
from sqlalchemy.orm import Session, aliased

from graphdeck.analysis.graphs.diff import diff_views
from graphdeck.analysis.graphs.view import graph_view, loads_json
from graphdeck.analysis.parallel.overlays import OVERLAY_KINDS, graph_overlay
from graphdeck.errors import UsageError
from graphdeck.server.deps import MAX_ID, find_graph, get_session, get_svg_cache, resolve_graph, resolve_node
from graphdeck.server.render.filters import compile_patterns
from graphdeck.server.render.flat import with_flat_clusters
from graphdeck.server.render.model_explorer import model_explorer_graph, model_explorer_node_data
from graphdeck.server.render.regions import with_regions
from graphdeck.server.render.svg import SvgCache
from graphdeck.server.routes.runs import GRAPH_FIELDS, pick
from graphdeck.store.schema import Edge, Graph, GraphIO, InternedString, Node, Run

router = APIRouter(tags=["graphs"])

NODE_FIELDS = ("idx", "name", "op", "dtype", "device", "size_bytes", "seq_nr", "partitioner_tag", "desc", "param_fqn")


def _strings(session: Session, ids) -> dict[int, str]:
    ids = {i for i in ids if i is not None}
    if not ids:
        return {}
    return dict(session.execute(select(InternedString.id, InternedString.value).where(InternedString.id.in_(ids))).all())


def node_dict(node: Node, strings: dict[int, str]) -> dict:
    return {**pick(node, NODE_FIELDS), "target": strings.get(node.target_id),
            "shape": loads_json(node.shape_json), "stride": loads_json(node.stride_json),
            "module_path": strings.get(node.module_path_id)}


@router.get("/api/graphs/{graph_id}")
def get_graph(graph: Graph = Depends(resolve_graph), session: Session = Depends(get_session)) -> dict:
    """The graph, its readable code, parameter/gradient bindings, parent and children graphs."""
    io = session.scalars(select(GraphIO).where(GraphIO.graph_id == graph.id).order_by(GraphIO.direction, GraphIO.position))
    children = session.scalars(select(Graph).where(Graph.parent_id == graph.id).order_by(Graph.ordinal))
    parent = session.get(Graph, graph.parent_id) if graph.parent_id else None
    run_name = session.scalar(select(Run.name).where(Run.id == graph.run_id))
    return {**pick(graph, GRAPH_FIELDS), "run_id": graph.run_id, "run_name": run_name, "code": graph.code,
            "meta": json.loads(graph.meta_json or "{}"),
            "io": [{"direction": b.direction, "position": b.position, "node_name": b.node_name,
                    "param_fqn": b.param_fqn, "has_grad": b.has_grad, "desc": b.desc} for b in io],
            "parent": pick(parent, GRAPH_FIELDS) if parent else None,
            "children": [pick(c, GRAPH_FIELDS) for c in children]}


@router.get("/api/graphs/{graph_id}/nodes")
def get_nodes(graph: Graph = Depends(resolve_graph), session: Session = Depends(get_session)) -> Response:
    """Every node's fields (as ``/nodes/{name}`` without args, stack trace and meta), in graph order.
    Read as Core rows and written with one ``json.dumps``: the graph page loads this for 20,000-node graphs."""
    cols = [getattr(Node, f) for f in NODE_FIELDS]
    rows = session.connection().execute(
        select(*cols, Node.target_id, Node.module_path_id, Node.shape_json, Node.stride_json)
        .where(Node.graph_id == graph.id).order_by(Node.idx)).all()
    strings = _strings(session, {r[-4] for r in rows} | {r[-3] for r in rows})
    n = len(NODE_FIELDS)
    out = [{**dict(zip(NODE_FIELDS, r[:n])), "target": strings.get(r[n]), "shape": loads_json(r[n + 2]),
            "stride": loads_json(r[n + 3]), "module_path": strings.get(r[n + 1])} for r in rows]
    return Response(json.dumps(out, separators=(",", ":")), media_type="application/json")


@router.get("/api/graphs/{graph_id}/nodes/{node_name}")
def get_node(node: Node = Depends(resolve_node), session: Session = Depends(get_session)) -> dict:
    """One node in full: args, stack trace, module stack, meta, and the names of its inputs and users."""
    strings = _strings(session, [node.target_id, node.module_path_id, node.stack_trace_id])
    src, dst = aliased(Node), aliased(Node)
    inputs = session.scalars(select(src.name).join(Edge, (Edge.graph_id == src.graph_id) & (Edge.src_idx == src.idx))
                             .where(Edge.graph_id == node.graph_id, Edge.dst_idx == node.idx)
                             .order_by(Edge.arg_pos)).all()
    users = session.scalars(select(dst.name).join(Edge, (Edge.graph_id == dst.graph_id) & (Edge.dst_idx == dst.idx))
                            .where(Edge.graph_id == node.graph_id, Edge.src_idx == node.idx)
                            .order_by(dst.idx)).all()
    args = loads_json(node.args_json) or {}
    return {**node_dict(node, strings), "graph_id": node.graph_id,
            "args": args.get("args", args) if isinstance(args, dict) else args,
            "kwargs": args.get("kwargs", {}) if isinstance(args, dict) else {},
            "stack_trace": strings.get(node.stack_trace_id), "module_stack": loads_json(node.module_stack_json),
            "meta": loads_json(node.meta_json), "inputs": list(dict.fromkeys(inputs)), "users": list(dict.fromkeys(users))}


@router.get("/api/graphs/{graph_id}/view")
def get_view(graph: Graph = Depends(resolve_graph), session: Session = Depends(get_session)) -> dict:
    """The graph view model (the SVG's JSON twin): nodes with namespace and tensor metadata, edges."""
    return graph_view(session, graph.id).model_dump()


def graph_key(graph: Graph) -> str:
    """What the SVG and layout caches key a stored graph by: rows of a captured graph never change."""
    return f"{graph.id}:{graph.structural_hash}:{graph.num_nodes}"


class ViewParams:
    """The view state of ``/svg``: every parameter the graph page keeps in its URL."""

    def __init__(
        self,
        max_depth: int | None = Query(None, ge=0, description="module clusters open to this depth by default "
                                      "(omitted: the deepest showing at most 400 items)"),
        expand: list[str] = Query([], description="module paths ('a/b') to open; repeat the parameter"),
        collapse: list[str] = Query([], description="module paths to close (wins over expand)"),
        filter_by_op: list[str] = Query([], description="op regexes (full match of short op, target or "
                                        "name): matches and paths between them kept, the rest faded"),
        node: str | None = Query(None, description="a node whose clusters are opened (the selection)"),
        overlay: str | None = Query(None, description="one of " + ", ".join(OVERLAY_KINDS)),
        diff_against: int | None = Query(None, ge=-MAX_ID - 1, le=MAX_ID,
                                         description="mark nodes added/removed/changed against this graph"),
    ):
        self.state = {"max_depth": max_depth, "expand": sorted(set(expand)), "collapse": sorted(set(collapse)),
                      "filter_by_op": list(filter_by_op), "focus": node, "overlay": overlay,
                      "diff_against": diff_against}
        if overlay is not None and overlay not in OVERLAY_KINDS:
            raise UsageError(f"unknown overlay {overlay!r}; one of {', '.join(OVERLAY_KINDS)}")
        compile_patterns(filter_by_op)


def drawn_view(session: Session, graph_id: int):
    """The view the SVG draws: regions as boxes (``render/regions.py``), a big flat graph clustered
    by parameter or stack frame (``render/flat.py``)."""
    return with_flat_clusters(session, graph_id, with_regions(session, graph_id, graph_view(session, graph_id)))


def render_view_svg(session: Session, graph: Graph, cache: SvgCache, params: ViewParams) -> str:
    """The SVG of ``graph`` in the view state ``params``, through the app's caches."""
    state = params.state
    cacheable = state["overlay"] not in ("time", "comm")  # a trace uploaded later changes these overlays
    if cacheable:
        hit = cache.lookup(graph_key(graph), state)
        if hit is not None:
            return hit
    view = cache.view(graph_key(graph), lambda: drawn_view(session, graph.id))
    extra = {}
    if state["overlay"]:
        extra["overlay"] = graph_overlay(session, graph.id, state["overlay"])
    if state["diff_against"] is not None:
        other_row = find_graph(session, state["diff_against"])
        other = cache.view(graph_key(other_row), lambda: drawn_view(session, other_row.id))
        extra["marks"] = diff_views(view, other).marks_a()
    if not cacheable:
        state = {**state, "uncached": object()}
    return cache.render(view, state, graph_key=graph_key(graph), **extra)


@router.get("/api/graphs/{graph_id}/svg", response_class=Response,
            responses={200: {"content": {"image/svg+xml": {}}}})
def get_svg(graph: Graph = Depends(resolve_graph), session: Session = Depends(get_session),
            cache: SvgCache = Depends(get_svg_cache), params: ViewParams = Depends(),
            download: bool = Query(False, description="as a standalone .svg file (Content-Disposition)")) -> Response:
    """The visible part of the graph laid out (``render/svg.py`` documents the markup): module
    clusters open to ``max_depth`` plus ``expand`` minus ``collapse``, a collapsed cluster as one
    box; edges weighted by bytes; filter, overlay and diff marks. Past the render deadline, the
    k-hop neighbourhood of ``node`` with a note."""
    svg = render_view_svg(session, graph, cache, params)
    headers = {"Content-Disposition": f'attachment; filename="graph-{graph.id}.svg"'} if download else None
    return Response(svg, media_type="image/svg+xml", headers=headers)


@router.get("/api/graphs/{graph_id}/regions")
def get_regions(graph: Graph = Depends(resolve_graph), session: Session = Depends(get_session)) -> dict:
    """Activation-checkpoint and autocast regions drawn as boxes (``server/render/regions.py``):
    ``{"regions": [{"kind", "label", "path" (the box's data-path in the SVG), "nodes", "detail"}]}``."""
    view = with_regions(session, graph.id, graph_view(session, graph.id))
    return {"regions": [r.model_dump() for r in getattr(view, "regions", [])]}


@router.get("/api/graphs/{graph_id}/overlays/{kind}")
def get_overlay(kind: str, graph: Graph = Depends(resolve_graph), session: Session = Depends(get_session)) -> dict:
    """Per-node overlay values keyed by node name (``analysis/parallel/overlays.py``)."""
    return graph_overlay(session, graph.id, kind).model_dump()


@router.get("/api/graphs/{graph_id}/diff/{other_id}")
def get_diff(other_id: int = Path(ge=-MAX_ID - 1, le=MAX_ID), graph: Graph = Depends(resolve_graph), session: Session = Depends(get_session)) -> dict:
    """Graph diff of this graph (A) against ``other_id`` (B): pairs, added, removed, changed."""
    other = find_graph(session, other_id)
    return diff_views(graph_view(session, graph.id), graph_view(session, other.id)).model_dump()


@router.get("/api/graphs/{graph_id}/nodes/{node_name}/counterparts")
def get_counterparts(node: Node = Depends(resolve_node), session: Session = Depends(get_session)) -> dict:
    """The nodes sharing this node's ``seq_nr`` in the AOT forward/backward sibling graph(s) of
    its graph: ``{"seq_nr", "graphs": [{"id", "kind", "name", "nodes": [names]}]}``."""
    graph = session.get(Graph, node.graph_id)
    out = {"seq_nr": node.seq_nr, "graphs": []}
    if node.seq_nr is None or graph.parent_id is None:
        return out
    siblings = session.scalars(select(Graph).where(Graph.parent_id == graph.parent_id, Graph.id != graph.id,
                                                   Graph.kind.in_(("aot_forward", "aot_backward")))
                               .order_by(Graph.id)).all()
    for sib in siblings:
        names = session.scalars(select(Node.name).where(Node.graph_id == sib.id, Node.seq_nr == node.seq_nr)
                                .order_by(Node.idx)).all()
        if names:
            out["graphs"].append({"id": sib.id, "kind": sib.kind, "name": sib.name, "nodes": list(names)})
    return out


@router.get("/api/graphs/{graph_id}/model-explorer")
def get_model_explorer(graph: Graph = Depends(resolve_graph), session: Session = Depends(get_session)) -> dict:
    """The graph as Model Explorer graph JSON (namespace = module path)."""
    return model_explorer_graph(graph_view(session, graph.id))


@router.get("/api/graphs/{graph_id}/model-explorer/node-data/{kind}")
def get_model_explorer_data(kind: str, graph: Graph = Depends(resolve_graph),
                            session: Session = Depends(get_session)) -> dict:
    """An overlay as Model Explorer node-data JSON for this graph."""
    return model_explorer_node_data(graph_view(session, graph.id), graph_overlay(session, graph.id, kind))
