"""Reading stored trace events back for the trace analyses (one trace at a time, as tuples).

Rows come from ``trace_events`` joined to the interned ``strings``; times are int64 ns as stored
(see :mod:`graphdeck.store.traces`). The category sets below name Kineto's categories, current
(``kernel``, ``cuda_runtime``, ``cpu_op``) and 2021 spellings (``Kernel``, ``Runtime``,
``Operator``), plus ROCm (``hip_*`` names use the same categories) and MTIA.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable

from sqlalchemy import text
from sqlalchemy.orm import Session

#: Events that run on a GPU stream and count as device work.
GPU_KERNEL_CATS = frozenset({"kernel", "Kernel", "mtia_ops"})
GPU_CATS = GPU_KERNEL_CATS | {"gpu_memcpy", "gpu_memset", "Memcpy", "Memset"}
#: Host-side launch calls whose ``correlation`` a GPU event repeats.
RUNTIME_CATS = frozenset({"cuda_runtime", "cuda_driver", "Runtime", "Driver", "mtia_runtime", "hip_runtime"})
#: Host-side ranges that enclose launches: operators and record_function ranges.
CPU_OP_CATS = frozenset({"cpu_op", "Operator"})
CPU_RANGE_CATS = CPU_OP_CATS | {"user_annotation"}


@dataclass(slots=True)
class Ev:
    """One stored ``X`` event: ``ts``/``dur``/``end`` in ns, ``args`` the stored JSON text."""

    id: int
    name: str
    cat: str
    ts: int
    dur: int
    pid: str
    tid: str
    corr: int | None
    args: str | None

    @property
    def end(self) -> int:
        return self.ts + self.dur

    def arg(self, key: str, default: Any = None) -> Any:
        if not self.args:
            return default
        try:
            return json.loads(self.args).get(key, default)
        except (ValueError, AttributeError):
            return default

    def args_dict(self) -> dict:
        try:
            value = json.loads(self.args) if self.args else {}
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}


_SQL = (
    "SELECT e.id, n.value, COALESCE(c.value, ''), e.ts_ns, e.dur_ns, e.pid, e.tid, e.correlation, {args} "
    "FROM trace_events e JOIN strings n ON n.id = e.name_id LEFT JOIN strings c ON c.id = e.cat_id "
    "WHERE e.trace_id = :tid AND e.ph = 'X' {where} ORDER BY e.ts_ns, e.id"
)


def load_events(session: Session, trace_id: int, *, cats: Iterable[str] | None = None,
                with_args: bool = True, t0_ns: int | None = None, t1_ns: int | None = None) -> list[Ev]:
    """The ``X`` events of trace ``trace_id`` ordered by start (ns), optionally only those whose
    category is in ``cats`` and that overlap ``[t0_ns, t1_ns)``."""
    where, params = [], {"tid": trace_id}
    if cats is not None:
        names = sorted(set(cats))
        where.append("AND c.value IN (" + ",".join(f":c{i}" for i in range(len(names))) + ")")
        params.update({f"c{i}": v for i, v in enumerate(names)})
    if t1_ns is not None:
        where.append("AND e.ts_ns < :t1")
        params["t1"] = t1_ns
    if t0_ns is not None:
        where.append("AND e.ts_ns + e.dur_ns > :t0")
        params["t0"] = t0_ns
    sql = _SQL.format(args="e.args_json" if with_args else "NULL", where=" ".join(where))
    return [Ev(*row) for row in session.execute(text(sql), params).fetchall()]  # one fetch, not a row at a time


def union_ns(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge ``(start, end)`` intervals (ns) into sorted disjoint ones."""
    out: list[list[int]] = []
    for s, e in sorted(intervals):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1][1] = e
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def total_ns(intervals: Iterable[tuple[int, int]]) -> int:
    return sum(e - s for s, e in intervals)


def intersect_ns(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    """Length (ns) of the intersection of two sorted disjoint interval lists."""
    i = j = 0
    got = 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if e > s:
            got += e - s
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return got
