"""CPU traces on graph nodes: the ATen ops and C++ kernels of a CPU-only trace mapped to FX nodes.

# NOTE: [CPU trace mapping]
A trace without GPU kernels (a CPU job: gloo ranks, ``aot_eager`` or Inductor's C++ backend)
still runs every compiled graph inside profiler ranges that say which graph runs:

* ``CompiledFunction`` (the AOT forward, inside ``Torch-Compiled Region: <compile_id>``) and
  ``CompiledFunctionBackward`` (its backward, run by the autograd engine). Both carry
  ``args["Sequence number"]``, the autograd sequence number of the compiled function's call, so
  a backward range is tied to the forward range of the same number (the latest one before it)
  and from there to the forward's ``compile_id`` and AOT graph pair (same ``parent_id``).
* Inductor's wrapper call ``## Call CompiledFxGraph <hash> ##`` inside those ranges. With
  ``torch._inductor.config.cpp.enable_kernel_profile`` each generated C++ kernel opens a
  ``RecordFunction`` named ``graph_<V.graph.graph_id>_<kernel name>`` (``CppKernelProxy``'s
  ``codegen_group`` in ``torch/_inductor/codegen/cpp.py``); extern calls show as ``aten::mm``...

The *units* of a range are what it runs: for Inductor, the direct children of each wrapper call
(kernels with the ``graph_<n>_`` prefix removed, extern ``aten::`` calls, allocations); for
``aot_eager``, the top-level ATen ops in the range (an ATen op not nested in another one).
*Compiled-region CPU time* is the ranges' own wall time (``region_ns``, = ``kernel_ns``);
``mapped_ns`` the part of it given to nodes: the units' own time plus the time around them
(NOTE: [Overhead]). ``units_ns`` / ``mapped_units_ns`` are the units' own time alone.

Matching, ``how`` per unit:

* ``aot_eager`` (``seq+name+order``): the graph is the AOT forward of the range's compile_id
  (for a backward range: the AOT backward beside the forward of the same sequence number); when
  several graphs qualify (DDPOptimizer's buckets) the one whose call_function op names align best
  with the range's op names, ties broken by call order (the k-th forward range of a region runs
  the k-th bucket, backward ranges run them in reverse). The graph's ``call_function`` nodes in
  ``Node.idx`` order (targets ``aten.X.overload`` → ``aten::X``) are aligned with the units by op
  name (``difflib.SequenceMatcher``): equal blocks pair by order (``name+order``); where both
  sides have ops between two equal blocks and the names differ, they pair by order
  (``order``). Node ``seq_nr`` is not needed inside a range: the ops run in graph order.
* NOTE: [Ops of a higher-order op] A node whose target is a higher-order op
  (``torch.ops.higher_order.flex_attention`` / ``flex_attention_backward``, ...) is no single
  dispatcher op: under ``aot_eager`` its eager implementation runs as many top-level ATen ops
  (``aten::matmul``, ``aten::max``, ``aten::_safe_softmax``...) that no node has by name. Those ops,
  between the neighbours the alignment matched, go to the HOP's node (``higher-order op``), except
  those another node of the same stretch has by name. Before, they were unmapped: a block with
  FlexAttention (torchtitan's llama3 debug model) mapped 47.7% of its ops' time.
* An ``aten::zeros`` at the top of a backward range is autograd materializing the zero gradient
  of an output nobody used: it goes to the backward graph's ``tangents_<i>`` placeholder of
  its shape (``materialized zero gradient``).
* Inductor (``provenance``): each wrapper call's units are looked up in the kernel tables of
  :mod:`graphdeck.analysis.traces.mapping` (NOTE: [Kernel to node mapping]) exactly as GPU kernels
  are, the k-th call named N to the k-th row group named N.

# NOTE: [Overhead]
A compiled range is more than its ops: Python dispatch between ATen ops (``aot_eager``), the
generated wrapper code between C++ kernels (Inductor's ``call()``: buffer allocation,
``reinterpret_tensor``), AOT's runtime wrapper before the graph (inputs) and after it (outputs:
``aten::detach`` of saved tensors that are views, ``aten::_unsafe_view`` of outputs that are views
of intermediates, ``save_for_backward``; ``torch/_functorch/_aot_autograd/runtime_wrappers.py``),
and on a busy host the thread's descheduling anywhere in it (a trace cannot tell that apart).
Given to nodes, labelled, never mixed into an op's own time:

* ``dispatch``: the gap before a mapped unit since the previous unit of its range ended → the
  node whose op follows (its launch / wrapper overhead);
* ``prologue``: from the range's start to its first unit, when that unit is mapped → its node;
* ``wrapper_ops``: units after the graph's last mapped op that are not the graph's (Inductor:
  outside the wrapper call; ``aot_eager``: left over once the graph's nodes ran out) → the graph's
  ``output`` node (``how`` = :data:`WRAPPER_OP_HOW`);
* ``epilogue``: the gaps before those wrapper ops and from the last unit to the range's end → the
  ``output`` node.

Each is a ``<kind>_ns`` key of ``KernelMapping.directions`` (``wrapper_ops_ns`` is part of
``mapped_units_ns``), and ``KernelMapping.overhead_ns[(graph, node)]`` is the part of
``node_ns`` that is overhead. What stays unmapped: ranges whose graph was not found, units no node
matched in the middle of a range and the gaps before them, a prologue before an unmatched unit.
"""

