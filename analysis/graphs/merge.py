"""The merged graph of N versions of one graph: a base graph plus what each other version changes.

Built for the N-way rank diff (:mod:`graphdeck.analysis.ranks.nway`): the same compiled graph on
every rank, drawn once. Each other version is diffed against the base with
:func:`graphdeck.analysis.graphs.diff.diff_views` (NOTE: [Node matching]); this module folds those
diffs into one drawable :class:`~graphdeck.analysis.graphs.view.GraphView` and says, per node of
that view, what each version does there. Returns data only; the SVG renderer draws the marks.

# NOTE: [Merged N-way graph]
* Base nodes keep their id (FX name) and ``idx``, so links into the base graph's page still work.
* A base node a version has no counterpart for, and a version's node the base lacks, that sit in
  the same gap between two paired nodes are read together, position by position: the node was
  *replaced* (``target aten.mm.default vs aten.bmm.default``), shown on the base node. What is left
  over is *absent* in the version (a base node) or *added* by it: an added node enters the merged
  view after the base node its gap follows, as ``<name>@<label>`` when the base has a node of that
  name, and with ``idx`` past the base's last; versions that add the same node (name and target) in
  the same gap share it.
* A paired node whose shape, dtype, inputs or module differ is *changed*, with what differs; an
  input that was replaced counts as its replacement (the change is shown once, on that input).
* Edges between base nodes are the base's; a version's edge that touches an added node is added,
  its other end mapped through the pairing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from graphdeck.analysis.graphs.diff import GraphDiff, _inputs
from graphdeck.analysis.graphs.view import GraphView, ViewEdge, ViewNode


@dataclass
class NodeChange:
    """What version ``version`` (an index into the versions given to :func:`merge_views`) does at
    one node of the merged view: ``kind`` ``absent`` (a base node the version lacks), ``added``
    (a node only some versions have), ``replaced`` (another op in its place) or ``changed`` (paired,
    but shape / dtype / inputs / module differ); ``detail`` says it in words; ``node``: the node's
    FX name in the version's graph (None when absent)."""

    version: int
    kind: str
    detail: str
    node: str | None = None


@dataclass
class MergedGraph:
    """The merged view and, per node id of it, each version's change there (nodes every version
    agrees on are absent from ``changes``); ``names[v]``: version ``v``'s FX node name → the
    merged view's node id (for per-node values read from that version's graph)."""

    view: GraphView
    changes: dict[str, list[NodeChange]] = field(default_factory=dict)
    names: list[dict[str, str]] = field(default_factory=list)


def _shape_text(node: ViewNode) -> str:
    return str(node.shape) if node.shape is not None else "?"


def _changed_detail(a: ViewNode, b: ViewNode, what: list[str]) -> str:
    parts = []
    for w in what:
        if w == "shape":
            parts.append(f"shape {_shape_text(a)} vs {_shape_text(b)}")
        elif w == "dtype":
            parts.append(f"dtype {a.dtype} vs {b.dtype}")
        elif w == "module":
            parts.append(f"module {a.namespace or '(top)'} vs {b.namespace or '(top)'}")
        else:
            parts.append("inputs differ")
    return "; ".join(parts)


def _replaced_detail(a: ViewNode, b: ViewNode) -> str:
    if a.op != b.op:
        return f"op {a.op} {a.target} vs {b.op} {b.target}"
    if a.target != b.target:
        return f"target {a.target} vs {b.target}"
    return f"{a.target}: " + (_changed_detail(a, b, [w for w, x, y in (("shape", a.shape, b.shape),
                                                                      ("dtype", a.dtype, b.dtype))
                                                  if x != y]) or "differs")


