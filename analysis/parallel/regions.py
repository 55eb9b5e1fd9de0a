"""Activation-checkpoint and autocast regions of a stored graph: which nodes each one holds.

# NOTE: [Graph regions]
What a captured graph records of these regions (torch 2.9 – 2.13, read from the stored rows):

* **Autocast, Dynamo graph**: ``torch.autocast`` inside a compiled region is traced as a call of
  ``torch.amp.autocast_mode._enter_autocast(device, dtype, enabled, cache_enabled)`` and later
  ``_exit_autocast(<the enter node>)``; the region is every node between the two in graph order
  (the pair is matched by the exit's argument, so nested regions pair correctly). An enter with
  no exit in the graph (a graph break inside the region) runs to the graph's end. Newer tracers
  emit one higher-order node ``wrap_with_autocast(device, dtype, enabled, cache_enabled, body,
  *args)`` instead; its region is that node, its body ``get_attr`` and its ``getitem`` users.
  AOTAutograd graphs keep no trace of autocast (only the casts it inserted).
* **Activation checkpoint, Dynamo graph**: ``checkpoint(fn, use_reentrant=False)`` becomes one
  higher-order node ``tag_activation_checkpoint(wrap_body_N, *args)`` whose body is a submodule
  the store does not keep as nodes; the capture keeps a summary in the node's ``meta["body"]``
  (``capture/fxrecord.py``: body name, the body nodes' common module path, op names). The region
  is that node, the body ``get_attr`` and the ``getitem`` users, placed at the body's module.
* **Activation checkpoint, AOT graphs**: the partitioner tags the forward ops of a checkpointed
  region with ``meta["recompute"]`` (``CheckpointPolicy.PREFER_RECOMPUTE`` / ``MUST_RECOMPUTE``)
  and ``meta["ac_graph_id"]`` (one id per ``checkpoint`` call), both stored. In the forward graph
  the region is the nodes of one ``ac_graph_id`` (captures without ``ac_graph_id``: every
  ``*_RECOMPUTE`` node, one region); in the backward graph, the forward nodes recomputed there
  (``partitioner_tag == "is_forward"``) with an ``ac_graph_id``, one region per id. Forward nodes
  the min-cut partitioner chose to recompute on its own (no ``ac_graph_id``) are no region.
  ``MUST_SAVE`` marks a region's saved inputs, outside it.

Pure: reads rows, returns data; nothing here draws (``server/render/regions.py`` does).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from sqlalchemy import or_, select
from sqlalchemy.orm import Session, aliased

from graphdeck.errors import NotFoundError
from graphdeck.store.schema import Graph, InternedString, Node

#: Region kinds, outermost-first order does not depend on them.
KINDS = ("autocast", "activation_checkpoint", "activation_checkpoint_recomputed")
_RECOMPUTE = ("PREFER_RECOMPUTE", "MUST_RECOMPUTE")
_SKIP_OPS = ("placeholder", "output")


@dataclass
class Region:
    """One region: ``kind`` (one of :data:`KINDS`), ``label`` (drawn on its box, e.g.
    ``"autocast cpu bfloat16"``, ``"activation checkpoint: layers.1"``), ``nodes`` (FX node names,
    graph order), ``module`` (module path ``"a/b"`` the region's nodes are placed at, or None to
    keep theirs), ``detail`` (one line for a tooltip), ``markers`` (nodes of ``nodes`` that only
    mark the region's ends, ``_enter_autocast`` / ``_exit_autocast``: they follow the box and do
    not decide where it goes)."""

    kind: str
    label: str
    nodes: list[str] = field(default_factory=list)
    module: str | None = None
    detail: str = ""
    markers: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "label": self.label, "nodes": list(self.nodes), "module": self.module,
                "detail": self.detail, "markers": list(self.markers)}


@dataclass
class _Row:
    idx: int
    name: str
    op: str
    target: str
    args: list
    meta: dict
    module: str | None
    tag: str | None
    fqn: str | None = None


def _loads(text: str | None, default):
    try:
        value = json.loads(text) if text else default
    except ValueError:
        return default
    return value if isinstance(value, type(default)) else default


def _args(text: str | None) -> list:
    """A stored node's positional arguments (``args_json`` is ``{"args": [...], "kwargs": {...}}``)."""
    value = _loads(text, {})
    args = value.get("args") if isinstance(value, dict) else None
    return args if isinstance(args, list) else []