from __future__ import annotations

import difflib
import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from graphdeck.analysis.traces.data import Ev
from graphdeck.store.schema import Graph, InternedString, Node

FWD, BWD = "CompiledFunction", "CompiledFunctionBackward"
WRAPPER_PREFIX = "## Call CompiledFxGraph"
_REGION = re.compile(r"^Torch-Compiled Region: (\S+)")
_KERNEL_PREFIX = re.compile(r"^graph_\d+_")
#: How a runtime wrapper op after the graph is matched (NOTE: [Overhead]).
WRAPPER_OP_HOW = "runtime wrapper op after the graph (its outputs) -> output node"
#: The kinds of a compiled range's time outside its ops, each a ``<kind>_ns`` key of ``directions``.
OVERHEAD_KINDS = ("prologue", "dispatch", "epilogue")
#: A graph node that runs a higher-order op (``torch.ops.higher_order.flex_attention``...): no one
#: dispatcher op, but the ATen ops of its eager implementation (NOTE: [Ops of a higher-order op]).
HOP, HOP_TARGET, HOP_HOW = "<higher-order op>", "torch.ops.higher_order.", "higher-order op (the ops it ran)"
#: Categories of host events that nest (ops, record_function ranges, Inductor's C++ kernels).
HOST_CATS = frozenset({"cpu_op", "Operator", "user_annotation", "gpu_user_annotation"})


@dataclass(slots=True)
class Unit:
    """One op or kernel run inside a compiled range: ``ev`` the event, ``name`` the name used for
    matching (``aten::mm``, ``cpp_fused_add_0``), ``root`` the ``CompiledFunction[Backward]``
    (or wrapper) event it ran in, ``direction`` ``forward`` / ``backward``, ``wrapper`` the
    Inductor wrapper call event or None."""

    ev: Ev
    name: str
    root: Ev
    direction: str
    wrapper: Ev | None


def aten_name(target: str) -> str | None:
    """``"aten.addmm.default"`` → ``"aten::addmm"``; None for targets that are no dispatcher op
    (``operator.getitem``, builtins).

    >>> [aten_name(t) for t in ("aten.addmm.default", "_c10d_functional.all_reduce.default", "operator.getitem")]
    ['aten::addmm', '_c10d_functional::all_reduce', None]
    """
    parts = target.split(".")
    if len(parts) != 3 or parts[0] in ("operator", "builtins", "torch", "math"):
        return None
    return f"{parts[0]}::{parts[1]}"


def _parents(events: list[Ev]) -> dict[int, Ev]:
    """Event id → innermost enclosing host event on its thread (per-thread sweep by start)."""
    per_thread: dict[tuple[str, str], list[Ev]] = defaultdict(list)
    for e in events:
        if e.cat in HOST_CATS:
            per_thread[(e.pid, e.tid)].append(e)
    parent: dict[int, Ev] = {}
    for items in per_thread.values():
        items.sort(key=lambda e: (e.ts, -e.dur, e.id))
        stack: list[Ev] = []
        for e in items:
            while stack and (stack[-1].end < e.end or (stack[-1].end <= e.ts and stack[-1].dur > 0)):
                stack.pop()
            if stack:
                parent[e.id] = stack[-1]
            stack.append(e)
    return parent


def _seq_numbers(session: Session, ids: list[int]) -> dict[int, int]:
    out: dict[int, int] = {}
    for i in range(0, len(ids), 500):
        chunk = ids[i:i + 500]
        sql = text("SELECT id, args_json FROM trace_events WHERE id IN (" + ",".join(str(int(x)) for x in chunk) + ")")
        for eid, args in session.execute(sql):
            try:
                seq = json.loads(args or "{}").get("Sequence number")
            except (ValueError, AttributeError):
                seq = None
            if isinstance(seq, int):
                out[eid] = seq
    return out


