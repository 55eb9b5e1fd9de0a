"""The parallel map of a run (issue 20): pipeline stage → TP group → ranks, DP/FSDP replicas
stacked, each rank with status badges from the other checks. ``GET /api/runs/{run_id}/parallel-map``.

NOTE: [Parallel map]
The grid comes from the run's layout records (:mod:`graphdeck.analysis.parallel.layout`): one block per
pipeline stage (one block when there is no pipeline); in a block, a column per coordinate on the
sharding dimensions (``RunLayout.sharding_dims()``: tp, cp, ep, ...) and a row per coordinate on
the remaining, data-parallel dimensions (dp, dp_shard, ...). Each rank gets one state per check:

* ``diverged`` — ``check-ranks``' report (:func:`graphdeck.analysis.ranks.core.rank_report`), which
  compares ranks per mesh dimension (:mod:`graphdeck.analysis.ranks.mesh`): the diverging side of
  a compile divergence or of a collective-schedule mismatch: ``ok`` | ``diverged``;
* ``grad`` — ``check-grads``' report (graph analysis and run-time evidence): ``missing`` for a
  rank with a parameter without a gradient path or named by an error finding (a pipeline stage
  that receives no gradient);
* ``straggler`` — traces of two or more ranks matched (:func:`~graphdeck.analysis.
  traces.collectives.align_and_match`'s ``timing``): ``straggler`` for the rank the others waited for;
* ``hang`` — Flight Recorder's first mismatch per group (:mod:`graphdeck.analysis.ranks.flight`):
  ``hang`` for a rank that did not reach a collective its peers issued, ``waiting`` for a rank
  blocked in it; a rank without a dump, and the dumped members of a group it belongs to, are
  ``unknown`` and the check's verdict INCOMPLETE (never "every group's collectives match");
* ``layout`` — ``missing`` for a rank without a layout record (its cell is placed from the
  other ranks' meshes).

Every check also has ``unknown``: a check that cannot run (no traces, no dumps, no evidence, an
error) says ``unknown`` with the reason, never ``ok``. Ranks with the same states share a *kind*
(``kinds`` lists them once; ``ranks.kind[r]`` indexes it), and in a block with more than
:data:`MERGE_ROWS_ABOVE` rows, consecutive rows whose cells have the same kinds are merged into
one row naming the range, so a 1,024-rank map stays one picture (``?expand=true`` keeps every
row). Per-rank text (``details``) is sent only for ranks whose state is not the check's default.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

from fastapi import APIRouter, Depends, Query
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from graphdeck.errors import BadInputError
from graphdeck.server.deps import RunPathRoute, get_session, resolve_run
from graphdeck.store.schema import CompileEvent, Rank, Run

log = logging.getLogger(__name__)
router = APIRouter(tags=["ranks"], route_class=RunPathRoute)

#: A block with more rows than this merges consecutive rows of identical cells.
MERGE_ROWS_ABOVE = 8
#: The checks, in badge order: key → (label, the run's dashboard page that shows it in full).
CHECKS: dict[str, tuple[str, str | None]] = {
    "diverged": ("diverged", "ranks"),
    "grad": ("missing gradient", "grads"),
    "straggler": ("straggler", "timeline"),
    "hang": ("hang", "ranks"),
    "layout": ("layout record", None),
}
EMPTY_HINT = ("Capture the job with graphdeck's Agent (agent.watch(model) on every rank of a DeviceMesh job: "
              "init_device_mesh, fully_shard, parallelize_module, a pipeline stage): each rank then records "
              "its parallel layout as soon as it is known, so a job that dies still has it.")


@dataclass
class Badge:
    """One check's states: ``states[rank]`` where it differs from ``default`` (``"ok"`` or
    ``"unknown"``), ``details[rank]`` the text for such a rank; ``ran`` false when the check could
    not run at all (every rank then ``unknown``); ``message`` says what was read or why not."""

    key: str
    ran: bool
    message: str
    default: str = "ok"
    states: dict[int, str] = field(default_factory=dict)
    verdict: str | None = None  # the check's own verdict where it has one (PASS/FAIL/INCOMPLETE)
    details: dict[int, str] = field(default_factory=dict)

    def set(self, rank: int, state: str, detail: str | None = None) -> None:
        self.states[rank] = state
        if detail:
            self.details[rank] = detail

    def state(self, rank: int) -> str:
        return self.states.get(rank, self.default)


def _unknown(key: str, why: str) -> Badge:
    return Badge(key, ran=False, message=why, default="unknown")


@router.get("/api/runs/{run_id}/parallel-map")
def run_parallel_map(run: Run = Depends(resolve_run), session: Session = Depends(get_session),
                     expand: bool = Query(False, description="one row per replica: no merging of identical rows"),
                     checks: str | None = Query(None, description="comma-separated checks to run (default: all of "
                                                + ", ".join(CHECKS) + "); the others are answered as not run",
                                                max_length=200)) -> dict:
    """The grid of ranks (stage → sharding-dim columns → data-parallel rows) with per-rank badge
    states (see NOTE: [Parallel map]). A run without layout records answers ``has_layout: false``
    with a ``message`` and a ``hint`` (what to capture), not an error. ``?checks=layout,grad``
    answers fast (the dashboard draws that first, then asks for every check). An unknown check
    name is a 400 naming it."""
    wanted = None
    if checks is not None:
        wanted = [c.strip() for c in checks.split(",") if c.strip()]
        bad = [c for c in wanted if c not in CHECKS]
        if bad:
            raise BadInputError(f"unknown check {bad[0]!r} in ?checks=: known checks are {', '.join(CHECKS)}")
    return parallel_map(session, run, expand=expand, checks=wanted)


def parallel_map(session: Session, run: Run, *, expand: bool = False, checks: list[str] | None = None) -> dict:
    """The map of ``run`` as JSON (shape in the module docstring and :func:`run_parallel_map`).

    ``checks``: the checks to run (None: all of :data:`CHECKS`); a check left out is answered
    ``pending: true`` and ``unknown`` for every rank.
    Keys: ``run_id``, ``run``, ``world_size``, ``has_layout``; with a layout: ``dims``
    (``{"stage": "pp" | None, "rows": [...], "cols": [...]}``), ``meshes`` (key, shape, dim
    names, device type; no rank tensor), ``checks`` (per check: key, label, ran, pending, message,
    link, counts per state), ``kinds`` (distinct ``{check: state}``), ``ranks`` (``kind``, ``host``,
    ``device``: lists indexed by rank, ``host``/``device`` indexing ``hosts``/``devices``),
    ``details`` (``[{"check", "text", "ranks"}]``: why a rank has a state other than its
    check's default, ranks sharing a text in one entry), ``stages`` (blocks: ``stage``, ``label``,
    ``cols`` labels, ``rows``: ``label``, ``count``, ``cells``: ``{"ranks": [...], "kind": k}`` or
    null), ``unplaced`` (ranks no mesh or stage places) and ``notes``. Never raises for odd
    records: a check that fails is ``unknown`` with its error named.
    """
    from graphdeck.analysis.parallel.layout import load_layout

    out = {"run_id": run.id, "run": run.name, "world_size": run.world_size}
    layout = load_layout(session, run.id)
    from graphdeck.analysis.parallel.replicas import replica_layout

    # NOTE: [Replica row]: DDP's group (its buckets and bytes), or the default group; without a
    # layout record it is the whole map (one row), with one (a DDP "ddp" mesh) it is the summary line.
    replica = replica_layout(session, run)
    if layout is not None and replica is not None and replica["kind"] != "ddp":
        replica = None  # a mesh job's default group says nothing the mesh does not
    replica_only = layout is None and replica is not None
    if replica_only:
        from graphdeck.analysis.parallel.layout import build_layout

        layout = build_layout({}, replica["world_size"])
    if layout is None:
        return {**out, "has_layout": False,
                "message": f"run {run.name!r} has no parallel layout record: no rank recorded a DeviceMesh, "
                           "DTensor placement, FSDP2 group or pipeline stage.",
                "hint": EMPTY_HINT}
    ws = layout.world_size
    everyone = list(range(ws))
    ctx = _Context(session, run, layout, replica if replica_only else None)
    badges = [_run_check(key, ctx) if checks is None or key in checks
              else _unknown(key, "not run in this request (see ?checks=)") for key in CHECKS]
    pending = {b.key for b in badges if checks is not None and b.key not in checks}
    kinds: list[dict] = []
    kind_index: dict[tuple, int] = {}
    rank_kind: list[int] = []
    for r in everyone:
        sig = tuple(b.state(r) for b in badges)
        if sig not in kind_index:
            kind_index[sig] = len(kinds)
            kinds.append(dict(zip(CHECKS, sig)))
        rank_kind.append(kind_index[sig])
    details = []  # one entry per (check, text): ranks sharing a reason share its entry
    for b in badges:
        by_text: dict[str, list[int]] = {}
        for r, text in sorted(b.details.items()):
            if 0 <= r < ws:
                by_text.setdefault(text, []).append(r)
        details += [{"check": b.key, "text": text, "ranks": ranks} for text, ranks in by_text.items()]
    hosts, host_of = _hosts(session, run.id, ws)
    devices, device_of = _devices(layout, ws)
    listed = []
    for b in badges:
        label, page = CHECKS[b.key]
        counts = Counter(b.state(r) for r in everyone)
        listed.append({"key": b.key, "label": label, "ran": b.ran, "pending": b.key in pending, "message": b.message,
                       "verdict": b.verdict, "default": b.default, "link": f"#/runs/{run.id}/{page}" if page else None,
                       "counts": dict(sorted(counts.items()))})
    grid = _replica_grid(replica, ws, rank_kind, expand) if replica_only else _grid(layout, rank_kind, expand)
    return {**out, "world_size": ws, "has_layout": True, "replica": replica, "dims": grid["dims"],
            "meshes": [{k: m.get(k) for k in ("key", "shape", "dim_names", "device_type")} for m in layout.meshes],
            "checks": listed, "kinds": kinds,
            "ranks": {"kind": rank_kind, "host": host_of, "device": device_of},
            "hosts": hosts, "devices": devices, "details": details,
            "stages": grid["stages"], "unplaced": grid["unplaced"], "notes": grid["notes"]}


# ---------------------------------------------------------------------------------------- grid

def _label(dims: list[str], key: tuple) -> str:
    return " · ".join(f"{d} {'?' if v is None else v}" for d, v in zip(dims, key))


def _grid(layout, rank_kind: list[int], expand: bool) -> dict:
    """Blocks per stage; columns by sharding-dim coordinate; rows by data-parallel coordinate."""
    from graphdeck.analysis.parallel.layout import PP_DIMS

    ws = layout.world_size
    col_dims = list(layout.sharding_dims())
    skip = layout.container_dims()  # NOTE: [Dimensions nothing is placed on]: no row, no column
    row_dims = [d for d in layout.dim_names() if d not in col_dims and d not in PP_DIMS and d not in skip]
    pipeline = layout.has_pipeline()
    stage_dim = next((d for d in layout.dim_names() if d in PP_DIMS), "pp" if pipeline else None)
    blocks: dict[object, dict[tuple, dict[tuple, list[int]]]] = {}
    unplaced: list[int] = []
    for r in range(ws):
        c = layout.coord(r)
        stage = layout.stage_of(r) if pipeline else 0
        if not c and not (col_dims or row_dims) and stage is None:
            unplaced.append(r)
            continue
        if (col_dims or row_dims) and not any(d in c for d in col_dims + row_dims) and stage is None:
            unplaced.append(r)
            continue
        row = tuple(c.get(d) for d in row_dims)
        col = tuple(c.get(d) for d in col_dims)
        blocks.setdefault(stage, {}).setdefault(row, {}).setdefault(col, []).append(r)
    notes = []
    stages = []
    order = sorted(blocks, key=lambda s: (s is None, s if isinstance(s, int) else 0))
    for stage in order:
        rows = blocks[stage]
        cols = sorted({col for cells in rows.values() for col in cells}, key=_sort_key)
        out_rows = []
        for row in sorted(rows, key=_sort_key):
            cells = rows[row]
            depth = max(len(v) for v in cells.values())  # >1: ranks the coordinates do not tell apart
            for i in range(depth):
                label = _label(row_dims, row)
                picked = {col: cells[col][i] for col in cols if col in cells and i < len(cells[col])}
                if depth > 1:
                    label = (label + " · " if label else "") + "rank " + ",".join(str(r) for r in picked.values())
                out_rows.append({"label": label, "count": 1,
                                 "cells": [None if col not in picked else {"ranks": [picked[col]],
                                                                           "kind": rank_kind[picked[col]]}
                                           for col in cols]})
        if not expand and len(out_rows) > MERGE_ROWS_ABOVE:
            out_rows = _merge_rows(out_rows)
        n = sum(len(v) for cells in rows.values() for v in cells.values())
        if not pipeline:
            label = "one program (no pipeline stages)"
        elif stage is None:
            label = "stage unknown"
        else:
            label = f"stage {stage}"
        stages.append({"stage": stage, "label": label, "ranks": n,
                       "cols": [_label(col_dims, col) if col_dims else "" for col in cols], "rows": out_rows})
    if unplaced:
        notes.append(f"{len(unplaced)} rank(s) are in no recorded mesh and no pipeline stage: {_ranges(unplaced)}")
    return {"dims": {"stage": stage_dim, "rows": row_dims, "cols": col_dims}, "stages": stages,
            "unplaced": unplaced, "notes": notes}


#: A replica row with more cells than this merges consecutive cells of the same kind.
MERGE_CELLS_ABOVE = 16


def _replica_grid(rep: dict, ws: int, rank_kind: list[int], expand: bool) -> dict:
    """One block, one row (the replica group, NOTE: [Replica row]), a column per member rank;
    above :data:`MERGE_CELLS_ABOVE` members (unless ``expand``), consecutive members of the same
    kind share one column (``replicas a-b``)."""
    members = [r for r in rep["ranks"] if 0 <= r < ws]
    cols: list[list[int]] = []
    for r in members:
        if (not expand and len(members) > MERGE_CELLS_ABOVE and cols
                and rank_kind[cols[-1][-1]] == rank_kind[r] and cols[-1][-1] == r - 1):
            cols[-1].append(r)
        else:
            cols.append([r])
    labels = [f"rank {c[0]}" if len(c) == 1 else f"ranks {c[0]}-{c[-1]}" for c in cols]
    kind = "DDP replicas" if rep["kind"] == "ddp" else "replicas"
    row = {"label": (f"{kind} · process group {rep['process_group']}" if rep.get("process_group") is not None
                     else f"{kind} · default group"), "count": 1,
           "cells": [{"ranks": c, "kind": rank_kind[c[0]]} for c in cols]}
    unplaced = [r for r in range(ws) if r not in set(members)]
    notes = [rep["text"]]
    if unplaced:
        notes.append(f"{len(unplaced)} rank(s) are in no recorded replica group: {_ranges(unplaced)}")
    stage = {"stage": None, "label": "one program (no pipeline stages, no device mesh)", "ranks": len(members),
             "cols": labels, "rows": [row]}
    return {"dims": {"stage": None, "rows": [], "cols": ["replica"]}, "stages": [stage], "unplaced": unplaced,
            "notes": notes}


def _sort_key(key: tuple) -> tuple:
    return tuple((v is None, v if isinstance(v, int) else 0) for v in key)


def _merge_rows(rows: list[dict]) -> list[dict]:
    """Consecutive rows whose cells have the same kinds (and holes) become one row: its cells
    list every merged rank, its label names the first and last row and the count."""
    out: list[dict] = []
    sig = lambda row: tuple(None if c is None else c["kind"] for c in row["cells"])  # noqa: E731
    for row in rows:
        prev = out[-1] if out else None
        if prev is not None and sig(prev) == sig(row):
            prev["count"] += 1
            prev["last"] = row["label"]
            for c, add in zip(prev["cells"], row["cells"]):
                if c is not None:
                    c["ranks"].extend(add["ranks"])
        else:
            out.append({**row, "cells": [None if c is None else {"ranks": list(c["ranks"]), "kind": c["kind"]}
                                         for c in row["cells"]]})
    for row in out:
        last = row.pop("last", None)
        if last is not None:
            row["label"] = f"{row['label']} … {last} ({row['count']} rows)"
    return out


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` → ``"0-2, 5"``."""
    from graphdeck.analysis.traces.collectives import rank_spans

    return rank_spans(ranks, ", ")


