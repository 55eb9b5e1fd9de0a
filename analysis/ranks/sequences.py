"""Per-rank compile sequences, read for many ranks at once, and the device-neutral re-hash of
graphs (NOTE: [Rank-local device indices]) — the inputs of
:func:`graphdeck.analysis.ranks.core.rank_report`.

A rank's **compile sequence** is every compile id in order (from the captured or imported graphs
and the ``compilation_metrics`` records), each with the structural hash of each of its graphs,
its failure and its recompile reason. Only the few fields the sequence needs leave SQLite (a
``compilation_metrics`` record's metadata is ~40 KB of configs and stack traces).

Pure: reads the store, returns data; importable from :mod:`graphdeck.analysis.ranks.core` as before.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import NamedTuple

from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.ranks.records import CompileEntry, _json
from graphdeck.store.schema import CompileEvent, Graph, Node

# NOTE: [Rank-local device indices]
# On a multi-GPU job each rank computes on its own device: rank 1's graphs say
# ``device(type='cuda', index=1)`` where rank 0's say ``index=0`` (``torch.arange(...,
# device=...)``, factory kwargs, tensor metadata), so their structural hashes differ though the
# graphs are the same program. Graphs whose hash is not shared by every rank are re-hashed from
# their stored nodes with device indices removed; only those graphs are read again.
_DEVICE_INDEX = re.compile(r"\b(cuda|xpu|hpu|npu|mtia|privateuseone):\d+")
_DEVICE_REPR_INDEX = re.compile(r"(device\(type='\w+'), index=\d+\)")


_DEVICE_MARKS = ("index=", "cuda:", "xpu:", "hpu:", "npu:", "mtia:", "privateuseone:")


def _device_neutral(text: str | None) -> str:
    """``"cuda:1"`` → ``"cuda"``, ``device(type='cuda', index=1)`` → ``device(type='cuda')``."""
    if not text or not any(m in text for m in _DEVICE_MARKS):  # no device index (most arguments)
        return text or ""
    return _DEVICE_REPR_INDEX.sub(r"\1)", _DEVICE_INDEX.sub(r"\1", text))


class NodeKeys:
    """The nodes of graphs as the neutral re-hashes read them — per graph, in node order,
    ``(op, target id, shape JSON, dtype, stride JSON, arguments JSON with device indices
    removed)`` — read in batches of 500 graphs and kept for one report, so a graph re-hashed by
    two passes (NOTE: [Rank-local device indices], NOTE: [Process group names in graphs]) is read
    once, and 1,024 ranks' graphs are a few queries, not one per graph."""

    def __init__(self, session: Session):
        self.session = session
        self._rows: dict[int, list[tuple]] = {}
        self._neutral: dict[str | None, str] = {}  # arguments JSON -> device neutral (repeats across graphs)
        self.memo: dict = {}  # for the passes' own per-argument results (ranks/mesh.py)

    def read(self, graph_ids) -> None:
        """Read the graphs of ``graph_ids`` not read yet."""
        todo = sorted({g for g in graph_ids if g not in self._rows})
        for start in range(0, len(todo), 500):
            chunk = todo[start:start + 500]
            got: dict[int, list[tuple]] = {g: [] for g in chunk}
            neutral = self._neutral
            for gid, op, target_id, shape, dtype, stride, args in self.session.connection().execute(
                    select(Node.graph_id, Node.op, Node.target_id, Node.shape_json, Node.dtype, Node.stride_json,
                           Node.args_json).where(Node.graph_id.in_(chunk)).order_by(Node.graph_id, Node.idx)):
                if args not in neutral:
                    neutral[args] = _device_neutral(args)
                got[gid].append((op, target_id if op != "placeholder" else "", shape, dtype, stride, neutral[args]))
            self._rows.update(got)

    def __getitem__(self, graph_id: int) -> list[tuple]:
        if graph_id not in self._rows:
            self.read([graph_id])
        return self._rows[graph_id]


def _device_neutral_hash(session: Session, graph_id: int, keys: NodeKeys | None = None) -> str:
    import hashlib

    h = hashlib.sha256()
    for op, target, shape, dtype, stride, args in (keys or NodeKeys(session))[graph_id]:
        h.update(f"{op}|{target}|{shape}|{dtype}|{stride}|{args};".encode())
    return "dn:" + h.hexdigest()[:32]


