"""The 1-D replica layout of a run without a device mesh: DDP's replica group, or the default
process group of a plain ``torch.distributed`` job (issue 42 item 5).

# NOTE: [Replica row]
A run whose ranks recorded no ``graphdeck_parallel_layout`` (no DeviceMesh, DTensor, FSDP2 group
or pipeline stage; :mod:`graphdeck.analysis.parallel.layout`) still has a parallel layout when
it ran more than one rank: every rank runs the same program on its own data and the ranks
all-reduce gradients (DDP) or run collectives over one group. The capture records it:

* ``graphdeck_comm_groups`` (:mod:`graphdeck.capture.comm_groups`): per DDP wrapper its process
  group's name, its gradient buckets (index, parameters, ``numel``, ``size_bytes``),
  ``find_unused_parameters`` and ``static_graph``;
* ``graphdeck_process_groups`` (:mod:`graphdeck.capture.process_groups`): every process group
  the rank knows (name, desc, backend, member ranks), the default group first;
* the ``ranks`` rows: each rank's world size and backend.

The replica group is DDP's process group when a rank recorded a DDP wrapper (its members from
the process-group records, else the ranks whose DDP record names that group), else the default
process group of the process-group records. ``ranks`` rows alone (an imported trace, a capture
without the Agent) place nothing: the map then says what to capture. The newest record of each
rank is read. A rank that wrote neither record is listed in ``unrecorded`` (its place is read from
the others' records, as the mesh map does for a rank without a layout record).

Pure: reads the store, returns data; malformed records are ignored as if not written.
"""

from __future__ import annotations

import json

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from graphdeck.store.schema import CompileEvent, Rank, Run

COMM_EVENT = "graphdeck_comm_groups"
PG_EVENT = "graphdeck_process_groups"


def _newest(session: Session, run_id: int, name: str) -> dict[int, dict]:
    """rank → its newest readable record ``name`` (a JSON object)."""
    newest = (select(CompileEvent.rank, func.max(CompileEvent.id).label("id"))
              .where(CompileEvent.run_id == run_id, CompileEvent.name == name).group_by(CompileEvent.rank).subquery())
    out: dict[int, dict] = {}
    for rank, payload in session.execute(select(CompileEvent.rank, CompileEvent.payload)
                                         .join(newest, CompileEvent.id == newest.c.id)):
        try:
            data = json.loads(payload or "")
        except ValueError:
            continue
        if isinstance(data, dict):
            out[int(rank)] = data
    return out


def _ints(values) -> list[int]:
    try:
        return sorted({int(v) for v in values or []})
    except (TypeError, ValueError):
        return []


