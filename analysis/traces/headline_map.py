"""The mapping behind ``graphdeck ingest-trace``'s coverage headline, read from the few events it
depends on.

# NOTE: [Headline mapping from launches]
The command prints, after the ingest, what :func:`~graphdeck.analysis.traces.mapping.map_trace`
says of the trace's coverage (NOTE: [Trace coverage]). For a rank without kernel tables (a trace
ingested without a capture of its job, every corpus trace) that result depends, per GPU kernel, only
on its name, its duration, whether a ``## Call CompiledFxGraph…`` range encloses its launch call
(then it is a compiled graph's kernel, unmapped) and whether an ``Optimizer.step#…`` range does
(NOTE: [Optimizer step kernels]), plus the communication kernels' collective records. A range's
place in a launch's chain is decided by its own span alone (:func:`~graphdeck.analysis.traces.
launch_sweep.stack_step` keeps, per thread, the open ranges that start at or before the launch
and end at or after its end; a range is popped only once it ended before a later item starts;
a runtime call no kernel points at only pops), so the chain of the events kept here is the full
chain with the other ranges left out, and
``map_trace`` on them classifies every kernel as it would on the whole trace. Reading the GPU
kernels, the runtime calls of their correlations and those two kinds of ranges is ~8% of the
trace's events on the xdit corpus trace (issue 41: the second full mapping was ~0.6–1.0 CPU s of the command).

Not used (the whole trace is read, as before): a rank with kernel tables (the mapping then needs
the call right under each wrapper range, any range) and a trace without GPU kernel time (the CPU
path, NOTE: [CPU trace mapping], reads every host range). tests/test_headline_map.py checks that
the result equals ``map_trace``'s on corpus traces.
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.orm import Session

from graphdeck.analysis.traces.data import CPU_RANGE_CATS, GPU_KERNEL_CATS, RUNTIME_CATS, Ev
from graphdeck.analysis.traces.launch_sweep import _cats
from graphdeck.analysis.traces.mapping import OPTIMIZER_PREFIX, WRAPPER_PREFIX, KernelMapping, _tables, map_trace
from graphdeck.errors import NotFoundError
from graphdeck.store.schema import Trace

_SQL = ("SELECT e.id, n.value, COALESCE(c.value, ''), e.ts_ns, e.dur_ns, e.pid, e.tid, e.correlation, NULL "
        "FROM trace_events e JOIN strings n ON n.id = e.name_id LEFT JOIN strings c ON c.id = e.cat_id "
        "WHERE e.trace_id = :tid AND e.ph = 'X' AND (e.cat_id IN (SELECT id FROM strings WHERE value IN ({kernels})) "
        "OR (e.cat_id IN (SELECT id FROM strings WHERE value IN ({runtime})) AND e.correlation IN ("
        "SELECT k.correlation FROM trace_events k WHERE k.trace_id = :tid AND k.ph = 'X' AND k.correlation IS NOT NULL "
        "AND k.cat_id IN (SELECT id FROM strings WHERE value IN ({kernels})))) "
        "OR e.name_id IN (SELECT id FROM strings WHERE substr(value, 1, :lw) = :wp OR substr(value, 1, :lo) = :op)) "
        "ORDER BY e.ts_ns, e.id")


def launch_events(session: Session, trace_id: int) -> list[Ev]:
    """Trace ``trace_id``'s GPU kernels, the runtime calls of their correlations and host ranges
    (``CPU_RANGE_CATS``) named
    ``## Call CompiledFxGraph…`` or ``Optimizer.step#…``, as :class:`Ev` (``args`` None) by
    ``(ts, id)``: what NOTE: [Headline mapping from launches] reads."""
    params: dict = {"tid": trace_id, "lw": len(WRAPPER_PREFIX), "wp": WRAPPER_PREFIX, "lo": len(OPTIMIZER_PREFIX),
                    "op": OPTIMIZER_PREFIX}
    sql = _SQL.format(kernels=_cats(params, "k", GPU_KERNEL_CATS), runtime=_cats(params, "r", RUNTIME_CATS))
    rows = session.execute(text(sql), params).fetchall()
    wanted = GPU_KERNEL_CATS | RUNTIME_CATS | CPU_RANGE_CATS  # a named range of another category stays out
    return [Ev(*row) for row in rows if row[2] in wanted]


def headline_mapping(session: Session, trace_id: int) -> KernelMapping:
    """:func:`~graphdeck.analysis.traces.mapping.map_trace` of trace ``trace_id``, reading only the
    events NOTE: [Headline mapping from launches] needs when the rank has no kernel tables and
    the trace has GPU kernel time; else ``map_trace`` on the whole trace.

    Raises NotFoundError when the trace does not exist."""
    trace = session.get(Trace, trace_id)
    if trace is None:
        raise NotFoundError(f"trace {trace_id} not found", resource="trace", id=trace_id)
    if _tables(session, trace.run_id, trace.rank):
        return map_trace(session, trace_id)
    events = launch_events(session, trace_id)
    if not any(e.dur for e in events if e.cat in GPU_KERNEL_CATS):  # the CPU path reads every range
        return map_trace(session, trace_id)
    return map_trace(session, trace_id, events)
