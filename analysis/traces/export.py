"""Export a run's traces as one Chrome Trace Event Format file, clocks aligned, for Perfetto.

# NOTE: [Trace export]
Output format: the JSON Object Format of Google's "Trace Event Format" document (the one
``chrome://tracing`` and ui.perfetto.dev read): ``{"baseTimeNanoseconds", "displayTimeUnit",
"traceEvents": [...], "graphdeck": {...}}``. Times are µs (floats, ns precision) since
``baseTimeNanoseconds`` (the aligned start of the chosen ranks, ns since the Unix epoch, or on the
traces' own clock), so a re-ingest into graphdeck (:func:`graphdeck.store.traces.ingest_trace`)
gives back each event at its aligned time to the ns.

* One process per rank: ``pid`` = the rank, ``process_name`` metadata ``"rank N"``,
  ``process_sort_index`` N. Each of the rank's lanes (a stored ``pid``/``tid`` pair: a host
  thread, a GPU stream) is one thread, ``tid`` 1, 2, ... in (pid, tid) order, named by
  ``thread_name`` metadata after the trace's own process and thread names.
* Every stored ``X`` and ``i`` event of the rank's newest usable trace (NOTE: [Rank clock
  alignment]: :func:`~graphdeck.analysis.traces.collectives.run_traces`), at ``ts - offset``,
  with its stored args plus, where the kernel → node mapping (:func:`~graphdeck.analysis.
  traces.mapping.map_trace`'s links: kept at ingest, NOTE: [Stored kernel links], else computed for less
  by :func:`~graphdeck.analysis.traces.export_map.kernel_links`: NOTE: [Export kernel links]) links it: ``fx_graph`` (graph id), ``fx_nodes`` (node names),
  ``nn_modules`` (their module paths) and ``source`` (``file:line`` of each node's innermost
  user frame); a collective's ``collective`` says what it carries (DDP bucket, FSDP group).
* Clock offsets are those of :func:`~graphdeck.analysis.traces.collectives.align_and_match`
  (median of matched collectives' end differences against the run's lowest rank): computed
  here from the collectives of the chosen ranks and the reference rank only (their collective
  index, NOTE: [Collective index]), which gives the same numbers (unless a rank that diverges
  is outside the chosen ones: see below).
* Each collective matched on two or more chosen ranks gets one flow per rank that waited, between
  that rank's slice and the slice of the rank that arrived last, both at the slice's start (each
  binds to its enclosing slice), ``cat`` ``"collective"``: the earlier of the two is the ``s``, the
  later the ``f`` (``bp: "e"``), since Perfetto reads a JSON trace in time order and drops a flow
  that ends before it starts. A collective where a rank runs another kind or element count than
  most of the exported ranks (a divergent rank) is not linked on that rank, and is used for no
  rank's offset (as in ``align_and_match``, which judges divergence among all the run's ranks). The
  flows come after all ranks' events and only where both slices were found, so every ``s`` has
  its ``f`` (a rank's slices are matched to its collectives by start, name and end: two
  collectives may start on the same ns).

Streaming: ranks are read one at a time (their events, links and mapping), written and dropped;
what is kept across ranks is only each rank's collectives (key, start, end), lane counts, the
interned names and stack frames seen so far and what each rank's kept links were computed against.
"""

from __future__ import annotations

import json
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import compress
from operator import itemgetter

import orjson
from sqlalchemy import select, text
from sqlalchemy.orm import Session

from graphdeck.analysis.traces.analyze import CommRule
from graphdeck.analysis.traces.collectives import diverging, rank_spans, run_traces, trace_indexes
from graphdeck.analysis.traces.data import Ev
from graphdeck.analysis.traces.export_map import gc_paused, kernel_links, rank_states, stored_links, with_comm
from graphdeck.errors import NotFoundError, UsageError
from graphdeck.store.schema import InternedString, Rank, Run, Trace

#: Bytes gathered before a chunk is handed to the writer / the HTTP response.
CHUNK_BYTES = 1 << 20
_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_INSTANTS = ("SELECT e.id, n.value, COALESCE(c.value, ''), e.ts_ns, e.pid, e.tid, e.args_json "
             "FROM trace_events e JOIN strings n ON n.id = e.name_id LEFT JOIN strings c ON c.id = e.cat_id "
             "WHERE e.trace_id = :tid AND e.ph IN ('i', 'I') ORDER BY e.ts_ns, e.id")
