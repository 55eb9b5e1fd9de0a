"""The compile list of a run, per rank, like tlparse's index page: for every compile id its frame,
graph breaks (reason and user source line), recompile reasons, failure or restarts, compile time,
the graphs it produced and its Inductor output code.

Read from ``compile_events`` (``dynamo_start``, ``compilation_metrics``,
``dynamo_graph_break_reason``, ``recompile_reasons``, ``dynamo_error``, ``inductor_output_code``)
and ``graphs``, as the TORCH_TRACE import and the capture agent store them. Pure: returns data.

Example (one entry)::

    {"compile_id": "5/0", "frame": "torch_dynamo_resume_in_forward_at_17 (ddp_trace.py:17)",
     "status": "ok", "compile_time_s": 1.93, "graph_breaks": [], "recompile_reasons": [],
     "failure": None, "restarts": [], "graphs": [{"id": 146, "kind": "dynamo", "name": "graph 5/0 ..."}],
     "output_code": [{"event_id": 512, "graph_id": 151, "chars": 8012}],
     "records": [{"event_id": 498, "name": "dynamo_start", "chars": 0}, ...]}
"""

from __future__ import annotations

import json
import re
from collections import defaultdict

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from graphdeck.store.schema import CompileEvent, Graph, KernelNode, Run

INDEX_EVENTS = ("dynamo_start", "compilation_metrics", "dynamo_graph_break_reason", "recompile_reasons",
                "dynamo_error", "inductor_output_code", "graph_dump")
#: Records that hold generated code: Inductor's output code, AOTInductor's wrapper/kernel code.
CODE_EVENTS = ("inductor_output_code", "graph_dump")
_BREAK_AT_RE = re.compile(r"Graph break in user code at (\S+:\d+)")


def _key(cid: str | None) -> tuple:
    """Sort key: compiled-autograd id, frame, compile, attempt (numbers, not text)."""
    nums = [int(x) for x in re.findall(r"\d+", cid or "")]
    return (cid or "").startswith("!"), nums


