"""Node-level gradient check: every differentiable output of a forward graph either reaches the
loss through the backward graph or is reported as a dangling output (``DANGLING_OUTPUT``).

Three kinds of evidence, all from the store (``graphs``, ``nodes``, ``edges``, ``graph_io``):

* **Dynamo graph, run time**: an output named in ``meta_json["outputs_without_grad"]`` (no gradient
  arrived in the first backward, NOTE: [Outputs without gradient] in ``capture/agent.py``) that
  reaches no live output by any other path: nothing the loss uses depends on it.
* **Dynamo graph, structure**: a ``split``/``chunk``/``unbind`` whose pieces are not all read — a
  piece without a ``getitem`` (Dynamo dropped it) or a ``getitem`` without users. The unused piece
  gets a zero gradient slice; the parameters before it still train ("output partly used", case
  G7 of ``../shared/cases/gradient-paths.md``).
* **AOT backward graph**: a tangent placeholder (``TangentAOTInput(output=PlainAOTOutput(idx=K))``,
  the gradient arriving at forward output ``K``) that no backward node reads, or reads only for
  its shape (``zeros_like``, ``sym_size``): the compiled backward drops the gradient of that output
  (``sign``, ``round``: a zero derivative).

Each finding is a warning naming the Dynamo graph's node (``graph_id``, ``node``), its op and its
user source line; a node flagged by several kinds of evidence is reported once. Rows of the
parameters that feed a partly used piece get a note. Cost: ``O(nodes + edges)`` per Dynamo graph
that has such facts (the forward graphs come from ``graph``'s loader, shared), and a few
indexed queries on each backward graph's placeholders.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict, namedtuple
from typing import Callable

from sqlalchemy.orm import Session

from graphdeck.analysis.gradients.cuts import DIFFERENTIABLE_DTYPES, cut_kind, frames, short_source, source_line
from graphdeck.analysis.gradients.report import Finding, ParamRow

SPLIT_OPS = frozenset({"split", "chunk", "unbind", "tensor_split", "split_with_sizes", "unsafe_split",
                       "unsafe_split_with_sizes", "unsafe_chunk", "hsplit", "vsplit", "dsplit"})
#: Ops that read only a tensor's metadata: a tangent read only by these is dropped.
SHAPE_ONLY_OPS = frozenset({"sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "size", "stride",
                            "numel", "dim", "zeros_like", "empty_like", "ones_like", "full_like", "new_zeros",
                            "new_empty", "new_ones", "new_full", "empty_strided"})
#: Ops whose output is the input's data (a view or a copy): followed when chasing a tangent.
PASS_OPS = frozenset({"view", "_unsafe_view", "reshape", "alias", "expand", "t", "transpose", "permute",
                      "squeeze", "unsqueeze", "clone", "contiguous", "detach", "view_as", "flatten"})
#: Findings of one kind per graph before the rest are summed up in one.
LIMIT_PER_GRAPH = 8

_TANGENT_RE = re.compile(r"^TangentAOTInput\(output=PlainAOTOutput\(idx=(\d+)\)\)$")
_GRAD_OF_RE = re.compile(r"GradAOTOutput\(grad_of=PlainAOTInput\(idx=(\d+)\)\)")
_PLAIN_OUT_RE = re.compile(r"^PlainAOTOutput\(idx=(\d+)\)$")

GraphRow = namedtuple("GraphRow", "id rank kind parent_id compile_id meta")


def fetch(session: Session, sql: str, params: tuple = ()) -> list:
    from graphdeck.analysis.gradients.graph import fetch as _fetch

    return _fetch(session, sql, params)


def op_base(target: str | None) -> str:
    """``aten.split.Tensor`` → ``split``; ``torch.Tensor.chunk`` / ``chunk`` → ``chunk``;
    ``_operator.getitem`` → ``getitem``."""
    t = target or ""
    if t.startswith("aten.") or t.startswith("torch.ops.aten."):
        parts = t.removeprefix("torch.ops.").split(".")
        return parts[1] if len(parts) > 1 else t
    return t.rsplit(".", 1)[-1]


class RunGraphs:
    """The graphs of one run: rows by id, AOT children by parent, the Dynamo graph a DDP bucket's
    graph was split from, and parameter placeholders per graph (``graph_io`` ``in`` rows)."""

    def __init__(self, session: Session, run_id: int):
        self.session, self.run_id = session, run_id
        self.by_id: dict[int, GraphRow] = {}
        self.children: dict[int, list[GraphRow]] = defaultdict(list)
        for gid, rank, kind, parent, cid, meta in fetch(
                session, "SELECT id, rank, kind, parent_id, compile_id, meta_json FROM graphs WHERE run_id = ? "
                         "ORDER BY id", (run_id,)):
            try:
                m = json.loads(meta or "{}")
            except ValueError:
                m = {}
            self.by_id[gid] = GraphRow(gid, rank, kind, parent, cid, m if isinstance(m, dict) else {})
        for g in self.by_id.values():
            if g.parent_id is not None:
                self.children[g.parent_id].append(g)
        self.param_in: dict[int, dict[str, str]] = defaultdict(dict)
        for gid, node, fqn in fetch(session, "SELECT io.graph_id, io.node_name, io.param_fqn FROM graph_io io "
                                             "JOIN graphs g ON g.id = io.graph_id WHERE g.run_id = ? AND "
                                             "io.direction = 'in' AND io.param_fqn IS NOT NULL", (run_id,)):
            self.param_in[gid].setdefault(node, fqn)
        self._grad_inputs: dict[int, set[int] | None] = {}

    def of_kind(self, *kinds: str) -> list[GraphRow]:
        return [g for g in self.by_id.values() if g.kind in kinds]

    def child(self, gid: int, kind: str) -> list[GraphRow]:
        return [c for c in self.children.get(gid, []) if c.kind == kind]

    def unsplit(self, gid: int) -> int:
        g = self.by_id.get(gid)
        return g.parent_id if g is not None and g.kind == "ddp_partition" and g.parent_id else gid

    def grad_inputs(self, gid: int) -> set[int] | None:
        """Positions ``k`` of the placeholders of forward graph ``gid`` that required grad when it
        was compiled: its AOT backward has a ``GradAOTOutput(grad_of=PlainAOTInput(idx=k))`` slot
        (filled or ``None``). ``None`` when the graph has no backward graph."""
        if gid not in self._grad_inputs:
            bws = self.child(gid, "aot_backward")
            if not bws:
                self._grad_inputs[gid] = None
            else:
                out: set[int] = set()
                for bw in bws:
                    _names, descs = output_of(self.session, bw.id)
                    out |= {int(m.group(1)) for d in descs if d and (m := _GRAD_OF_RE.search(d))}
                self._grad_inputs[gid] = out
        return self._grad_inputs[gid]


def output_of(session: Session, graph_id: int) -> tuple[list[str | None], list[str | None]]:
    """The output node's values (node names; ``None`` for a constant or ``None``) and their AOT
    descriptors (``"PlainAOTOutput(idx=0)"``; ``None`` where absent), both by output position."""
    rows = fetch(session, "SELECT args_json, \"desc\" FROM nodes WHERE graph_id = ? AND op = 'output'", (graph_id,))
    if not rows:
        return [], []
    args_text, desc_text = rows[0]
    try:
        a = json.loads(args_text or "[]")
        a = a.get("args", a) if isinstance(a, dict) else a
        vals = a[0] if a and isinstance(a[0], (list, tuple)) else a
    except (ValueError, TypeError, IndexError, AttributeError):
        vals = []
    names = [v.get("node") if isinstance(v, dict) else None for v in (vals or [])]
    try:
        d = json.loads(desc_text) if desc_text else []
    except ValueError:
        d = []
    descs = [(x.get("repr") if isinstance(x, dict) else x) if x is not None else None
             for x in (d if isinstance(d, list) else [])]
    return names, descs


def node_args(session: Session, graph_id: int, idxs) -> dict[int, list]:
    """Positional arguments of the nodes at positions ``idxs`` (``{"node": name}`` for a node)."""
    out: dict[int, list] = {}
    idxs = sorted(set(idxs))
    for k in range(0, len(idxs), 900):
        chunk = idxs[k:k + 900]
        marks = ",".join("?" * len(chunk))
        for idx, text in fetch(session, f"SELECT idx, args_json FROM nodes WHERE graph_id = ? AND idx IN ({marks})",
                               (graph_id, *chunk)):
            try:
                a = json.loads(text or "[]")
                a = a.get("args", a) if isinstance(a, dict) else a
                out[idx] = list(a) if isinstance(a, (list, tuple)) else []
            except (ValueError, TypeError, AttributeError):
                out[idx] = []
    return out


def graphs_with(graphs: "RunGraphs", keep: Callable[[str], bool], likes: tuple[str, ...]) -> set[int]:
    """Ids of the run's graphs holding a node whose op name passes ``keep``; only interned strings
    matching one of the SQL ``LIKE`` patterns ``likes`` (``\\`` escapes) are tested."""
    where_sql = " OR ".join("value LIKE ? ESCAPE '\\'" for _ in likes)
    ids = [sid for sid, value in fetch(graphs.session, f"SELECT id, value FROM strings WHERE length(value) < 120 "
                                                        f"AND ({where_sql})", likes) if keep(value)]
    out: set[int] = set()
    for k in range(0, len(ids), 900):
        chunk = ids[k:k + 900]
        out |= {gid for (gid,) in fetch(
            graphs.session, f"SELECT DISTINCT n.graph_id FROM nodes n JOIN graphs g ON g.id = n.graph_id WHERE "
                            f"g.run_id = ? AND n.target_id IN ({','.join('?' * len(chunk))})", (graphs.run_id, *chunk))}
    return out


def grad_sources(graphs: RunGraphs, lg, row_of: Callable[[int, str], ParamRow | None]) -> set[int]:
    """Placeholders of loaded forward graph ``lg`` that require grad: those its AOT backward has a
    gradient slot for, and those bound to a parameter whose row says ``requires_grad``."""
    flow = lg.flow
    placeholders = [i for i, op in enumerate(flow.ops) if op == "placeholder"]
    out = {placeholders[k] for k in (graphs.grad_inputs(lg.graph_id) or ()) if k < len(placeholders)}
    rank = graphs.by_id[lg.graph_id].rank
    for name, fqn in graphs.param_in.get(lg.graph_id, {}).items():
        i = lg.by_name.get(name)
        row = row_of(rank, fqn)
        if i is not None and (row is None or row.requires_grad):
            out.add(i)
    return out


def where(lg, strings, i: int) -> tuple[str | None, str | None]:
    """``("file.py:LINE", code)`` of the user frame that ran node ``i`` of ``lg``."""
    fr = frames(strings.get(lg.stack_ids[i]))
    if not fr:
        return None, None
    return short_source(fr[-1][0], fr[-1][1]), source_line(fr[-1][0], fr[-1][1])


def differentiable(flow, i: int) -> bool:
    """Node ``i``'s output is a tensor (or unknown) of a floating/complex dtype (or unknown)."""
    return flow.tensor[i] is not False and (flow.dtypes[i] is None or flow.dtypes[i] in DIFFERENTIABLE_DTYPES)


