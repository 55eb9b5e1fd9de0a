"""Per-compile gradient state of each parameter: was it trainable in the compile that ran?

A compiled graph serves one ``requires_grad`` state of its inputs, so a training loop that flips
``requires_grad`` between steps gets one compile per state (pytorch/pytorch#139476, case N1 of
``../shared/cases/gradient-paths.md``). The ``params`` table holds ``requires_grad`` as of the
moment the capture wrote the parameter list (``Agent.watch`` under torch.distributed, else the
first compile); what each compile saw is in its AOT backward graph, which has a gradient slot
(``GradAOTOutput(grad_of=PlainAOTInput(idx=k))``, a ``graph_io`` ``grad`` row) for exactly the
inputs that required grad when it was compiled, ``None`` in it (``has_grad`` false) when no
gradient flows.

State of a parameter in one compile (``compile_id``, e.g. ``"0/3"``) whose graphs read it:

* ``gradient``: a backward graph of the compile returns its gradient;
* ``none``: it has a slot, but the backward returns ``None`` (it required grad; nothing flows);
* ``frozen``: the backward has no slot for it (``requires_grad`` was False when compiled);
* ``inference``: only an inference graph (nothing required grad, or grad mode was off);
* unknown (not listed): no AOT graph was recorded for it.

:func:`compile_findings` adds a note to each row that is ``frozen`` in some compiles and has a
slot in others (``requires_grad`` changed between compiles; an ``inference`` compile alone, such as
an evaluation under ``no_grad``, is not a change), one ``REQUIRES_GRAD_CHANGED`` warning per rank
and state pattern, and corrects a row whose recorded ``requires_grad`` disagrees with the
compiles: ``FROZEN`` but some compile returns its gradient becomes ``OK``; ``NO_GRAD`` with no
gradient slot in any compile becomes ``FROZEN``. Cost: two queries over the run's graphs and
``graph_io`` rows.
"""

from __future__ import annotations

import json
from collections import defaultdict

from sqlalchemy.orm import Session

from graphdeck.analysis.compilation.index import _key as compile_key
from graphdeck.analysis.gradients.report import Finding, ParamRow

STATE_ORDER = ("gradient", "none", "frozen", "inference")
STATE_TEXT = {
    "gradient": "gradient",
    "none": "no gradient (its slot in the backward is None)",
    "frozen": "frozen (no gradient slot: requires_grad was False when compiled)",
    "inference": "inference graph only (no backward: grad mode off, or nothing in it needed a gradient)",
}


def fetch(session: Session, sql: str, params: tuple = ()) -> list:
    from graphdeck.analysis.gradients.graph import fetch as _fetch

    return _fetch(session, sql, params)


def compile_states(session: Session, run_id: int, rows: list[ParamRow]) -> dict[int, dict[str, str]]:
    """``id(row)`` → ``{compile_id: state}`` for every non-buffer row read by a compiled graph
    (states above; compiles without AOT graphs are left out)."""
    graphs = {gid: (rank, kind, parent, cid) for gid, rank, kind, parent, cid in fetch(
        session, "SELECT id, rank, kind, parent_id, compile_id FROM graphs WHERE run_id = ?", (run_id,))}
    children: dict[int, list[tuple[int, str]]] = defaultdict(list)
    for gid, (_rank, kind, parent, _cid) in graphs.items():
        if parent is not None and kind in ("aot_backward", "aot_inference"):
            children[parent].append((gid, kind))
    reads: dict[tuple[int, str], set[int]] = defaultdict(set)
    slots: dict[tuple[int, str], bool] = {}  # (backward graph, fqn) -> any gradient returned
    for gid, direction, fqn, has_grad in fetch(
            session, "SELECT io.graph_id, io.direction, io.param_fqn, io.has_grad FROM graph_io io JOIN graphs g "
                     "ON g.id = io.graph_id WHERE g.run_id = ? AND io.param_fqn IS NOT NULL", (run_id,)):
        if direction == "in" and graphs.get(gid, (0, ""))[1] in ("dynamo", "ddp_partition"):
            reads[(graphs[gid][0], fqn)].add(gid)
        elif direction == "grad":
            slots[(gid, fqn)] = slots.get((gid, fqn), False) or bool(has_grad)
    out: dict[int, dict[str, str]] = {}
    for row in rows:
        if row.status == "BUFFER":
            continue
        names = row.aliases or [row.fqn]
        per: dict[str, set[str]] = defaultdict(set)
        for gid in sorted({g for a in names for g in reads.get((row.rank, a), ())}):
            cid = graphs[gid][3] or "?"
            kids = children.get(gid, [])
            bws = [k for k, kind in kids if kind == "aot_backward"]
            if bws:
                got = [slots[(b, a)] for b in bws for a in names if (b, a) in slots]
                per[cid].add("gradient" if any(got) else "none" if got else "frozen")
            elif any(kind == "aot_inference" for _, kind in kids):
                per[cid].add("inference")
        if per:
            out[id(row)] = {cid: next(s for s in STATE_ORDER if s in states) for cid, states in per.items()}
    return out