def find_units(events: list[Ev]) -> tuple[list[Unit], list[Ev], dict[int, str]]:
    """The units of every compiled range of a trace, by start; the root ranges; and root id →
    the compile_id of the ``Torch-Compiled Region`` enclosing it (forward ranges only)."""
    parent = _parents(events)

    def ancestors(e: Ev):
        p = parent.get(e.id)
        while p is not None:
            yield p
            p = parent.get(p.id)

    units: list[Unit] = []
    roots: dict[int, Ev] = {}
    region: dict[int, str] = {}
    for e in events:
        if e.cat not in HOST_CATS:
            continue
        chain = list(ancestors(e))
        root_at = next((i for i, a in enumerate(chain) if a.name in (FWD, BWD)), None)
        wrap_at = next((i for i, a in enumerate(chain) if a.name.startswith(WRAPPER_PREFIX)), None)
        if wrap_at is not None:  # Inductor: direct children of the wrapper call
            if wrap_at != 0:
                continue
            root = chain[root_at] if root_at is not None else chain[0]
            name = _KERNEL_PREFIX.sub("", e.name)
            wrapper = chain[0]
        elif root_at is not None:  # aot_eager: top-level ATen ops
            if not e.name.startswith("aten::") or any(a.name.startswith("aten::") for a in chain[:root_at]):
                continue
            root, name, wrapper = chain[root_at], e.name, None
        else:
            continue
        roots[root.id] = root
        if root.id not in region:
            region[root.id] = next((m.group(1) for a in ancestors(root) if (m := _REGION.match(a.name))), None)
        units.append(Unit(e, name, root, "backward" if root.name == BWD else "forward", wrapper))
    units.sort(key=lambda u: (u.ev.ts, u.ev.id))
    return units, sorted(roots.values(), key=lambda r: (r.ts, r.id)), {k: v for k, v in region.items() if v}


def _graph_ops(session: Session, run_id: int, rank: int) -> tuple[dict[int, Graph], dict[int, list[tuple[str, str]]]]:
    graphs = {g.id: g for g in session.scalars(select(Graph).where(
        Graph.run_id == run_id, Graph.rank == rank,
        Graph.kind.in_(("aot_forward", "aot_backward", "aot_inference"))))}
    ops: dict[int, list[tuple[str, str]]] = defaultdict(list)
    if graphs:
        for gid, name, target in session.execute(
                select(Node.graph_id, Node.name, InternedString.value)
                .join(InternedString, InternedString.id == Node.target_id)
                .where(Node.graph_id.in_(list(graphs)), Node.op == "call_function").order_by(Node.graph_id, Node.idx)):
            op = HOP if target.startswith(HOP_TARGET) else aten_name(target)
            if op is not None:
                ops[gid].append((op, name))
    return graphs, ops


def _align(unit_names: list[str], nodes: list[tuple[str, str]]) -> list[tuple[int, str, str]]:
    """(unit index, node name, how) pairs of an op-name alignment (see the NOTE). A higher-order
    op's node (``HOP``) takes the ops run between its neighbours that no other node of that stretch
    has by name (``higher-order op``; NOTE: [Ops of a higher-order op])."""
    sm = difflib.SequenceMatcher(None, unit_names, [op for op, _ in nodes], autojunk=False)
    out = []
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        hops = [j for j in range(j1, j2) if nodes[j][0] == HOP]
        if tag == "equal":
            out += [(i1 + k, nodes[j1 + k][1], "name+order") for k in range(i2 - i1)]
        elif tag == "replace" and hops:
            rest = [j for j in range(j1, j2) if nodes[j][0] != HOP]
            sub = difflib.SequenceMatcher(None, unit_names[i1:i2], [nodes[j][0] for j in rest], autojunk=False)
            named = {i1 + b.a + k: nodes[rest[b.b + k]][1] for b in sub.get_matching_blocks() for k in range(b.size)}
            out += [(i, named[i], "name+order") if i in named else (i, nodes[hops[0]][1], HOP_HOW)
                    for i in range(i1, i2)]
        elif tag == "replace":
            out += [(i1 + k, nodes[j1 + k][1], "order") for k in range(min(i2 - i1, j2 - j1))]
        elif tag == "delete" and j1 > 0 and nodes[j1 - 1][0] == HOP:  # more of the op just run
            out += [(i, nodes[j1 - 1][1], HOP_HOW) for i in range(i1, i2)]
    return out


