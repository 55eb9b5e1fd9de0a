"""The collective schedule each rank is predicted to issue, from its compiled graphs and the
capture's records (NOTE: [Recompiles replace graphs]), and the first position where ranks'
schedules disagree (a predicted hang) — for :func:`graphdeck.analysis.ranks.core.rank_report`.

Per rank: the collectives of the graphs that run in steady state, in order — per frame its
live compiles (NOTE: [Live compiles] in :mod:`graphdeck.analysis.ranks.frame_compiles`); each collective
names its compile id — (functional collectives ``_c10d_functional.*`` and ``torch.distributed``
calls: kind, process group, output bytes), Inductor's ``inductor_collective_schedule`` where it
was imported, and DDP's bucket all-reduces / FSDP2's group collectives as the capture recorded
them. Graphs with one stored structural hash issue the same collectives, so each distinct graph's
collective nodes are read once for every rank (a few queries for a 1,024-rank run).

Pure: reads the store, returns data; importable from :mod:`graphdeck.analysis.ranks.core` as before.
"""

from __future__ import annotations

import functools
import re
from collections import defaultdict
from dataclasses import asdict

from sqlalchemy import select
from sqlalchemy.orm import Session, aliased

from graphdeck.analysis.gradients.cuts import frames
from graphdeck.analysis.ranks.records import Collective, CollectiveMismatch, CompileEntry, _json, _ranks_phrase
from graphdeck.store.schema import CompileEvent, Graph, InternedString, Node, Partition

#: Graph kinds that run (their collectives execute), best first per compile id. A compile whose
#: AOTAutograd graphs were captured is read from those; otherwise from the next tier.
EXECUTED_TIERS: tuple[tuple[str, ...], ...] = (
    ("aot_forward", "aot_backward", "aot_inference"),
    ("inductor_post_grad",),
    ("ddp_partition",),
    ("dynamo",),
)

#: Collective ops by the last component of their target (``_c10d_functional.all_reduce.default``,
#: ``torch.distributed.all_reduce``, ``funcol.all_gather_tensor`` ...). ``wait_tensor`` is not a
#: collective of its own and is left out of the schedule.
COLLECTIVE_KINDS: tuple[str, ...] = (
    "all_reduce", "all_reduce_coalesced", "all_gather_into_tensor", "all_gather_into_tensor_coalesced",
    "all_gather_tensor", "all_gather", "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced",
    "reduce_scatter", "all_to_all_single", "all_to_all", "broadcast", "reduce", "scatter", "gather",
    "send", "recv", "isend", "irecv", "barrier", "permute_tensor",
)
_COLLECTIVE_RE = re.compile(
    r"(?:^|\.)(" + "|".join(sorted(COLLECTIVE_KINDS, key=len, reverse=True)) + r")(?:_?)(?:\.default|\.\w+)?$")
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "torch.distributed", "_functional_collectives", "funcol")


@functools.lru_cache(maxsize=65536)
def source_line(stack_trace: str | None) -> str | None:
    """``file:line in fn`` of the innermost frame of an FX ``stack_trace`` (user code), or None."""
    fr = frames(stack_trace)
    if not fr:
        return None
    path, line, fn = fr[-1]
    return f"{path}:{line} in {fn}" if fn else f"{path}:{line}"


def collective_kind(target: str) -> str | None:
    """``all_reduce`` for ``_c10d_functional.all_reduce.default`` and friends; None otherwise."""
    if not any(ns in target for ns in _COLLECTIVE_NAMESPACES):
        return None
    m = _COLLECTIVE_RE.search(target)
    return m.group(1) if m else None


@functools.lru_cache(maxsize=65536)
def group_of(args_json: str | None) -> str | None:
    """The process group of a collective call: its last string argument (``group_name``), or a
    ``ProcessGroup``/rank-list repr."""
    payload = _json(args_json)
    args = payload.get("args", []) if isinstance(payload, dict) else []
    kwargs = payload.get("kwargs", {}) if isinstance(payload, dict) else {}
    for key in ("group_name", "group", "tag"):
        if isinstance(kwargs.get(key), (str, int)):
            return str(kwargs[key])
    for a in reversed(args):
        if isinstance(a, str):
            return a
        if isinstance(a, dict) and "repr" in a and "ProcessGroup" in a["repr"]:
            return re.sub(r" at 0x[0-9a-f]+", "", a["repr"])
    return None


def collective_target_ids(session: Session) -> dict[int, str]:
    """Interned-string id → collective kind, for every stored op target that is a collective."""
    rows = session.execute(select(InternedString.id, InternedString.value).where(
        InternedString.value.like("%c10d%") | InternedString.value.like("%distributed%")
        | InternedString.value.like("%funcol%") | InternedString.value.like("%functional_collectives%")))
    out = {}
    for sid, value in rows:
        if len(value) < 200 and "\n" not in value:
            kind = collective_kind(value)
            if kind is not None:
                out[sid] = kind
    return out


