"""Export a graph view and its overlays for Google's Model Explorer.

Formats (read from Model Explorer's documented JSON adapter types, ``GraphCollection`` /
``Graph`` / ``GraphNode`` / ``IncomingEdge`` / ``MetadataItem`` / ``KeyValue``, and its node-data
files; no code taken):

* graph JSON: ``{"label": ..., "graphs": [{"id": ..., "nodes": [{"id", "label", "namespace",
  "subgraphIds": [], "attrs": [{"key", "value"}], "incomingEdges": [{"sourceNodeId",
  "sourceNodeOutputId", "targetNodeInputId"}], "outputsMetadata": [{"id": "0", "attrs": [...]}]}]}]}``
  — namespace is the module path (``a/b/c``), which Model Explorer turns into collapsible layers;
* node data JSON: ``{"<graph id>": {"results": {"<node id>": {"value": v}}, "gradient": [{"stop",
  "bgColor"}]}}``, one value per node of an :class:`~graphdeck.analysis.parallel.overlays.Overlay`.
"""

from __future__ import annotations

from graphdeck.analysis.graphs.view import GraphView
from graphdeck.analysis.parallel.overlays import Overlay
from graphdeck.server.render.palette import HEAT
from graphdeck.server.render.svg import tensor_label


def graph_id_of(view: GraphView) -> str:
    return f"graphdeck-{view.graph_id}"


def model_explorer_graph(view: GraphView) -> dict:
    """``view`` as a Model Explorer ``GraphCollection`` (one graph; node ids are FX names)."""
    incoming: dict[str, list[dict]] = {}
    for e in sorted(view.edges, key=lambda e: (e.dst, e.arg_pos, e.src)):
        incoming.setdefault(e.dst, []).append(
            {"sourceNodeId": e.src, "sourceNodeOutputId": "0", "targetNodeInputId": str(e.arg_pos)})
    nodes = []
    for n in sorted(view.nodes, key=lambda n: n.idx):
        attrs = [{"key": "op", "value": n.op}, {"key": "target", "value": n.target},
                 {"key": "category", "value": n.category}]
        for key in ("seq_nr", "param_fqn", "dtype_change"):
            value = getattr(n, key)
            if value is not None:
                attrs.append({"key": key, "value": str(value)})
        if n.recomputed:
            attrs.append({"key": "recomputed", "value": "true"})
        out_attrs = [{"key": "tensor", "value": tensor_label(n.shape, n.dtype)}]
        if n.size_bytes is not None:
            out_attrs.append({"key": "size_bytes", "value": str(n.size_bytes)})
        nodes.append({
            "id": n.id, "label": n.label, "namespace": n.namespace or "", "subgraphIds": [],
            "attrs": attrs, "incomingEdges": incoming.get(n.id, []),
            "outputsMetadata": [{"id": "0", "attrs": out_attrs}], "inputsMetadata": [],
        })
    return {"label": view.name, "graphs": [{"id": graph_id_of(view), "nodes": nodes}]}


def model_explorer_node_data(view: GraphView, overlay: Overlay) -> dict:
    """``overlay`` as Model Explorer node data for ``view``'s graph. Categorical values are
    written as their sorted index (Model Explorer colours numbers), numeric ones as they are."""
    if overlay.categorical:
        cats = sorted({str(v) for v in overlay.values.values()})
        results = {k: {"value": cats.index(str(v))} for k, v in sorted(overlay.values.items())}
    else:
        results = {k: {"value": v} for k, v in sorted(overlay.values.items())}
    stops = len(HEAT) - 1
    gradient = [{"stop": round(i / stops, 4), "bgColor": c} for i, c in enumerate(HEAT)]
    return {graph_id_of(view): {"results": results, "gradient": gradient}}
