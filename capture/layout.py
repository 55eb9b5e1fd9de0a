"""The parallel layout of one rank — device meshes, DTensor placements, FSDP2 groups, tensor
parallel styles, the pipeline stage and schedule, checkpoint/autocast regions — recorded as soon
as it is known (issue 20).

# NOTE: [Capturing the parallel layout]
The record is a ``compile_events`` row ``name = "graphdeck_parallel_layout"`` whose JSON payload
is described in NOTE: [Parallel layout] (graphdeck/analysis/parallel/layout.py), read from torch's own
objects, never changing them:

- **meshes**: every ``DeviceMesh`` a watched parameter (a DTensor's ``device_mesh``), an FSDP2
  group (its ``mesh_info.mesh``) or a pipeline stage uses, recorded as its ROOT mesh
  (``_get_root_mesh()``: ``mesh["dp"]`` is recorded as the ``("dp", "tp")`` mesh it was cut
  from): ``mesh.mesh`` (global ranks), ``mesh_dim_names``, ``get_coordinate()`` and, per
  dimension, its process group's c10d name (``_dim_group_names``), ``group_desc`` and global
  ranks (``get_process_group_ranks``). A flattened mesh (``mesh._flatten("dp_cp")``) whose name
  is no dimension of its root is recorded on its own with ``"flattened_from"``.
- **params**: the watched models' DTensor parameters — under FSDP2 the SHARDED parameter of each
  ``FSDPParam`` (``sharded_param``; during FSDP2's forward the module holds the unsharded one),
  named by the watched model's names — with ``str(placement)`` per mesh dimension, the local
  (``_local_tensor``) and global shapes.
- **fsdp_groups**: per ``fully_shard`` module, its ``FSDPParamGroup``'s parameters, the mesh and
  its dimensions, and whether it reshards after forward (``post_forward_mesh_info`` set).
- **tp**: parallel styles found in the forward (pre-)hooks ``distribute_module`` registers for
  ``parallelize_module``: the hook's closure holds the style's bound ``_prepare_input_fn`` /
  ``_prepare_output_fn`` and the mesh. Styles applied otherwise are not seen (``[]``).
- **pipeline**: the ``torch.distributed.pipelining`` stage(s) and schedule of this rank. Seen
  without a user call when a stage's module is compiled through the agent's backend: the first
  compile runs inside ``schedule.step()``, and the calling frames (read, not changed, like
  NOTE: [Finding the DDP bucket]) hold the ``_PipelineSchedule`` and ``_PipelineStageBase``.
  A pipeline whose stages are not compiled through the agent is recorded by an explicit
  :meth:`graphdeck.capture.agent.Agent.watch_pipeline` (schedule or stage). ``stage_ranks[i]``
  is the global rank holding stage ``i`` (``stage_index_to_group_rank`` mapped through the
  stage's group); ``params`` are the stage module's parameter names (``_orig_mod.`` removed).
- **regions**: ``checkpoint_wrapper`` modules and modules under the composable ``checkpoint``
  (``activation_checkpoint``; ``torch.utils.checkpoint`` called inside a forward is visible only
  in the graph, as ``tag_activation_checkpoint``), and autocast that was on while a graph was
  compiled (``autocast``, with the compile id).

The agent writes the record at ``watch()``, at each compile (the point where a stage, a schedule
or FSDP2/TP placements applied after ``watch()`` become visible), at ``watch_pipeline()``, when
a profile ends and at ``close()``/exit — each time only when the payload differs from the last
one written. Everything here is best-effort and never raises into the job.
"""

from __future__ import annotations

import json
import sys
import warnings
import weakref
from typing import Any

import torch

EVENT_NAME = "graphdeck_parallel_layout"
VERSION = 1
_ORIG_MOD = "_orig_mod."


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _pg_by_name() -> dict[str, Any]:
    try:
        from torch.distributed import distributed_c10d as c10d

        return {str(name): pg for pg, name in list(c10d._world.pg_names.items())}
    except Exception:  # noqa: BLE001
        return {}


def _group_info(name: str | None, pgs: dict[str, Any]) -> dict:
    out: dict = {"name": name, "desc": None, "ranks": None}
    pg = pgs.get(str(name)) if name is not None else None
    dist = _dist()
    if pg is not None and dist is not None:
        try:
            out["desc"] = getattr(pg, "group_desc", None)
            out["ranks"] = [int(r) for r in dist.get_process_group_ranks(pg)]
        except Exception:  # noqa: BLE001
            pass
    return out


