"""Kernel → launching runtime call → enclosing host ranges, read from a stored trace as a stream.

# NOTE: [Bounded launch sweep]
The ingest's post-ingest analyses (the collective index, the kept kernel links: NOTE:
[Collective index], NOTE: [Stored kernel links]) need, per GPU kernel, its launching runtime call
(the first one, in ``(ts, id)`` order, of the same ``correlation``) and, for the links of a rank
with kernel tables, that call's enclosing host ranges (NOTE: [GPU to CPU links]). Read from a list
of every event (:func:`launches`, what export and the analyses use), that holds the whole trace.
The ingest reads them so that its memory does not grow with the trace (issue 36 item 9):

* the collective index needs only the launch's start: :func:`stream_kernels` streams the kernels
  with the smallest ``ts`` of their correlation's runtime calls joined by the database (a grouped
  pass over the launch calls, none of them held in Python); the links of a rank without kernel
  tables need no launch at all (the kernels alone are streamed);
* the links of a rank with kernel tables need the host ranges: :class:`Sweep` reads every event
  by ``(ts, id)`` (:func:`stream_events`) and keeps only, per thread, the stack of ranges open at
  the current time (:func:`stack_step`, the sweep of ``links._chains`` fed the same per-thread
  order), the runtime calls not yet claimed by a kernel and the kernels not yet matched to their
  call, both forgotten once older than the *horizon*: the older of the start of the third-last
  ``ProfilerStep#N`` seen (host side; none in a trace without steps) and the event two to three
  times ``mark_events`` (20,000) back. So memory is bounded by three steps or 60,000 events,
  whichever is more, and a kernel may run up to that far from its launch (a CPU running ahead of
  a queue of tiny steps, a trace without steps).

The sweep yields ``(kernel, runtime call or None, chain)`` for every kernel (``GPU_KERNEL_CATS``) in
the kernels' ``(ts, id)`` order, as :func:`launches` does. Forgetting is exact only if nothing
forgotten was needed: a kernel given up unmatched whose correlation some runtime call of the trace
has (it ran more than the horizon after, or before, its launch), or a correlation id two runtime
calls share once something was forgotten (the list path gives every kernel the first of them, maybe
long gone). :meth:`Sweep.check` tells (two streamed queries), and :func:`bounded` then runs the
consumer again over an unbounded sweep (the whole trace held, as before): the result is always the
list path's.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from sqlalchemy import text
from sqlalchemy.orm import Session

from graphdeck.analysis.traces.data import CPU_RANGE_CATS, GPU_KERNEL_CATS, RUNTIME_CATS, Ev

log = logging.getLogger(__name__)

_STEP = re.compile(r"^ProfilerStep#\d+$")
#: Events between two count marks of the horizon (NOTE: [Bounded launch sweep]).
MARK_EVENTS = 20_000
T = TypeVar("T")
Launch = tuple[Ev, Ev | None, tuple[Ev, ...]]


def stack_step(stack: list[tuple[int, int, Ev]], e: Ev, is_runtime: bool, want: bool = True) -> tuple[Ev, ...] | None:
    """One item of a thread's sweep (NOTE: [GPU to CPU links]): pop the ranges that ended before
    ``e`` starts, then push ``e`` (a host range; returns None) or return a runtime call's enclosing
    ranges, outermost first (None when not ``want``). Items must come in ``(ts, -dur, is_runtime,
    id)`` order per thread."""
    ts = e.ts
    while stack and (stack[-1][1] < ts or (stack[-1][1] == ts and stack[-1][2].dur != 0)):
        stack.pop()
    if is_runtime:
        if not want:
            return None
        end = ts + e.dur
        return tuple(s for s_ts, s_end, s in stack if s_ts <= ts and s_end >= end)
    stack.append((ts, ts + e.dur, e))
    return None


def launches(events: list[Ev], chains_of: Callable[[dict, set], dict]) -> Iterator[Launch]:
    """The list path: ``(kernel, runtime call or None, chain)`` for each kernel of ``events`` (the
    trace's ``X`` events by ``(ts, id)``), in that order; ``chains_of`` is
    :func:`graphdeck.analysis.traces.links._chains` (launch call id → chain, for the wanted
    correlations), run only on the threads of the kernels' launches."""
    runtime_by_corr: dict[int, Ev] = {}
    per_thread: dict[tuple[str, str], list[Ev]] = {}
    kernels: list[Ev] = []
    for e in events:
        cat = e.cat
        if cat in GPU_KERNEL_CATS:
            kernels.append(e)
        elif cat in RUNTIME_CATS:
            if e.corr is not None:
                runtime_by_corr.setdefault(e.corr, e)
            per_thread.setdefault((e.pid, e.tid), []).append(e)
        elif cat in CPU_RANGE_CATS:
            per_thread.setdefault((e.pid, e.tid), []).append(e)
    wanted = {k.corr for k in kernels if k.corr is not None}
    threads = {(rt.pid, rt.tid) for c in wanted if (rt := runtime_by_corr.get(c)) is not None}
    chains = chains_of({lane: items for lane, items in per_thread.items() if lane in threads}, wanted)
    for k in kernels:
        rt = runtime_by_corr.get(k.corr) if k.corr is not None else None
        yield k, rt, (chains.get(rt.id, ()) if rt is not None else ())


_SQL = ("SELECT e.id, n.value, COALESCE(c.value, ''), e.ts_ns, e.dur_ns, e.pid, e.tid, e.correlation, {args} "
        "FROM trace_events e JOIN strings n ON n.id = e.name_id LEFT JOIN strings c ON c.id = e.cat_id "
        "WHERE e.trace_id = :tid AND e.ph = 'X' {where} ORDER BY e.ts_ns, e.id")


def _cats(params: dict, prefix: str, cats: Iterable[str]) -> str:
    names = sorted(cats)
    params.update({f"{prefix}{i}": c for i, c in enumerate(names)})
    return ",".join(f":{prefix}{i}" for i in range(len(names)))


def stream_events(session: Session, trace_id: int) -> Iterator[Ev]:
    """Trace ``trace_id``'s ``X`` events by ``(ts, id)`` (``args`` not read), streamed: a
    server-side cursor on PostgreSQL; SQLite's cursor reads as it goes."""
    result = session.connection().execution_options(stream_results=True, yield_per=5000).execute(
        text(_SQL.format(args="NULL", where="")), {"tid": trace_id})
    try:
        for row in result:
            yield Ev(*row)
    finally:
        result.close()


_KERNELS_SQL = (
    "SELECT e.id, n.value, c.value, e.ts_ns, e.dur_ns, e.pid, e.tid, e.correlation, {args}, {launch} "
    "FROM trace_events e JOIN strings n ON n.id = e.name_id JOIN strings c ON c.id = e.cat_id {join} "
    "WHERE e.trace_id = :tid AND e.ph = 'X' AND e.cat_id IN (SELECT id FROM strings WHERE value IN ({kernels})) "
    "ORDER BY e.ts_ns, e.id")
# the first launch call of each correlation starts at its smallest ts (ties by id start at the same ts)
_LAUNCH_JOIN = (
    "LEFT JOIN (SELECT r.correlation AS corr, MIN(r.ts_ns) AS ts FROM trace_events r JOIN strings rc "
    "ON rc.id = r.cat_id WHERE r.trace_id = :tid AND r.ph = 'X' AND r.correlation IS NOT NULL AND r.cat_id IN "
    "(SELECT id FROM strings WHERE value IN ({runtime})) GROUP BY r.correlation) f ON f.corr = e.correlation")


def stream_kernels(session: Session, trace_id: int, *, args: bool, launch: bool) -> Iterator[tuple[Ev, int]]:
    """``(kernel, launch ns)`` for each kernel (``GPU_KERNEL_CATS``) of trace ``trace_id`` by
    ``(ts, id)``, streamed (NOTE: [Bounded launch sweep]). ``launch``: the start of its launch
    call (the first runtime call of its correlation, as
    :meth:`~graphdeck.analysis.traces.analyze.TraceData.launch_ts`: its own start when none),
    joined by the database (one grouped pass over the launch calls, none of them held here); else
    the kernel's own start. ``args``: read the kernels' args."""
    params: dict = {"tid": trace_id}
    sql = _KERNELS_SQL.format(args="e.args_json" if args else "NULL", launch="f.ts" if launch else "NULL",
                              join=_LAUNCH_JOIN.format(runtime=_cats(params, "r", RUNTIME_CATS)) if launch else "",
                              kernels=_cats(params, "k", GPU_KERNEL_CATS))
    result = session.connection().execution_options(stream_results=True, yield_per=5000).execute(text(sql), params)
    try:
        for row in result:
            k = Ev(*row[:9])
            yield k, row[9] if row[9] is not None else k.ts
    finally:
        result.close()


class Sweep:
    """One pass of NOTE: [Bounded launch sweep] over ``events`` (``(ts, id)`` order).
    ``horizon=False``: nothing is forgotten (memory grows with the trace, always exact)."""

    def __init__(self, horizon: bool = True, mark_events: int = MARK_EVENTS):
        self.horizon = horizon
        self.mark_events = mark_events
        self.step_marks: list[int] = []  # starts of the last three steps
        self.stacks: dict[tuple[str, str], list] = {}
        self.pending: OrderedDict[int, list] = OrderedDict()  # corr → [runtime call, chain or None]
        self.waiting: deque[list] = deque()  # [kernel, call or None, chain] by (ts, id), not yet yielded
        self.unmatched: dict[int, list[list]] = {}  # corr → the waiting items without a call
        self.given_up: set[int] = set()  # correlations of kernels yielded unmatched after a horizon
        self.forgot = False  # a runtime call was forgotten unclaimed
        self.marks: list[int] = []  # ts of the last three events counted every mark_events
        self.since_mark = 0
        self.exact: bool | None = None  # set by check()

    def run(self, events: Iterable[Ev]) -> Iterator[Launch]:
        group: list[Ev] = []
        for e in events:
            if group and e.ts != group[0].ts:
                yield from self._group(group)
                group = []
            group.append(e)
        if group:
            yield from self._group(group)
        yield from self._emit(final=True)

    def _group(self, group: list[Ev]) -> Iterator[Launch]:
        """The events of one ``ts``: runtime calls claim their correlation in ``(ts, id)`` order
        (the list path's ``setdefault``), the thread sweeps run in their own order, then kernels
        are matched (those waiting for a call that came after them too) and queue up."""
        kernels, claimed = [], []
        for e in group:
            if e.cat in RUNTIME_CATS and e.corr is not None and e.corr not in self.pending:
                self.pending[e.corr] = [e, None]
                claimed.append(e.corr)
            elif e.cat in GPU_KERNEL_CATS:
                kernels.append(e)
            elif e.cat in CPU_RANGE_CATS and _STEP.match(e.name) and (not self.step_marks or e.ts > self.step_marks[-1]):
                self.step_marks = [*self.step_marks[-2:], e.ts]
        for e in sorted(group, key=lambda e: (-e.dur, e.cat in RUNTIME_CATS, e.id)):
            is_rt = e.cat in RUNTIME_CATS
            if not (is_rt or e.cat in CPU_RANGE_CATS):
                continue
            chain = stack_step(self.stacks.setdefault((e.pid, e.tid), []), e, is_rt)
            if is_rt and (p := self.pending.get(e.corr)) is not None and p[0] is e:
                p[1] = chain
        for corr in claimed:  # kernels that ran before their launch call (clock skew)
            for item in self.unmatched.pop(corr, ()):
                item[1], item[2] = self.pending[corr]
        for k in kernels:
            p = self.pending.get(k.corr) if k.corr is not None else None
            item = [k, *p] if p is not None else [k, None, None]
            if p is None and k.corr is not None:
                self.unmatched.setdefault(k.corr, []).append(item)
            self.waiting.append(item)
        self.since_mark += len(group)
        if self.since_mark >= self.mark_events:
            self.marks = [*self.marks[-2:], group[0].ts]
            self.since_mark = 0
        yield from self._emit()

    def _emit(self, final: bool = False) -> Iterator[Launch]:
        cut = None
        if self.horizon and len(self.marks) == 3:
            cut = min(self.marks[0], self.step_marks[0]) if len(self.step_marks) == 3 else self.marks[0]
        while self.waiting:
            k, rt, chain = self.waiting[0]
            if rt is None and not (final or k.corr is None or (cut is not None and k.ts < cut)):
                break  # its launch call may still come
            self.waiting.popleft()
            if rt is None and k.corr is not None:
                self.unmatched.pop(k.corr, None)
                self.given_up.add(k.corr)
            yield k, rt, chain or ()
        if cut is not None:
            while self.pending:
                corr, (rt, _) = next(iter(self.pending.items()))
                if rt.ts >= cut:
                    break
                del self.pending[corr]
                self.forgot = True

    def check(self, session: Session, trace_id: int) -> bool:
        """Whether what was forgotten was never needed (NOTE: [Bounded launch sweep]); two streamed
        queries, only when something was forgotten or given up."""
        if not self.given_up and not self.forgot:
            self.exact = True
            return True
        params: dict = {"tid": trace_id}
        cats = _cats(params, "r", RUNTIME_CATS)
        base = ("FROM trace_events e JOIN strings c ON c.id = e.cat_id WHERE e.trace_id = :tid AND e.ph = 'X' "
                f"AND e.cat_id IN (SELECT id FROM strings WHERE value IN ({cats})) AND e.correlation IS NOT NULL")
        exact = True
        if self.given_up:
            rows = session.connection().execution_options(stream_results=True, yield_per=5000).execute(
                text(f"SELECT e.correlation {base}"), params)
            exact = not any(corr in self.given_up for (corr,) in rows)
            rows.close()
        if exact and self.forgot:
            exact = session.execute(text(f"SELECT 1 {base} GROUP BY e.correlation HAVING COUNT(*) > 1 LIMIT 1"),
                                    params).first() is None
        self.exact = exact
        return exact


def bounded(session: Session, trace_id: int, consume: Callable[[Iterator[Launch]], T],
            mark_events: int = MARK_EVENTS) -> T:
    """``consume(launches)`` over a bounded :class:`Sweep` of trace ``trace_id``'s stored events
    (:func:`stream_events`), again over an unbounded one when the bounded one was not exact
    (NOTE: [Bounded launch sweep]); ``consume`` must start from scratch each time."""
    for horizon in (True, False):
        sweep = Sweep(horizon=horizon, mark_events=mark_events)
        got = consume(sweep.run(stream_events(session, trace_id)))
        if not horizon or sweep.check(session, trace_id):
            return got
        log.info("trace %s: a kernel ran further than three profiler steps from its launch, or launches share a "
                 "correlation id: its launches are read again with the whole trace in memory", trace_id)
    raise AssertionError("unreachable")
