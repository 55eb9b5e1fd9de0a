"""A run that asked for ``torch.compile`` and got no graph: every frame Dynamo tried produced
nothing to compile, so the job ran eagerly (NOTE: [No graph produced] in capture/compile_context.py).

Evidence, per rank (all of it from the store; a rank lacking any part is not claimed):

* Dynamo ran: the rank has ``compilation_metrics`` records (a frame was tried);
* no compile produced a graph: no ``graphs`` row on the rank (the capture's backend was never
  called, or the imported log holds no ``dynamo_output_graph``), no ``bwd_compilation_metrics``,
  and every metrics record that counts ops says ``graph_op_count`` 0 — with at least one that
  counts them (an old log without the field proves nothing);
* what torch said about those frames: the restart reasons and graph-break headlines of the
  tried frames (``Attempted to call function marked as skipped`` for DDP's
  ``_inside_ddp_forward``, with torch's ``skip reason``), and, when the capture recorded it
  (``graphdeck_model_frames``), Dynamo's own rule for the watched model's ``forward``: skipped
  as a frame of its own (``file matches MOD_SKIPLIST (.../torch/nn)``).

Pure: reads the store, returns data.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.compilation.rules import frame_label, is_library_path, short_path
from graphdeck.store.schema import CompileEvent, Graph, Run

MODEL_FRAMES = "graphdeck_model_frames"
_SKIP_RE = re.compile(r"skip reason:\s*([^\n]+)")
_EXPLAIN_RE = re.compile(r"Explanation:\s*([^\n]+)")
#: An absolute path up to the installed package or the standard library: shown from there on.
_PATH_RE = re.compile(r"/[^\s`'\"()]*/(?:site-packages|dist-packages|lib/python\d\.\d+)/([^\s`'\"()]*)")


@dataclass
class NoGraph:
    """Ranks on which no compile produced a graph. ``ranks``: those ranks; ``compiles``: the
    frames Dynamo tried on them (the most of any rank); ``frames``: their labels ``name
    (file.py:line)``; ``call_site``: the user line that called the compiled function (``job.py:14:
    loss = compiled(x)``) or None; ``compiled``: the compiled function as Dynamo's first frame
    names it; ``reasons``: what torch recorded about those frames (distinct, at most 4);
    ``models``: the watched models whose ``forward`` Dynamo skips as a frame of its own
    (``{"model", "forward", "reason"}``); ``message``: one sentence with all of it; ``hint``."""

    ranks: list[int]
    compiles: int
    frames: list[str]
    call_site: str | None
    compiled: str | None
    reasons: list[str] = field(default_factory=list)
    models: list[dict] = field(default_factory=list)
    message: str = ""
    hint: str = ""


def _json(text) -> dict | list:
    try:
        got = json.loads(text or "{}")
    except ValueError:
        return {}
    return got if isinstance(got, (dict, list)) else {}


def _reason_text(text: str) -> str:
    """A restart reason or graph-break text as one line: its headline, torch's explanation, and
    the skip reason when torch gave one."""
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    if lines and lines[0].startswith("Graph break in user code"):
        lines = [ln for ln in lines[1:] if not ln.startswith("Graph Break Reason:")] or lines
    head = lines[0] if lines else ""
    out = head
    if (m := _EXPLAIN_RE.search(text)) and m.group(1).strip() not in head:
        out += f": {m.group(1).strip()}"
    if (m := _SKIP_RE.search(text)):
        out += f" (skip reason: {m.group(1).strip()})"
    return _short(out)[:300]


def _short(text: str) -> str:
    """Absolute paths into site-packages or the standard library cut to the part from there on."""
    return _PATH_RE.sub(r"\1", text)


def find(session: Session, run: Run, per_rank: dict[int, list]) -> NoGraph | None:
    """The :class:`NoGraph` of ``run``, or None when every rank with compile records produced a
    graph (or the records cannot tell). ``per_rank``: rank → compile-event rows ``(rank, name,
    compile_id, metadata_json, payload)`` as :func:`graphdeck.analysis.compilation.health.compile_health`
    reads them."""
    with_graphs = set(session.scalars(select(Graph.rank).where(Graph.run_id == run.id).distinct()))
    ranks, frames, reasons = [], {}, {}
    call_site = compiled = None
    most = 0
    for rank, events in sorted(per_rank.items()):
        metrics = [_json(m).get("compilation_metrics", {}) for _r, name, _c, m, _p in events
                   if name == "compilation_metrics"]
        metrics = [m for m in metrics if isinstance(m, dict)]
        counted = [m["graph_op_count"] for m in metrics if isinstance(m.get("graph_op_count"), int)]
        if (rank in with_graphs or not metrics or not counted or any(counted)
                or any(name == "bwd_compilation_metrics" for _r, name, *_ in events)):
            continue
        ranks.append(rank)
        most = max(most, len(metrics))
        for m in metrics:
            label = frame_label(m.get("co_name"), m.get("co_filename"), m.get("co_firstlineno"))
            frames.setdefault(label, None)
            for why in m.get("restart_reasons") or []:
                reasons.setdefault(_reason_text(why), None)
            if m.get("fail_reason"):
                reasons.setdefault(_reason_text(m["fail_reason"]), None)
        for _r, name, cid, meta, payload in events:
            if name == "dynamo_graph_break_reason":
                reasons.setdefault(_reason_text(payload or ""), None)
            elif name == "dynamo_start" and call_site is None and (cid or "").startswith("0/"):
                stack = (_json(meta).get("dynamo_start") or {}).get("stack") or []
                stack = [f for f in stack if isinstance(f, dict)]
                user = [f for f in stack if isinstance(f.get("filename"), str) and not is_library_path(f["filename"])]
                if user:
                    u = user[-1]
                    call_site = f"{short_path(u['filename'])}:{u.get('line')}" + (f": {u['loc']}" if u.get("loc") else "")
                if stack:
                    compiled = frame_label(stack[-1].get("name"), stack[-1].get("filename"), stack[-1].get("line"))
    if not ranks:
        return None
    models = _skipped_models(session, run, ranks)
    out = NoGraph(ranks=ranks, compiles=most, frames=list(frames), call_site=call_site, compiled=compiled,
                  reasons=[r for r in reasons if r][:4], models=models)
    out.message, out.hint = _words(out)
    return out


def _skipped_models(session: Session, run: Run, ranks: list[int]) -> list[dict]:
    rows = session.execute(select(CompileEvent.rank, CompileEvent.payload)
                           .where(CompileEvent.run_id == run.id, CompileEvent.name == MODEL_FRAMES,
                                  CompileEvent.rank.in_(ranks)).order_by(CompileEvent.id)).all()
    out: dict[str, dict] = {}
    for _rank, payload in rows:
        for m in _json(payload) if isinstance(_json(payload), list) else []:
            if isinstance(m, dict) and m.get("skipped"):
                out[str(m.get("model"))] = {"model": str(m.get("model")), "forward": str(m.get("forward") or ""),
                                            "reason": str(m.get("reason") or "")}
    return list(out.values())


def _words(n: NoGraph) -> tuple[str, str]:
    from graphdeck.analysis.ranks.records import _ranks_phrase

    what = "the compiled function" + (f" called at {n.call_site}" if n.call_site else "") + (
        f" (Dynamo's first frame: {n.compiled})" if n.compiled else "")
    msg = (f"no graph produced: {what} ran eagerly on {_ranks_phrase(n.ranks)} — Dynamo tried {n.compiles} "
           f"frame(s) ({', '.join(n.frames[:4])}{' …' if len(n.frames) > 4 else ''}) and none held an op to "
           "compile, so nothing is compiled and the job runs eager (torch.compile raised nothing)")
    for m in n.models:
        msg += (f"; the model's forward, {m['model']}.forward ({short_path(m['forward'].rsplit(':', 1)[0])}), is "
                f"skipped by Dynamo as a frame of its own ({_short(m['reason'])})")
    if n.reasons:
        msg += "; torch recorded: " + "; ".join(n.reasons)
    hint = ("compile the model DDP wraps rather than the wrapper (DDP(torch.compile(model))), or give it a forward "
            "of your own (a subclass of nn.Module whose forward calls the torch module): Dynamo compiles a frame "
            "in torch's own files only when it inlines it from a compiled frame, and DDP's forward breaks before "
            "calling the model") if n.models or any("_inside_ddp_forward" in r for r in n.reasons) else (
            "see the reasons torch recorded; TORCH_LOGS=+dynamo prints each skipped frame with its reason "
            "('skipping: NAME (reason: ...)')")
    return msg, hint


def nothing_compiled(session: Session, run_id: int) -> bool:
    """Whether the run's compile records show that no compile produced a graph on any rank: some
    ``compilation_metrics`` count ops, none counts more than 0, no backward was compiled and no
    graph is stored. False when the records cannot tell (none, or none counting ops): a run of a
    trace alone has no evidence either way."""
    if session.scalar(select(Graph.id).where(Graph.run_id == run_id).limit(1)) is not None:
        return False
    counted = False
    for name, meta in session.execute(select(CompileEvent.name, CompileEvent.metadata_json).where(
            CompileEvent.run_id == run_id, CompileEvent.name.in_(("compilation_metrics", "bwd_compilation_metrics")))):
        if name == "bwd_compilation_metrics":
            return False
        body = _json(meta).get("compilation_metrics") if isinstance(_json(meta), dict) else None
        ops = body.get("graph_op_count") if isinstance(body, dict) else None
        if isinstance(ops, int):
            if ops > 0:
                return False
            counted = True
    return counted
