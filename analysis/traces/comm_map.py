"""Communication kernels → graph nodes: a DDP all-reduce or an FSDP2 all-gather / reduce-scatter
is tied to the nodes that produce or read the parameters it carries.

# NOTE: [Collectives to graph nodes]
The capture records which parameters each DDP bucket and each FSDP2 group carries
(:mod:`graphdeck.capture.comm_groups`, NOTE: [Communication groups]). A communication kernel of
a trace (per :class:`~graphdeck.analysis.traces.analyze.CommRule`) names its collective and its
element counts (Kineto's ``args["Collective name"]``, ``"In msg nelems"``, ``"Out msg nelems"``,
``"dtype"``, PyTorch >= 2.1 on NCCL kernels). It is matched to a group by kind and exact size:

- all-reduce, ``In msg nelems`` = a DDP bucket's element count → the bucket's gradients: the
  ``grad`` outputs of the rank's ``aot_backward`` graphs for those parameters;
- reduce-scatter, ``In msg nelems`` = an FSDP2 group's padded element count → the same gradient
  outputs of the group's parameters;
- all-gather, ``Out msg nelems`` = an FSDP2 group's padded element count (or its byte count when
  the kernel's dtype is a byte type) → the placeholders of the rank's ``aot_forward`` graphs that
  read those parameters (one block graph bound to many blocks reads each block's parameters
  through the same placeholders, so every block's all-gather lands on them).

Several groups of one size (twelve identical blocks, equal buckets) are taken in turn: the k-th
kernel of that kind and size takes the (k mod n)-th group in recorded order (DDP reduces its
buckets in index order). Within a kernel the time is split over its nodes in proportion to the
parameters' element counts; parameters no graph reads or produces (run eagerly) keep their share
unmapped, so mapped and unmapped time still add up to the kernel's duration.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, replace

from sqlalchemy import text
from sqlalchemy.orm import Session

from graphdeck.analysis.traces.data import Ev

EVENT_NAME = "graphdeck_comm_groups"  # the capture's record (graphdeck.capture.comm_groups)
_BYTE_DTYPES = {"byte", "char", "uint8", "int8"}


@dataclass(frozen=True)
class CommGroup:
    """One DDP bucket or FSDP2 group: ``source`` (``comm_ddp_bucket`` / ``comm_fsdp_group``),
    ``label`` (``DDP reducer bucket <index>``: DDP's own gradient bucket, not DDPOptimizer's graph
    split of the same name; ``FSDP2 group <module path>``), ``params`` (fqns), the element counts it is matched
    by per collective kind (``sizes``: kind → elements), and ``byte_size`` for byte all-gathers."""

    source: str
    label: str
    params: tuple[str, ...]
    sizes: tuple[tuple[str, int], ...]
    byte_size: int | None = None


def collective_kind(kernel_name: str, args: dict) -> str | None:
    """``all_reduce`` / ``all_gather`` / ``reduce_scatter`` from the collective's name (args) or
    the NCCL kernel's name, else None."""
    for text_ in (str(args.get("Collective name") or ""), kernel_name):
        t = text_.lower().replace("_", "")
        if "reducescatter" in t:
            return "reduce_scatter"
        if "allgather" in t:
            return "all_gather"
        if "allreduce" in t:
            return "all_reduce"
    return None


def load_record(session: Session, run_id: int, rank: int) -> dict | None:
    """The newest ``graphdeck_comm_groups`` record of ``(run_id, rank)`` (see
    :meth:`graphdeck.capture.comm_groups.CommGroupWatch.record`), or None when the capture wrote
    none or it is unreadable."""
    row = session.execute(text("SELECT payload FROM compile_events WHERE run_id = :r AND rank = :k AND name = :n "
                               "ORDER BY id DESC LIMIT 1"), {"r": run_id, "k": rank, "n": EVENT_NAME}).first()
    try:
        data = json.loads(row[0] or "{}") if row is not None else None
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def ddp_find_unused(session: Session, run_id: int) -> bool | None:
    """Whether the run's DDP ran with ``find_unused_parameters=True`` on every rank that recorded
    its DDP (True / False), or None when no rank recorded one (not DDP, or an older capture)."""
    flags = set()
    ranks = [r for (r,) in session.execute(text("SELECT DISTINCT rank FROM compile_events WHERE run_id = :r AND name = :n"),
                                           {"r": run_id, "n": EVENT_NAME})]
    for rank in ranks:
        for ddp in (load_record(session, run_id, rank) or {}).get("ddp") or []:
            if "find_unused_parameters" in ddp:
                flags.add(bool(ddp["find_unused_parameters"]))
    return None if not flags else flags == {True}


