"""TORCH_TRACE import over HTTP, and the per-rank compile index it feeds.

* ``POST /api/runs/{run_name}/torch-trace?strict=false``: multipart upload of one or more logs
  (field ``files``; each part's file name is kept, so ``…rank_<r>….log`` gives the rank), streamed
  to disk part by part and capped at ``settings.max_upload_bytes`` in total while it is read
  (413 as soon as it passes; nothing kept), then
  :func:`~graphdeck.store.torch_trace.import_torch_trace` — the CLI's ``graphdeck import`` code
  path. 201 ``{"ok": true, "run_id", "run_name", "ranks", "stats", "dropped", "unverified", "files",
  "skipped_files"}``.
* ``GET /api/runs/{run_id}/compile-index?rank=``: :func:`~graphdeck.analysis.compilation.index.compile_index`
  as ``{"run", "ranks": {rank: [entry, ...]}, "rank_sources": {rank: {"file", "envelope_rank",
  "rank_mismatch", "records", "dropped": {reason: count}, "unverified": n}}}`` (records kept though
  their md5 failed) (``rank_sources`` for ranks imported
  from TORCH_TRACE logs).
* ``GET /api/compile-events/{event_id}``: one compile record with its whole payload (e.g. the
  Inductor output code of a graph).
* ``GET /api/graphs/{graph_id}/kernels``: kernel → node links of a graph (``kernel_nodes``).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path as FsPath

from fastapi import APIRouter, Depends, Path, Query, Request
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from graphdeck.analysis.compilation.index import compile_index
from graphdeck.errors import BadInputError, NotFoundError, PayloadTooLargeError
from graphdeck.server.auth import BODY_ENVELOPE_BYTES
from graphdeck.server.deps import get_engine, get_session, get_settings, resolve_graph, resolve_run
from graphdeck.server.routes.traces import UploadBudget, receive_multipart
from graphdeck.store.schema import CompileEvent, Graph, KernelNode, Rank, Run
from graphdeck.store.torch_trace import import_torch_trace

router = APIRouter(tags=["imports"])
DEFAULT_MAX_UPLOAD_BYTES = 512 * 1024 * 1024


def _safe_name(name: str | None, i: int) -> str:
    base = FsPath(name or f"upload_{i}.log").name
    base = re.sub(r"[^A-Za-z0-9._-]", "_", base) or f"upload_{i}.log"
    return base if base.endswith((".log", ".txt")) else base + ".log"


#: Most log files one upload may carry (a rank each; more is a 400).
MAX_FILES = 4096
_FILES_BODY = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["files"],
    "properties": {"files": {"type": "array", "items": {"type": "string", "format": "binary"}}}}}}}}


@router.post("/api/runs/{run_name}/torch-trace", status_code=201, openapi_extra=_FILES_BODY)
async def upload_torch_trace(request: Request, run_name: str = Path(..., max_length=200),
                             strict: bool = Query(False, description="fail, keeping nothing, on any dropped record"),
                             settings=Depends(get_settings), engine=Depends(get_engine)) -> dict:
    """Import uploaded TORCH_TRACE logs as run ``run_name`` (see the module docstring). The parts
    stream to files of a private temp folder as they arrive, every byte counted against the cap
    (413 the moment it passes; the folder is removed), so memory stays flat whatever the size."""
    cap = int(getattr(settings, "max_upload_bytes", DEFAULT_MAX_UPLOAD_BYTES))
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > cap + BODY_ENVELOPE_BYTES:
        raise PayloadTooLargeError(f"upload of {length} bytes is larger than the {cap}-byte limit", limit_bytes=cap)
    if not request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
        raise BadInputError("send the logs as multipart/form-data, one part per file in the field 'files'")
    tmp = FsPath(tempfile.mkdtemp(prefix="graphdeck-tt-"))
    opened: list = []

    def open_part(filename: str | None):
        i = len(opened)
        if i >= MAX_FILES:
            raise BadInputError(f"at most {MAX_FILES} files per upload")
        target = tmp / _safe_name(filename, i)
        while target.exists():
            target = tmp / f"{i}_{target.name}"
        opened.append(open(target, "xb"))
        return opened[-1]

    try:
        await receive_multipart(request, UploadBudget(cap), "files", open_part, max_parts=None)
        for f in opened:
            f.close()
        result = await run_in_threadpool(import_torch_trace, engine, tmp, run_name=run_name, strict=strict)
    finally:
        for f in opened:
            f.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return {"ok": True, **result.to_dict()}


@router.get("/api/runs/{run_id}/compile-index")
def get_compile_index(run: Run = Depends(resolve_run), session: Session = Depends(get_session),
                      rank: int | None = Query(None, description="only this rank")) -> dict:
    """Per rank, one entry per compile id (frame, status, compile time, graph breaks with reason
    and source line, recompile reasons, failure/restarts, graphs, output-code records)."""
    index = compile_index(session, run, rank)
    sources = {}
    for r, meta_json in session.execute(select(Rank.rank, Rank.meta_json).where(Rank.run_id == run.id)):
        meta = json.loads(meta_json or "{}")
        if meta.get("source") == "torch_trace":
            sources[str(r)] = {k: meta.get(k) for k in ("file", "envelope_rank", "rank_mismatch", "records", "dropped",
                                                         "unverified")}
    return {"run": {"id": run.id, "name": run.name}, "ranks": {str(r): v for r, v in index.items()},
            "rank_sources": sources}


@router.get("/api/compile-events/{event_id}")
def get_compile_event(event_id: int, session: Session = Depends(get_session)) -> dict:
    """One compile record: name, rank, compile id, metadata and the whole payload."""
    ev = session.get(CompileEvent, event_id)
    if ev is None:
        raise NotFoundError(f"compile event {event_id} not found", resource="compile_event", id=event_id)
    meta = json.loads(ev.metadata_json or "{}")
    graph_name = None
    if isinstance(meta.get("graph_id"), int):
        graph_name = session.scalar(select(Graph.name).where(Graph.id == meta["graph_id"]))
    return {"id": ev.id, "run_id": ev.run_id, "rank": ev.rank, "name": ev.name, "compile_id": ev.compile_id,
            "graph_id": meta.get("graph_id"), "graph_name": graph_name, "metadata": meta, "payload": ev.payload}


@router.get("/api/graphs/{graph_id}/kernels")
def get_graph_kernels(graph: Graph = Depends(resolve_graph), session: Session = Depends(get_session)) -> dict:
    """Kernel → node links of this graph: ``{"kernels": {kernel: [{"node", "pre_grad_node",
    "source", "call_index"}]}, "nodes": {node: [kernel, ...]}}``. A kernel called at several call
    sites of the graph's wrapper (two extern ``aten::mm`` calls, one C++ kernel run on two buffers)
    is keyed per call: ``"aten::mm #3"`` (``#`` + the call's 1-based index in the wrapper)."""
    rows = session.execute(select(KernelNode.kernel_name, KernelNode.node_name, KernelNode.pre_grad_node,
                                  KernelNode.source, KernelNode.call_index).where(KernelNode.graph_id == graph.id)
                           .order_by(KernelNode.kernel_name, KernelNode.call_index, KernelNode.id)).all()
    sites: dict[str, set] = {}
    for k, _, _, _, ci in rows:
        sites.setdefault(k, set()).add(ci)
    kernels: dict[str, list[dict]] = {}
    nodes: dict[str, list[str]] = {}
    for k, n, pre, src, ci in rows:
        key = f"{k} #{ci}" if len(sites[k]) > 1 and ci is not None else k
        kernels.setdefault(key, []).append({"node": n, "pre_grad_node": pre, "source": src, "call_index": ci})
        nodes.setdefault(n, [])
        if key not in nodes[n]:
            nodes[n].append(key)
    return {"graph_id": graph.id, "kernels": kernels, "nodes": nodes}