def _hosts(session: Session, run_id: int, ws: int) -> tuple[list[str], list[int | None]]:
    names: list[str] = []
    index: dict[str, int] = {}
    of: list[int | None] = [None] * ws
    for rank, host in session.execute(select(Rank.rank, Rank.hostname).where(Rank.run_id == run_id)):
        if host is None or not 0 <= rank < ws:
            continue
        if host not in index:
            index[host] = len(names)
            names.append(host)
        of[rank] = index[host]
    return names, of


def _devices(layout, ws: int) -> tuple[list[str], list[int | None]]:
    """Per rank: its record's ``device`` where recorded, else the device type of the first mesh
    holding it."""
    import numpy as np

    names: list[str] = []
    index: dict[str, int] = {}
    of: list[int | None] = [None] * ws

    def put(rank: int, name) -> None:
        if name is None or of[rank] is not None:
            return
        name = str(name)
        if name not in index:
            index[name] = len(names)
            names.append(name)
        of[rank] = index[name]

    for r, rec in layout.records.items():
        if 0 <= r < ws and isinstance(rec, dict):
            put(r, rec.get("device"))
    for m in layout.meshes:
        for r in np.asarray(m["ranks"], dtype=np.int64).ravel().tolist():
            if 0 <= r < ws:
                put(r, m.get("device_type"))
    return names, of