_ROWS = ("SELECT id, name_id, cat_id, ts_ns, dur_ns, pid, tid, args_json FROM trace_events "
         "WHERE trace_id = {p} AND ph = 'X' ORDER BY ts_ns, id")
_CORRELATIONS = "SELECT id, correlation FROM trace_events WHERE trace_id = :tid AND ph = 'X' AND correlation IS NOT NULL"


def parse_ranks(spec: str | None, available: Iterable[int], missing_is: str = "have no usable trace in this run",
                have_are: str = "ranks with one") -> list[int]:
    """``"0,2-5"`` → ``[0, 2, 3, 4, 5]`` (sorted, unique); ``None``, ``""`` or ``"all"`` → every
    rank in ``available``.

    Raises:
        UsageError: a part that is not ``N`` or ``N-M`` (M >= N), or ranks not in ``available``
            (``missing_is`` says what that means; the message names them and the ranks there are).
    """
    have = sorted(set(available))
    if spec is None or spec.strip().lower() in ("", "all"):
        return have
    wanted: set[int] = set()
    bad: list[str] = []
    for part in spec.split(","):
        m = _RANGE.match(part)
        if not m or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            bad.append(part.strip() or "(empty)")
            continue
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi - lo > 1_000_000:
            bad.append(part.strip())
            continue
        wanted.update(range(lo, hi + 1))
    if bad:
        raise UsageError(f"bad --ranks part(s) {', '.join(repr(b) for b in bad)}: use a list of ranks and ranges "
                         f"such as 0,2-5", ranks=spec)
    missing = sorted(wanted - set(have))
    if missing:
        raise UsageError(f"rank(s) {rank_spans(missing)} {missing_is} ({have_are}: {rank_spans(have) or 'none'})",
                         missing=missing[:100])
    return sorted(wanted)


@dataclass
class ExportPlan:
    """What an export writes, known before any event is: ``ranks`` (chosen, sorted), ``traces``
    (rank → trace id), ``offsets`` (rank → ``{"offset_ns", "method", "matched"}``), ``origin_ns``
    (aligned start: the file's ``baseTimeNanoseconds``), ``collectives`` (key → rank → ``(start_ns,
    end_ns, name)`` on the rank's own clock, keys on 2+ chosen ranks) and ``last`` (key → the
    rank that arrived last)."""

    run_id: int
    run_name: str
    ranks: list[int]
    traces: dict[int, int]
    offsets: dict[int, dict]
    origin_ns: int
    collectives: dict[tuple, dict[int, tuple[int, int, str]]] = field(default_factory=dict)
    last: dict[tuple, int] = field(default_factory=dict)
    kinds: dict[tuple, str] = field(default_factory=dict)
    stats: dict = field(default_factory=lambda: defaultdict(int))
    frames: dict = field(default_factory=dict)  # interned stack id -> file:line (NOTE: [Trace export])
    strings: dict = field(default_factory=dict)  # interned string id -> value, kept across ranks
    states: dict | None = None  # rank -> what kept links were computed against (NOTE: [Stored kernel links])
    skipped: dict = field(default_factory=dict)  # asked rank of the run without a usable trace -> why


