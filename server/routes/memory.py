"""Memory routes: graph-derived liveness of a graph or of a forward+backward step, what-if
estimates, and measured memory from a trace's ``[memory]`` events."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query
from sqlalchemy.orm import Session

from graphdeck.analysis.memory import (
    checkpoint_estimate,
    dtype_estimate,
    forward_backward_pair,
    graph_memory,
    measured_from_trace,
    step_memory,
)
from graphdeck.server.deps import get_session, resolve_graph
from graphdeck.store.schema import Graph

router = APIRouter(tags=["memory"])


@router.get("/api/graphs/{graph_id}/memory")
def get_memory(graph: Graph = Depends(resolve_graph), session: Session = Depends(get_session),
               scope: str = Query("graph", pattern="^(graph|step)$",
                                  description="graph: this graph alone; step: its forward then its backward graph"),
               top: int = Query(10, ge=1, le=200, description="holders listed at the peak")) -> dict:
    """Live bytes after each node (``live_bytes``, node order), the peak (bytes, node, index),
    the top holders at the peak by module path and kind, and the saved activations (bytes per
    module; the backward node that frees each, for ``scope=step``). 404 when ``scope=step`` and
    the graph has no stored forward/backward pair."""
    if scope == "step":
        fw, bw = forward_backward_pair(session, graph.id)
        curve = step_memory(session, fw, bw)
    else:
        curve = graph_memory(session, graph.id)
    out = curve.to_dict()
    out["holders"] = out["holders"][:top]
    out["scope"] = scope
    return out


@router.get("/api/graphs/{graph_id}/memory/whatif")
def get_whatif(graph: Graph = Depends(resolve_graph), session: Session = Depends(get_session),
               checkpoint: str | None = Query(None, description="module path to checkpoint, e.g. transformer/h/0"),
               dtype: str | None = Query(None, description="store activations in this dtype, e.g. bfloat16")) -> dict:
    """Estimated step peak after activation-checkpointing a module, or with activations in another
    dtype. 400 when neither or an unknown module/dtype is given."""
    from graphdeck.errors import UsageError

    fw, bw = forward_backward_pair(session, graph.id)
    if checkpoint:
        return checkpoint_estimate(session, fw, bw, checkpoint).to_dict()
    if dtype:
        return dtype_estimate(session, fw, bw, dtype).to_dict()
    raise UsageError("give checkpoint=<module path> or dtype=<dtype>")


@router.get("/api/traces/{trace_id}/memory")
def get_trace_memory(trace_id: int, session: Session = Depends(get_session)) -> dict:
    """Measured memory over time per device from the trace's ``[memory]`` events (``ts_ns``,
    ``total_allocated_bytes``, peak). 404 when the trace has none."""
    return measured_from_trace(session, trace_id)