def compile_index(session: Session, run: Run, rank: int | None = None) -> dict[int, list[dict]]:
    """``{rank: [entry per compile id, in compile-id order]}`` (see the module example)."""
    q = select(CompileEvent.id, CompileEvent.rank, CompileEvent.name, CompileEvent.compile_id,
               CompileEvent.metadata_json, CompileEvent.payload).where(
        CompileEvent.run_id == run.id, CompileEvent.name.in_(INDEX_EVENTS))
    gq = select(Graph.id, Graph.rank, Graph.kind, Graph.name, Graph.compile_id, Graph.frame_name,
                Graph.compile_time_s, Graph.num_nodes).where(Graph.run_id == run.id)
    if rank is not None:
        q, gq = q.where(CompileEvent.rank == rank), gq.where(Graph.rank == rank)
    entries: dict[tuple[int, str], dict] = {}

    def entry(r: int, cid: str) -> dict:
        got = entries.get((r, cid))
        if got is None:
            got = entries[(r, cid)] = {"compile_id": cid, "frame": None, "status": "ok", "compile_time_s": None,
                                       "graph_breaks": [], "recompile_reasons": [], "failure": None,
                                       "restarts": [], "graphs": [], "output_code": [], "records": []}
        return got

    for ev_id, r, name, cid, meta_json, payload in session.execute(q.order_by(CompileEvent.id)):
        if cid is None and name not in CODE_EVENTS:
            continue
        e = entry(r, cid)
        meta = json.loads(meta_json or "{}")
        body = meta.get(name) if isinstance(meta.get(name), dict) else {}
        if name == "dynamo_start":
            stack = body.get("stack") or []
            if stack and isinstance(stack[-1], dict):
                last = stack[-1]
                e["frame"] = f"{last.get('name')} ({str(last.get('filename')).rsplit('/', 1)[-1]}:{last.get('line')})"
        elif name == "compilation_metrics":
            _metrics(e, body)
        elif name == "dynamo_graph_break_reason":
            text = (payload or "").strip()
            m = _BREAK_AT_RE.search(text)
            e["graph_breaks"].append({"reason": text, "source_line": m.group(1) if m else None})
        elif name == "recompile_reasons":
            reasons = _reasons(payload)
            e["recompile_reasons"].extend(str(x).strip() for x in (reasons if isinstance(reasons, list) else [reasons]))
        elif name == "dynamo_error":
            e["status"] = "error"
            e["error"] = (payload or "").strip()[-4000:]
        elif name in CODE_EVENTS:
            e["output_code"].append({"event_id": ev_id, "graph_id": meta.get("graph_id"),
                                     "chars": len(payload or "")})
    for gid, r, kind, name, cid, frame, t, n in session.execute(gq.order_by(Graph.rank, Graph.ordinal)):
        e = entry(r, cid)  # graphs without a compile id (export, AOTInductor) are listed under None
        e["graphs"].append({"id": gid, "kind": kind, "name": name, "num_nodes": n})
        e["frame"] = e["frame"] or frame
        if kind == "dynamo" and t is not None and e["compile_time_s"] is None:
            e["compile_time_s"] = t
    for (r, cid), e in entries.items():  # a restarted attempt ("4/0_1") keeps attempt 0's frame
        if e["frame"] is None and cid and "_" in cid and (first := entries.get((r, cid.split("_")[0]))):
            e["frame"] = first["frame"]
    rq = select(CompileEvent.id, CompileEvent.rank, CompileEvent.name, CompileEvent.compile_id,
                func.length(CompileEvent.payload)).where(CompileEvent.run_id == run.id,
                                                         CompileEvent.compile_id.is_not(None))
    if rank is not None:
        rq = rq.where(CompileEvent.rank == rank)
    for ev_id, r, name, cid, chars in session.execute(rq.order_by(CompileEvent.id)):
        if (r, cid) in entries:  # every record of the compile, as tlparse lists its artifacts
            entries[(r, cid)]["records"].append({"event_id": ev_id, "name": name, "chars": chars or 0})
    kernels = dict(session.execute(select(KernelNode.graph_id, func.count()).where(KernelNode.run_id == run.id)
                                   .group_by(KernelNode.graph_id)).all())
    out: dict[int, list[dict]] = defaultdict(list)
    for (r, cid), e in sorted(entries.items(), key=lambda kv: (kv[0][0], _key(kv[0][1]))):
        for g in e["graphs"]:
            g["kernel_links"] = kernels.get(g["id"], 0)
        out[r].append(e)
    return dict(out)


def _reasons(payload: str | None) -> list:
    """A ``recompile_reasons`` payload: a JSON list (torch ≤ 2.9), or plain text, one reason per
    line, although the envelope says ``"encoding": "json"`` (torch 2.13)."""
    try:
        got = json.loads(payload or "[]")
    except ValueError:
        return [ln for ln in (payload or "").splitlines() if ln.strip()]
    return got if isinstance(got, list) else [got]


def _metrics(e: dict, body: dict) -> None:
    t = body.get("entire_frame_compile_time_s")
    if isinstance(t, (int, float)):
        e["compile_time_s"] = float(t)
    if body.get("fail_type"):
        e["status"] = "failed"
        e["failure"] = {"type": body.get("fail_type"), "reason": body.get("fail_reason"),
                        "user_frame": f"{body.get('fail_user_frame_filename')}:{body.get('fail_user_frame_lineno')}"
                        if body.get("fail_user_frame_filename") else None}
    restarts = body.get("restart_reasons") or []
    e["restarts"].extend(str(x) for x in restarts)
    if restarts and e["status"] == "ok":
        e["status"] = "restarted"
    if body.get("recompile_reason") and not e["recompile_reasons"]:
        e["recompile_reasons"].append(str(body["recompile_reason"]).strip())
    for k in ("graph_op_count", "graph_node_count", "co_name", "co_filename", "co_firstlineno",
              "inductor_fx_local_cache_hit_count", "aotautograd_local_cache_hit_count", "cache_size"):
        if body.get(k) is not None:
            e.setdefault("metrics", {})[k] = body[k]
    if body.get("graph_op_count") == 0 and e["status"] == "ok":
        e["status"] = "empty"