def _score(unit_names: list[str], nodes: list[tuple[str, str]]) -> int:
    sm = difflib.SequenceMatcher(None, unit_names, [op for op, _ in nodes], autojunk=False)
    return sum(b.size for b in sm.get_matching_blocks())


def map_aot_eager(session: Session, run_id: int, rank: int, units: list[Unit], roots: list[Ev],
                  region: dict[int, str]) -> dict[int, tuple[int, str, str]]:
    """Unit event id → ``(graph_id, node, how)`` for the units of ``aot_eager`` ranges (no
    wrapper call); see NOTE: [CPU trace mapping]."""
    inductor = {u.root.id for u in units if u.wrapper is not None}
    eager = [r for r in roots if r.id not in inductor]
    if not eager:
        return {}
    graphs, ops = _graph_ops(session, run_id, rank)
    seq = _seq_numbers(session, [r.id for r in eager])
    by_root: dict[int, list[Unit]] = defaultdict(list)
    for u in units:
        by_root[u.root.id].append(u)
    fwd_graph_of_seq: dict[int, int] = {}
    turns: Counter = Counter()  # (kind, compile_id) -> ranges seen, for the tie-break by order
    out: dict[int, tuple[int, str, str]] = {}
    for r in eager:
        mine = by_root.get(r.id, [])
        names = [u.name for u in mine]
        if r.name == FWD:
            cid = region.get(r.id)
            cands = sorted(g for g, gr in graphs.items() if gr.kind != "aot_backward" and (cid is None or gr.compile_id == cid))
            key = ("fwd", cid)
        else:
            fg = graphs.get(fwd_graph_of_seq.get(seq.get(r.id, -1), -1))
            cands = sorted(g for g, gr in graphs.items() if gr.kind == "aot_backward" and (
                fg is None or (gr.parent_id == fg.parent_id and gr.compile_id == fg.compile_id)))
            if not cands and fg is not None:
                cands = sorted(g for g, gr in graphs.items() if gr.kind == "aot_backward" and gr.compile_id == fg.compile_id)
            key = ("bwd", fg.id if fg is not None else None)
            if fg is None or len(cands) > 1:
                cands = cands[::-1]  # buckets' backwards run last to first
        if not cands:
            continue
        k = turns[key]
        turns[key] += 1
        gid = max(cands, key=lambda g: (_score(names, ops[g]), -((cands.index(g) - k) % len(cands))))
        if r.name == FWD and r.id in seq:
            fwd_graph_of_seq[seq[r.id]] = gid
        for i, node, how in _align(names, ops[gid]):
            out[mine[i].ev.id] = (gid, node, how if how == HOP_HOW else f"aot_eager {how}")
    return out


