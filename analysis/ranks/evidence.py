"""What a rank check rests on that is missing or unverified: Flight Recorder entries dropped,
members without a dump or with an unreadable one, TORCH_TRACE records dropped on import or read
though their md5 failed (the importers name them in ``ranks.meta_json``). Missing evidence makes a
verdict INCOMPLETE; unverified evidence is named beside it."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.ranks.records import _ranks_phrase
from graphdeck.store.schema import Rank

if TYPE_CHECKING:
    from graphdeck.analysis.ranks.flight import FlightReport

#: TORCH_TRACE records check-ranks does not read (generated code, its run-time metadata, guard
#: text): dropping one loses no evidence. Any other dropped record — a graph, compile metrics, a
#: recompile reason, Inductor's collective schedule, a record whose kind is unreadable — does.
NOT_EVIDENCE = ("inductor_output_code", "inductor_runtime_and_tensor_meta", "dynamo_guards", "dynamo_cpp_guards_str",
                "inductor_provenance_tracking_kernel_stack_traces")
_DROP_RE = re.compile(r"line \d+: ([^\s:]+)")  # "line 60: exported_program: md5_mismatch" too


def missing_evidence(session: Session, run_id: int, report: FlightReport | None = None) -> list[str]:
    """Records that should be evidence and are not: FR entries dropped, members without a dump,
    TORCH_TRACE records dropped on import (named by the importer). Empty when nothing is missing."""
    out: list[str] = []
    if report is not None:
        out += [f"Flight Recorder entry dropped: {d}" for d in report.dropped]
        out += [f"{_ranks_phrase(report.no_dump)}: no Flight Recorder dump"] if report.no_dump else []
    for rank, meta in session.execute(select(Rank.rank, Rank.meta_json).where(Rank.run_id == run_id)
                                      .order_by(Rank.rank)):
        try:
            data = json.loads(meta or "{}")
            named = data.get("dropped_records") or []
            broken = data.get("broken_flight_dumps") or []
        except (ValueError, AttributeError):
            continue
        out += [f"rank {rank}: Flight Recorder dump unreadable: {d}" for d in broken]
        out += [f"rank {rank}: compile record dropped on import: {d}" for d in named
                if not ((m := _DROP_RE.match(d)) and m.group(1) in NOT_EVIDENCE)]
    return out


def unverified_evidence(session: Session, run_id: int) -> list[str]:
    """TORCH_TRACE records kept and read though their payload's md5 failed (the importer names
    them in ``ranks.meta_json["unverified_records"]``), other than :data:`NOT_EVIDENCE`: what a
    finding built on this run's compile records rests on without verification. Not missing
    evidence: the record is there and used."""
    out: list[str] = []
    for rank, meta in session.execute(select(Rank.rank, Rank.meta_json).where(Rank.run_id == run_id)
                                      .order_by(Rank.rank)):
        try:
            named = json.loads(meta or "{}").get("unverified_records") or []
        except (ValueError, AttributeError):
            continue
        out += [f"rank {rank}: {d}" for d in named if not ((m := _DROP_RE.match(d)) and m.group(1) in NOT_EVIDENCE)]
    return out