def _pg_name(pg) -> str | None:
    if pg is None:
        dist = _dist()
        pg = dist.group.WORLD if dist is not None else None
    try:
        from torch.distributed import distributed_c10d as c10d

        return str(c10d._world.pg_names.get(pg)) if pg is not None else None
    except Exception:  # noqa: BLE001
        return None


class _Meshes:
    """Root meshes seen so far, each with a key (``mesh0``, ...) in order of first appearance."""

    def __init__(self) -> None:
        self.entries: list[tuple[Any, dict]] = []

    def key_of(self, mesh) -> str | None:
        """The key of ``mesh``'s root mesh (recording it), or of ``mesh`` itself when it is a
        flattened mesh whose dimension its root does not name."""
        try:
            root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
            names = tuple(mesh.mesh_dim_names or ())
            root_names = tuple(root.mesh_dim_names or ())
            target, flat = (root, None) if set(names) <= set(root_names) else (mesh, root)
            for m, entry in self.entries:
                if m is target or m == target:
                    return entry["key"]
            # The root first: its key is taken before this mesh's (both were "mesh0" when the
            # first mesh seen was a flattened one, as torchtitan's "fsdp" cut from its "world").
            root_key = self.key_of(flat) if flat is not None else None
            entry = self._describe(target, f"mesh{len(self.entries)}")
            if flat is not None:
                entry["flattened_from"] = root_key
            self.entries.append((target, entry))
            return entry["key"]
        except Exception:  # noqa: BLE001 - capture never breaks training
            return None

    @staticmethod
    def _describe(mesh, key: str) -> dict:
        names = list(mesh.mesh_dim_names or [f"dim{i}" for i in range(mesh.ndim)])
        coord = mesh.get_coordinate()
        pgs = _pg_by_name()
        group_names = list(getattr(mesh, "_dim_group_names", None) or [])
        groups = []
        if coord is not None:
            for i, dim in enumerate(names):
                info = _group_info(group_names[i] if i < len(group_names) else None, pgs)
                groups.append({"dim": dim, **info})
        return {"key": key, "device_type": str(mesh.device_type), "shape": [int(s) for s in mesh.shape],
                "dim_names": names, "ranks": mesh.mesh.tolist(),
                "coord": [int(c) for c in coord] if coord is not None else None, "dim_groups": groups}

    def records(self) -> list[dict]:
        return [entry for _, entry in self.entries]

    def add_ddp(self, ddp) -> None:
        """Record the process group ``ddp`` (a ``DistributedDataParallel``) all-reduces over as a
        1-D mesh named ``ddp``, unless a recorded mesh already has that group as a dimension
        (DDP over ``mesh["dp"]``: the dimension is there). NOTE: [DDP as a mesh dimension]:
        DDP replicates the model over its group, so its ranks are replicas on one data-parallel
        dimension — the map draws them as such (a DDP job records no ``DeviceMesh``)."""
        try:
            dist = _dist()
            pg = getattr(ddp, "process_group", None) or (dist.group.WORLD if dist is not None else None)
            if pg is None or dist is None:
                return
            name = _pg_name(pg)
            if any(name is not None and g.get("name") == name for _, e in self.entries for g in e["dim_groups"]):
                return
            if any(obj is ddp for obj, _ in self.entries):
                return
            ranks = [int(r) for r in dist.get_process_group_ranks(pg)]
            entry = {"key": f"mesh{len(self.entries)}", "device_type": _device_type(ddp), "shape": [len(ranks)],
                     "dim_names": ["ddp"], "ranks": ranks, "coord": [int(dist.get_rank(pg))],
                     "dim_groups": [{"dim": "ddp", **_group_info(name, _pg_by_name())}], "source": "ddp"}
            self.entries.append((ddp, entry))
        except Exception:  # noqa: BLE001 - capture never breaks training
            return


def _device_type(module) -> str:
    try:
        return next(module.parameters()).device.type
    except Exception:  # noqa: BLE001 - no parameters
        return "cpu"