def preds_of(lg, cache: dict) -> dict[int, list[int]]:
    """Node → the nodes it reads (the reverse of ``lg.flow.users``), built once per graph id in ``cache``."""
    if lg.graph_id not in cache:
        preds: dict[int, list[int]] = defaultdict(list)
        for i, us in enumerate(lg.flow.users):
            for u in us:
                preds[u].append(i)
        cache[lg.graph_id] = preds
    return cache[lg.graph_id]


def feeding_params(graphs: RunGraphs, lg, start: int, cache: dict) -> list[str]:
    """Parameters whose gradient flows into node ``start`` (backwards over non-cut nodes)."""
    flow, preds = lg.flow, preds_of(lg, cache)
    names = graphs.param_in.get(lg.graph_id, {})
    seen, stack, out = {start}, [start], set()
    while stack:
        j = stack.pop()
        if flow.ops[j] == "placeholder":
            if flow.names[j] in names:
                out.add(names[flow.names[j]])
            continue
        if j != start and cut_kind(flow, j) is not None:
            continue
        for p in preds.get(j, ()):
            if p not in seen:
                seen.add(p)
                stack.append(p)
    return sorted(out)


def node_findings(session: Session, run_id: int, flow_of: Callable, strings, rows: list[ParamRow]) -> list[Finding]:
    """All node-level findings of ``run_id``: ``DANGLING_OUTPUT`` (this module) and the graph-only
    flags of :mod:`graphdeck.analysis.gradients.flags`. ``flow_of(graph_id)`` loads a forward graph
    (``graph``'s ``_Loaded``), ``strings`` resolves interned stack traces. Adds notes to
    ``rows``. Raises nothing for graphs without AOT children or run-time facts (fewer findings)."""
    from graphdeck.analysis.gradients.flags import flag_findings

    graphs = RunGraphs(session, run_id)
    row_by = {(r.rank, a): r for r in rows for a in (r.aliases or [r.fqn])}

    def row_of(rank: int, fqn: str) -> ParamRow | None:
        return row_by.get((rank, fqn))

    return dangling_outputs(graphs, flow_of, strings, row_of) + flag_findings(graphs, flow_of, strings, row_of)