def map_cpu_trace(session: Session, trace, events: list[Ev], tables: dict[int, dict], out, unmapped: Counter,
                  sources: Counter) -> None:
    """Fill ``out`` (a :class:`graphdeck.analysis.traces.mapping.KernelMapping` with no GPU kernel)
    with the CPU units of ``events`` (NOTE: [CPU trace mapping]): ``device = "cpu"``,
    ``kernel_ns`` / ``mapped_ns`` / ``node_ns`` / ``by_kernel`` / ``how`` / ``directions``."""
    from graphdeck.analysis.traces.mapping import _map_wrappers

    units, roots, region = find_units(events)
    if not units:
        return
    out.device = "cpu"
    out.cpu_units = units
    out.region_ns = sum(r.dur for r in roots)
    # Inductor: wrapper calls through the kernel tables
    wrappers: dict[int, list[tuple[Ev, Ev]]] = defaultdict(list)
    wrapper_ev: dict[int, tuple[Ev, str | None]] = {}
    for u in units:
        if u.wrapper is None or not tables:
            continue
        ev = Ev(u.ev.id, u.name, u.ev.cat, u.ev.ts, u.ev.dur, u.ev.pid, u.ev.tid, None, None)
        wrapper_ev[u.wrapper.id] = (u.wrapper, region.get(u.root.id))
        wrappers[u.wrapper.id].append((ev, ev))
    inductor_unmapped: Counter = Counter()
    row_source: dict[int, str] = {}
    _map_wrappers(session, trace, tables, wrappers, wrapper_ev, out, inductor_unmapped, sources, row_source)
    for kid, src in row_source.items():
        out.how[kid] = ("inductor provenance by stack trace (kernel name + call order; NOTE: [Kernels by stack trace])"
                        if src.endswith(("stack_trace", "_stacks")) else "inductor provenance (kernel name + call order)")
    # aot_eager: op names and order against the AOT graphs
    for kid, (gid, node, how) in map_aot_eager(session, trace.run_id, trace.rank, units, roots, region).items():
        out.by_kernel[kid] = (gid, [node])
        out.how[kid] = how
        sources[how] += 1
    for kid, (gid, node, how) in _materialized_zeros(session, units, out.by_kernel).items():
        out.by_kernel[kid] = (gid, [node])
        out.how[kid] = how
        sources[how] += 1
    outputs = _output_nodes(session, {gid for gid, _ in out.by_kernel.values()})
    for kid, (gid, node, how) in _wrapper_ops(units, out.by_kernel, outputs).items():
        out.by_kernel[kid] = (gid, [node])
        out.how[kid] = how
        sources[how] += 1
    # Each unit's own time goes to its node (an Inductor kernel's was split over its nodes by
    # _map_wrappers); the time around them to the node whose op follows or, after the graph's
    # last op, to its output node, kept apart in overhead_ns and by kind (NOTE: [Overhead]).
    dirs: dict[str, Counter] = defaultdict(Counter)
    for r in roots:
        dirs["backward" if r.name == BWD else "forward"]["region_ns"] += r.dur
    for u in units:
        d = dirs[u.direction]
        d["units"] += 1
        d["units_ns"] += u.ev.dur
        if u.ev.id not in out.by_kernel:
            unmapped[u.name] += u.ev.dur
            continue
        d["mapped"] += 1
        d["mapped_units_ns"] += u.ev.dur
        gid, nodes = out.by_kernel[u.ev.id]
        if u.wrapper is None:
            out.node_ns[(gid, nodes[0])] = out.node_ns.get((gid, nodes[0]), 0) + u.ev.dur
        if out.how[u.ev.id] == WRAPPER_OP_HOW:
            d["wrapper_ops_ns"] += u.ev.dur
            out.overhead_ns[(gid, nodes[0])] = out.overhead_ns.get((gid, nodes[0]), 0) + u.ev.dur
    for u, kind, key, ns in _overhead(units, out.by_kernel, outputs):
        out.node_ns[key] = out.node_ns.get(key, 0) + ns
        out.overhead_ns[key] = out.overhead_ns.get(key, 0) + ns
        dirs[u.direction][f"{kind}_ns"] += ns
    for d in dirs.values():
        d["mapped_ns"] = d["mapped_units_ns"] + sum(d[f"{k}_ns"] for k in OVERHEAD_KINDS)
    out.kernel_ns = out.region_ns
    out.mapped_ns = sum(d["mapped_ns"] for d in dirs.values())
    out.directions = {k: dict(v) for k, v in sorted(dirs.items())}


def _output_nodes(session: Session, gids: set[int]) -> dict[int, str]:
    """graph id → the name of its ``output`` node."""
    if not gids:
        return {}
    return dict(session.execute(select(Node.graph_id, Node.name).where(
        Node.graph_id.in_(gids), Node.op == "output")).all())


def _by_root(units: list[Unit]) -> dict[int, list[Unit]]:
    out: dict[int, list[Unit]] = defaultdict(list)
    for u in units:  # units are sorted by start
        out[u.root.id].append(u)
    return out


def _wrapper_ops(units: list[Unit], by_kernel: dict, outputs: dict[int, str]) -> dict[int, tuple[int, str, str]]:
    """Unit id → ``(graph_id, output node, WRAPPER_OP_HOW)`` for the ops a compiled range runs after
    its graph's last mapped op and outside the graph (NOTE: [Overhead]): for Inductor, ops outside
    the wrapper call; for ``aot_eager``, ops the alignment left over once the graph's nodes ran out
    (``aten::detach`` / ``aten::_unsafe_view``: AOT's runtime wrapper handling the outputs)."""
    out: dict[int, tuple[int, str, str]] = {}
    for mine in _by_root(units).values():
        last = max((i for i, u in enumerate(mine) if u.ev.id in by_kernel), default=None)
        if last is None:
            continue
        gid = by_kernel[mine[last].ev.id][0]
        inductor = any(u.wrapper is not None for u in mine)
        for u in mine[last + 1:]:
            if gid in outputs and not (inductor and u.wrapper is not None):
                out[u.ev.id] = (gid, outputs[gid], WRAPPER_OP_HOW)
    return out


