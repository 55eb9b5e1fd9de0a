"""A stored Dynamo graph read back as a :class:`~graphdeck.analysis.gradients.cuts.FlowGraph` for
the gradient-path report (:mod:`graphdeck.analysis.gradients.graph`): its nodes and edges by plain
SQL (:func:`fetch`: no ORM objects, for graphs of 10^5 nodes), the interned strings it needs in
batches, and the per-node ids that explain a cut."""

from __future__ import annotations

import json

from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.gradients.cuts import GRAD_MODE_TARGETS, FlowGraph, grad_off_mask, live_mask
from graphdeck.store.schema import InternedString, Node


class Strings:
    """Interned strings by id, fetched in batches."""

    def __init__(self, session: Session):
        self.s = session
        self.cache: dict[int, str] = {}

    def load(self, ids) -> None:
        need = [i for i in set(ids) if i is not None and i not in self.cache]
        for k in range(0, len(need), 900):
            chunk = need[k:k + 900]
            for sid, value in self.s.execute(select(InternedString.id, InternedString.value)
                                             .where(InternedString.id.in_(chunk))):
                self.cache[sid] = value

    def get(self, sid: int | None) -> str | None:
        if sid is None:
            return None
        if sid not in self.cache:
            self.load([sid])
        return self.cache.get(sid)


class LoadedGraph:
    """One Dynamo graph as a FlowGraph plus the per-node ids needed to explain a cut."""

    def __init__(self, session: Session, strings: Strings, graph_id: int, dead_names: set[str]):
        rows = fetch(session, "SELECT name, op, target_id, dtype, shape_json IS NOT NULL, "
                              "meta_json LIKE '%\"value\"%', stack_trace_id, module_path_id, shape_json = '[]' "
                              "FROM nodes WHERE graph_id = ? ORDER BY idx", (graph_id,))
        self.graph_id = graph_id
        n = len(rows)
        names, ops, target_ids, dtypes, is_tensor, has_value, self.stack_ids, self.module_ids, self.scalar = (
            list(col) for col in zip(*rows)) if rows else ([] for _ in range(9))
        # Targets matter for ops only (a placeholder's target is its own name: 10^4 strings).
        strings.load(t for t, op in zip(target_ids, ops) if op not in ("placeholder", "output", "get_attr"))
        cache = strings.cache
        targets = [cache.get(t, "") if op not in ("placeholder", "output", "get_attr") else ""
                   for t, op in zip(target_ids, ops)]
        tensor = [True if a else (False if b else None) for a, b in zip(is_tensor, has_value)]
        users = users_of(session, graph_id, n)
        grad_args: dict[int, bool | None] = {}
        mode_idx = [i for i, t in enumerate(targets) if t in GRAD_MODE_TARGETS]
        if mode_idx:
            for idx, args in session.execute(select(Node.idx, Node.args_json).where(
                    Node.graph_id == graph_id, Node.idx.in_(mode_idx))):
                try:
                    a = json.loads(args)
                    a = a.get("args", a) if isinstance(a, dict) else a
                    grad_args[idx] = bool(a[0]) if a and isinstance(a[0], (bool, int)) else None
                except (ValueError, TypeError, IndexError, AttributeError):
                    grad_args[idx] = None
        self.by_name = {name: i for i, name in enumerate(names)}
        self.flow = FlowGraph(names=names, ops=ops, targets=targets, dtypes=dtypes, tensor=tensor,
                              users=users, grad_off=grad_off_mask(ops, targets, grad_args), source=[None] * n,
                              modules=[None] * n,
                              dead={self.by_name[x] for x in dead_names if x in self.by_name})
        self.live = live_mask(self.flow)
        outputs = {i for i, op in enumerate(ops) if op == "output"}
        self.output_producers = sorted({i for i in range(n) if users[i] and users[i][-1] in outputs}
                                       | {i for i in range(n) for u in users[i][:-1] if u in outputs})


def fetch(session: Session, sql: str, params: tuple = ()) -> list:
    """Rows of a plain SQL query (qmark parameters) on the session's connection: no ORM objects,
    which matters for graphs of 10^5 nodes."""
    conn = session.connection()
    if conn.dialect.paramstyle != "qmark":  # psycopg: format style; our SQL holds no literal '?'
        sql = sql.replace("%", "%%").replace("?", "%s")
    cursor = conn.connection.cursor()  # the driver's own cursor: plain tuples
    try:
        cursor.execute(sql, params)
        return cursor.fetchall()
    finally:
        cursor.close()


def users_of(session: Session, graph_id: int, n: int) -> list[list[int]]:
    """``users[i]``: positions of the nodes reading node ``i`` (edges of ``graph_id``)."""
    users: list[list[int]] = [[] for _ in range(n)]
    for src, dst in fetch(session, "SELECT src_idx, dst_idx FROM edges WHERE graph_id = ?", (graph_id,)):
        if 0 <= src < n and 0 <= dst < n:
            users[src].append(dst)
    return users