def dangling_outputs(graphs: RunGraphs, flow_of: Callable, strings, row_of) -> list[Finding]:
    """``DANGLING_OUTPUT`` warnings, see the module docstring."""
    session = graphs.session
    found: dict[tuple[int, str], dict] = {}  # (unsplit graph, node name) -> facts

    def add(gid: int, i: int, lg, why: str, piece: int | None = None) -> None:
        key = (graphs.unsplit(gid), lg.flow.names[i])
        entry = found.setdefault(key, {"gid": gid, "lg": lg, "i": i, "why": [], "pieces": []})
        if why not in entry["why"]:
            entry["why"].append(why)
        if piece is not None:
            entry["pieces"].append(piece)

    dynamo = graphs.of_kind("dynamo")
    # 1. Outputs without gradient in the first backward that reach the loss by no other path.
    for g in dynamo:
        facts = list(g.meta.get("outputs_without_grad") or [])
        for c in graphs.child(g.id, "ddp_partition"):
            facts += c.meta.get("outputs_without_grad") or []
        if not facts:
            continue
        lg = flow_of(g.id)
        for i in sorted(lg.flow.dead):
            if not lg.live[i] and lg.flow.ops[i] != "placeholder" and differentiable(lg.flow, i):
                add(g.id, i, lg, "no_grad_at_run_time")
    # 2. split/chunk pieces nobody reads.
    with_splits = graphs_with(graphs, lambda v: op_base(v) in SPLIT_OPS, ("%split%", "%chunk%", "%unbind%"))
    for g in dynamo:
        if g.id in with_splits:
            _unused_pieces(graphs, g, flow_of, row_of, add)
    # 3. Tangents the compiled backward never reads.
    for bw in graphs.of_kind("aot_backward"):
        parent = graphs.by_id.get(bw.parent_id)
        if parent is None or parent.kind not in ("dynamo", "ddp_partition"):
            continue
        dropped = _dropped_tangents(session, bw.id)
        if not dropped:
            continue
        outs, _ = output_of(session, parent.id)
        lg = flow_of(parent.id)
        for k, (tangent, readers) in sorted(dropped.items()):
            name = outs[k] if k < len(outs) else None
            i = lg.by_name.get(name) if name else None
            if i is not None:
                add(parent.id, i, lg, f"tangent:{bw.id}:{tangent}:{k}:{','.join(readers)}")
    return _render(graphs, found, strings, row_of)