def _overhead(units: list[Unit], by_kernel: dict, outputs: dict[int, str]):
    """``(unit, kind, (graph_id, node), ns)`` for the time of each compiled range outside its
    units (NOTE: [Overhead]); ranges with no mapped unit give nothing."""
    for mine in _by_root(units).values():
        mapped = [u for u in mine if u.ev.id in by_kernel]
        if not mapped:
            continue
        root = mine[0].root
        cursor, after_graph = root.ts, False
        for u in mine:
            gap = max(0, u.ev.ts - cursor)
            if u.ev.id in by_kernel:
                gid, nodes = by_kernel[u.ev.id]
                after_graph = after_graph or nodes[0] == outputs.get(gid)
                kind = "epilogue" if after_graph else ("prologue" if cursor == root.ts else "dispatch")
                if gap:
                    yield u, kind, (gid, nodes[0]), gap
            cursor = max(cursor, u.ev.end)
        gid = by_kernel[mapped[-1].ev.id][0]
        if root.end > cursor and gid in outputs:
            yield mapped[-1], "epilogue", (gid, outputs[gid]), root.end - cursor


def _materialized_zeros(session: Session, units: list[Unit], by_kernel: dict) -> dict[int, tuple[int, str, str]]:
    """An ``aten::zeros`` at the top of a backward range, outside the graph's ops, is autograd
    materializing the zero gradient of a compiled function's output nobody used (an
    ``autograd.Function`` materializes grads by default): it becomes that backward graph's
    ``tangents_<i>`` placeholder of the same shape (the op's first argument), when there is one."""
    graph_of: dict[int, int] = {}
    for u in units:
        if u.ev.id in by_kernel:
            graph_of.setdefault(u.root.id, by_kernel[u.ev.id][0])
    todo = [u for u in units if u.name == "aten::zeros" and u.direction == "backward"
            and u.ev.id not in by_kernel and u.root.id in graph_of]
    if not todo:
        return {}
    sizes: dict[int, list] = {}
    for eid, args in session.execute(text("SELECT id, args_json FROM trace_events WHERE id IN ("
                                          + ",".join(str(int(u.ev.id)) for u in todo) + ")")):
        try:
            sizes[eid] = json.loads(json.loads(args or "{}").get("Concrete Inputs", [""])[0])
        except (ValueError, TypeError, IndexError, AttributeError):
            continue
    tangents: dict[int, list[tuple[str, list]]] = defaultdict(list)
    for gid, name, shape in session.execute(select(Node.graph_id, Node.name, Node.shape_json).where(
            Node.graph_id.in_(set(graph_of.values())), Node.op == "placeholder", Node.name.like("tangents%"))
            .order_by(Node.graph_id, Node.idx)):
        try:
            tangents[gid].append((name, json.loads(shape or "null")))
        except ValueError:
            continue
    out: dict[int, tuple[int, str, str]] = {}
    used: set[tuple[int, int, str]] = set()
    for u in todo:
        gid = graph_of[u.root.id]
        for name, shape in tangents.get(gid, ()):
            if shape == sizes.get(u.ev.id) and (u.root.id, gid, name) not in used:
                used.add((u.root.id, gid, name))
                out[u.ev.id] = (gid, name, "materialized zero gradient -> tangent of the same shape")
                break
    return out


def cpu_gaps(mapping, label, top: int = 10) -> list[dict]:
    """The ``top`` largest gaps between consecutive units of one compiled range (one thread; ns:
    Python dispatch, allocation, waits between the ops of a compiled region), each named by the
    unit before and after it (``label(ev)``), shaped like
    :func:`graphdeck.analysis.traces.analyze.hotspots`' GPU gaps."""
    gaps = []
    prev: Unit | None = None
    for u in sorted(mapping.cpu_units, key=lambda u: (u.root.id, u.ev.ts, u.ev.id)):
        if prev is not None and prev.root.id == u.root.id and u.ev.ts > prev.ev.end:
            gaps.append((u.ev.ts - prev.ev.end, prev.ev, u.ev))
        if prev is None or prev.root.id != u.root.id or u.ev.end > prev.ev.end:
            prev = u
    gaps.sort(key=lambda g: (-g[0], g[1].ts))
    return [{"gap_ns": g, "stream": f"{p.pid}/{p.tid} (CPU thread)", "at_ns": p.end, "after": label(p),
             "after_kernel": p.name, "before": label(n), "before_kernel": n.name} for g, p, n in gaps[:top]]