def plan_export(session: Session, run_id: int, ranks: str | list[int] | None = None,
                rule: CommRule | None = None) -> ExportPlan:
    """Choose the ranks, estimate their clock offsets and match their collectives (pass 1:
    each rank's trace read once, one at a time).

    Raises:
        NotFoundError: no run ``run_id``, or it has no usable trace.
        UsageError: ``ranks`` cannot be read, names ranks that are not in the run, or none of the
            asked ranks has a usable trace (:func:`_choose`). Asked ranks of the run without one
            are left out and named in ``plan.skipped`` (rank → why), for ``"all"`` as for a list.
    """
    run = session.get(Run, run_id)
    if run is None:
        raise NotFoundError(f"run {run_id} not found", resource="run", id=run_id)
    traces = run_traces(session, run_id)
    if not traces:
        raise NotFoundError(f"run {run.name!r} has no usable trace to export", resource="trace", id=run.name)
    spec = ",".join(map(str, ranks)) or None if isinstance(ranks, list) else ranks
    chosen, skipped = _choose(session, run_id, spec, traces)
    ref = min(traces)
    per_rank: dict[int, list[dict]] = {}
    for r, colls, _steps in trace_indexes(session, {r: traces[r] for r in {ref, *chosen}}, rule):
        per_rank[r] = [{"key": c["key"], "start_ns": c["start_ns"], "end_ns": c["end_ns"], "kernel": c["kernel"],
                        "kind": c["kind"], "nelems": c.get("nelems")} for c in colls]
    apart = diverging(per_rank)
    offsets = _offsets(per_rank, ref, chosen, len(traces), apart)
    starts = session.execute(select(Trace.rank, Trace.start_ns).where(Trace.id.in_([traces[r] for r in chosen]))).all()
    origin = min((s - offsets[r]["offset_ns"] for r, s in starts if s is not None), default=0)
    plan = ExportPlan(run_id, run.name, chosen, {r: traces[r] for r in chosen}, offsets, origin, skipped=skipped)
    by_key: dict[tuple, dict[int, tuple[int, int, str]]] = defaultdict(dict)
    for r in chosen:
        for c in per_rank[r]:
            if r in apart.get(c["key"], ()):
                plan.stats["collectives_diverging_not_linked"] += 1
                continue
            by_key[c["key"]][r] = (c["start_ns"], c["end_ns"], c["kernel"])
            plan.kinds.setdefault(c["key"], c["kind"])
    for key, parts in by_key.items():
        if len(parts) > 1:
            plan.collectives[key] = parts
            arrive = {r: p[0] - offsets[r]["offset_ns"] for r, p in parts.items()}
            plan.last[key] = max(sorted(arrive), key=lambda r: arrive[r])
    return plan


def _choose(session: Session, run_id: int, spec: str | None, traces: dict[int, int]) -> tuple[list[int], dict]:
    """``(ranks to export, {asked rank of the run without a usable trace: why})``. The run's
    ranks are those with a trace or a ``ranks`` row (records without a trace: a traceless rank).

    Raises:
        UsageError: a bad ``spec``, ranks not in the run, or no asked rank with a usable trace."""
    known = set(traces) | set(session.execute(select(Rank.rank).where(Rank.run_id == run_id)).scalars())
    asked = parse_ranks(spec, known, "are not in this run", "its ranks")  # bad part, or ranks the run lacks
    chosen = [r for r in asked if r in traces]
    skipped: dict[int, str] = {}
    if len(chosen) < len(asked):
        status = defaultdict(list)
        for r, st in session.execute(select(Trace.rank, Trace.status).where(Trace.run_id == run_id)).all():
            status[r].append(st)
        for r in asked:
            if r not in traces:
                skipped[r] = (f"no usable trace (status {', '.join(sorted(set(status[r])))})" if status[r]
                              else "no trace ingested")
    if not chosen:
        raise UsageError(f"none of the asked ranks {rank_spans(asked)} has a usable trace in this run (ranks with "
                         f"one: {rank_spans(sorted(traces))})", missing=asked[:100])
    return chosen, skipped


def _offsets(per_rank: dict[int, list[dict]], ref: int, chosen: list[int], n_traces: int,
             apart: dict[tuple, set[int]] | None = None) -> dict[int, dict]:
    """Per chosen rank, ``align_and_match``'s offset: median of ``end_r - end_ref`` over the
    collectives both hold (NOTE: [Rank clock alignment]), less those where any rank diverges
    (``apart``, :func:`~graphdeck.analysis.traces.collectives.diverging`)."""
    apart = apart or {}
    ref_end = {c["key"]: c["end_ns"] for c in per_rank[ref] if c["key"] not in apart}
    shared = {c["key"] for r, colls in per_rank.items() if r != ref for c in colls if c["key"] in ref_end}
    out = {}
    for r in chosen:
        diffs = [c["end_ns"] - ref_end[c["key"]] for c in per_rank[r] if c["key"] in ref_end] if r != ref else []
        if n_traces == 1:
            out[r] = {"offset_ns": 0, "method": "single rank", "matched": 0}
        elif r == ref or not diffs:
            out[r] = {"offset_ns": 0, "method": "reference" if r == ref else "base_time",
                      "matched": len(shared) if r == ref else len(diffs)}
        else:
            out[r] = {"offset_ns": int(statistics.median(diffs)), "method": "collective_end_median",
                      "matched": len(diffs)}
    return out


