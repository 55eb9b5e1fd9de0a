"""Graph routes: a graph, its nodes, one node in full, and its view as JSON and SVG."""

from __future__ import annotations

import json

from fastapi import APIRouter, Depends, Query
from fastapi.responses import Response
from sqlalchemy import select
from sqlalchemy.orm import Session, aliased

from graphdeck.server.deps import get_session, get_svg_cache, resolve_graph, resolve_node
from graphdeck.server.render.svg import SvgCache
from graphdeck.server.routes.runs import GRAPH_FIELDS, pick
from graphdeck.server.views import graph_view, loads_json
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
def get_nodes(graph: Graph = Depends(resolve_graph), session: Session = Depends(get_session)) -> list[dict]:
    nodes = session.scalars(select(Node).where(Node.graph_id == graph.id).order_by(Node.idx)).all()
    strings = _strings(session, [n.target_id for n in nodes] + [n.module_path_id for n in nodes])
    return [node_dict(n, strings) for n in nodes]


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


@router.get("/api/graphs/{graph_id}/svg", response_class=Response,
            responses={200: {"content": {"image/svg+xml": {}}}})
def get_svg(graph: Graph = Depends(resolve_graph), session: Session = Depends(get_session),
            cache: SvgCache = Depends(get_svg_cache),
            max_depth: int | None = Query(None, ge=0, description="module-path depth of the drawn clusters")) -> Response:
    """The graph laid out by Graphviz ``dot``; nodes are ``<g id="node-<idx>" class="node">``.
    Long edges are drawn as stubs and very large graphs collapsed (see ``render/svg.py``)."""
    svg = cache.render(graph_view(session, graph.id), max_depth=max_depth)
    return Response(svg, media_type="image/svg+xml")