def compile_findings(session: Session, run_id: int, rows: list[ParamRow]) -> list[Finding]:
    """Notes, status corrections and ``REQUIRES_GRAD_CHANGED`` warnings (module docstring)."""
    states = compile_states(session, run_id, rows)
    frames = _frames(session, run_id)
    groups: dict[tuple[int, tuple], list[ParamRow]] = defaultdict(list)
    for row in rows:
        per = states.get(id(row))
        if not per:
            continue
        kinds = set(per.values())
        by_state = {s: sorted((c for c, v in per.items() if v == s), key=compile_key) for s in STATE_ORDER}
        listing = "; ".join(f"{STATE_TEXT[s]} in {_ids(by_state[s])}" for s in STATE_ORDER if by_state[s])
        if row.status == "FROZEN" and "gradient" in kinds:
            row.status, row.fix, row.cut = "OK", None, None
            row.paths = max(row.paths, 1)
            row.reason = (f"requires_grad was False when the parameter list was recorded, but the backward graphs of "
                          f"compile(s) {_ids(by_state['gradient'])} return its gradient: trainable there")
        elif row.status == "NO_GRAD" and "frozen" in kinds and kinds <= {"frozen", "inference"}:
            row.status, row.fix, row.cut, row.paths = "FROZEN", None, None, 0
            row.reason = (f"requires_grad was False in every compile that reads it ({_ids(by_state['frozen'])}: "
                          "no gradient slot in their backward graphs), though it was True when the parameter list "
                          "was recorded")
        if "frozen" in kinds and kinds & {"gradient", "none"}:  # requires_grad changed between compiles
            row.notes.append(f"per compile: {listing}")
            groups[(row.rank, tuple(sorted(per.items())))].append(row)
    out = []
    for (rank, pattern), members in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[1][0].fqn)):
        per = dict(pattern)
        by_state = {s: sorted((c for c, v in per.items() if v == s), key=compile_key) for s in STATE_ORDER}
        names = [m.fqn for m in members]
        frame_ids = sorted({c.split("/", 1)[0] for c in per}, key=lambda f: compile_key(f + "/0"))
        frame_text = ", ".join(f"{frames.get((rank, f), {}).get('name') or 'frame ' + f}" for f in frame_ids)
        msg = (f"{', '.join(names)}: trainable in some compiles of {frame_text} and not in others — "
               + "; ".join(f"{STATE_TEXT[s]} in {_ids(by_state[s])}" for s in STATE_ORDER if by_state[s])
               + ". Each compiled graph serves one requires_grad state, so changing requires_grad between "
                 "steps makes the frame compile again")
        limits = [f"{frames[(rank, f)]['name']} hit the recompile limit at {frames[(rank, f)]['failed']}: later "
                  "calls run eagerly" for f in frame_ids if frames.get((rank, f), {}).get("failed")]
        if limits:
            msg += "; " + "; ".join(limits)
        out.append(Finding(kind="REQUIRES_GRAD_CHANGED", severity="warning", params=names, ranks=[rank],
                           message=msg,
                           fix="set requires_grad once before compiling (or keep one compiled module per "
                               "state); to skip an update, zero or drop the gradient instead of flipping the flag"))
    return out


def _ids(cids: list[str], limit: int = 12) -> str:
    return ", ".join(cids[:limit]) + (f" … ({len(cids)} in all)" if len(cids) > limit else "")


def _frames(session: Session, run_id: int) -> dict[tuple[int, str], dict]:
    """``(rank, frame id)`` → ``{"name": co_name, "failed": compile id}`` from ``compilation_metrics``;
    ``failed`` is set when Dynamo gave up on the frame at its recompile limit."""
    out: dict[tuple[int, str], dict] = {}
    for rank, cid, meta in fetch(session, "SELECT rank, compile_id, metadata_json FROM compile_events "
                                          "WHERE run_id = ? AND name = 'compilation_metrics'", (run_id,)):
        try:
            m = (json.loads(meta or "{}") or {}).get("compilation_metrics") or {}
        except (ValueError, AttributeError):
            continue
        if not cid or "/" not in str(cid):
            continue
        entry = out.setdefault((rank, str(cid).split("/", 1)[0]), {"name": None, "failed": None})
        entry["name"] = entry["name"] or m.get("co_name")
        if "recompile limit" in str(m.get("fail_reason") or "").lower() or \
                "cache_size_limit" in str(m.get("fail_reason") or ""):
            entry["failed"] = str(cid)
    return out