def _fsdp_units(model: torch.nn.Module) -> list[tuple[str, Any, Any]]:
    """(module name, module, FSDPParamGroup) of every ``fully_shard`` module of ``model``."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except Exception:  # noqa: BLE001
        return []
    out = []
    for name, m in model.named_modules():
        if isinstance(m, FSDPModule):
            try:
                group = m._get_fsdp_state()._fsdp_param_group
            except Exception:  # noqa: BLE001
                group = None
            out.append((name, m, group))
    return out


def _param_fqns(model: torch.nn.Module) -> dict[tuple[int, str], str]:
    """(id(module), param name) → the model's fully-qualified name, for every registered slot."""
    names: dict[tuple[int, str], str] = {}
    for mname, m in model.named_modules(remove_duplicate=False):
        for pname in list(getattr(m, "_parameters", {}).keys()):
            names.setdefault((id(m), pname), f"{mname}.{pname}" if mname else pname)
    return names


def placement_str(pl) -> str:
    """``Shard(0)``, ``Replicate()``, ``Partial(sum)``, ``_StridedShard(0, sf=2)`` (torch 2.13's
    ``str`` is ``S(0)``, ``R``, ``P(sum)``, ``_S(0, 2)``); any other placement: ``str()``."""
    name = type(pl).__name__
    dim = getattr(pl, "dim", None)
    if name == "_StridedShard":
        return f"_StridedShard({dim}, sf={getattr(pl, 'split_factor', '?')})"
    if name == "Shard" or (dim is not None and callable(getattr(pl, "is_shard", None)) and pl.is_shard()):
        return f"Shard({dim})"
    if name == "Replicate":
        return "Replicate()"
    if name == "Partial" or "Partial" in name:
        return f"Partial({getattr(pl, 'reduce_op', 'sum')})"
    return str(pl)


def _dtensor_row(fqn: str, p, meshes: _Meshes) -> dict | None:
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # noqa: BLE001
        return None
    if not isinstance(p, DTensor):
        return None
    mesh = p.device_mesh
    return {"fqn": fqn, "mesh": meshes.key_of(mesh), "mesh_dims": list(mesh.mesh_dim_names or []),
            "placements": [placement_str(pl) for pl in p.placements], "local_shape": [int(s) for s in p._local_tensor.shape],
            "global_shape": [int(s) for s in p.shape], "dtype": str(p.dtype).removeprefix("torch.")}


def _tp_styles(model: torch.nn.Module, meshes: _Meshes) -> list[dict]:
    """Parallel styles ``parallelize_module`` applied, from ``distribute_module``'s hooks."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.parallel import style as style_mod
        from torch.distributed.tensor.parallel.style import ParallelStyle
    except Exception:  # noqa: BLE001
        return []
    out = []
    for name, m in model.named_modules():
        name = name.replace(_ORIG_MOD, "").removeprefix("_orig_mod")
        style, mesh = None, None
        hooks = list(getattr(m, "_forward_pre_hooks", {}).values()) + list(getattr(m, "_forward_hooks", {}).values())
        for hook in hooks:
            for cell in getattr(hook, "__closure__", None) or ():
                try:
                    v = cell.cell_contents
                except ValueError:
                    continue
                if isinstance(v, DeviceMesh):
                    mesh = v
                fn = getattr(v, "func", v)  # functools.partial → its function
                owner = getattr(fn, "__self__", None)
                if isinstance(owner, ParallelStyle):
                    style = type(owner)
                    continue
                # the styles' _prepare_input_fn/_prepare_output_fn are staticmethods: by qualname
                cls = getattr(style_mod, str(getattr(fn, "__qualname__", "")).split(".")[0], None)
                if isinstance(cls, type) and issubclass(cls, ParallelStyle) and cls is not ParallelStyle:
                    style = cls
            if style is not None and mesh is not None:
                break
        if style is not None:
            dims = list(mesh.mesh_dim_names or []) if mesh is not None else []
            out.append({"module": name, "style": style.__name__,
                        "mesh": meshes.key_of(mesh) if mesh is not None else None,
                        "mesh_dim": dims[0] if len(dims) == 1 else dims or None})
    return out


def _checkpoint_regions(model: torch.nn.Module) -> list[dict]:
    out = []
    try:
        from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

        wrappers = tuple(c for c in (getattr(cw, "CheckpointWrapper", None), getattr(cw, "OffloadWrapper", None)) if c)
    except Exception:  # noqa: BLE001
        wrappers = ()
    try:
        from torch.distributed._composable.contract import _get_registry
    except Exception:  # noqa: BLE001
        _get_registry = None
    for name, m in model.named_modules():
        name = name.replace(_ORIG_MOD, "").removeprefix("_orig_mod")
        if wrappers and isinstance(m, wrappers):  # FSDP2 subclasses the module's class: isinstance
            out.append({"kind": "activation_checkpoint", "module": name,
                        "how": "offload_wrapper" if "Offload" in type(m).__name__ else "checkpoint_wrapper"})
            continue
        try:
            registry = _get_registry(m) if _get_registry is not None else None
        except Exception:  # noqa: BLE001
            registry = None
        if registry and "checkpoint" in registry:
            out.append({"kind": "activation_checkpoint", "module": name, "how": "composable checkpoint"})
    return out


# ---------------------------------------------------------------------------- pipelining

def _pipeline_classes():
    """(``_PipelineStageBase``, ``_PipelineSchedule``) when the job imported
    ``torch.distributed.pipelining`` (never imported here), else None."""
    stage_mod = sys.modules.get("torch.distributed.pipelining.stage")
    sched_mod = sys.modules.get("torch.distributed.pipelining.schedules")
    if stage_mod is None or sched_mod is None:
        return None
    try:
        return stage_mod._PipelineStageBase, sched_mod._PipelineSchedule
    except AttributeError:
        return None


def pipeline_on_stack(depth: int = 200) -> list[Any]:
    """The pipeline schedule and stage objects of the calling frames (outermost first), read
    from the frames' ``self``; ``[]`` when none (or pipelining was never imported)."""
    classes = _pipeline_classes()
    if classes is None:
        return []
    from graphdeck.capture.compile_context import frame_self

    found: list[Any] = []
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            break
        obj = frame_self(frame)
        if isinstance(obj, classes) and not any(o is obj for o in found):
            found.append(obj)
        frame = frame.f_back
    return found[::-1]