_STACK = aliased(InternedString)


def collective_schedules(session: Session, run_id: int, sequences: dict[int, list[CompileEntry]],
                         cache: dict | None = None, at_step: int | None = None,
                         steps: dict[int, dict[str, int]] | None = None) -> dict[int, list[Collective]]:
    """Collectives each rank of ``sequences`` (rank → its compile sequence) issues, in compile order
    then graph order (see :data:`EXECUTED_TIERS`), then Inductor's imported schedules for compiles
    without graphs, then the data-parallel collectives: DDP's reducer buckets and FSDP2's groups as
    the capture recorded them (else DDPOptimizer's graph buckets, for stores without that record).
    ``cache``: a dict shared by the calls of one report (the collective target ids; each stored
    structural hash's collective nodes, read once for all ranks). The graphs' collective nodes
    are read in a few queries for all ranks: one representative graph per stored structural hash
    (graphs with one hash issue the same collectives). With ``at_step`` and ``steps`` (rank →
    compile id → its compile step): each rank's graphs live at that step (NOTE: [Compiles live at
    a step] in analysis/ranks/predicted.py), not its steady state."""
    cache = {} if cache is None else cache
    steps = steps or {}
    if "target_ids" not in cache:
        _fill_schedule_cache(session, run_id, cache)
    target_ids, stored_hash, cached_rows = cache["target_ids"], cache["stored_hash"], cache["rows"]
    from graphdeck.analysis.ranks.predicted import live_compiles  # NOTE: [Live compiles]

    plans: dict[int, tuple] = {}
    rep_of: dict[int, int] = {}  # graph id -> the graph whose collective rows stand for it
    first_with_hash: dict[str, int] = {}
    for rank, sequence in sequences.items():
        inductor = cache["inductor"].get(rank, {})
        chosen: list[tuple[CompileEntry, list[int]]] = []
        at = {"at_step": at_step, "steps": steps.get(rank)} if at_step is not None else {}
        for entry in live_compiles(session, run_id, rank, sequence, {cid for cid, p in inductor.items() if p},
                                   **at)[0]:
            graph_ids: list[int] = []
            for tier in EXECUTED_TIERS:
                graph_ids = [gid for kind, _h, gid in entry.graphs if kind in tier]
                if graph_ids:
                    break
            chosen.append((entry, graph_ids))
            for gid in graph_ids:
                # The stored hash (a report's sequences may hold neutralised ones: graphs equal up
                # to a device index or a process group name, whose collectives still differ there).
                h = stored_hash.get(gid) or next((h for _k, h, g in entry.graphs if g == gid), None)
                rep_of[gid] = first_with_hash.setdefault(h, gid) if h else gid
        plans[rank] = (sequence, inductor, chosen)
    by_graph: dict[int, list] = {}
    for rep in set(rep_of.values()):
        if stored_hash.get(rep) in cached_rows:
            by_graph[rep] = cached_rows[stored_hash[rep]]
    reps = sorted(set(rep_of.values()) - set(by_graph))
    if target_ids and reps:
        for chunk_start in range(0, len(reps), 500):
            chunk = reps[chunk_start:chunk_start + 500]
            for row in session.execute(
                    select(Node.graph_id, Node.idx, Node.name, Node.target_id, Node.shape_json, Node.dtype,
                           Node.size_bytes, Node.args_json, _STACK.value)
                    .outerjoin(_STACK, _STACK.id == Node.stack_trace_id)
                    .where(Node.graph_id.in_(chunk), Node.op == "call_function",
                           Node.target_id.in_(list(target_ids)))):
                by_graph.setdefault(row.graph_id, []).append(row)
        for rows in by_graph.values():
            rows.sort(key=lambda r: r.idx)
        for rep in reps:
            if stored_hash.get(rep):
                cached_rows[stored_hash[rep]] = by_graph.get(rep, [])
    return {rank: _schedule_of(cache, rank, *plans[rank], by_graph, rep_of) for rank in sequences}


