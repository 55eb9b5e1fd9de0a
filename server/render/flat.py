"""Clusters for big graphs without module paths: by parameter, else by stack-trace frame.

An optimizer step (``torch.optim`` compiled: ``_foreach_*`` ops over lists of every parameter,
then one ``getitem`` per element and an in-place ``copy_`` per state tensor), a fused kernel's
graph or an imported log carries no ``nn_module_stack``: every node is at the top level, and the
4,611-node AdamW graph of the shipped GPT-2 store was drawn as 4,611 loose nodes.

# NOTE: [Clusters of flat graphs]
A graph is *flat* when it has more than :data:`MIN_NODES` nodes and fewer than
:data:`MAX_MODULE_SHARE` of its ops have a module path. Its nodes are then grouped by the
parameter they read or write, found from the graph's own structure (union-find over node names):

* the ``i``-th elements of the list arguments of one call (``_foreach_add(exp_avgs, grads)``)
  belong to the same parameter, and so does ``getitem(F, i)`` with the ``i``-th elements of the
  lists ``F`` took;
* then, in graph order, any other op that reads exactly one of those groups joins it
  (``copy_(param, getitem_k)``, ``mul(getitem_k, lr)``: ``lr`` stays where it is); an op reading
  several groups (the ``_foreach_*`` ops themselves, a global norm) is *shared* and stays
  outside every group, and so does an op reading none.

A group of two or more nodes becomes the cluster ``param_group <g>/<name>`` where ``<name>`` is,
in this order: the ``param_fqn`` of one of its placeholders; the parameter Dynamo's source name
spells (``self___param_groups_0__params___7`` → ``params[7]``, group 0), read from the node's
name or, for an AOT graph of a Dynamo graph, from the Dynamo graph's input at the same position
(AOT lifts the Dynamo graph's attributes, then its placeholders, in node order; used only when
both graphs have as many inputs and every input's shape is equal); else the name of the group's
first input. When more than ``MIN_NODES / 4`` ops are left outside every group (a graph with no
list arguments), they are grouped by the innermost frame of their stack trace (``frame
adam.py:248 step``) if that makes several groups; fewer (the ``_foreach_*`` ops of an optimizer
step) stay at the top level, between the parameters' boxes.
Each namespace so made is marked ``namespace_from="param"`` / ``"frame"``.
"""

from __future__ import annotations

import re

from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.graphs.view import GraphView, loads_json
from graphdeck.store.schema import Graph, InternedString, Node

#: Graphs up to this many nodes are drawn as they are.
MIN_NODES = 400
#: A graph where at least this share of ops has a module path is not flat.
MAX_MODULE_SHARE = 0.1
_PARAM = re.compile(r"param_groups_+(\d+)_+params_+(\d+)", re.IGNORECASE)
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_PLACED = ("placeholder", "get_attr", "output")


def is_flat(view: GraphView) -> bool:
    """Whether ``view`` is big and (nearly) without module paths (NOTE: [Clusters of flat graphs])."""
    ops = [n for n in view.nodes if n.op not in _PLACED]
    if len(view.nodes) <= MIN_NODES or not ops:
        return False
    return sum(1 for n in ops if n.namespace) < MAX_MODULE_SHARE * len(ops)


class _Groups:
    """Union-find over node names."""

    def __init__(self):
        self.parent: dict[str, str] = {}
        self.sizes: dict[str, int] = {}

    def size(self, x: str) -> int:
        return self.sizes.get(self.find(x), 1)

    def find(self, x: str) -> str:
        root = x
        while self.parent.get(root, root) != root:
            root = self.parent[root]
        while self.parent.get(x, x) != root:
            self.parent[x], x = root, self.parent[x]
        return root

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        self.parent.setdefault(ra, ra)
        if ra != rb:
            self.parent[rb] = ra
            self.sizes[ra] = self.sizes.get(ra, 1) + self.sizes.pop(rb, 1)


def _refs(value) -> list[str]:
    """Node names referenced anywhere in an FX argument as capture stores it (``{"node": n}``)."""
    if isinstance(value, dict):
        if isinstance(value.get("node"), str) and len(value) == 1:
            return [value["node"]]
        return [r for v in value.values() for r in _refs(v)]
    if isinstance(value, list):
        return [r for v in value for r in _refs(v)]
    return []


def _node_lists(args) -> list[list[str]]:
    """The arguments of a call that are lists of at least two node references."""
    out = []
    for a in args if isinstance(args, list) else []:
        if isinstance(a, list) and len(a) >= 2 and all(isinstance(x, dict) and isinstance(x.get("node"), str) for x in a):
            out.append([x["node"] for x in a])
    return out