def _stage_ranks(stage) -> list[int] | None:
    dist = _dist()
    if dist is None:
        return None
    try:
        group_ranks = dist.get_process_group_ranks(stage.group) if stage.group is not None else \
            list(range(dist.get_world_size()))
        return [int(group_ranks[stage.stage_index_to_group_rank[i]]) for i in range(stage.num_stages)]
    except Exception:  # noqa: BLE001
        return None


def _pipeline_record(stages: list, schedule) -> dict | None:
    if not stages:
        return None
    stages = sorted(stages, key=lambda s: s.stage_index)
    first = stages[0]
    params: list[str] = []
    for s in stages:
        try:
            params.extend(fqn.replace(_ORIG_MOD, "") for fqn, _ in s.submod.named_parameters())
        except Exception:  # noqa: BLE001
            pass
    out = {"stage_index": int(first.stage_index), "num_stages": int(first.num_stages),
           "stage_ranks": _stage_ranks(first), "group": _pg_name(first.group),
           "schedule": type(schedule).__name__ if schedule is not None else None,
           "n_microbatches": int(schedule._n_microbatches) if schedule is not None
           and isinstance(getattr(schedule, "_n_microbatches", None), int) else None,
           "params": params}
    if len(stages) > 1:
        out["stage_indices"] = [int(s.stage_index) for s in stages]
    return out