def _schedule_of(cache: dict, rank: int, sequence: list[CompileEntry], inductor: dict,
                 chosen: list[tuple[CompileEntry, list[int]]], by_graph: dict[int, list],
                 rep_of: dict[int, int]) -> list[Collective]:
    target_ids = cache["target_ids"]
    out: list[Collective] = []
    for entry, graph_ids in chosen:
        from_graph = [
            Collective(index=0, kind=target_ids[row.target_id], group=group_of(row.args_json),
                       size_bytes=row.size_bytes, shape=row.shape_json, dtype=row.dtype, source="graph",
                       compile_id=entry.compile_id, graph_id=gid, node=row.name, line=source_line(row[8]))
            for gid in graph_ids for row in by_graph.get(rep_of.get(gid, gid), ())]
        ops = _json(inductor.get(entry.compile_id)) if inductor.get(entry.compile_id) else None
        if isinstance(ops, list) and ops:
            # Inductor's schedule is the order its generated code issues collectives (it may
            # reorder the graph's); each op takes size and group from the first unused graph node
            # of the same kind, when the graph was stored.
            pool = list(from_graph)
            for op in ops:
                kind = collective_kind(str(op))
                if kind is None:  # wait_tensor and other non-collectives
                    continue
                match = next((c for c in pool if c.kind == kind.rstrip("_")), None)
                if match is not None:
                    pool.remove(match)
                    match.source = "inductor_collective_schedule"
                    out.append(match)
                else:
                    out.append(Collective(index=0, kind=kind.rstrip("_"), group=None, size_bytes=None, shape=None,
                                          dtype=None, source="inductor_collective_schedule",
                                          compile_id=entry.compile_id))
        else:
            out.extend(from_graph)
    record = cache["records"].get(rank) or {}
    if record.get("ddp") or record.get("fsdp"):
        out += _recorded_collectives(record)
    else:  # no record of the reducer (an older capture): DDPOptimizer's graph buckets stand in
        replaced = {gid for e in sequence for _k, _h, gid in e.graphs} - {gid for e, _ids in chosen
                                                                           for _k, _h, gid in e.graphs}
        for p in cache["partitions"].get(rank, []):
            if p.parent_graph_id in replaced:  # a graph a recompile replaced: its buckets do not run
                continue
            out.append(Collective(index=len(out), kind="all_reduce", group="ddp", size_bytes=p.size_bytes,
                                  shape=None, dtype=None, source="ddp_bucket", graph_id=p.graph_id,
                                  node=f"DDPOptimizer split {p.index} ({len(_json(p.params_json) or [])} params; "
                                       "stands in for the reducer's bucket)"))
    for i, c in enumerate(out):
        c.index = i
    return out


def _fill_schedule_cache(session: Session, run_id: int, cache: dict) -> None:
    """What :func:`collective_schedules` reads per rank, read once for every rank of the run: the
    collective target ids, each graph's stored hash, Inductor's imported collective schedules,
    the newest readable ``graphdeck_comm_groups`` record of each rank (as
    :func:`graphdeck.analysis.traces.comm_map.load_record` reads it) and DDPOptimizer's partitions."""
    from graphdeck.analysis.traces.comm_map import EVENT_NAME as COMM_GROUPS

    cache["target_ids"] = collective_target_ids(session)
    cache["stored_hash"] = dict(session.execute(select(Graph.id, Graph.structural_hash)
                                                .where(Graph.run_id == run_id)).all())
    cache["rows"] = {}  # stored structural hash -> collective node rows (same hash: same nodes)
    cache["inductor"] = defaultdict(dict)
    cache["records"] = {}
    for rank, name, cid, payload in session.execute(
            select(CompileEvent.rank, CompileEvent.name, CompileEvent.compile_id, CompileEvent.payload)
            .where(CompileEvent.run_id == run_id,
                   CompileEvent.name.in_(["inductor_collective_schedule", COMM_GROUPS]))
            .order_by(CompileEvent.id)):
        if name == COMM_GROUPS:  # the newest row wins, readable or not (load_record's rule)
            data = _json(payload)
            cache["records"][rank] = data if isinstance(data, dict) and payload else None
        else:
            cache["inductor"][rank][cid] = payload
    cache["partitions"] = defaultdict(list)
    for p in session.scalars(select(Partition).where(Partition.run_id == run_id)
                             .order_by(Partition.rank, Partition.parent_graph_id, Partition.index)):
        cache["partitions"][p.rank].append(p)


def frame_of(compile_id: str | None) -> str | None:
    """The frame a compile id belongs to: ``"1"`` for ``"1/0"``, ``"1/2_1"``; ``"!0:1"`` for
    compiled autograd's ``"!0/1/0"``; None for a compile without an id."""
    if not compile_id or "/" not in compile_id:
        return None
    return compile_id.rsplit("/", 1)[0]


def steady_state(sequence: list[CompileEntry], scheduled: frozenset[str] | set[str] = frozenset()
                 ) -> list[CompileEntry]:
    """The compiles whose graphs run in steady state (NOTE: [Recompiles replace graphs]): per
    frame, its latest compile that did not fail and has graphs (or, in ``scheduled``, an imported
    Inductor collective schedule), at the place of the frame's first compile."""
    latest: dict[str, CompileEntry] = {}
    for e in sequence:
        f = frame_of(e.compile_id)
        if f is not None and e.failed is None and (e.graphs or e.compile_id in scheduled):
            latest[f] = e
    return at_first_compile(sequence, {f: [e] for f, e in latest.items()})