# ---------------------------------------------------------------------------------------- checks

class _Context:
    """What the checks share: the run, its layout, and ``check-ranks``' report, computed once."""

    def __init__(self, session: Session, run: Run, layout, replica: dict | None = None):
        self.session, self.run, self.layout, self.replica = session, run, layout, replica
        self._report = None

    def rank_report(self):
        """``check-ranks``' report (:func:`graphdeck.analysis.ranks.core.rank_report`), which compares
        ranks per mesh dimension when :mod:`graphdeck.analysis.ranks.mesh` is installed; None
        without it (a report comparing every rank with every other would call pipeline stages
        diverged)."""
        import importlib.util

        if importlib.util.find_spec("graphdeck.analysis.ranks.mesh") is None:
            return None
        if self._report is None:
            from graphdeck.analysis.ranks.core import rank_report

            self._report = rank_report(self.session, self.run)
        return self._report


def _run_check(key: str, ctx: _Context) -> Badge:
    """One check's badge; any failure is an ``unknown`` badge naming the error (never ``ok``)."""
    try:
        return {"diverged": _diverged, "grad": _grad, "straggler": _straggler, "hang": _hang,
                "layout": _layout_records}[key](ctx)
    except Exception as exc:  # noqa: BLE001 - a check that cannot run is unknown, and the map still draws
        log.exception("parallel map: the %s check failed on run %s", key, ctx.run.id)
        ctx.session.rollback()
        return _unknown(key, f"the check could not run: {type(exc).__name__}: {exc}")