class LayoutWatch:
    """Builds and writes one rank's layout record (NOTE: [Capturing the parallel layout]).
    Holds pipeline objects and explicitly watched meshes weakly."""

    def __init__(self) -> None:
        self._stages: list[weakref.ref] = []
        self._schedule: weakref.ref | None = None
        self._meshes: list[weakref.ref] = []
        self._ddp: list[weakref.ref] = []
        self._autocast: list[dict] = []
        self._written: str | None = None

    def note(self, obj: Any) -> None:
        """Remember a pipeline schedule (and its stages), a stage, or a ``DeviceMesh``."""
        classes = _pipeline_classes()
        try:
            from torch.distributed.device_mesh import DeviceMesh
        except Exception:  # noqa: BLE001
            DeviceMesh = ()  # noqa: N806
        if isinstance(obj, DeviceMesh):
            if not any(r() is obj for r in self._meshes):
                self._meshes.append(weakref.ref(obj))
            return
        if classes is None:
            return
        stage_cls, sched_cls = classes
        if isinstance(obj, sched_cls):
            self._schedule = weakref.ref(obj)
            stages = [getattr(obj, "_stage", None)] + list(getattr(obj, "_stages", None) or [])
            for s in stages:
                if s is not None:
                    self.note(s)
        elif isinstance(obj, stage_cls) and not any(r() is obj for r in self._stages):
            self._stages.append(weakref.ref(obj))

    def note_ddp(self, ddp: Any | None) -> None:
        """Remember a ``DistributedDataParallel`` wrapper (NOTE: [DDP as a mesh dimension])."""
        if ddp is not None and not any(r() is ddp for r in self._ddp):
            self._ddp.append(weakref.ref(ddp))

    def note_stack(self) -> None:
        """Remember the pipeline objects of the calling frames (see :func:`pipeline_on_stack`)."""
        for obj in pipeline_on_stack():
            self.note(obj)

    def note_autocast(self, context: dict, compile_id: str | None) -> None:
        """Remember autocast that was on while graph ``compile_id`` was compiled (``context``:
        :func:`graphdeck.capture.compile_context.compile_context`'s dict)."""
        for a in (context or {}).get("autocast") or []:
            region = {"kind": "autocast", "module": "", "device": a.get("device"), "dtype": a.get("dtype"),
                      "compile_id": compile_id}
            if region not in self._autocast:
                self._autocast.append(region)

    def record(self, models: list[torch.nn.Module]) -> dict | None:
        """The payload (see NOTE: [Parallel layout]), or None when there is nothing parallel to
        record (no mesh, no DTensor, no FSDP2 group, no pipeline)."""
        dist = _dist()
        if dist is None:  # before init or after destroy_process_group: groups unreadable
            return None
        rank, world = dist.get_rank(), dist.get_world_size()
        meshes = _Meshes()
        for ref in self._meshes:
            if (m := ref()) is not None:
                meshes.key_of(m)
        params: dict[str, dict] = {}
        fsdp_groups: list[dict] = []
        tp: list[dict] = []
        regions: list[dict] = []
        for model in models:
            names = _param_fqns(model)
            for mname, _m, group in _fsdp_units(model):
                if group is None:
                    continue
                members = []
                for fp in getattr(group, "fsdp_params", []) or []:
                    info = fp._module_info
                    fqn = names.get((id(info.module), info.param_name))
                    if fqn is None:
                        continue
                    members.append(fqn)
                    if (row := _dtensor_row(fqn, fp.sharded_param, meshes)) is not None:
                        params[fqn] = row
                mesh = group.mesh_info.mesh
                fsdp_groups.append({"module": mname, "params": members, "mesh": meshes.key_of(mesh),
                                    "mesh_dims": list(mesh.mesh_dim_names or []),
                                    "reshard_after_forward": group.post_forward_mesh_info is not None})
            for fqn, p in model.named_parameters():
                if fqn not in params and (row := _dtensor_row(fqn, p, meshes)) is not None:
                    params[fqn] = row
            tp.extend(_tp_styles(model, meshes))
            regions.extend(_checkpoint_regions(model))
        for ref in self._ddp:  # after the meshes: DDP over a mesh dimension is that dimension
            if (d := ref()) is not None:
                meshes.add_ddp(d)
        stages = [s for r in self._stages if (s := r()) is not None]
        schedule = self._schedule() if self._schedule is not None else None
        pipeline = _pipeline_record(stages, schedule)
        regions.extend(self._autocast)
        if not meshes.entries and not params and not fsdp_groups and pipeline is None:
            return None
        return {"version": VERSION, "rank": rank, "world_size": world, "meshes": meshes.records(),
                "params": list(params.values()), "fsdp_groups": fsdp_groups, "tp": tp, "pipeline": pipeline,
                "regions": regions}

    def write(self, writer_of, models: list[torch.nn.Module]) -> bool:
        """Build the record and write it through ``writer_of()`` (the agent's writer, made only
        when there is something to write) unless it equals the last one written. Returns
        whether a record was written; never raises."""
        try:
            record = self.record(models)
            if record is None:
                return False
            payload = json.dumps(record, sort_keys=True)
            if payload == self._written:
                return False
            writer_of().write_compile_events([{"name": EVENT_NAME, "compile_id": None, "metadata": {},
                                               "payload": payload}])
            self._written = payload
            return True
        except Exception as exc:  # noqa: BLE001 - capture never breaks training
            warnings.warn(f"graphdeck: could not record the parallel layout: {type(exc).__name__}: {exc}")
            return False
