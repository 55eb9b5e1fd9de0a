"""Memory routes: graph-derived liveness of a graph or of a forward+backward step, what-if
estimates, and measured memory from a trace's ``[memory]`` events (a CUDA memory snapshot's: in
:mod:`graphdeck.server.routes.memory_measured`, included here)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Path, Query
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.memory.core import (
    checkpoint_estimate,
    dtype_estimate,
    forward_backward_pair,
    graph_memory,
    measured_from_trace,
    step_memory,
)
from graphdeck.server.deps import MAX_ID, get_session, resolve_graph
from graphdeck.store.schema import Graph

router = APIRouter(tags=["memory"])


def _include_measured() -> None:
    from graphdeck.server.routes.memory_measured import router as measured

    router.include_router(measured)  # /api/graphs/{id}/memory/measured: a CUDA memory snapshot beside the models




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
def get_trace_memory(trace_id: int = Path(le=MAX_ID, ge=-MAX_ID - 1), session: Session = Depends(get_session),
                     if_any: bool = Query(False, description="answer {} (200) instead of 404 when the trace has no "
                                                              "[memory] events: a page probing every trace")) -> dict:
    """Measured memory over time per device from the trace's ``[memory]`` events (``ts_ns``,
    ``total_allocated_bytes``, peak). 404 when the trace has none (``if_any=true``: ``{}``), or is
    still being written (status ``ingesting``: its writer may have died; the server sweeps such
    traces at start). 422 when its ``[memory]`` events hold non-numbers (ingested before the ingest
    skipped them)."""
    from graphdeck.errors import CheckFailed, NotFoundError
    from graphdeck.store.schema import Trace

    status = session.scalar(select(Trace.status).where(Trace.id == trace_id))
    if status is None:
        raise NotFoundError(f"trace {trace_id} not found", resource="trace", id=trace_id)
    if status == "ingesting":
        raise NotFoundError(f"trace {trace_id} is not complete (status 'ingesting': still being written, or its "
                            "writer died)", resource="trace", id=trace_id)
    try:
        return measured_from_trace(session, trace_id)
    except NotFoundError:
        if if_any:
            return {}
        raise
    except (ValueError, TypeError, AttributeError, OverflowError) as exc:
        raise CheckFailed(f"trace {trace_id}'s [memory] events hold values that are not numbers ({exc}); "
                          "upload the trace again: the ingest now skips such events and counts them") from exc


_include_measured()