def replica_layout(session: Session, run: Run) -> dict | None:
    """The run's 1-D replica layout (NOTE: [Replica row]), or None for a single-rank run or one
    with nothing recorded about its groups.

    Keys: ``kind`` (``"ddp"`` | ``"default_group"``), ``world_size``, ``process_group`` (name),
    ``desc``, ``backend``, ``ranks`` (members, sorted global ranks), ``ddp`` (None, or
    ``{"wrappers", "buckets", "bytes", "bucket_bytes": [bytes per bucket, by index],
    "params", "find_unused_parameters", "static_graph", "ranks": [ranks that recorded it]}`` —
    bytes are one step's gradient all-reduce payload per rank), ``sources`` (what was read:
    record names / ``"ranks rows"``), ``unrecorded`` (members without a comm-groups or
    process-groups record) and ``text`` (one line for the map and CLI)."""
    comm = _newest(session, run.id, COMM_EVENT)
    pgs = _newest(session, run.id, PG_EVENT)
    rank_rows = dict(session.execute(select(Rank.rank, Rank.world_size).where(Rank.run_id == run.id)).all())
    ws = max([int(run.world_size or 0)] + [int(w or 0) for w in rank_rows.values()]
             + [int(d.get("world_size") or 0) for d in comm.values() if isinstance(d.get("world_size"), int)])
    groups: dict[str, dict] = {}  # process-group name -> {"desc", "backend", "ranks"}
    default_name = None
    for rank in sorted(pgs):
        listed = pgs[rank].get("groups")
        for i, g in enumerate(listed if isinstance(listed, list) else []):
            if not isinstance(g, dict) or g.get("name") is None:
                continue
            name = str(g["name"])
            if i == 0 and default_name is None:
                default_name = name  # the capture lists the default group first
            entry = groups.setdefault(name, {"desc": g.get("desc"), "backend": g.get("backend"), "ranks": set()})
            entry["ranks"].update(_ints(g.get("ranks")))
    ddp_pg = None
    ddp_by_rank: dict[int, dict] = {}
    for rank in sorted(comm):
        wrappers = [d for d in comm[rank].get("ddp") or [] if isinstance(d, dict) and d.get("buckets")]
        if wrappers:
            ddp_by_rank[rank] = wrappers[0]
            ddp_pg = str(wrappers[0].get("process_group") or "") if ddp_pg is None else ddp_pg
    if not groups and not ddp_by_rank:
        return None
    if ddp_by_rank:
        kind, name = "ddp", ddp_pg
        members = set(groups.get(name, {}).get("ranks") or ())
        members |= {r for r, d in ddp_by_rank.items() if str(d.get("process_group") or "") == name}
        if not members and name == default_name:
            members = set(range(ws))
    elif groups and default_name is not None:
        kind, name = "default_group", default_name
        members = set(groups[name]["ranks"])
    else:
        return None
    members = sorted(members)
    ws = max([ws] + [r + 1 for r in members])
    info = groups.get(name or "", {})
    backend = info.get("backend") or next(iter(session.scalars(select(Rank.backend).where(
        Rank.run_id == run.id, Rank.backend.is_not(None)).limit(1))), None)
    ddp = _ddp_summary(ddp_by_rank) if ddp_by_rank else None
    sources = ([COMM_EVENT] if ddp_by_rank else []) + ([PG_EVENT] if groups else []) + (["ranks rows"] if rank_rows else [])
    unrecorded = [r for r in members if r not in comm and r not in pgs]
    out = {"kind": kind, "world_size": ws, "process_group": name, "desc": info.get("desc"), "backend": backend,
           "ranks": members, "ddp": ddp, "sources": sources, "unrecorded": unrecorded}
    out["text"] = replica_text(out)
    return out


def _ddp_summary(by_rank: dict[int, dict]) -> dict:
    """DDP's buckets as the lowest recording rank has them (every replica holds the same ones)."""
    first = by_rank[min(by_rank)]
    buckets = sorted((b for b in first.get("buckets") or [] if isinstance(b, dict)), key=lambda b: b.get("index", 0))
    sizes = [int(b.get("size_bytes") or 0) for b in buckets]
    return {"buckets": len(buckets), "bytes": sum(sizes), "bucket_bytes": sizes,
            "params": sum(len(b.get("params") or []) for b in buckets),
            "find_unused_parameters": bool(first.get("find_unused_parameters")),
            "static_graph": bool(first.get("static_graph")), "ranks": sorted(by_rank)}


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} B"


def replica_text(rep: dict) -> str:
    """``DDP replica group: process group 0 (default_pg, gloo), 2 ranks; 3 buckets, 4.0 MiB of
    gradients all-reduced per step`` (or ``default process group …`` for a job without DDP)."""
    pg = rep.get("process_group")
    extra = ", ".join(str(x) for x in (rep.get("desc"), rep.get("backend")) if x)
    where = (f"process group {pg}" if pg is not None else "the default process group") + (f" ({extra})" if extra else "")
    n = len(rep["ranks"])
    if rep["kind"] == "ddp":
        d = rep["ddp"]
        return (f"DDP replica group: {where}, {n} ranks; {d['buckets']} gradient bucket"
                f"{'s' if d['buckets'] != 1 else ''}, {_mib(d['bytes'])} all-reduced per step"
                + ("; find_unused_parameters" if d["find_unused_parameters"] else ""))
    return f"one replica group: {where}, {n} ranks (no DDP wrapper and no device mesh recorded)"