def load_groups(session: Session, run_id: int, rank: int) -> list[CommGroup]:
    """The newest ``graphdeck_comm_groups`` record of ``(run_id, rank)`` as groups; empty when the
    capture recorded none or the record is unreadable."""
    data = load_record(session, run_id, rank)
    if data is None:
        return []
    try:
        groups = []
        for ddp in data.get("ddp") or []:
            for b in ddp.get("buckets") or []:
                groups.append(CommGroup("comm_ddp_bucket", f"DDP reducer bucket {b['index']}", tuple(b["params"]),
                                        (("all_reduce", int(b["numel"])),)))
        for g in data.get("fsdp") or []:
            n = int(g["all_gather_numel"])
            groups.append(CommGroup("comm_fsdp_group", f"FSDP2 group {g['module'] or '(root)'}", tuple(g["params"]),
                                    (("all_gather", n), ("reduce_scatter", n)),
                                    int(g["all_gather_bytes"]) if g.get("all_gather_bytes") else None))
        return groups
    except (ValueError, KeyError, TypeError, AttributeError):
        return []


def _param_nodes(session: Session, run_id: int, rank: int) -> dict[tuple[str, str], list[tuple[int, str]]]:
    """(direction, fqn) → [(graph_id, node name)] over the rank's AOT graphs: ``in`` from
    ``aot_forward`` placeholders, ``grad`` from ``aot_backward`` outputs."""
    sql = text("SELECT io.direction, io.param_fqn, io.graph_id, io.node_name FROM graph_io io "
               "JOIN graphs g ON g.id = io.graph_id WHERE g.run_id = :r AND g.rank = :k AND io.param_fqn IS NOT NULL "
               "AND io.node_name IS NOT NULL AND ((io.direction = 'in' AND g.kind = 'aot_forward') "
               "OR (io.direction = 'grad' AND g.kind = 'aot_backward')) ORDER BY io.graph_id, io.position")
    out: dict[tuple[str, str], list[tuple[int, str]]] = defaultdict(list)
    for direction, fqn, gid, node in session.execute(sql, {"r": run_id, "k": rank}):
        if (gid, node) not in out[(direction, fqn)]:
            out[(direction, fqn)].append((gid, node))
    return out


def map_collectives(session: Session, run_id: int, rank: int, kernels: list[Ev]
                    ) -> dict[int, tuple[str, list[tuple[int, str, int, str]], int, str]]:
    """Tie communication kernels (``kernels``, in start order, ``args`` loaded or not) of one
    rank's trace to graph nodes (NOTE: [Collectives to graph nodes]).

    Returns kernel event id → ``(source, [(graph_id, node, weight, param fqn), ...], unmapped_weight,
    label)`` for the kernels matched to a group; weights are parameter element counts (a node's
    share of the kernel's time is its weight over the sum of all weights plus
    ``unmapped_weight``); ``label`` names the collective for people (``all_reduce of DDP reducer
    bucket 3 (12 params)``). Kernels not matched are absent."""
    groups = load_groups(session, run_id, rank)
    if not groups or not kernels:
        return {}
    args_by_id = _args(session, [k.id for k in kernels if not k.args])
    by_size: dict[tuple[str, int], list[CommGroup]] = defaultdict(list)
    by_bytes: dict[int, list[CommGroup]] = defaultdict(list)
    for g in groups:
        for kind, n in g.sizes:
            by_size[(kind, n)].append(g)
        if g.byte_size:
            by_bytes[g.byte_size].append(g)
    numel = dict(session.execute(text("SELECT fqn, numel FROM params WHERE run_id = :r AND rank = :k"),
                                 {"r": run_id, "k": rank}).all())
    nodes_of = _param_nodes(session, run_id, rank)
    turn: Counter = Counter()
    out: dict[int, tuple[str, list[tuple[int, str, int, str]], int, str]] = {}
    for k in kernels:
        args = (k if k.args else replace(k, args=args_by_id.get(k.id))).args_dict()
        kind = collective_kind(k.name, args)
        if kind is None:
            continue
        count = args.get("Out msg nelems" if kind == "all_gather" else "In msg nelems")
        if not isinstance(count, int):
            continue
        if kind == "all_gather" and str(args.get("dtype", "")).lower() in _BYTE_DTYPES:
            candidates, key = by_bytes.get(count, []), ("bytes", count)
        else:
            candidates, key = by_size.get((kind, count), []), (kind, count)
        if not candidates:
            continue
        group = candidates[turn[key] % len(candidates)]
        turn[key] += 1
        direction = "in" if kind == "all_gather" else "grad"
        weighted, spare = [], 0
        for fqn in group.params:
            w = int(numel.get(fqn) or 1)
            places = nodes_of.get((direction, fqn))
            if not places:
                spare += w
                continue
            share, rest = divmod(w, len(places))
            weighted += [(gid, node, share + (rest if i == 0 else 0), fqn) for i, (gid, node) in enumerate(places)]
        if weighted:
            out[k.id] = (group.source, weighted, spare, f"{kind} of {group.label} ({len(group.params)} params)")
    return out


def _args(session: Session, ids: list[int]) -> dict[int, str | None]:
    """event id → its stored ``args_json`` (for events loaded without args)."""
    out: dict[int, str | None] = {}
    for i in range(0, len(ids), 500):
        chunk = ids[i:i + 500]
        params = {f"i{j}": v for j, v in enumerate(chunk)}
        sql = text("SELECT id, args_json FROM trace_events WHERE id IN (" + ",".join(f":i{j}" for j in range(len(chunk))) + ")")
        out.update(session.execute(sql, params).all())
    return out
