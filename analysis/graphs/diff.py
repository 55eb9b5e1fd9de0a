"""Graph diff: which nodes of graph A and graph B correspond, and which were added, removed or changed.

Built for comparing two ranks' graphs or two compiles of one frame (cross-rank checks build on
it). Returns data only; the graph view draws the marks.

# NOTE: [Node matching]
Each graph becomes a sequence of node signatures ``(op, short target, module path)`` in graph
order, aligned by :class:`difflib.SequenceMatcher` (Ratcliff/Obershelp longest matching blocks,
autojunk off), so renamed nodes still pair up and an inserted op shifts nothing else. Inside a
``replace`` block, nodes pair up position by position when their op and target agree (their
module moved) and otherwise count as removed + added. A paired node is *changed* when its output
shape, dtype or the signatures of its inputs differ.
"""

from __future__ import annotations

import difflib

from pydantic import BaseModel, Field

from graphdeck.analysis.graphs.view import GraphView, short_target


class NodePair(BaseModel):
    a: str
    b: str
    changed: list[str] = Field(default_factory=list, description="what differs: 'shape', 'dtype', 'inputs', 'module'")


class GraphDiff(BaseModel):
    """The diff of graph ``a_id`` against ``b_id``; node ids are FX node names.

    A graph diffed against itself has ``counts == {"same": len(nodes), "changed": 0, "removed": 0,
    "added": 0}``; ``marks_a()`` / ``marks_b()`` give the SVG's ``marks`` argument for each side.
    """

    a_id: int
    b_id: int
    pairs: list[NodePair]
    removed: list[str] = Field(description="nodes of A with no counterpart in B")
    added: list[str] = Field(description="nodes of B with no counterpart in A")
    counts: dict[str, int]

    def marks_a(self) -> dict[str, str]:
        """Node id of A → ``removed`` / ``changed`` (unchanged nodes absent)."""
        marks = {n: "removed" for n in self.removed}
        marks.update({p.a: "changed" for p in self.pairs if p.changed})
        return marks

    def marks_b(self) -> dict[str, str]:
        """Node id of B → ``added`` / ``changed``."""
        marks = {n: "added" for n in self.added}
        marks.update({p.b: "changed" for p in self.pairs if p.changed})
        return marks


def _signature(node) -> tuple[str, str, str]:
    return (node.op, short_target(node.target) if node.op not in ("placeholder", "output") else node.op,
            node.namespace or "")


def diff_views(a: GraphView, b: GraphView) -> GraphDiff:
    """Align ``a`` and ``b`` (NOTE: [Node matching]) and classify every node."""
    sig_a = [_signature(n) for n in a.nodes]
    sig_b = [_signature(n) for n in b.nodes]
    matcher = difflib.SequenceMatcher(a=sig_a, b=sig_b, autojunk=False)
    raw: list[tuple[int, int]] = []
    removed, added = [], []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            raw.extend(zip(range(i1, i2), range(j1, j2)))
            continue
        k = 0
        if tag == "replace":
            while k < min(i2 - i1, j2 - j1) and sig_a[i1 + k][:2] == sig_b[j1 + k][:2]:
                raw.append((i1 + k, j1 + k))
                k += 1
        removed.extend(a.nodes[i].id for i in range(i1 + k, i2))
        added.extend(b.nodes[j].id for j in range(j1 + k, j2))
    a_to_b = {a.nodes[i].id: b.nodes[j].id for i, j in raw}
    inputs_a = _inputs(a)
    inputs_b = _inputs(b)
    pairs = []
    for i, j in raw:
        na, nb = a.nodes[i], b.nodes[j]
        changed = []
        if na.shape != nb.shape:
            changed.append("shape")
        if na.dtype != nb.dtype:
            changed.append("dtype")
        if [a_to_b.get(s) for s in inputs_a.get(na.id, [])] != inputs_b.get(nb.id, []):
            changed.append("inputs")
        if (na.namespace or "") != (nb.namespace or ""):
            changed.append("module")
        pairs.append(NodePair(a=na.id, b=nb.id, changed=changed))
    counts = {"same": sum(1 for p in pairs if not p.changed), "changed": sum(1 for p in pairs if p.changed),
              "removed": len(removed), "added": len(added)}
    return GraphDiff(a_id=a.graph_id, b_id=b.graph_id, pairs=pairs, removed=removed, added=added, counts=counts)


def _inputs(view: GraphView) -> dict[str, list[str]]:
    out: dict[str, list[tuple[int, str]]] = {}
    for e in view.edges:
        out.setdefault(e.dst, []).append((e.arg_pos, e.src))
    return {k: [s for _, s in sorted(v)] for k, v in out.items()}