def _layout_records(ctx: _Context) -> Badge:
    layout, rep = ctx.layout, ctx.replica
    if rep is not None:  # NOTE: [Replica row]: each member's own comm-groups / process-groups record
        b = Badge("layout", ran=True, message=f"no device mesh recorded; {rep['text']} (read from "
                  f"{', '.join(rep['sources'])})")
        members = set(rep["ranks"])
        for r in rep["unrecorded"]:
            b.set(r, "missing", "no process-group or DDP record from this rank: its place is read from the other ranks'")
        for r in range(layout.world_size):
            if r not in members:
                b.set(r, "missing", "in no recorded replica group")
        return b
    b = Badge("layout", ran=True, message=f"{len(layout.ranks)} of {layout.world_size} ranks wrote a layout record")
    for r in layout.missing_ranks:
        b.set(r, "missing", "no layout record from this rank: its place is read from the other ranks' meshes")
    return b


def _diverged(ctx: _Context) -> Badge:
    """``check-ranks`` per mesh dimension: the diverging side of each compile divergence and of
    each collective-schedule mismatch; ranks with no compiled graph and no compile record are
    unknown."""
    report = ctx.rank_report()
    if report is None:
        return _unknown("diverged", "the per-mesh-dimension rank check (graphdeck.analysis.ranks.mesh) "
                        "is not installed: ranks of different stages cannot be told apart from diverged ones")
    b = Badge("diverged", ran=True, verdict=report.verdict, message=f"check-ranks per mesh dimension: {report.verdict}; "
              f"{len(report.divergences)} compile divergence(s), "
              f"{len(report.collective_mismatches)} collective-schedule mismatch(es)")
    for r in range(ctx.layout.world_size):
        if not report.sequences.get(r):
            b.set(r, "unknown", "no compiled graph and no compile record from this rank")
    for r, why in report.diverged_ranks().items():  # NOTE: [One rank verdict]: harmless ones are warnings
        b.set(r, "diverged", why)
    if all(b.state(r) == "unknown" for r in range(ctx.layout.world_size)):
        return _unknown("diverged", "no rank has a compiled graph or a compile record: nothing to compare")
    return b