def _us(ns: int) -> float | int:
    """ns → µs: an int when whole, else a float that reads back to the same ns."""
    return ns // 1000 if ns % 1000 == 0 else ns / 1000


def _dumps(obj: dict) -> bytes:
    try:
        return orjson.dumps(obj)
    except TypeError:  # an int past 64 bits in stored args
        return json.dumps(obj, default=str, separators=(",", ":")).encode()


def _loads_args(raw: str | None) -> dict:
    if not raw:
        return {}
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        try:
            value = json.loads(raw)
        except ValueError:
            return {"args_json": raw}
    return value if isinstance(value, dict) else {"args": value}


def _node_info(session: Session, graph_ids: set[int],
               frames: dict | None = None) -> dict[tuple[int, str], tuple[str | None, str | None]]:
    """(graph id, node name) → (module path, ``file:line`` of the innermost frame of its stack).
    ``frames``: interned stack id → that ``file:line``, kept across the ranks of one export."""
    if not graph_ids:
        return {}
    frames = {} if frames is None else frames
    stack = InternedString.__table__.alias("st")
    out = {}
    ids = sorted(graph_ids)
    conn = session.connection()
    p = "?" if conn.dialect.paramstyle == "qmark" else "%s"
    for i in range(0, len(ids), 500):
        part = ids[i:i + 500]
        cur = conn.connection.cursor()  # the driver's cursor: no per-row SQLAlchemy work
        try:
            cur.execute("SELECT n.graph_id, n.name, m.value, n.stack_trace_id FROM nodes n LEFT JOIN strings m "
                        "ON m.id = n.module_path_id WHERE n.graph_id IN (" + ",".join([p] * len(part)) + ")", part)
            rows = cur.fetchall()
        finally:
            cur.close()
        new = {sid for *_x, sid in rows if sid is not None and sid not in frames}
        for sid, trace in (session.execute(select(stack.c.id, stack.c.value).where(stack.c.id.in_(sorted(new))))
                           if new else ()):
            found = _FRAME.findall(trace or "")
            frames[sid] = f"{found[-1][0]}:{found[-1][1]}" if found else None
        for gid, name, module, sid in rows:
            out[(gid, name)] = (module, frames.get(sid))
    return out


def _lane_names(meta: dict, lanes: list[tuple[str, str]]) -> dict[tuple[str, str], str]:
    procs = {**(meta.get("process_names") or {}), **(meta.get("process_labels") or {})}
    threads = meta.get("thread_names") or {}
    out = {}
    for pid, tid in lanes:
        proc = procs.get(pid) or f"pid {pid}"
        out[(pid, tid)] = f"{proc} / {threads.get(f'{pid}/{tid}') or f'thread {tid}'}"
    return out


def _lane_key(lane: tuple[str, str]) -> tuple:
    return tuple((0, int(x), "") if x.lstrip("-").isdigit() else (1, 0, x) for x in lane)


def _rows(session: Session, trace_id: int, strings: dict) -> tuple[list[tuple], dict]:
    """The trace's ``X`` events as the driver's rows ``(id, name id, cat id, ts_ns, dur_ns, pid, tid,
    args_json)`` ordered by start (``data.load_events``' order; no correlation: only a
    recomputation of the links reads it, a fifth of the fetch), and ``strings``
    (interned id → value, ``None`` → ``""``; kept across the ranks of one export) holding every name
    and category id of them."""
    conn = session.connection()
    cur = conn.connection.cursor()  # the driver's cursor: no per-row SQLAlchemy work, no string join
    try:
        cur.execute(_ROWS.format(p="?" if conn.dialect.paramstyle == "qmark" else "%s"), (trace_id,))
        rows = cur.fetchall()
    finally:
        cur.close()
    strings.setdefault(None, "")
    need = sorted((set(map(itemgetter(1), rows)) | set(map(itemgetter(2), rows))) - strings.keys())
    for i in range(0, len(need), 500):
        part = need[i:i + 500]
        strings.update(session.execute(select(InternedString.id, InternedString.value)
                                       .where(InternedString.id.in_(part))).all())
    return rows, strings