def _neutralise_device_indices(session: Session, sequences: dict[int, list[CompileEntry]],
                               keys: NodeKeys | None = None) -> None:
    """Re-hash, device indices removed, the graphs whose hash some rank lacks (NOTE: [Rank-local
    device indices]); a graph equal up to its device index then compares equal. ``keys``: the
    report's node cache (one is made when None)."""
    if len(sequences) < 2:
        return
    keys = keys or NodeKeys(session)
    holders: dict[str | None, set[int]] = defaultdict(set)
    for r, seq in sequences.items():
        for e in seq:
            for _k, h, _gid in e.graphs:
                holders[h].add(r)
    n = len(sequences)
    lacking = {h for h, rs in holders.items() if len(rs) < n}
    if not lacking:
        return
    # One structural hash: the same nodes, re-hashed once (from its first graph).
    rep: dict[str, int] = {}
    plain: list[int] = []
    for seq in sequences.values():
        for e in seq:
            for _k, h, gid in e.graphs:
                if h is None and None in lacking:
                    plain.append(gid)
                elif h is not None and h in lacking:
                    rep.setdefault(h, gid)
    keys.read([*rep.values(), *plain])
    cache = {h: _device_neutral_hash(session, gid, keys) for h, gid in rep.items()}
    for seq in sequences.values():
        for e in seq:
            if any(h in lacking for _k, h, _gid in e.graphs):
                e.graphs = [(k, (cache[h] if h is not None else _device_neutral_hash(session, gid, keys))
                             if h in lacking else h, gid) for k, h, gid in e.graphs]


def compile_sequence(session: Session, run_id: int, rank: int) -> list[CompileEntry]:
    """Every compile id of ``rank`` in order of first appearance, with its graphs and outcome."""
    return compile_sequences(session, run_id, [rank])[rank]


def compile_sequences(session: Session, run_id: int, ranks: list[int],
                      metric_records: dict[int, list[tuple]] | None = None) -> dict[int, list[CompileEntry]]:
    """:func:`compile_sequence` of each of ``ranks``, read with two queries for all of them (a
    1,024-rank run is not 2,048 round trips). Only compile records with a compile id are read, and
    only the fields and payload the sequence uses (``compilation_metrics``' failure, frame name
    and recompile reason; ``recompile_reasons``'). ``metric_records`` (a dict): filled, in the
    same read, with every rank's compile-time records as
    :func:`graphdeck.analysis.ranks.compile_skew.compile_skew` takes them (``records``), so the run's
    ~40 KB compile records are read once for both."""
    want = set(ranks)
    graphs: dict[int, list] = defaultdict(list)
    rank_filter = Graph.rank.in_(ranks) if len(want) <= 500 else Graph.rank.is_not(None)
    for g in session.execute(
            select(Graph.rank, Graph.id, Graph.ordinal, Graph.kind, Graph.compile_id, Graph.structural_hash,
                   Graph.frame_name).where(Graph.run_id == run_id, rank_filter).order_by(Graph.rank, Graph.ordinal)):
        if g.rank in want:
            graphs[g.rank].append(g)
    events = _read_events(session, run_id, ranks, metric_records)
    return {r: _sequence_of(graphs.get(r, []), events.get(r, [])) for r in ranks}


#: The ``compilation_metrics`` fields a compile sequence reads (:func:`_sequence_of`).
_SEQUENCE_FIELDS = ("fail_type", "fail_reason", "co_name", "recompile_reason")


class _Event(NamedTuple):
    id: int
    name: str
    compile_id: str | None
    fields: list | None  # _SEQUENCE_FIELDS' values (compilation_metrics), else None
    payload: str | None  # recompile_reasons' payload, else None