def _unused_pieces(graphs: RunGraphs, g: GraphRow, flow_of: Callable, row_of, add) -> None:
    lg = flow_of(g.id)
    flow = lg.flow
    splits = [i for i, t in enumerate(flow.targets) if op_base(t) in SPLIT_OPS and flow.ops[i] != "placeholder"]
    if not splits:
        return
    # Does gradient reach the split at all? Forward from the inputs that require grad.
    carries = [False] * len(flow)
    for i in grad_sources(graphs, lg, row_of):
        carries[i] = True
    for i in range(len(flow)):
        if carries[i] and flow.ops[i] != "output":
            for u in flow.users[i]:
                if cut_kind(flow, u) is None:
                    carries[u] = True
    splits = [s for s in splits if carries[s]]
    if not splits:
        return
    session = graphs.session
    shapes: dict[int, str] = {}
    for k in range(0, len(splits), 900):
        chunk = splits[k:k + 900]
        shapes.update(fetch(session, f"SELECT idx, shape_json FROM nodes WHERE graph_id = ? AND idx IN "
                                     f"({','.join('?' * len(chunk))})", (g.id, *chunk)))
    getitems = [u for s in splits for u in flow.users[s] if op_base(flow.targets[u]) == "getitem"]
    args = node_args(session, g.id, getitems) if getitems else {}
    for s in splits:
        users = flow.users[s]
        if not users or any(op_base(flow.targets[u]) != "getitem" for u in users):
            continue  # read whole (cat(pieces), a list argument): every piece is used
        try:
            shape = json.loads(shapes.get(s) or "null")
        except ValueError:
            shape = None
        n = len(shape) if isinstance(shape, list) and shape and all(isinstance(x, list) for x in shape) else None
        taken: dict[int, int] = {}
        for u in users:
            a = args.get(u, [])
            k = a[1] if len(a) > 1 and isinstance(a[1], int) and not isinstance(a[1], bool) else None
            if k is None or (k < 0 and n is None):
                taken = {}
                break  # a slice or an unknown index: which pieces are read is not known
            taken[k + n if k < 0 else k] = u
        if not taken:
            continue
        unused = sorted(k for k, u in taken.items() if not flow.users[u])
        if n is not None:
            unused += [k for k in range(n) if k not in taken]
        for k in sorted(unused):
            add(g.id, s, lg, "piece_unused", piece=k)


