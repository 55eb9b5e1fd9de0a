"""The graph view from Python (scripts, notebooks): ``GraphVisualizer(graph).render(...)`` → SVG.

Example (a live GraphModule; the same for a stored graph with ``GraphVisualizer("run.db", 3)``)::

    >>> import torch
    >>> from graphdeck.visualize import GraphVisualizer
    >>> class Block(torch.nn.Module):
    ...     def forward(self, x, w):
    ...         return torch.relu(torch.nn.functional.linear(x, w))
    >>> svg = GraphVisualizer(torch.fx.symbolic_trace(Block())).render(max_depth=2, filter_by_op=["linear"])
    >>> svg.startswith("<?xml") and 'class="node cat-matmul match"' in svg
    True

In Jupyter the object displays itself (``_repr_html_``: the SVG in a scrollable box). The SVG is
the dashboard's (``server/render/svg.py``); :meth:`GraphVisualizer.save` writes it as a standalone
file, :meth:`GraphVisualizer.model_explorer` gives Model Explorer graph JSON. torch is imported
only for a GraphModule, the store only for a stored graph.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from graphdeck.analysis.graphs.view import GraphView, ViewEdge, ViewNode, finish_view, node_label, op_category
from graphdeck.server.render.model_explorer import model_explorer_graph
from graphdeck.server.render.svg import render_graph_svg


class GraphVisualizer:
    """One graph to draw: a ``torch.fx.GraphModule``, a :class:`GraphView`, or a store path/URL
    plus ``graph_id``.

    Raises:
        UsageError: a store path without ``graph_id``, or an unsupported ``graph`` type.
        NotFoundError: no graph ``graph_id`` in the store (or no store file).
    """

    def __init__(self, graph: Any, graph_id: int | None = None, *, name: str | None = None):
        from graphdeck.errors import UsageError

        if isinstance(graph, GraphView):
            self.view = graph
        elif isinstance(graph, (str, os.PathLike)):
            if graph_id is None:
                raise UsageError("a stored graph needs graph_id: GraphVisualizer(store, graph_id)")
            self.view = _stored_view(graph, graph_id)
        elif hasattr(graph, "graph") and hasattr(graph.graph, "nodes"):
            self.view = view_from_graph_module(graph, name=name or type(graph).__name__)
        else:
            raise UsageError(f"cannot draw a {type(graph).__name__}: pass a GraphModule, a GraphView or a store path")
        self.defaults: dict[str, Any] = {}

    def render(self, max_depth: int | None = None, filter_by_op: list[str] | tuple[str, ...] = (),
               expand: list[str] | tuple[str, ...] = (), collapse: list[str] | tuple[str, ...] = (),
               focus: str | None = None) -> str:
        """The SVG text (see :func:`~graphdeck.server.render.svg.render_graph_svg` for every argument;
        ``max_depth=None`` opens as deep as ~400 items allow). Remembered for Jupyter display.

        Raises:
            UsageError: a ``filter_by_op`` pattern is not a valid regular expression.
            ValueError: ``max_depth`` < 0.
        """
        self.defaults = {"max_depth": max_depth, "filter_by_op": tuple(filter_by_op), "expand": tuple(expand),
                         "collapse": tuple(collapse), "focus": focus}
        return render_graph_svg(self.view, **self.defaults)

    def save(self, path: str | os.PathLike, **view) -> Path:
        """Write :meth:`render` (with ``view`` arguments) to ``path`` as a standalone SVG file."""
        out = Path(path)
        out.write_text(self.render(**view) if view else render_graph_svg(self.view, **self.defaults), encoding="utf-8")
        return out

    def model_explorer(self) -> dict:
        """Model Explorer graph JSON (namespace = module path)."""
        return model_explorer_graph(self.view)

    def _repr_svg_(self) -> str:
        return render_graph_svg(self.view, **self.defaults)

    def _repr_html_(self) -> str:
        return ('<div style="height:600px;overflow:auto;border:1px solid #ddd">'
                + self._repr_svg_().split("?>", 1)[-1] + "</div>")


def _stored_view(store: str | os.PathLike, graph_id: int) -> GraphView:
    from sqlalchemy.orm import Session

    from graphdeck.analysis.graphs.view import graph_view
    from graphdeck.store.db import open_engine

    engine = open_engine(store, read_only=True)
    try:
        with Session(engine) as session:
            return graph_view(session, graph_id)
    finally:
        engine.dispose()


def view_from_graph_module(gm, *, name: str = "GraphModule", graph_id: int = 0) -> GraphView:
    """A live ``torch.fx.GraphModule`` as a :class:`GraphView`, through the capture's own reader
    (``capture/fxrecord.py``: module paths from ``nn_module_stack`` / ``fwd_nn_module_stack``,
    tensor metadata from ``meta["val"]``)."""
    from graphdeck.capture.fxrecord import record_graph

    rec = record_graph(gm)
    nodes = [
        ViewNode(id=n.name, idx=n.idx, label=node_label(n.op, n.target), op=n.op, target=n.target,
                 category=op_category(n.op, n.target), namespace=n.module_path or None,
                 shape=n.shape, dtype=n.dtype, size_bytes=n.size_bytes, seq_nr=n.seq_nr)
        for n in rec.nodes
    ]
    names = {n.idx: n.name for n in rec.nodes}
    edges = [ViewEdge(src=names[e.src_idx], dst=names[e.dst_idx], arg_pos=e.arg_pos, size_bytes=e.size_bytes)
             for e in rec.edges]
    finish_view(nodes, edges)
    return GraphView(graph_id=graph_id, name=name, kind="fx", nodes=nodes, edges=edges)