def graph_regions(session: Session, graph_id: int) -> list[Region]:
    """The regions of stored graph ``graph_id`` (NOTE: [Graph regions]), outermost first
    (larger regions before the ones they may hold), ties in graph order.

    Raises:
        NotFoundError: no graph ``graph_id``.
    """
    graph = session.get(Graph, graph_id)
    if graph is None:
        raise NotFoundError(f"graph {graph_id} not found", resource="graph", id=graph_id)
    target, module = aliased(InternedString), aliased(InternedString)
    if not _may_have_regions(session, graph_id):
        return []
    rows = [
        _Row(idx, name, op, tgt or "", _args(args), _loads(meta, {}), (mod or "").strip("/") or None, tag, fqn)
        for idx, name, op, tgt, args, meta, mod, tag, fqn in session.execute(
            select(Node.idx, Node.name, Node.op, target.value, Node.args_json, Node.meta_json, module.value,
                   Node.partitioner_tag, Node.param_fqn)
            .join(target, Node.target_id == target.id).outerjoin(module, Node.module_path_id == module.id)
            .where(Node.graph_id == graph_id).order_by(Node.idx))
    ]
    return find_regions(rows, graph.kind)


def _may_have_regions(session: Session, graph_id: int) -> bool:
    """One indexed pass in SQL before any row is parsed: an autocast or checkpoint target, or
    a recompute tag (most graphs have neither)."""
    target = aliased(InternedString)
    hit = session.execute(
        select(Node.idx).join(target, Node.target_id == target.id)
        .where(Node.graph_id == graph_id, or_(target.value.like("%autocast%"), target.value.like("%checkpoint%"),
                                             Node.meta_json.like('%"recompute"%'),
                                             Node.meta_json.like('%"ac_graph_id"%')))
        .limit(1)).first()
    return hit is not None


def find_regions(rows: list, kind: str) -> list[Region]:
    """:func:`graph_regions` on rows with ``idx, name, op, target, args, meta, module, tag, fqn``
    (graph order) of a graph of ``kind`` (``dynamo``, ``aot_forward``, ``aot_backward``, ...)."""
    by_name = {r.name: r for r in rows}
    out = _autocast(rows) + _hop_regions(rows, by_name)
    if kind in ("aot_forward", "aot_backward", "aot_joint", "aot_inference"):
        out += _recompute(rows, by_name, backward=kind == "aot_backward")
    order = {r.name: r.idx for r in rows}
    return sorted(out, key=lambda r: (-len(r.nodes), min((order[n] for n in r.nodes), default=0)))


def _short(target: str) -> str:
    return target.rsplit(".", 1)[-1]


def _ref(value) -> str | None:
    return value.get("node") if isinstance(value, dict) and isinstance(value.get("node"), str) else None


def _const(value) -> str | None:
    if value is None:
        return None
    if isinstance(value, dict):
        value = value.get("repr")
    return None if value is None else str(value).removeprefix("torch.")


def _autocast_label(args: list) -> str:
    device = _const(args[0]) if args else None
    dtype = _const(args[1]) if len(args) > 1 else None
    enabled = args[2] if len(args) > 2 else True
    label = " ".join(p for p in ("autocast", device, dtype) if p)
    return label + (" disabled" if enabled is False else "")


def _autocast(rows: list) -> list[Region]:
    enters = {r.name: r for r in rows if _short(r.target) == "_enter_autocast"}
    exits = {}
    for r in rows:
        if _short(r.target) == "_exit_autocast" and r.args and _ref(r.args[0]) in enters:
            exits[_ref(r.args[0])] = r
    out = []
    last = rows[-1].idx if rows else 0
    for name, enter in enters.items():
        end = exits.get(name)
        stop = end.idx if end is not None else last
        nodes = [r.name for r in rows if enter.idx <= r.idx <= stop and r.op not in _SKIP_OPS]
        detail = f"torch.autocast from {name} to " + (end.name if end is not None else "the end of the graph (no exit "
                                                      "in this graph: a graph break inside the region?)")
        markers = [name] + ([end.name] if end is not None else [])
        out.append(Region("autocast", _autocast_label(enter.args), nodes, None, detail, markers))
    return out