def _dropped_tangents(session: Session, bw_id: int, depth: int = 4) -> dict[int, tuple[str, list[str]]]:
    """Forward output position ``K`` → (tangent name, ops that read it) for each tangent of backward
    graph ``bw_id`` that no node reads except for its shape (followed through views and copies;
    one query per level for all tangents together)."""
    tangents: dict[int, tuple[int, str]] = {}
    for idx, name, desc in fetch(session, "SELECT idx, name, \"desc\" FROM nodes WHERE graph_id = ? AND "
                                          "op = 'placeholder' AND \"desc\" LIKE 'TangentAOTInput%'", (bw_id,)):
        m = _TANGENT_RE.match(desc or "")
        if m:
            tangents[idx] = (int(m.group(1)), name)
    if not tangents:
        return {}
    used: set[int] = set()
    readers: dict[int, set[str]] = defaultdict(set)
    frontier = {t: {t} for t in tangents}  # node -> tangents whose value it holds
    for _ in range(depth):
        frontier = {n: ts - used for n, ts in frontier.items() if ts - used}
        if not frontier:
            break
        marks = ",".join("?" * len(frontier))
        nxt: dict[int, set[int]] = defaultdict(set)
        for src, dst, op, target in fetch(
                session, f"SELECT e.src_idx, n.idx, n.op, s.value FROM edges e JOIN nodes n ON n.graph_id = e.graph_id "
                         f"AND n.idx = e.dst_idx LEFT JOIN strings s ON s.id = n.target_id "
                         f"WHERE e.graph_id = ? AND e.src_idx IN ({marks})", (bw_id, *sorted(frontier))):
            base = op_base(target)
            for t in frontier.get(src, ()):
                if op != "output" and base in SHAPE_ONLY_OPS:
                    readers[t].add(base)
                elif op != "output" and base in PASS_OPS:
                    nxt[dst].add(t)
                else:
                    used.add(t)
        frontier = nxt
    # A tangent still being followed after ``depth`` levels counts as used (no claim without evidence).
    pending = {t for ts in frontier.values() for t in ts}
    return {k: (name, sorted(readers[t])) for t, (k, name) in tangents.items() if t not in used and t not in pending}