def _links(session: Session, trace: Trace, rows: list[tuple], strings: dict, plan: ExportPlan):
    """``(by_kernel, comm_label)`` of the trace (NOTE: [Export kernel links]): its links kept at
    ingest plus its communication kernels mapped now (NOTE: [Stored kernel links]), else computed
    from ``rows`` (:func:`_rows`)."""
    ids = list(map(itemgetter(0), rows))
    if plan.states is None:
        plan.states = rank_states(session, plan.run_id)
    got, comm = stored_links(session, trace, len(ids), min(ids, default=None), max(ids, default=None), plan.states)
    if got is not None:
        plan.stats["ranks_links_kept"] += 1
        kernels = [Ev(i, strings[n], strings[c], ts, dur, pid, tid, None, a)  # the collective mapping reads no correlation
                   for i, n, c, ts, dur, pid, tid, a in compress(rows, map(set(comm).__contains__, ids))]
        return with_comm(session, trace, got, kernels)
    del ids
    plan.stats["ranks_links_computed"] += 1
    corr = dict(session.execute(text(_CORRELATIONS), {"tid": trace.id}).all())
    events = [Ev(i, strings[n], strings[c], ts, dur, pid, tid, corr.get(i), a) for i, n, c, ts, dur, pid, tid, a in rows]
    return kernel_links(session, trace.id, events)