def merge_views(base: GraphView, versions: list[tuple[str, GraphView, GraphDiff]]) -> MergedGraph:
    """Fold ``versions`` — ``(label, view, diff of base against view)`` each, ``label`` a short
    tag such as ``"r2"`` used in added nodes' ids — into one view over ``base`` (NOTE: [Merged
    N-way graph]). Cost: linear in the nodes and edges of the views given."""
    base_pos = {n.id: i for i, n in enumerate(base.nodes)}
    base_names = set(base_pos)
    out = MergedGraph(view=base)
    added_after: dict[int, list[ViewNode]] = {}  # base position (-1: before the first) -> added nodes
    added_key: dict[tuple, str] = {}  # (gap, name, target) -> merged id
    next_idx = max((n.idx for n in base.nodes), default=-1) + 1
    extra_edges: dict[tuple, ViewEdge] = {}
    for v, (label, view, diff) in enumerate(versions):
        a_to_b = {p.a: p.b for p in diff.pairs}
        b_pos = {n.id: j for j, n in enumerate(view.nodes)}
        b_to_base_pos = {b_pos[p.b]: base_pos[p.a] for p in diff.pairs}
        names = {p.b: p.a for p in diff.pairs}
        by_b = {n.id: n for n in view.nodes}
        by_a = {n.id: n for n in base.nodes}
        # gaps: the base position of the last paired node before each removed / added node
        paired_a = sorted(base_pos[a] for a in a_to_b)
        paired_b = sorted(b_to_base_pos)
        removed_gap: dict[int, list[str]] = {}
        for a in sorted(diff.removed, key=base_pos.get):
            i = base_pos[a]
            removed_gap.setdefault(_last_before(paired_a, i), []).append(a)
        added_gap: dict[int, list[str]] = {}
        for b in sorted(diff.added, key=b_pos.get):
            j = b_pos[b]
            last = _last_before(paired_b, j)
            added_gap.setdefault(b_to_base_pos[last] if last >= 0 else -1, []).append(b)
        for gap in sorted(set(removed_gap) | set(added_gap)):
            gone, new = removed_gap.get(gap, []), added_gap.get(gap, [])
            for a, b in zip(gone, new):
                names[b] = a
                out.changes.setdefault(a, []).append(NodeChange(v, "replaced", _replaced_detail(by_a[a], by_b[b]), b))
            for a in gone[len(new):]:
                out.changes.setdefault(a, []).append(NodeChange(v, "absent", f"{by_a[a].target} absent"))
            for b in new[len(gone):]:
                node = by_b[b]
                key = (gap, node.id, node.target)
                mid = added_key.get(key)
                if mid is None:
                    taken = node.id in base_names or node.id in added_key.values()
                    mid = f"{node.id}@{label}" if taken else node.id
                    added_key[key] = mid
                    added_after.setdefault(gap, []).append(node.model_copy(update={"id": mid, "idx": next_idx}))
                    next_idx += 1
                names[b] = mid
                out.changes.setdefault(mid, []).append(NodeChange(v, "added", f"{node.target} added", b))
        # A replaced input is no "inputs differ" of its consumer: it is shown on the input itself.
        ext = {b: a for b, a in names.items() if a in base_pos}
        ins_a, ins_b = _inputs(base), _inputs(view)
        for p in diff.pairs:
            what = [w for w in p.changed if w != "inputs" or [ext.get(x) for x in ins_b.get(p.b, [])]
                    != ins_a.get(p.a, [])]
            if what:
                detail = _changed_detail(by_a[p.a], by_b[p.b], what)
                new_in = [x for x in ins_b.get(p.b, []) if x not in ext]
                if "inputs" in what and new_in:
                    detail = detail.replace("inputs differ", f"inputs differ (reads {', '.join(new_in[:3])})")
                out.changes.setdefault(p.a, []).append(NodeChange(v, "changed", detail, p.b))
        for e in view.edges:
            src, dst = names.get(e.src), names.get(e.dst)
            if src is None or dst is None or (src in base_names and dst in base_names):
                continue
            extra_edges.setdefault((src, dst, e.arg_pos), ViewEdge(src=src, dst=dst, arg_pos=e.arg_pos,
                                                                   size_bytes=e.size_bytes))
        out.names.append(names)
    if added_after or extra_edges:
        nodes = list(added_after.get(-1, []))
        for i, n in enumerate(base.nodes):
            nodes.append(n)
            nodes.extend(added_after.get(i, []))
        idx = {n.id: n.idx for n in nodes}
        edges = sorted([*base.edges, *extra_edges.values()], key=lambda e: (idx[e.src], idx[e.dst], e.arg_pos))
        out.view = GraphView.model_construct(graph_id=base.graph_id, name=base.name, kind=base.kind,
                                             nodes=nodes, edges=edges)
    return out


def _last_before(sorted_positions: list[int], pos: int) -> int:
    """The largest of ``sorted_positions`` below ``pos``, or -1."""
    import bisect

    k = bisect.bisect_left(sorted_positions, pos)
    return sorted_positions[k - 1] if k else -1