def _render(graphs: RunGraphs, found: dict, strings, row_of) -> list[Finding]:
    by_graph: dict[int, list[dict]] = defaultdict(list)
    for (_unsplit, _name), e in sorted(found.items(), key=lambda kv: (kv[0][0], kv[1]["i"])):
        by_graph[e["gid"]].append(e)
    cache: dict = {}
    out: list[Finding] = []
    for gid, entries in sorted(by_graph.items()):
        out += [_finding(graphs, e, strings, row_of, cache) for e in entries[:LIMIT_PER_GRAPH]]
        rest = entries[LIMIT_PER_GRAPH:]
        if rest:
            names = [e["lg"].flow.names[e["i"]] for e in rest]
            out.append(Finding(kind="DANGLING_OUTPUT", severity="warning", graph_id=gid, node=names[0],
                               ranks=[graphs.by_id[gid].rank],
                               message=f"{len(rest)} more dangling output(s) in graph {gid}: "
                                       + ", ".join(names[:20]) + (" …" if len(names) > 20 else "")))
    return out


def _finding(graphs: RunGraphs, e: dict, strings, row_of, cache: dict) -> Finding:
    lg, i, gid = e["lg"], e["i"], e["gid"]
    flow = lg.flow
    name = flow.names[i]
    op = flow.targets[i] or flow.ops[i]
    src, code = where(lg, strings, i)
    at = f" at {src}" + (f" ({code})" if code else "") if src else ""
    rank = graphs.by_id[gid].rank
    parts, partly, dropped_tangent = [], False, False
    if e["pieces"]:
        partly = True
        pieces = ", ".join(map(str, sorted(set(e["pieces"]))))
        parts.append(f"piece(s) {pieces} of {op} (node {name}){at} are never read: they get a zero gradient "
                     "slice; the rest of its output reaches the loss")
    if "no_grad_at_run_time" in e["why"]:
        parent = _getitem_parent(lg, i, cache)
        partly = partly or (parent is not None and any(lg.live[u] for u in flow.users[parent] if u != i))
        parts.append(f"output {name} ({op}{', a piece of ' + flow.names[parent] if parent is not None else ''})"
                     f"{at} is returned by graph {gid} but got no gradient in the first backward and reaches "
                     "the loss by no other path")
    for why in e["why"]:
        if why.startswith("tangent:"):
            _, bw, tangent, k, readers = why.split(":", 4)
            how = f"only for its shape ({readers})" if readers else "nowhere"
            parts.append(f"backward graph {bw} reads {tangent}, the gradient arriving at output {k} ({name}, "
                         f"{op}){at}, {how}: that gradient is dropped (the op has a zero derivative, or the "
                         "output does not depend differentiably on the graph's inputs)")
            dropped_tangent = True
    params = feeding_params(graphs, lg, i, cache)
    if partly:
        parts.append("output partly used")
        note = f"output partly used: node {name} ({op}) in graph {gid}{at}"
        for fqn in params:
            row = row_of(rank, fqn)
            if row is not None and note not in row.notes:
                row.notes.append(note)
        fix = "if the unused piece is not needed, split off only what is used; a zero gradient slice is harmless"
    elif dropped_tangent and len(e["why"]) == 1:
        fix = (f"if a gradient through {op} was meant, use a differentiable surrogate (straight-through: "
               "x + (f(x) - x).detach()); otherwise detach the output to say so")
    else:
        fix = "use the output in the loss, stop computing it while training, or detach it on purpose"
    return Finding(kind="DANGLING_OUTPUT", severity="warning", graph_id=gid, node=name, source=src, params=params,
                   ranks=[rank], message="; ".join(parts), fix=fix)


def _getitem_parent(lg, i: int, cache: dict) -> int | None:
    """The split-like node whose piece node ``i`` is (``getitem`` of it), or ``None``."""
    flow = lg.flow
    if op_base(flow.targets[i]) != "getitem":
        return None
    src = preds_of(lg, cache).get(i, [])
    return src[0] if src and op_base(flow.targets[src[0]]) in SPLIT_OPS else None
