"""Which parameters each data-parallel collective carries: DDP's gradient buckets and FSDP2's
parameter groups, recorded so that trace analysis can tie communication kernels to graph nodes.

# NOTE: [Communication groups]
A DDP all-reduce or an FSDP2 all-gather / reduce-scatter is launched by eager hooks, outside any
compiled graph, so Inductor's provenance never names it. What it moves is known exactly, though:
- **DDP**: the reducer all-reduces one flat bucket of gradients per call, buckets in index order.
  After the first iteration the buckets are rebuilt in gradient-ready order; the DDP logger
  exposes them (``DistributedDataParallel._get_ddp_logging_data()``: ``rebuilt_per_bucket_param_indices``
  = buckets separated by ``", "``, each a space-separated list of indices into the reducer's
  parameter list, and ``rebuilt_bucket_sizes`` in bytes; before a rebuild, ``bucket_sizes`` and
  the reducer's initial buckets are runs of its parameters in reverse order, cut at the logged
  ``bucket_sizes``; under ``find_unused_parameters=True`` they are never rebuilt). The reducer's
  parameter list is rebuilt here the way ``DistributedDataParallel._build_params_for_reducer``
  builds it (``named_modules`` × ``named_parameters(recurse=False)``, requires grad, not ignored,
  shared tensors once), and each bucket is checked against its logged size in bytes.
- **FSDP2**: each module under ``fully_shard`` owns the parameters of its subtree that no nested
  ``fully_shard`` module owns. One all-gather per group brings them whole (per parameter
  ``ceil(dim0 / shards) * shards * prod(rest)`` elements: FSDP2 pads dim 0 to a multiple of the
  shard count), and one reduce-scatter takes their gradients, of the same element count.
The record is a ``compile_events`` row named ``graphdeck_comm_groups`` (JSON payload, see
:func:`comm_groups`); :mod:`graphdeck.analysis.traces.comm_map` reads it.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch

EVENT_NAME = "graphdeck_comm_groups"


def active_ddp() -> Any | None:
    """The ``DistributedDataParallel`` whose forward is running now (DDP sets the class attribute
    ``_active_ddp_module`` around its inner module's call), else None."""
    try:
        from torch.nn.parallel import DistributedDataParallel
    except Exception:  # noqa: BLE001 - capture never breaks training
        return None
    return getattr(DistributedDataParallel, "_active_ddp_module", None)


def _reducer_params(ddp) -> list[tuple[str, torch.Tensor]]:
    """(fqn, parameter) in the reducer's order (NOTE: [Communication groups])."""
    ignore = set(getattr(ddp, "parameters_to_ignore", ()) or ())
    seen: set[int] = set()
    out = []
    for mname, module in ddp.module.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            fqn = f"{mname}.{pname}" if mname else pname
            if not p.requires_grad or fqn in ignore or id(p) in seen:
                continue
            seen.add(id(p))
            out.append((fqn, p))
    return out


def ddp_buckets(ddp) -> list[dict] | None:
    """DDP's gradient buckets as ``[{"index", "params": [fqn, ...], "numel", "size_bytes"}]`` in
    all-reduce order (the rebuilt ones once DDP rebuilt them after its first iteration, else the
    initial ones), or None when the logged sizes do not match the parameters (a torch whose
    logger says something else)."""
    try:
        data = ddp._get_ddp_logging_data()
    except Exception:  # noqa: BLE001 - capture never breaks training
        return None
    indices = data.get("rebuilt_per_bucket_param_indices")
    sizes = data.get("rebuilt_bucket_sizes")
    params = _reducer_params(ddp)
    try:
        if isinstance(indices, str) and indices.strip() and isinstance(sizes, str):
            groups = [[int(i) for i in part.split()] for part in indices.split(",")]
            sizes_bytes = [int(s) for s in sizes.split(",")]
        elif isinstance(data.get("bucket_sizes"), str) and data["bucket_sizes"].strip():
            sizes_bytes = [int(s) for s in data["bucket_sizes"].split(",")]
            groups = _initial_buckets(params, sizes_bytes)
            if groups is None:
                return None
        else:
            return None
    except ValueError:
        return None
    if len(groups) != len(sizes_bytes) or any(i >= len(params) for g in groups for i in g):
        return None
    out = []
    for index, (group, size_bytes) in enumerate(zip(groups, sizes_bytes)):
        members = [params[i] for i in group]
        if sum(p.numel() * p.element_size() for _, p in members) != size_bytes:
            return None
        out.append({"index": index, "params": [fqn for fqn, _ in members],
                    "numel": sum(p.numel() for _, p in members), "size_bytes": size_bytes})
    return out


def _initial_buckets(params: list[tuple[str, torch.Tensor]], sizes_bytes: list[int]) -> list[list[int]] | None:
    """The buckets DDP starts with (kept for good under ``find_unused_parameters=True``): runs of
    the reducer's parameters in reverse order whose byte sizes are the logged ``bucket_sizes``, in
    order; None when the sizes do not cut the list that way."""
    groups, current, acc = [], [], 0
    sizes = iter(sizes_bytes)
    want = next(sizes, None)
    for i in range(len(params) - 1, -1, -1):
        if want is None:
            return None
        current.append(i)
        acc += params[i][1].numel() * params[i][1].element_size()
        if acc == want:
            groups.append(current)
            current, acc, want = [], 0, next(sizes, None)
        elif acc > want:
            return None
    return groups if not current and want is None else None


def _shards(p: torch.Tensor, world_size: int) -> int:
    mesh = getattr(p, "device_mesh", None)
    try:
        return int(mesh.size()) if mesh is not None else world_size
    except Exception:  # noqa: BLE001
        return world_size


def fsdp_groups(model: torch.nn.Module, world_size: int) -> list[dict]:
    """FSDP2 parameter groups of ``model`` as ``[{"module", "params": [fqn, ...], "numel",
    "all_gather_numel", "all_gather_bytes"}]`` in ``named_modules`` order (empty when nothing is
    under ``fully_shard``). ``numel`` counts the unsharded parameters; ``all_gather_numel`` adds
    dim-0 padding to a multiple of the shard count (the element count of the group's all-gather
    output and of its reduce-scatter input); ``all_gather_bytes`` is the same in bytes (FSDP2
    all-gathers a byte buffer when the group mixes dtypes)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except Exception:  # noqa: BLE001
        return []
    units = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not units:
        return []
    owner: dict[int, str] = {}
    for name, m in units:  # parents come first in named_modules: a nested unit overwrites
        for _, p in m.named_parameters():
            owner[id(p)] = name
    out = []
    for name, m in units:
        members = []
        for pname, p in m.named_parameters():
            if owner.get(id(p)) == name and p.requires_grad:
                members.append((f"{name}.{pname}" if name else pname, p))
        if not members:
            continue
        padded = padded_bytes = 0
        for _, p in members:
            shards = _shards(p, world_size)
            shape = list(p.shape) or [1]
            n = math.ceil(shape[0] / shards) * shards * math.prod(shape[1:])
            padded += n
            padded_bytes += n * p.element_size()
        out.append({"module": name, "params": [fqn for fqn, _ in members], "numel": sum(p.numel() for _, p in members),
                    "all_gather_numel": padded, "all_gather_bytes": padded_bytes})
    return out


class CommGroupWatch:
    """Remembers the DDP wrappers seen while compiling (weakly) and builds the record."""

    def __init__(self) -> None:
        self._ddp: list[weakref.ref] = []

    def note_ddp(self, ddp: Any | None) -> None:
        if ddp is not None and not any(r() is ddp for r in self._ddp):
            self._ddp.append(weakref.ref(ddp))

    def record(self, models: list[torch.nn.Module], world_size: int) -> dict | None:
        """``{"world_size", "ddp": [{"process_group", "buckets": [...], "find_unused_parameters",
        "static_graph"}], "fsdp": [...]}`` or None when there is nothing to record. Never raises."""
        try:
            ddp = []
            for ref in self._ddp:
                d = ref()
                buckets = ddp_buckets(d) if d is not None else None
                if buckets:
                    pg = getattr(d, "process_group", None)
                    ddp.append({"process_group": str(getattr(pg, "group_name", "") or ""), "buckets": buckets,
                                "find_unused_parameters": bool(getattr(d, "find_unused_parameters", False)),
                                "static_graph": bool(getattr(d, "static_graph", False))})
            fsdp = [g for m in models for g in fsdp_groups(m, world_size)]
        except Exception:  # noqa: BLE001 - capture never breaks training
            return None
        if not ddp and not fsdp:
            return None
        return {"world_size": world_size, "ddp": ddp, "fsdp": fsdp}