def _rank_events(session: Session, plan: ExportPlan, rank: int, rule: CommRule | None,
                 found_at: dict[tuple, dict[int, tuple[int, int]]]) -> Iterator[bytes]:
    """The encoded events of one rank: metadata, slices and instants; where each of its
    collectives' slices is goes into ``found_at`` (key → rank → (aligned start ns, tid))."""
    tid = plan.traces[rank]
    off, origin = plan.offsets[rank]["offset_ns"], plan.origin_ns
    trace = session.get(Trace, tid)
    meta = _loads_args(trace.meta_json)
    with gc_paused():
        rows, strings = _rows(session, tid, plan.strings)  # (id, name id, cat id, ts, dur, pid, tid, args)
        by_kernel, comm_label = _links(session, trace, rows, strings, plan)
    info = _node_info(session, {g for g, _ in by_kernel.values()}, plan.frames)
    instants = session.execute(text(_INSTANTS), {"tid": tid}).all()
    lanes = sorted(set(map(itemgetter(5, 6), rows)) | {(row[4], row[5]) for row in instants}, key=_lane_key)
    lane_tid = {lane: i + 1 for i, lane in enumerate(lanes)}
    names = _lane_names(meta, lanes)
    yield _dumps({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
    yield _dumps({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
    for lane, t in lane_tid.items():
        yield _dumps({"ph": "M", "name": "thread_name", "pid": rank, "tid": t, "args": {"name": names[lane]}})
        yield _dumps({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": t, "args": {"sort_index": t}})
    # start ns -> name -> [(end ns, collective key)]: two collectives of a rank may start on the same
    # ns under the same name (a straggler's jittered starts); each slice takes the key of its own end
    mine: dict[int, dict[str, list[tuple[int, tuple]]]] = defaultdict(lambda: defaultdict(list))
    for key, parts in plan.collectives.items():
        if (p := parts.get(rank)) is not None:
            mine[p[0]][p[2]].append((p[1], key))
    n_mine = sum(len(v) for by_name in mine.values() for v in by_name.values())
    where: dict[tuple, tuple[int, int]] = {}  # collective key -> (aligned start ns, tid) of its slice here
    stats = plan.stats
    special = by_kernel.keys() | {k for k, v in comm_label.items() if v}  # events whose args get more
    # (name id, cat id, pid, tid) -> (b'{"ph":"X","name":...,"ts":', b',"pid":..,"tid":..,"cat":..', lane)
    head: dict[tuple, tuple[bytes, bytes, int]] = {}
    shift = off + origin
    dumps = orjson.dumps
    buf: list[bytes] = []
    append = buf.append
    durs: dict[int, bytes] = {}  # dur ns -> b',"dur":<us>'
    node_extra: dict[tuple, tuple] = {}  # (graph id, *nodes) -> (nn_modules or None, source or None)
    for eid, name_id, cat_id, ts, dur, pid, etid, raw in rows:
        hk = (name_id, cat_id, pid, etid)
        pre = head.get(hk)
        if pre is None:
            t = lane_tid[(pid, etid)]
            cat = strings[cat_id]
            cat = b',"cat":' + dumps(cat) if cat else b""
            pre = head[hk] = (b'{"ph":"X","name":' + dumps(strings[name_id]) + b',"ts":',
                              b',"pid":' + str(rank).encode() + b',"tid":' + str(t).encode() + cat, t)
        if ts in mine and (cands := mine[ts].get(strings[name_id])):
            end = ts + (dur or 0)
            key = next((k for e, k in cands if e == end), None) or next((k for _e, k in cands), None)
            if key is not None:
                where[key] = (ts - off, pre[2])
                cands.remove(next(c for c in cands if c[1] == key))
        if eid not in special and (not raw or (raw[0] == "{" and raw[-1] == "}" and "NaN" not in raw
                                              and "Infinity" not in raw)):
            # No node link to add: the stored args are the ingest's own compact JSON, written as they
            # are (parsing and dumping them was a third of the export's time); NaN/Infinity go the slow way
            tail = b"}" if not raw or raw == "{}" else b',"args":' + raw.encode() + b"}"
        else:
            args = _loads_args(raw)
            got = by_kernel.get(eid)
            label = comm_label.get(eid)
            if got is not None:
                gid, nodes = got
                args["fx_graph"] = gid
                args["fx_nodes"] = nodes
                extra = node_extra.get((gid, *nodes))
                if extra is None:
                    found = [info.get((gid, n), (None, None)) for n in nodes]
                    extra = node_extra[(gid, *nodes)] = ([m for m, _ in found] if any(m for m, _ in found) else None,
                                                         [s for _, s in found] if any(s for _, s in found) else None)
                if extra[0] is not None:
                    args["nn_modules"] = list(extra[0])
                if extra[1] is not None:
                    args["source"] = list(extra[1])
                stats["events_with_nodes"] += 1
            if label:
                args["collective"] = label
            tail = (b',"args":' + _dumps(args) + b"}") if args else b"}"
        ts -= shift
        db = durs.get(dur)
        if db is None:
            db = durs[dur] = b',"dur":' + dumps(dur // 1000 if dur % 1000 == 0 else dur / 1000)
        append(b"".join((pre[0], dumps(ts // 1000 if ts % 1000 == 0 else ts / 1000), db, pre[1], tail)))
        if len(buf) >= 4096:
            yield b",".join(buf)
            buf.clear()
    if buf:
        yield b",".join(buf)
    stats["X"] += len(rows)
    del rows, by_kernel, comm_label
    for _id, name, cat, ts, pid, tid_, raw in instants:
        ev = {"ph": "i", "s": "t", "name": name, "ts": _us(ts - off - origin), "pid": rank, "tid": lane_tid[(pid, tid_)]}
        if cat:
            ev["cat"] = cat
        args = _loads_args(raw)
        if args:
            ev["args"] = args
        stats["i"] += 1
        yield _dumps(ev)
    for key, found in where.items():
        found_at[key][rank] = found
    stats["collective_slices_not_found"] += n_mine - len(where)


def iter_export(session: Session, plan: ExportPlan, rule: CommRule | None = None) -> Iterator[bytes]:
    """The export file's bytes (uncompressed JSON) in chunks of about :data:`CHUNK_BYTES`, rank
    by rank (NOTE: [Trace export]). ``plan.stats`` counts what was written once it is exhausted.

    A collective whose slice is not found on a rank (none in the stored events at its start) is
    counted in ``stats["collective_slices_not_found"]`` and gets no flow there: the flow pairs come
    after every rank's events (:func:`_flow_events`), each ``s`` with its ``f``, never one alone."""
    found_at: dict[tuple, dict[int, tuple[int, int]]] = defaultdict(dict)
    head = {"baseTimeNanoseconds": plan.origin_ns, "displayTimeUnit": "ns"}
    buf = [orjson.dumps(head)[:-1] + b',"traceEvents":[']
    size, first = len(buf[0]), True
    for chunk in (c for rank in plan.ranks for c in _rank_events(session, plan, rank, rule, found_at)):
        if not first:
            buf.append(b",")
        first = False
        buf.append(chunk)
        size += len(chunk) + 1
        if size >= CHUNK_BYTES:
            yield b"".join(buf)
            buf, size = [], 0
    flows = _flow_events(plan, found_at)
    if flows:
        buf.append((b"," if not first else b"") + b",".join(flows))
    tail = {"run": plan.run_name, "run_id": plan.run_id, "ranks": plan.ranks,
            "traces": {str(r): t for r, t in plan.traces.items()}, "origin_ns": str(plan.origin_ns),
            "offsets": {str(r): plan.offsets[r] for r in plan.ranks}, "collectives_linked": len(plan.collectives),
            "collectives_diverging_not_linked": plan.stats.get("collectives_diverging_not_linked", 0),
            "skipped": {str(r): why for r, why in plan.skipped.items()},
            "format": "Chrome Trace Event Format (JSON Object Format), times in us since baseTimeNanoseconds"}
    buf.append(b'],"graphdeck":' + _dumps(tail) + b"}")
    yield b"".join(buf)


def _flow_events(plan: ExportPlan, found_at: dict[tuple, dict[int, tuple[int, int]]]) -> list[bytes]:
    """The flow pairs, written after every rank's events: for each collective, an ``s`` on the
    slice of the rank that arrived last and an ``f`` (``bp: "e"``) on each waiting rank's slice,
    only where both slices were found (else neither; counted in ``stats["flows_unpaired"]``).
    Ids: 1, 2, ... in (collective key, waiting rank) order."""
    out: list[bytes] = []
    stats, origin = plan.stats, plan.origin_ns
    for key in sorted(plan.collectives):
        last, here = plan.last[key], found_at.get(key, {})
        waiting = [r for r in sorted(plan.collectives[key]) if r != last]
        if last not in here:
            stats["flows_unpaired"] += len(waiting)
            continue
        name = f"{plan.kinds.get(key, 'collective')} (group {key[0]}) #{key[-1]}"
        ts_l, t_l = here[last]
        for r in waiting:
            if r not in here:
                stats["flows_unpaired"] += 1
                continue
            fid = stats["flows"] = stats["flows"] + 1
            ts_r, t_r = here[r]
            # The earlier end is the ``s``: Perfetto reads a JSON trace in time order and drops a
            # flow whose ``f`` comes before its ``s`` (the waiting rank's slice starts first).
            ends = sorted([(ts_r, r, t_r), (ts_l, last, t_l)], key=lambda e: (e[0], e[1] != r))
            for ph, (ts, pid, tid) in zip(("s", "f"), ends):
                ev = {"name": name, "cat": "collective", "pid": pid, "tid": tid, "ts": _us(ts - origin), "ph": ph,
                      "id": fid, "args": {"last_rank": last, "waiting_rank": r}}
                if ph == "f":
                    ev["bp"] = "e"
                out.append(_dumps(ev))
    return out


def export_trace(session: Session, run_id: int, out, ranks: str | list[int] | None = None,
                 rule: CommRule | None = None) -> dict:
    """Write the export of run ``run_id`` (``ranks``: all, or ``"0,2-5"``) to ``out`` (a path:
    gzip when it ends in ``.gz``; or a binary file object). Returns ``{"ranks", "offsets",
    "origin_ns", "collectives_linked", "bytes" (uncompressed), "X", "i", "flows",
    "events_with_nodes", "collective_slices_not_found", "ranks_links_kept" (ranks whose kernel
    links were kept at ingest), "ranks_links_computed" (ranks whose links were computed from the
    events: NOTE: [Stored kernel links])}``.

    Raises:
        NotFoundError, UsageError: see :func:`plan_export`.
    """
    from pathlib import Path

    plan = plan_export(session, run_id, ranks, rule)
    total = 0
    if isinstance(out, (str, Path)):
        path = Path(out)
        if path.suffix == ".gz":
            try:
                from isal import igzip as gz
            except ImportError:  # pragma: no cover - isal is a dependency
                import gzip as gz
            fh = gz.open(path, "wb", compresslevel=1)  # ISA-L level 1: ~3x level 3, +5% size
        else:
            fh = open(path, "wb")
        with fh:
            for chunk in iter_export(session, plan, rule):
                fh.write(chunk)
                total += len(chunk)
    else:
        for chunk in iter_export(session, plan, rule):
            out.write(chunk)
            total += len(chunk)
    return {"ranks": plan.ranks, "skipped": plan.skipped, "offsets": plan.offsets, "origin_ns": plan.origin_ns,
            "collectives_linked": len(plan.collectives), "bytes": total,
            **{k: plan.stats.get(k, 0) for k in ("X", "i", "flows", "flows_unpaired", "events_with_nodes",
                                                   "collective_slices_not_found", "collectives_diverging_not_linked",
                                                   "ranks_links_kept", "ranks_links_computed")}}