def _read_events(session: Session, run_id: int, ranks: list[int],
                 metric_records: dict[int, list[tuple]] | None) -> dict[int, list[_Event]]:
    """rank → its compile records with a compile id, in id order (:class:`_Event`); with
    ``metric_records``, also every rank's :data:`~graphdeck.analysis.ranks.compile_skew.METRIC_EVENTS`
    records into it (one read of the metadata for both)."""
    from sqlalchemy import case, or_

    from graphdeck.analysis.ranks.compile_skew import (
        METRIC_EVENTS,
        METRIC_FIELDS,
        field_values,
        fields_sql,
        is_sqlite,
        raw_fields,
    )

    want = set(ranks)
    skew = metric_records is not None
    fields = (*METRIC_FIELDS, *_SEQUENCE_FIELDS) if skew else _SEQUENCE_FIELDS
    metric_names = METRIC_EVENTS if skew else ("compilation_metrics",)
    where = [CompileEvent.run_id == run_id]
    where.append(or_(CompileEvent.compile_id.is_not(None), CompileEvent.name.in_(METRIC_EVENTS)) if skew
                 else CompileEvent.compile_id.is_not(None))
    if not skew and len(want) <= 500:
        where.append(CompileEvent.rank.in_(ranks))
    sqlite = is_sqlite(session)
    rows = session.connection().execute(
        select(CompileEvent.rank, CompileEvent.id, CompileEvent.name, CompileEvent.compile_id,
               case((CompileEvent.name.in_(metric_names), fields_sql(fields, sqlite)), else_=None),
               CompileEvent.metadata_json.is_not(None),
               case((CompileEvent.name == "recompile_reasons", CompileEvent.payload), else_=None))
        .where(*where).order_by(CompileEvent.rank, CompileEvent.id)).all()
    # Metadata SQLite does not take as JSON (a NaN, say): Python's json reads it (rare).
    unread = [(row_id, name) for _r, row_id, name, _c, text, present, _p in rows
              if text is None and present and name in metric_names]
    fallback = raw_fields(session, unread, fields) if unread and sqlite else {}
    events: dict[int, list[_Event]] = defaultdict(list)
    n = len(METRIC_FIELDS) if skew else 0
    for rank, row_id, name, cid, text, _present, payload in rows:
        values = field_values(name, text, fields, sqlite) if text else fallback.get(row_id)
        if cid is not None and rank in want:
            events[rank].append(_Event(row_id, name, cid, values[n:] if values and name == "compilation_metrics"
                                       else None, payload))
        if skew and name in METRIC_EVENTS:
            metric_records.setdefault(rank, []).append((name, cid, (name, text) if text else ("row", row_id),
                                                        values[:n] if values else None))
    return events


def _sequence_of(graphs: list, events: list) -> list[CompileEntry]:
    """One rank's compile sequence from its graph rows (by ordinal) and compile records (by id)."""
    entries: dict[str, CompileEntry] = {}
    order: list[tuple[int, int, str]] = []  # (source order, tie, compile id) — graphs by ordinal

    def entry(cid: str, pos: tuple[int, int]) -> CompileEntry:
        if cid not in entries:
            entries[cid] = CompileEntry(compile_id=cid, graphs=[])
            order.append((*pos, cid))
        return entries[cid]

    # Compile ids in log order: compile records first appear before their graphs in both capture
    # and import, but a store may hold graphs only; order by the earliest mention of either kind.
    first_event: dict[str, int] = {}
    for ev in events:
        if ev.compile_id is not None:
            first_event.setdefault(ev.compile_id, ev.id)
    for g in graphs:
        cid = g.compile_id or f"graph{g.ordinal}"
        e = entry(cid, (0, g.ordinal))
        e.graphs.append((g.kind, g.structural_hash, g.id))
        e.frame = e.frame or g.frame_name
    for ev in events:
        if ev.compile_id is None:
            continue
        e = entry(ev.compile_id, (1, ev.id))
        if ev.name == "compilation_metrics":
            # Records keep torch's envelope: {"compilation_metrics": {...fields}}; bare fields are
            # read too (_read_events extracted them).
            meta = dict(zip(_SEQUENCE_FIELDS, ev.fields)) if ev.fields else {}
            if meta.get("fail_type"):
                e.failed = f"{meta.get('fail_type')}: {meta.get('fail_reason') or ''}".strip().rstrip(":")
            e.frame = e.frame or meta.get("co_name")
            reasons = meta.get("recompile_reason")
            if reasons and not e.recompile_reason:
                e.recompile_reason = str(reasons).strip()
        elif ev.name == "recompile_reasons" and not e.recompile_reason:
            payload = _json(ev.payload) if ev.payload else None
            e.recompile_reason = ("; ".join(str(x).strip() for x in payload) if isinstance(payload, list)
                                  else (ev.payload or "").strip() or None)
    return [entries[cid] for cid in sorted(entries, key=lambda c: _compile_order(c, first_event, entries))]


def _compile_order(cid: str, first_event: dict[str, int], entries: dict[str, CompileEntry]) -> tuple:
    """Sort key: frame id, then compile number, then attempt (``"[!]f/c[_a]"``, compiled autograd
    prefix kept), so ranks that logged records in a different interleaving still line up."""
    nums = [int(x) for x in re.findall(r"\d+", cid)]
    return (0 if nums else 1, nums, first_event.get(cid, 0), cid)
