"""Node-level comparison of two stored graphs: the first node where their node lists differ
(:func:`first_node_difference`, aligned with :mod:`difflib`), the node rows it reads
(:func:`_node_rows`) and the comparable key, argument shape and :class:`NodeRef` made of a row.
The rank check (:mod:`graphdeck.analysis.ranks.core`, which re-exports these names), the mesh,
constants and shard-shape explanations and the run diff share them."""

from __future__ import annotations

import difflib
import json
import re

from sqlalchemy import select
from sqlalchemy.orm import Session, aliased

from graphdeck.analysis.ranks.records import NodeRef
from graphdeck.analysis.ranks.schedules import source_line
from graphdeck.store.schema import InternedString, Node

#: Longest differing middle (nodes) that :func:`first_node_difference` aligns with difflib.
ALIGN_LIMIT = 3000


def _node_rows(session: Session, graph_id: int, idx: int | None = None) -> list:
    """``(idx, name, op, target, shape_json, dtype, stride_json, module path, stack trace,
    args_json)`` per node of ``graph_id`` in graph order (only node ``idx`` when given)."""
    target = aliased(InternedString)
    module = aliased(InternedString)
    stack = aliased(InternedString)
    query = (select(Node.idx, Node.name, Node.op, target.value, Node.shape_json, Node.dtype, Node.stride_json,
                    module.value, stack.value, Node.args_json)
             .join(target, target.id == Node.target_id)
             .outerjoin(module, module.id == Node.module_path_id)
             .outerjoin(stack, stack.id == Node.stack_trace_id)
             .where(Node.graph_id == graph_id))
    if idx is not None:
        query = query.where(Node.idx == idx)
    return session.execute(query.order_by(Node.idx)).all()


def _node_key(row) -> tuple:
    # Placeholder targets are input names, not structure; everything else is compared as stored.
    return (row[2], "" if row[2] == "placeholder" else row[3], row[4], row[5], row[6])


def first_node_difference(session: Session, graph_a: int, graph_b: int
                          ) -> tuple[NodeRef | None, NodeRef | None, str | None]:
    """The first place (graph order) where two graphs' node lists differ, aligned as sequences of
    (op, target, shape, dtype, stride, arguments with node names replaced) with :mod:`difflib`, so
    one inserted node does not make every later node "differ". Returns ``(node of a, node of b,
    change)`` with change ``"added"`` (only in b; node of a is None), ``"removed"`` (only in a) or
    ``"changed"``; ``(None, None, None)`` when the lists agree."""
    rows_a, rows_b = _node_rows(session, graph_a), _node_rows(session, graph_b)
    keys_a = [(*_node_key(r), _args_shape(r)) for r in rows_a]
    keys_b = [(*_node_key(r), _args_shape(r)) for r in rows_b]
    # Equal prefix and suffix first (linear); align only the middle, whose size is what differs.
    # SequenceMatcher is quadratic on graphs of repeated layers, so a middle past
    # ALIGN_LIMIT nodes is reported as changed at its first node without alignment.
    lo = 0
    while lo < len(keys_a) and lo < len(keys_b) and keys_a[lo] == keys_b[lo]:
        lo += 1
    hi_a, hi_b = len(keys_a), len(keys_b)
    while hi_a > lo and hi_b > lo and keys_a[hi_a - 1] == keys_b[hi_b - 1]:
        hi_a, hi_b = hi_a - 1, hi_b - 1
    if lo == hi_a and lo == hi_b:
        return None, None, None
    if lo == hi_a:
        return None, _ref(graph_b, rows_b[lo]), "added"
    if lo == hi_b:
        return _ref(graph_a, rows_a[lo]), None, "removed"
    if max(hi_a, hi_b) - lo > ALIGN_LIMIT:
        return _ref(graph_a, rows_a[lo]), _ref(graph_b, rows_b[lo]), "changed"
    matcher = difflib.SequenceMatcher(None, keys_a[lo:hi_a], keys_b[lo:hi_b], autojunk=False)
    for tag, i1, _i2, j1, _j2 in matcher.get_opcodes():
        i1, j1 = i1 + lo, j1 + lo
        if tag == "equal":
            continue
        if tag == "insert":
            return None, _ref(graph_b, rows_b[j1]), "added"
        if tag == "delete":
            return _ref(graph_a, rows_a[i1]), None, "removed"
        return _ref(graph_a, rows_a[i1]), _ref(graph_b, rows_b[j1]), "changed"
    return None, None, None


def _args_shape(row, at: int = 9) -> str:
    """Arguments (``row[at]``) with node names replaced by their position, so renamed nodes
    compare equal."""
    return re.sub(r'\{"node": "[^"]*"\}', "N", row[at] or "")


def _ref(graph_id: int, row) -> NodeRef:
    shape = row[4]
    return NodeRef(graph_id=graph_id, idx=row[0], name=row[1], op=row[2], target=row[3],
                   shape=shape, dtype=row[5], module_path=row[7], source=source_line(row[8]),
                   args=_args_text(row[9]))


def _args_text(args_json: str | None, limit: int = 120) -> str | None:
    """A node's arguments as a call reads them — ``where, 1024`` (node names, constants,
    ``key=value``) — cut at ``limit`` characters; None when it has none or they are unreadable."""
    try:
        data = json.loads(args_json or "null")
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None

    def show(v) -> str:
        if isinstance(v, dict) and set(v) == {"node"}:
            return str(v["node"])
        if isinstance(v, list):
            return "[" + ", ".join(show(x) for x in v) + "]"
        return json.dumps(v) if isinstance(v, str) else str(v)

    parts = [show(a) for a in data.get("args") or []]
    parts += [f"{k}={show(v)}" for k, v in (data.get("kwargs") or {}).items()]
    text = ", ".join(parts)
    return (text[:limit - 1] + "…" if len(text) > limit else text) or None
