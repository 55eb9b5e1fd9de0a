"""The N-D parallel part of the ``partition`` overlay: FSDP2 groups, collectives per mesh
dimension, pipeline stages (issue 20; :func:`graphdeck.analysis.parallel.overlays.graph_overlay` merges it
with DDP's buckets).

# NOTE: [Partition overlay]
One categorical value per node, the first that applies:

1. **A collective and the mesh dimension it runs on** (``"tp collective"``): a
   ``_c10d_functional`` node (``all_gather_into_tensor``, ``reduce_scatter_tensor``,
   ``all_reduce``, ``all_to_all_single``, ``broadcast``, ...: what DTensor inserts into the AOT
   graphs for tensor parallelism, and what compiled FSDP2 / compiled autograd trace) names its
   process group by its last string argument (``group_name``, torch's ``_c10d_functional``
   schemas); the group is matched against the mesh dimensions' process groups of the rank's
   parallel-layout record (``dim_groups[].name``, NOTE: [Parallel layout]), else of any rank,
   else against the rank's process-group record (a DeviceMesh names its groups ``mesh_<dim>``).
   A ``wait_tensor`` takes its collective's value. An unmatched group shows as
   ``"collective (group <name>)"``.
2. **The FSDP2 group whose parameters a node reads** (``"fsdp blocks.0"``, ``"fsdp (root)"``):
   a placeholder bound to a parameter of a ``fully_shard`` group (the layout record's
   ``fsdp_groups``, else the communication-group record's ``fsdp``) and the nodes that read it,
   following views and casts of it (``t``, ``view``, ``_to_copy``, ...) to the op that uses it.
   Parameter names are compared without wrapper segments (``_checkpoint_wrapped_module``,
   ``_orig_mod``, ``_fsdp_wrapped_module``).
3. (DDP buckets, in ``overlays.py``.)
4. **Pipeline stage boundaries**: for a graph of a rank with a pipeline stage (the layout's
   ``stage_of``), tensor placeholders that are not parameters are ``"stage k input"`` (in a
   backward graph only the tangents: the gradient the next stage sends), the output node is
   ``"stage k output"``, every other node ``"stage k"``; the overlay's ``label`` names the stage
   (``"pipeline stage 1 of 2 (ScheduleGPipe, 4 microbatches)"``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from sqlalchemy import select
from sqlalchemy.orm import Session, aliased

from graphdeck.store.schema import CompileEvent, Graph, InternedString, Node

_WRAPPER_SEGMENTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})
#: Ops a parameter flows through on its way to the op that reads it (short target names).
_PASS_THROUGH = frozenset({"t", "view", "_unsafe_view", "reshape", "transpose", "permute", "expand", "detach",
                           "_to_copy", "to", "convert_element_type", "clone", "alias", "contiguous", "getitem",
                           "_to_copy_default", "unsqueeze", "squeeze", "as_strided", "to_local", "from_local"})


@dataclass
class ParallelPartition:
    """``values``: node name → value (NOTE: [Partition overlay]); ``label``: the graph's pipeline
    stage or None; ``notes``: what was (not) found, for the overlay's note."""

    values: dict[str, str] = field(default_factory=dict)
    label: str | None = None
    notes: list[str] = field(default_factory=list)


def norm_fqn(fqn: str) -> str:
    """``"blocks.1._checkpoint_wrapped_module.w1.weight"`` → ``"blocks.1.w1.weight"``."""
    return ".".join(p for p in fqn.split(".") if p not in _WRAPPER_SEGMENTS)


def _short(target: str) -> str:
    text = target.removeprefix("torch.ops.")
    parts = text.split(".")
    if parts[0] in ("aten", "_c10d_functional", "c10d_functional", "prims", "_dtensor") and len(parts) > 1:
        return parts[1]
    return parts[-1]


def _json(text: str | None, default):
    try:
        value = json.loads(text) if text else default
    except ValueError:
        return default
    return value if isinstance(value, type(default)) else default


def _last_event(session: Session, run_id: int, rank: int | None, name: str) -> dict:
    q = select(CompileEvent.payload).where(CompileEvent.run_id == run_id, CompileEvent.name == name)
    if rank is not None:
        q = q.where(CompileEvent.rank == rank)
    return _json(session.scalars(q.order_by(CompileEvent.id.desc()).limit(1)).first(), {})


def group_dims(layout, rank: int | None, pg_record: dict) -> dict[str, str]:
    """Process-group name → mesh dimension name: the rank's layout record first, then every
    other rank's, then the rank's process-group record (``desc`` ``mesh_<dim>``)."""
    out: dict[str, str] = {}
    if layout is not None:
        ranks = ([rank] if rank in layout.records else []) + [r for r in sorted(layout.records) if r != rank]
        for r in ranks:
            for mesh in layout.records[r].get("meshes") or []:
                for g in (mesh.get("dim_groups") if isinstance(mesh, dict) else None) or []:
                    if isinstance(g, dict) and g.get("name") is not None and g.get("dim"):
                        out.setdefault(str(g["name"]), str(g["dim"]))
    for g in pg_record.get("groups") or []:
        desc = str(g.get("desc") or "") if isinstance(g, dict) else ""
        if desc.startswith("mesh_") and g.get("name") is not None:
            out.setdefault(str(g["name"]), desc.removeprefix("mesh_"))
    return out


def _group_name(args: list, kwargs: dict) -> str | None:
    if isinstance(kwargs.get("group_name"), str):
        return kwargs["group_name"]
    return next((a for a in reversed(args) if isinstance(a, str)), None)


