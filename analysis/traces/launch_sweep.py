"""Kernel → launching runtime call → enclosing host ranges, read from a stored trace as a stream.

# NOTE: [Bounded launch sweep]
The ingest's post-ingest analyses (the collective index, the kept kernel links: NOTE:
[Collective index], NOTE: [Stored kernel links]) need, per GPU kernel, its launching runtime call
(the first one, in ``(ts, id)`` order, of the same ``correlation``) and that call's enclosing host
ranges (NOTE: [GPU to CPU links]). Read from a list of every event, that holds the whole trace;
:func:`sweep` reads the events in ``(ts, id)`` order through a server-side cursor and keeps only:

* per thread, the stack of host ranges open at the current time (:func:`stack_step`, the sweep of
  :func:`graphdeck.analysis.traces.links._chains`, fed the same per-thread order);
* the runtime calls not yet claimed by a kernel and the kernels not yet matched to their call,
  both forgotten once older than the *horizon*: the start of the third-last ``ProfilerStep#N``
  seen (host side), or, in a stretch of ``mark_events`` events without a step, the event that many
  events back. So memory is bounded by about three steps, not by the trace.

It yields ``(kernel, runtime call or None, chain)`` for every kernel (``GPU_KERNEL_CATS``) in the
kernels' ``(ts, id)`` order — what the list path gives (:func:`launches`). A kernel is matched to
a call launched up to a horizon before it (or after it: clock skew). Forgetting is exact only if
nothing forgotten was needed: a kernel given up unmatched whose correlation some runtime call of
the trace has, or a correlation shared by two runtime calls once something was forgotten. The
sweep says so (:attr:`Sweep.exact`, checked with two queries after the stream, bounded too), and
:func:`bounded` then runs the consumer again over an unbounded sweep (the whole trace held, as
before), so the result is always the list path's.
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


def stream_events(session: Session, trace_id: int, *, ranges: bool, kernel_args: bool) -> Iterator[Ev]:
    """Trace ``trace_id``'s ``X`` events by ``(ts, id)``, streamed (a server-side cursor on
    PostgreSQL; SQLite's cursor reads as it goes): every event when ``ranges``, else only kernels,
    runtime calls and ``ProfilerStep#N`` ranges; ``args`` only on kernels when ``kernel_args``."""
    params: dict = {"tid": trace_id}
    args = f"CASE WHEN c.value IN ({_cats(params, 'k', GPU_KERNEL_CATS)}) THEN e.args_json ELSE NULL END" \
        if kernel_args else "NULL"
    where = "" if ranges else (f"AND (c.value IN ({_cats(params, 'w', GPU_KERNEL_CATS | RUNTIME_CATS)}) "
                               "OR n.value LIKE 'ProfilerStep#%')")
    result = session.connection().execution_options(stream_results=True, yield_per=5000).execute(
        text(_SQL.format(args=args, where=where)), params)
    try:
        for row in result:
            yield Ev(*row)
    finally:
        result.close()


class Sweep:
    """One pass of NOTE: [Bounded launch sweep] over ``events`` (``(ts, id)`` order).
    ``horizon=False``: nothing is forgotten (memory grows with the trace, always exact)."""

    def __init__(self, horizon: bool = True, mark_events: int = 50_000, chains: bool = True):
        self.horizon = horizon
        self.mark_events = mark_events
        self.chains = chains
        self.stacks: dict[tuple[str, str], list] = {}
        self.pending: OrderedDict[int, list] = OrderedDict()  # corr → [runtime call, chain or None]
        self.waiting: deque[Ev] = deque()  # kernels by (ts, id), the first ones not yet matched
        self.given_up: set[int] = set()  # correlations of kernels yielded unmatched after a horizon
        self.forgot = False  # a runtime call was forgotten unclaimed
        self.marks: list[int] = []
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
        (the list path's ``setdefault``), the thread sweeps run in their own order, then the
        kernels queue up."""
        kernels = []
        for e in group:
            if e.cat in RUNTIME_CATS and e.corr is not None and e.corr not in self.pending:
                self.pending[e.corr] = [e, None]
            elif e.cat in GPU_KERNEL_CATS:
                kernels.append(e)
            elif e.cat in CPU_RANGE_CATS and _STEP.match(e.name):
                self._mark(e.ts)
        for e in sorted(group, key=lambda e: (-e.dur, e.cat in RUNTIME_CATS, e.id)):
            is_rt = e.cat in RUNTIME_CATS
            if not self.chains or not (is_rt or e.cat in CPU_RANGE_CATS):
                continue
            chain = stack_step(self.stacks.setdefault((e.pid, e.tid), []), e, is_rt)
            if is_rt and (p := self.pending.get(e.corr)) is not None and p[0] is e:
                p[1] = chain
        self.waiting.extend(kernels)
        self.since_mark += len(group)
        if self.since_mark >= self.mark_events:
            self._mark(group[0].ts)
        yield from self._emit()

    def _mark(self, ts: int) -> None:
        if not self.marks or ts > self.marks[-1]:
            self.marks.append(ts)
            del self.marks[:-3]
        self.since_mark = 0

    def _emit(self, final: bool = False) -> Iterator[Launch]:
        cut = self.marks[0] if self.horizon and len(self.marks) == 3 else None
        while self.waiting:
            k = self.waiting[0]
            p = self.pending.get(k.corr) if k.corr is not None else None
            if p is not None:
                self.waiting.popleft()
                yield k, p[0], p[1] or ()
            elif final or k.corr is None or (cut is not None and k.ts < cut):
                yield self._give_up(self.waiting.popleft())
            else:
                break
        if cut is not None:
            while self.pending:
                corr, (rt, _) = next(iter(self.pending.items()))
                if rt.ts >= cut:
                    break
                del self.pending[corr]
                self.forgot = True

    def _give_up(self, k: Ev) -> Launch:
        if k.corr is not None:
            self.given_up.add(k.corr)
        return k, None, ()

    def check(self, session: Session, trace_id: int) -> bool:
        """Whether what was forgotten was never needed (NOTE: [Bounded launch sweep]); two streamed
        queries, only when something was forgotten or given up."""
        if not self.given_up and not self.forgot:
            self.exact = True
            return True
        params: dict = {"tid": trace_id}
        cats = _cats(params, "r", RUNTIME_CATS)
        base = ("FROM trace_events e JOIN strings c ON c.id = e.cat_id WHERE e.trace_id = :tid AND e.ph = 'X' "
                f"AND c.value IN ({cats}) AND e.correlation IS NOT NULL")
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


def bounded(session: Session, trace_id: int, consume: Callable[[Iterator[Launch], Sweep], T], *,
            ranges: bool, kernel_args: bool = False) -> T:
    """``consume(launches, sweep)`` over a bounded :class:`Sweep` of trace ``trace_id``'s stored
    events (:func:`stream_events`), again over an unbounded one when the bounded one was not exact
    (NOTE: [Bounded launch sweep]); ``consume`` must start from scratch each time. ``ranges``:
    the chains are wanted (every event is read), else only kernels and their launches."""
    for horizon in (True, False):
        sweep = Sweep(horizon=horizon, chains=ranges)
        got = consume(sweep.run(stream_events(session, trace_id, ranges=ranges, kernel_args=kernel_args)), sweep)
        if not horizon or sweep.check(session, trace_id):
            return got
        log.info("trace %s: a kernel ran further than three profiler steps from its launch, or launches share a "
                 "correlation id: its launches are read again with the whole trace in memory", trace_id)
    raise AssertionError("unreachable")