def _grad(ctx: _Context) -> Badge:
    """``check-grads`` (:func:`graphdeck.analysis.gradients.core.gradient_report`: graph analysis
    joined with the run-time evidence): a rank with a failing parameter row (NO_GRAD,
    NOT_IN_GRAPH, DEAD_END, not allowed) or named by an error finding (a pipeline stage that
    receives no gradient, a gradient never reduced, ...) is ``missing``; one with no row, or only
    UNKNOWN rows, is ``unknown``. Findings that are the other badges' (rank divergence, predicted
    hang) are left to them. Run-time evidence alone is not enough: a pipeline stage whose
    backward is cut still shows every parameter with a gradient (pipelining's own)."""
    from graphdeck.analysis.gradients.core import gradient_report

    report = gradient_report(ctx.session, ctx.run)
    rows: dict[int, list] = {}
    for row in report.rows:
        rows.setdefault(row.rank, []).append(row)
    if not rows:
        return _unknown("grad", "check-grads found no parameter of any rank (no captured backward graph, "
                        "no parameter list and no gradient evidence)")
    gaps = report.gaps
    b = Badge("grad", ran=True, verdict=report.verdict,
              message=f"check-grads: {report.verdict}; {len(report.failures)} failing parameter "
              f"row(s), {len(report.errors)} error finding(s)"
              + (f"; evidence missing: {_clip(gaps[0])}" + (f" (+{len(gaps) - 1} more)" if len(gaps) > 1 else "")
                 if gaps else ""))
    for r in range(ctx.layout.world_size):
        mine = rows.get(r) or []
        failing = [x for x in mine if x.failing]
        if failing:
            first = failing[0]
            b.set(r, "missing", f"{len(failing)} parameter(s) without a gradient path "
                                f"({_some([f'{x.fqn} {x.status}' for x in failing])})"
                                + (f": {first.reason}" if first.reason else "") + "; see check-grads")
        elif not mine:
            b.set(r, "unknown", "check-grads has no parameter of this rank")
        elif all(x.status == "UNKNOWN" for x in mine):
            b.set(r, "unknown", "check-grads could not tell for any parameter of this rank")
    for f in report.errors:
        if f.kind in ("RANK_DIVERGENCE", "PREDICTED_HANG"):
            continue
        for r in (f.ranks if isinstance(f.ranks, (dict, list)) else []):
            try:
                r = int(r)
            except (TypeError, ValueError):
                continue
            if 0 <= r < ctx.layout.world_size and b.state(r) != "missing":
                b.set(r, "missing", f"{f.kind}: {_clip(f.message)}; see check-grads")
    return b