def at_first_compile(sequence: list, chosen: dict[str, list]) -> list:
    """``sequence`` with each frame's compiles replaced by ``chosen[frame]`` at the place of the
    frame's first compile (a frame not in ``chosen`` left out; entries without a frame id kept)."""
    out, seen = [], set()
    for e in sequence:
        f = frame_of(e.compile_id)
        if f is None:
            out.append(e)
        elif f not in seen and f in chosen:
            seen.add(f)
            out.extend(chosen[f])
    return out


# NOTE: [Recompiles replace graphs]
# (Which older compiles still run — replaced, live, or uncertain — is NOTE: [Live compiles] in
# analysis/ranks/frame_compiles.py; the rule below is its default when a recompile supersedes a graph.)
# A frame compiled again on a rank (compile ids F/0, F/1, ...) runs the graph of its latest
# compile from then on; the earlier graph is not run again (a guard that fails once keeps failing
# for the inputs of the steady state), so it does not add collectives. The predicted schedule
# takes each frame's latest compile that produced graphs (a failed compile ran nothing), in the
# order of the frames' first compiles; each predicted collective names its compile id, so the
# report says which compile a segment comes from. A rank that recompiled into a graph with the
# same collectives agrees with the ranks that did not; one whose new graph lacks a collective is
# a predicted hang at that collective.


def schedule_segments(schedule: list[Collective]) -> list[dict]:
    """Consecutive runs of one source: ``{"compile_id", "source", "first", "count"}``."""
    out: list[dict] = []
    for c in schedule:
        key = (c.compile_id, c.source if c.compile_id is None else "graph")
        if out and (out[-1]["compile_id"], out[-1]["_key"]) == key:
            out[-1]["count"] += 1
            continue
        out.append({"compile_id": c.compile_id, "source": c.source, "_key": key[1], "first": c.index, "count": 1})
    for seg in out:
        seg.pop("_key")
    return out


def _recorded_collectives(record: dict) -> list[Collective]:
    """The data-parallel collectives of one training step from the capture's record of DDP's
    reducer buckets and FSDP2's groups (NOTE: [Communication groups]): each DDP bucket's
    all-reduce in bucket order; each FSDP2 group's all-gather in forward order, then its
    reduce-scatter in reverse (backward) order."""
    out: list[Collective] = []
    for ddp in record.get("ddp") or []:
        for b in ddp.get("buckets") or []:
            out.append(Collective(index=0, kind="all_reduce", group="ddp", size_bytes=b.get("size_bytes"), shape=None,
                                  dtype=None, source="ddp_bucket",
                                  node=f"DDP reducer bucket {b.get('index')} ({len(b.get('params') or [])} params)"))
    groups = record.get("fsdp") or []
    for kind, ordered in (("all_gather", groups), ("reduce_scatter", groups[::-1])):
        for g in ordered:
            out.append(Collective(index=0, kind=kind, group="fsdp", size_bytes=g.get("all_gather_bytes"), shape=None,
                                  dtype=None, source="fsdp_group",
                                  node=f"FSDP2 group {g.get('module') or '(root)'} ({len(g.get('params') or [])} params)"))
    return out


def _schedule_mismatch(schedules: dict[int, list[Collective]]) -> CollectiveMismatch | None:
    if len(schedules) < 2:
        return None
    longest = max(len(s) for s in schedules.values())
    for i in range(longest):
        variants: dict[tuple | None, list[int]] = defaultdict(list)
        for r, sch in schedules.items():
            variants[sch[i].signature() if i < len(sch) else None].append(r)
        if len(variants) == 1:
            continue
        ordered = sorted(variants.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
        described = []
        for sig, rs in ordered:
            c = schedules[rs[0]][i] if sig is not None else None
            described.append({"ranks": sorted(rs), "collective": asdict(c) if c else None})
        world = sorted(schedules)
        text = "; ".join(
            f"{_ranks_phrase(d['ranks'], world)}: "
            + (Collective(**d['collective']).describe() if d["collective"] else "no collective (schedule ended)")
            for d in described)
        # NOTE: numbering — ``i`` counts the collectives of one step as predicted from the compile-time
        # records (graph collectives, DDP buckets, FSDP2 groups), not the traces' per-group sequence
        # numbers; core._timing_findings adds the traces' number when a trace shows the same ranks diverging.
        return CollectiveMismatch(index=i, variants=described,
                                  message=f"collective #{i} of the predicted step differs by rank — {text}; "
                                          "the job would hang here")
    return None