def fsdp_groups(layout, rank: int | None, comm_record: dict) -> dict[str, str]:
    """Normalised parameter fqn → its FSDP2 group's module path (``""`` for the root)."""
    out: dict[str, str] = {}
    groups = []
    if layout is not None and rank in layout.records:
        groups = layout.records[rank].get("fsdp_groups") or []
    if not groups:
        groups = comm_record.get("fsdp") or []
    for g in groups:
        if isinstance(g, dict):
            for p in g.get("params") or []:
                out.setdefault(norm_fqn(str(p)), str(g.get("module") or ""))
    return out


def _stage_label(layout, rank: int) -> tuple[int | None, str | None]:
    stage = layout.stage_of(rank) if layout is not None else None
    if stage is None:
        return None, None
    pipe = (layout.records.get(rank) or {}).get("pipeline") or {}
    extra = [str(pipe["schedule"])] if pipe.get("schedule") else []
    if isinstance(pipe.get("n_microbatches"), int):
        extra.append(f"{pipe['n_microbatches']} microbatches")
    total = f" of {pipe['num_stages']}" if isinstance(pipe.get("num_stages"), int) else ""
    return stage, f"pipeline stage {stage}{total}" + (f" ({', '.join(extra)})" if extra else "")


def parallel_partition(session: Session, graph: Graph) -> ParallelPartition:
    """The N-D parallel values of stored ``graph`` (NOTE: [Partition overlay]); empty values when
    the run recorded no layout, no FSDP2 group and the graph has no collective."""
    from graphdeck.analysis.parallel.layout import load_layout

    out = ParallelPartition()
    layout = load_layout(session, graph.run_id)
    target = aliased(InternedString)
    rows = session.execute(
        select(Node.idx, Node.name, Node.op, target.value, Node.args_json, Node.param_fqn, Node.desc, Node.shape_json)
        .join(target, Node.target_id == target.id).where(Node.graph_id == graph.id).order_by(Node.idx)).all()
    args = {r[1]: _json(r[4], {}) for r in rows}
    users: dict[str, list[str]] = {}
    for name, a in args.items():
        for ref in _refs(a):
            users.setdefault(ref, []).append(name)
    short = {r[1]: _short(r[3] or "") for r in rows}
    ops = {r[1]: r[2] for r in rows}

    # 1. collectives by mesh dimension
    dims = group_dims(layout, graph.rank, _last_event(session, graph.run_id, graph.rank, "graphdeck_process_groups"))
    collectives = [r for r in rows if "c10d" in (r[3] or "") and r[2] == "call_function"]
    counts: dict[str, int] = {}
    for r in collectives:
        if short[r[1]] == "wait_tensor":
            continue
        a = args[r[1]]
        pg = _group_name(a.get("args") or [], a.get("kwargs") or {})
        value = f"{dims[pg]} collective" if pg in dims else f"collective (group {pg})"
        out.values[r[1]] = value
        counts[value] = counts.get(value, 0) + 1
    for r in collectives:
        if short[r[1]] == "wait_tensor":
            src = next(iter(_refs(args[r[1]])), None)
            while src is not None and src not in out.values and short.get(src) == "getitem":
                src = next(iter(_refs(args.get(src, {}))), None)
            if src in out.values:
                out.values[r[1]] = out.values[src]
    if counts:
        out.notes.append(", ".join(f"{n} {v}{'s' if n > 1 else ''}" for v, n in sorted(counts.items())))

    # 2. FSDP2 groups
    groups = fsdp_groups(layout, graph.rank, _last_event(session, graph.run_id, graph.rank, "graphdeck_comm_groups"))
    seen_groups: set[str] = set()
    if groups:
        for idx, name, op, tgt, _a, fqn, _d, _s in rows:
            module = groups.get(norm_fqn(fqn)) if fqn and op in ("placeholder", "get_attr") else None
            if module is None:
                continue
            value = f"fsdp {module or '(root)'}"
            seen_groups.add(value)
            out.values.setdefault(name, value)
            todo = list(users.get(name, []))
            while todo:
                user = todo.pop()
                if ops.get(user) == "output" or (user in out.values and out.values[user] != value):
                    continue
                out.values[user] = value
                if short.get(user) in _PASS_THROUGH:
                    todo.extend(u for u in users.get(user, []) if u not in out.values)
        out.notes.append(f"{len(seen_groups)} FSDP2 group{'s' if len(seen_groups) != 1 else ''} read here"
                         if seen_groups else "no parameter of an FSDP2 group is read in this graph")

    # 4. pipeline stage
    stage, out.label = _stage_label(layout, graph.rank)
    if stage is not None:
        backward = graph.kind == "aot_backward"
        for idx, name, op, tgt, _a, fqn, desc, shape in rows:
            if name in out.values:
                continue
            if op == "output":
                out.values[name] = f"stage {stage} output"
            elif op == "placeholder" and not fqn and shape is not None and (
                    not backward or "Tangent" in (desc or "")):
                out.values[name] = f"stage {stage} input"
            else:
                out.values[name] = f"stage {stage}"
    return out


def _refs(value) -> list[str]:
    """Node names referenced in a stored argument structure (``{"node": name}`` leaves)."""
    out: list[str] = []
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            if isinstance(v.get("node"), str) and len(v) == 1:
                out.append(v["node"])
            else:
                stack.extend(reversed(list(v.values())))
        elif isinstance(v, list):
            stack.extend(reversed(v))
    return out