#: Compile records only graphdeck's Agent writes: a run holding one was captured by it.
_AGENT_RECORDS = ("graphdeck_parallel_layout", "graphdeck_process_groups", "graphdeck_comm_groups")


def _no_dump_hint(session: Session, run_id: int) -> str:
    """What is missing for a run without any Flight Recorder dump. The Agent turns the recorder on
    itself (:mod:`graphdeck.capture.flight`), so for a run it captured, setting
    ``TORCH_FR_BUFFER_SIZE`` is not the answer; for any other run it is, with an import."""
    agent = session.scalar(select(func.count()).select_from(CompileEvent).where(
        CompileEvent.run_id == run_id, CompileEvent.name.in_(_AGENT_RECORDS)))
    if agent:
        return ("graphdeck's Agent turns the Flight Recorder on (TORCH_FR_BUFFER_SIZE, unless the job set it) and "
                "writes each rank's dump into the store when the job raises, is stopped (SIGTERM), exits or calls "
                "agent.close(), but no rank of this run wrote one: no rank recorded a collective after the Agent was "
                "made (make it before the first collective), the job set TORCH_FR_BUFFER_SIZE=0, or every rank was "
                "killed (SIGKILL, out of memory) before it could write")
    return ("the run was not captured by graphdeck's Agent (which records the dumps itself): set "
            "TORCH_FR_BUFFER_SIZE and TORCH_FR_DUMP_TEMP_FILE on the job, then `graphdeck import` the dumps")


def _clip(text: str, n: int = 240) -> str:
    return text if len(text) <= n else text[:n - 1] + "…"