def _hop_regions(rows: list, by_name: dict) -> list[Region]:
    users: dict[str, list[str]] = {}
    for r in rows:
        if _short(r.target) in ("getitem",) and r.args and _ref(r.args[0]):
            users.setdefault(_ref(r.args[0]), []).append(r.name)
    out = []
    for r in rows:
        short = _short(r.target)
        if short not in ("tag_activation_checkpoint", "wrap_with_autocast", "checkpoint"):
            continue
        body = r.meta.get("body") if isinstance(r.meta.get("body"), dict) else {}
        attrs = [n for n in map(_ref, r.args) if n and by_name.get(n) is not None and by_name[n].op == "get_attr"]
        nodes = attrs + [r.name] + users.get(r.name, [])
        module = str(body.get("module") or "").strip("/") or None
        ops = ", ".join(str(o) for o in body.get("ops") or [])
        detail = (f"body {body.get('name') or (attrs[0] if attrs else '?')}"
                  + (f": {body.get('nodes')} ops ({ops})" if body.get("nodes") is not None else " (not stored)"))
        if short == "wrap_with_autocast":
            label = _autocast_label(r.args)
            out.append(Region("autocast", label, nodes, module, detail))
        else:
            where = (_model_path(module, [r], by_name) or module or body.get("name") or (attrs[0] if attrs else r.name))
            out.append(Region("activation_checkpoint", f"activation checkpoint: {where}", nodes, module, detail))
    return out


def _common_module(rows: list) -> str | None:
    """The module path every row's module lies under (part by part), or None."""
    paths = [r.module.split("/") for r in rows if r.module]
    if not paths:
        return None
    return "/".join(os.path.commonprefix(paths)) or None


_WRAPPERS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module", "__dict__", "_modules"})


def _model_path(module: str | None, members: list, by_name: dict) -> str | None:
    """The region's module as a dotted path in the model (``"blocks.1"``): the graph-relative
    ``module`` (``"a/b"``; a graph compiled per block has paths relative to the block) located in
    the names of the parameters the region's nodes read, wrapper segments
    (``_checkpoint_wrapped_module``, ...) dropped; the relative path when no parameter is read."""
    rel = "/".join(p for p in (module or "").split("/") if p and p not in _WRAPPERS)
    fqns = []
    for m in members:
        for a in m.args:
            src = by_name.get(_ref(a)) if _ref(a) else None
            if src is not None and src.fqn:
                fqns.append([p for p in src.fqn.split(".") if p not in _WRAPPERS][:-1])
    for parts in fqns if rel else []:  # "/"- and "."-joined parts align char by char
        at = ("/" + "/".join(parts) + "/").find("/" + rel + "/")
        if at >= 0:
            return ".".join(parts)[: at + len(rel)] or None
    if fqns and not rel:
        return ".".join(os.path.commonprefix(fqns)) or None
    return rel.replace("/", ".") or None


def _recompute(rows: list, by_name: dict, backward: bool) -> list[Region]:
    groups: dict[str, list] = {}
    for r in rows:
        if r.op in _SKIP_OPS:
            continue
        ac = r.meta.get("ac_graph_id")
        if backward:
            if r.tag == "is_forward" and ac is not None:
                groups.setdefault(str(ac), []).append(r)
        elif ac is not None:
            groups.setdefault(str(ac), []).append(r)
        elif str(r.meta.get("recompute") or "").endswith(_RECOMPUTE):
            groups.setdefault("", []).append(r)
    out = []
    for ac, members in groups.items():
        module = _model_path(_common_module(members), members, by_name)
        where = f": {module}" if module else ""
        if backward:
            label = f"activation checkpoint (recomputed){where}"
            detail = (f"{len(members)} forward ops of checkpointed region {ac} run again in the backward "
                      "(meta ac_graph_id)")
            kind = "activation_checkpoint_recomputed"
        else:
            label = f"activation checkpoint{where}"
            detail = (f"{len(members)} ops tagged for recomputation"
                      + (f" (checkpointed region {ac}, meta ac_graph_id)" if ac else " (meta recompute)"))
            kind = "activation_checkpoint"
        out.append(Region(kind, label, [r.name for r in members], None, detail))
    return out