def param_groups(view: GraphView, calls: dict[str, list]) -> dict[str, str]:
    """Node name → the name of its group's root, for nodes in a group of two or more
    (NOTE: [Clusters of flat graphs]); ``calls``: node name → its positional args as stored."""
    ops = {n.id: n.op for n in view.nodes}
    groups = _Groups()
    lists_of: dict[str, list[list[str]]] = {}
    shared: set[str] = set()
    for n in view.nodes:
        args = calls.get(n.id) or []
        lists = _node_lists(args)
        if lists:
            lists_of[n.id] = lists
            shared.add(n.id)
            by_len: dict[int, list[list[str]]] = {}
            for lst in lists:
                by_len.setdefault(len(lst), []).append(lst)
            for same in by_len.values():
                for lst in same[1:]:
                    for a, b in zip(same[0], lst):
                        groups.union(a, b)
        elif n.label == "getitem" and len(args) == 2 and isinstance(args[1], int) and not isinstance(args[1], bool):
            src = _refs(args[0])
            for lst in lists_of.get(src[0] if src else "", []):
                if 0 <= args[1] < len(lst):
                    groups.union(lst[args[1]], n.id)
    seeded = {groups.find(name) for name in groups.parent}  # groups the list arguments made
    for n in view.nodes:  # other ops join the one such group they read (other inputs stay where they are)
        if n.id in shared or n.id in groups.parent or ops[n.id] in _PLACED:
            continue
        roots = {groups.find(r) for r in _refs(calls.get(n.id) or []) if r in groups.parent}
        if len(roots & seeded) == 1 and not roots & shared:
            groups.union(next(iter(roots & seeded)), n.id)
    out: dict[str, list[str]] = {}
    for name in groups.parent:
        if name in ops and name not in shared:
            out.setdefault(groups.find(name), []).append(name)
    return {name: root for root, members in out.items() if len(members) >= 2 for name in members}


def _frame(stack: str | None) -> str | None:
    frames = _FRAME.findall(stack or "")
    if not frames:
        return None
    path, line, func = frames[-1]
    return f"frame {path.rsplit('/', 1)[-1]}:{line} {func}"


def _parent_inputs(session: Session, graph_id: int, view: GraphView) -> dict[str, tuple[str, str | None]]:
    """AOT placeholder name → (name, param_fqn) of the Dynamo parent's input at the same position,
    when both have as many inputs with equal shapes (else ``{}``)."""
    graph = session.get(Graph, graph_id)
    if graph is None or graph.parent_id is None or not graph.kind.startswith("aot_"):
        return {}
    rows = session.execute(select(Node.idx, Node.name, Node.op, Node.shape_json, Node.param_fqn)
                           .where(Node.graph_id == graph.parent_id, Node.op.in_(("get_attr", "placeholder")))
                           .order_by(Node.idx)).all()
    parent = [r for r in rows if r.op == "get_attr"] + [r for r in rows if r.op == "placeholder"]
    mine = [n for n in view.nodes if n.op == "placeholder"]
    if len(parent) != len(mine) or any(loads_json(p.shape_json) != n.shape for p, n in zip(parent, mine)):
        return {}
    return {n.id: (p.name, p.param_fqn) for p, n in zip(parent, mine)}


def _group_name(members: list, parent: dict) -> tuple[str, str]:
    """(param group segment, parameter segment) of a group's cluster path."""
    placeholders = [n for n in members if n.op in ("placeholder", "get_attr")]
    for n in placeholders:
        if n.param_fqn:
            return "param_group", n.param_fqn
    for n in members:
        for name in (n.id, (parent.get(n.id) or ("",))[0]):
            m = _PARAM.search(name)
            if m:
                return f"param_group {m.group(1)}", f"params[{m.group(2)}]"
    first = (placeholders or members)[0]
    return "param_group", first.id


def with_flat_clusters(session: Session, graph_id: int, view: GraphView) -> GraphView:
    """``view`` of stored graph ``graph_id`` with namespaces for a flat graph (NOTE: [Clusters of
    flat graphs]); ``view`` itself when it is not flat."""
    if not is_flat(view):
        return view
    rows = session.execute(select(Node.name, Node.args_json, InternedString.value)
                           .outerjoin(InternedString, Node.stack_trace_id == InternedString.id)
                           .where(Node.graph_id == graph_id)).all()
    calls, stacks = {}, {}
    for name, args_json, stack in rows:
        args = loads_json(args_json) or {}
        calls[name] = args.get("args", []) if isinstance(args, dict) else args
        stacks[name] = stack
    return cluster_flat(view, calls, stacks, _parent_inputs(session, graph_id, view))


def cluster_flat(view: GraphView, calls: dict[str, list], stacks: dict[str, str | None],
                 parent: dict[str, tuple[str, str | None]] | None = None) -> GraphView:
    """``view`` with namespaces from :func:`param_groups` (and stack frames for the rest);
    ``calls``: node name → positional args as stored; ``stacks``: node name → stack trace."""
    parent = parent or {}
    root_of = param_groups(view, calls)
    by_root: dict[str, list] = {}
    for n in view.nodes:
        if n.id in root_of:
            by_root.setdefault(root_of[n.id], []).append(n)
    where: dict[str, tuple[str, str]] = {}
    taken: dict[tuple[str, str], str] = {}
    for root, members in by_root.items():
        path = _group_name(members, parent)
        k = 1
        while path in taken and taken[path] != root:
            k += 1
            path = (path[0], f"{_group_name(members, parent)[1]} #{k}")
        taken[path] = root
        for n in members:
            where[n.id] = path
    frames = {n.id: _frame(stacks.get(n.id)) for n in view.nodes
              if n.id not in where and n.op not in _PLACED}
    use_frames = len(frames) > MIN_NODES // 4 and len({f for f in frames.values() if f}) >= 2
    nodes = []
    for n in view.nodes:
        if n.id in where:
            ns, how = "/".join(p.replace("/", "\u2215") for p in where[n.id]), "param"
        elif use_frames and frames.get(n.id):
            ns, how = frames[n.id].replace("/", "\u2215"), "frame"
        else:
            nodes.append(n)
            continue
        nodes.append(n.model_copy(update={"namespace": ns, "namespace_from": how}))
    return type(view).model_construct(**{**{k: getattr(view, k) for k in type(view).model_fields}, "nodes": nodes})