def _some(names: list[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (", …" if len(names) > n else "")


def _straggler(ctx: _Context) -> Badge:
    """Traces of two or more ranks matched; the rank the others waited for is the straggler."""
    from graphdeck.analysis.traces.collectives import align_and_match, run_traces

    session, run, layout = ctx.session, ctx.run, ctx.layout
    traces = run_traces(session, run.id)
    if len(traces) < 2:
        return _unknown("straggler", "needs Kineto traces of two or more ranks; "
                        + (f"only rank {next(iter(traces))} has one" if traces else "the run has none"))
    timing = align_and_match(session, run.id, traces=traces)["timing"]
    b = Badge("straggler", ran=True, message=timing.get("message")
              or f"traces of {len(traces)} ranks matched: no rank kept the others waiting")
    timed = {int(r) for r in timing.get("ranks") or {}}
    for r in range(layout.world_size):
        if r not in timed:
            b.set(r, "unknown", "no trace from this rank" if r not in traces else "no matched collective in its trace")
    if timing.get("straggler") is not None:
        b.set(int(timing["straggler"]), "straggler", timing.get("message"))
    return b


def _hang(ctx: _Context) -> Badge:
    """Flight Recorder's first mismatch per process group: ``hang`` for a rank that skipped a
    collective its peers issued, ``waiting`` for a rank blocked in it (or in a consequence)."""
    from graphdeck.analysis.ranks.flight import flight_report
    from graphdeck.store.fr_import import EVENT_NAME

    session, run, layout = ctx.session, ctx.run, ctx.layout
    if not session.scalar(select(func.count()).select_from(CompileEvent).where(
            CompileEvent.run_id == run.id, CompileEvent.name == EVENT_NAME)):
        return _unknown("hang", "no Flight Recorder dump in this run: " + _no_dump_hint(session, run.id))
    report = ctx.rank_report()  # it read the dumps already (and explained the mismatches)
    fr = report.flight if report is not None else flight_report(session, run.id)
    if fr is None:
        return _unknown("hang", "the run's Flight Recorder dumps could not be read")
    dumped = set(fr.ranks)
    lacking = sorted(set(fr.no_dump) | {r for r in range(layout.world_size) if r not in dumped})
    incomplete = fr.groups_incomplete
    parts = [f"{len(fr.mismatches)} group(s) with a first mismatch"] if fr.mismatches else []
    if lacking:  # NOTE: a rank without a dump makes the comparison incomplete, never "match"
        parts.append(f"INCOMPLETE: ranks {_ranges(lacking)} wrote no dump, so "
                     + (f"whether the collectives of group(s) {', '.join(sorted(incomplete))} match cannot be told"
                        if incomplete else "their collectives are unknown")
                     + " (a rank that aborts inside a collective, or is killed, writes none)")
    elif not fr.mismatches:
        parts.append("every group's collectives match")
    b = Badge("hang", ran=True, message=f"Flight Recorder dumps of {len(fr.ranks)} rank(s): " + "; ".join(parts),
              verdict="FAIL" if fr.mismatches else "INCOMPLETE" if lacking else None)
    for r in lacking:
        if 0 <= r < layout.world_size:
            b.set(r, "unknown", "no Flight Recorder dump from this rank")
    for g, missing in incomplete.items():
        for r in fr.group_members.get(g, []):
            if r in dumped and 0 <= r < layout.world_size:
                b.set(r, "unknown", f"its group {g}" + (f" ({fr.descs[g]})" if fr.descs.get(g) else "")
                      + f" cannot be compared: members {_ranges(missing)} wrote no Flight Recorder dump")
    for m in fr.mismatches:
        what = f"collective #{m.seq} {m.op} of group {m.group}" + (f" ({m.desc})" if m.desc else "")
        for r in m.not_reached:
            doing = m.doing.get(r)
            if m.primary and m.cause.get(r) != "waiting":
                b.set(r, "hang", f"did not reach {what}, which ranks {_ranges(sorted(m.reached))} issued"
                                 + (f"; went on to {doing.describe()}" if doing is not None else ""))
            elif b.state(r) != "hang":
                b.set(r, "waiting", f"blocked before {what}" + (f" in {doing.describe()}" if doing is not None else ""))
        for r in m.reached:
            if b.state(r) not in ("hang",):
                b.set(r, "waiting", f"waiting in {what}: ranks {_ranges(sorted(m.not_reached))} never reached it")
    return b
