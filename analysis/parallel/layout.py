"""The parallel layout of a run: device meshes, DTensor placements, FSDP2 groups, pipeline stages.

# NOTE: [Parallel layout]
Each rank's capture writes a ``compile_events`` row ``name = "graphdeck_parallel_layout"``
(``compile_id`` None; :mod:`graphdeck.capture.layout`) as soon as its layout is known, and again
when it changes (a pipeline stage or schedule built, a new mesh or placement). Payload (JSON,
version 1; the format is graphdeck's own, its fields read from torch's ``DeviceMesh``,
``DTensor``, FSDP2 ``FSDPModule`` and ``torch.distributed.pipelining`` objects)::

    {"version": 1, "rank": 3, "world_size": 4,
     "meshes": [{"key", "device_type", "shape": [2, 2], "dim_names": ["dp", "tp"],
                 "ranks": [[0, 1], [2, 3]],   # the mesh tensor: nested global ranks
                 "coord": [1, 1] | null,      # this rank's coordinate
                 "dim_groups": [{"dim", "name", "desc", "ranks"}]}],
     "params": [{"fqn", "mesh", "mesh_dims", "placements": ["Shard(0)", ...], "local_shape",
                 "global_shape", "dtype"}],
     "fsdp_groups": [{"module", "params", "mesh", "mesh_dims", "reshard_after_forward"}],
     "tp": [{"module", "style", "mesh", "mesh_dim"}],
     "pipeline": {"stage_index", "num_stages", "stage_ranks", "group", "schedule",
                  "n_microbatches", "params"} | null,
     "regions": [{"kind": "activation_checkpoint" | "autocast", "module", ...}]}

The analysis takes the LAST row of each rank (highest id). Meshes of all ranks are merged by
their dimension names and rank tensor (a rank's mesh ``key`` is local to that rank); a rank's
coordinate is read from the merged rank tensors, so it is known for a rank without a record too.

Which ranks must agree:

* ``program_peers``: ranks of the same pipeline stage run the same program (every rank when
  there is no pipeline). The stage is the record's ``stage_index`` (a rank holding several
  stages, as interleaved schedules do, lists them in ``stage_indices``), else the rank's
  coordinate on a mesh dimension named like a pipeline dimension (``pp``).
* ``replica_peers``: same stage and same coordinate on every sharding dimension — every mesh
  dimension that is neither a pipeline dimension nor a data-parallel one. Data-parallel
  dimensions are those only FSDP2 groups shard over (their ``mesh_dims``, else their mesh's
  dims: ``dim0`` of ``fully_shard``'s unnamed default mesh; a dim a TP style also uses is not
  one) and those named like
  one (``dp``, ``dp_shard``, ``dp_replicate``, ``fsdp``, ``hsdp``, ``ddp``, ...). Replicas
  hold the same local shapes (up to FSDP2's uneven last shard, which the placements explain).

Pure: reads the store, returns data. A record that is not valid JSON (or not an object) is
ignored, as if the rank wrote none.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.store.schema import CompileEvent, Run

EVENT_NAME = "graphdeck_parallel_layout"
VERSION = 1
#: Mesh dimension names read as data parallel (replicas of one program and one shard layout).
DP_DIMS = frozenset({"dp", "ddp", "fsdp", "hsdp", "dp_shard", "dp_replicate", "dp_shard_cp", "dp_cp",
                     "replicate", "shard", "data", "data_parallel"})
#: Mesh dimension names read as pipeline parallel (the coordinate is the stage).
PP_DIMS = frozenset({"pp", "pipeline", "pipe", "stage", "pipeline_parallel"})
#: Mesh dimension names read as sharding a program's tensors even where no record places anything
#: on them (NOTE: [Dimensions nothing is placed on]).
SHARD_DIMS = frozenset({"tp", "cp", "ep", "sp", "etp", "tensor", "context", "expert", "sequence",
                        "tensor_parallel", "context_parallel", "expert_parallel", "sequence_parallel"})
#: ``Shard(0)``, ``_StridedShard(0, sf=2)`` (the capture's spelling) and torch 2.13's ``str()``:
#: ``S(0)``, ``_S(0, 2)``.
_SHARD = re.compile(r"^(?:_StridedShard|Shard|_S|S)\(\s*(?:dim=)?(-?\d+)")


@dataclass
class RunLayout:
    """The merged layout of one run (see NOTE: [Parallel layout]).

    ``world_size``: the largest of the records' and the run's world size; ``ranks``: ranks with a
    record; ``missing_ranks``: ranks ``0 .. world_size-1`` without one (an evidence gap: a verdict
    about them is INCOMPLETE); ``meshes``: merged global meshes ``{"key", "device_type", "shape",
    "dim_names", "ranks"}`` (keys ``mesh0``, ``mesh1``, ... in order of first appearance; a
    flattened sub-mesh such as ``mesh._flatten("dp_cp")`` appears once per group of its ranks,
    marked ``"flattened": True``);
    ``records``: rank → its (last) payload.
    """

    world_size: int
    ranks: list[int]
    missing_ranks: list[int]
    meshes: list[dict]
    records: dict[int, dict]
    _mesh_key: dict[tuple[int, str], str] = field(default_factory=dict, repr=False)  # (rank, local key) -> global
    # Answers computed once (a layout is read-only once built): the rank -> coordinate index, the
    # peer sets, the data-parallel dims. 1,024 ranks ask for them thousands of times.
    _memo: dict = field(default_factory=dict, repr=False, compare=False)

    def _cached(self, key, compute):
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def _mesh_coords(self) -> dict[int, dict[str, int]]:
        """rank → ``{dim: index}`` over every mesh (first mesh wins a name; a rank listed twice in
        one mesh: its first place in C order), computed for all ranks at once."""
        def compute():
            import numpy as np

            out: dict[int, dict[str, int]] = {}
            for mesh in self.meshes:
                arr = np.asarray(mesh["ranks"], dtype=np.int64)
                names = mesh["dim_names"]
                seen: set[int] = set()
                for idx, rank in zip(np.ndindex(*arr.shape), arr.reshape(-1).tolist()):
                    if rank in seen:
                        continue
                    seen.add(rank)
                    c = out.setdefault(rank, {})
                    for name, i in zip(names, idx):
                        c.setdefault(name, int(i))
            return out
        return self._cached("mesh_coords", compute)

    # ------------------------------------------------------------------ coordinates

    def coord(self, rank: int) -> dict[str, int]:
        """``{dim name: index}`` of ``rank`` across all meshes it belongs to (the first mesh wins
        a name two meshes share), plus ``"pp"``: its stage when a pipeline is recorded and no mesh
        has a pipeline dimension. ``{}`` when nothing places the rank."""
        out: dict[str, int] = dict(self._mesh_coords().get(rank, {}))
        if not any(d in PP_DIMS for d in out):
            stage = self._record_stage(rank)
            if stage is not None:
                out["pp"] = stage
        return out

    def _pipeline(self, rank: int) -> dict | None:
        pipe = (self.records.get(rank) or {}).get("pipeline")
        return pipe if isinstance(pipe, dict) else None

    def _record_stage(self, rank: int) -> int | None:
        pipe = self._pipeline(rank)
        idx = pipe.get("stage_index") if pipe else None
        return idx if isinstance(idx, int) and not isinstance(idx, bool) else None

    def has_pipeline(self) -> bool:
        """Whether any rank recorded a pipeline stage or a mesh has a pipeline dimension."""
        return any(self._pipeline(r) for r in self.records) or any(
            d in PP_DIMS for m in self.meshes for d in m["dim_names"])

    def stage_of(self, rank: int) -> int | None:
        """The pipeline stage index of ``rank`` (its record's ``stage_index``, else its coordinate
        on a pipeline mesh dimension); None when there is no pipeline or the rank's is unknown."""
        stage = self._record_stage(rank)
        if stage is not None:
            return stage
        for name, idx in self.coord(rank).items():
            if name in PP_DIMS:
                return idx
        return None

    def _stage_key(self, rank: int):
        pipe = self._pipeline(rank)
        if pipe and isinstance(pipe.get("stage_indices"), list) and pipe["stage_indices"]:
            return tuple(sorted(int(i) for i in pipe["stage_indices"]))
        stage = self.stage_of(rank)
        return None if stage is None else (stage,)

    # ------------------------------------------------------------------ peers

    def program_peers(self) -> list[list[int]]:
        """Sets of ranks that must run the SAME program: ranks of the same pipeline stage(s).

        Without a pipeline: one set, ``0 .. world_size-1``. With one: one set per stage, over
        ``0 .. world_size-1``; a rank whose stage is unknown (no record, no pipeline mesh dim) is
        a set of its own, compared with nobody. Sets sorted by their first rank."""
        return [list(x) for x in self._cached("program_peers", self._program_peers)]

    def _program_peers(self) -> list[list[int]]:
        everyone = list(range(self.world_size))
        if not self.has_pipeline():
            return [everyone] if everyone else []
        groups: dict[object, list[int]] = {}
        alone: list[list[int]] = []
        for r in everyone:
            key = self._stage_key(r)
            if key is None:
                alone.append([r])
            else:
                groups.setdefault(key, []).append(r)
        return sorted(list(groups.values()) + alone, key=lambda g: g[0])

    def dp_dims(self) -> set[str]:
        """Mesh dimension names that are data parallel: those named like one (:data:`DP_DIMS`) and
        those FSDP2 groups shard over (their ``mesh_dims``, else their mesh's dims — ``dim0`` of
        ``fully_shard``'s default mesh) that no TP style uses."""
        return set(self._cached("dp_dims", self._dp_dims))

    def _dp_dims(self) -> set[str]:
        # NOTE: [Unnamed meshes are data parallel when FSDP2 shards over them]
        # ``fully_shard(model)`` without a mesh builds a 1-D mesh with no dimension names: the
        # capture names its dim ``dim0`` and records the FSDP2 group's (and its parameters')
        # ``mesh_dims`` as ``[]``. The group's dims are then read from its mesh (``mesh_dims_of``),
        # so ``dim0`` is data parallel, not a sharding dim (it was: replicas [0] | [1]). A dim
        # that a TP style also uses (a ``tp`` record's ``mesh_dim``) stays a sharding dim unless
        # its name says data parallel: only dims FSDP2 alone shards over are read as DP.
        dims = {d for m in self.meshes for d in m["dim_names"] if d in DP_DIMS}
        tp_dims: set[str] = set()
        for rank, rec in self.records.items():
            for t in rec.get("tp") or []:
                if isinstance(t, dict):
                    d = t.get("mesh_dim")
                    tp_dims.update([str(d)] if isinstance(d, str) else [str(x) for x in d or []]
                                   if isinstance(d, list) else self.mesh_dims_of(rank, {"mesh": t.get("mesh")}))
        for rank, rec in self.records.items():
            for g in rec.get("fsdp_groups") or []:
                if isinstance(g, dict):
                    dims.update(d for d in self.mesh_dims_of(rank, g) if d not in tp_dims)
        return dims

    def mesh_dims_of(self, rank: int, row: dict) -> list[str]:
        """The mesh dimension names of a record's FSDP2 group or parameter ``row`` (a dict with
        ``"mesh"`` and ``"mesh_dims"``) on ``rank``: its ``mesh_dims`` when given, else — a mesh
        built without dimension names, such as ``fully_shard``'s default 1-D mesh — the names the
        capture gave the dims of its mesh (``dim0``, ...; :meth:`global_mesh_key` resolves the
        rank-local key). ``[]`` when neither is known or the row is malformed."""
        dims = row.get("mesh_dims") if isinstance(row, dict) else None
        if isinstance(dims, list) and dims:
            return [str(d) for d in dims]
        key = self.global_mesh_key(rank, str(row.get("mesh"))) if isinstance(row, dict) else None
        for m in self.meshes:
            if m["key"] == key:
                return list(m["dim_names"])
        return []

    def sharding_dims(self) -> list[str]:
        """Mesh dimension names that shard a program's tensors (tp, cp, ep, ...): all but the
        data-parallel, pipeline and container ones (:meth:`container_dims`), in mesh order."""
        return list(self._cached("sharding_dims", self._sharding_dims))

    def _sharding_dims(self) -> list[str]:
        dp = self.dp_dims() | self.container_dims()
        out: list[str] = []
        for m in self.meshes:
            for d in m["dim_names"]:
                if d not in dp and d not in PP_DIMS and d not in out:
                    out.append(d)
        return out

    def used_dims(self) -> set[str]:
        """Mesh dimension names some record places something on: a DTensor parameter's placement
        (its ``mesh_dims``, else its mesh's), an FSDP2 group's mesh dims, a TP style's
        ``mesh_dim``, a pipeline stage (its pipeline-named dims)."""
        return set(self._cached("used_dims", self._used_dims))

    def _used_dims(self) -> set[str]:
        used = {d for m in self.meshes for d in m["dim_names"] if d in PP_DIMS} if self.has_pipeline() else set()
        for rank, rec in self.records.items():
            for p in rec.get("params") or []:
                if isinstance(p, dict):
                    used.update(self.mesh_dims_of(rank, p))
            for g in rec.get("fsdp_groups") or []:
                if isinstance(g, dict):
                    used.update(self.mesh_dims_of(rank, g))
            for t in rec.get("tp") or []:
                if isinstance(t, dict):
                    d = t.get("mesh_dim")
                    used.update([str(d)] if isinstance(d, str) else [str(x) for x in d or []]
                                if isinstance(d, list) else self.mesh_dims_of(rank, {"mesh": t.get("mesh")}))
        return used

    def container_dims(self) -> set[str]:
        """Mesh dimensions that shard nothing and tell no replicas apart (NOTE: [Dimensions nothing
        is placed on]): no record places anything on them while some record places something on
        another dimension, and their name is neither a sharding (:data:`SHARD_DIMS`), a
        data-parallel nor a pipeline one. ``set()`` when no record places anything anywhere."""
        return set(self._cached("container_dims", self._container_dims))

    # NOTE: [Dimensions nothing is placed on]
    # torchtitan builds a one-dimensional "world" mesh over every rank and cuts its data-parallel
    # and tensor-parallel meshes from it (``_flatten``/``_unflatten``); the capture records it as
    # the root mesh of each. Read as a sharding dimension, every rank had its own "world"
    # coordinate: pure FSDP2 ranks were tensor-parallel peers, not replicas, and the map drew a
    # 2×2 grid with the ranks on its diagonal. A dimension is a sharding one because something is
    # sharded over it: one that no parameter placement, FSDP2 group, TP style or pipeline stage
    # uses, while others are used, is the container the used ones were cut from — neither a
    # column nor a row of the map, and no reason for two ranks to differ. A dimension named like
    # a sharding one (``tp``, ``cp``, ``ep``, ...) stays one: TP applied by hand leaves no record.
    def _container_dims(self) -> set[str]:
        used = self.used_dims()
        if not used:
            return set()
        return {d for m in self.meshes for d in m["dim_names"]
                if d not in used and d not in SHARD_DIMS and d not in DP_DIMS and d not in PP_DIMS}

    def replica_peers(self) -> list[list[int]]:
        """Sets of ranks that must agree on shapes exactly: same stage and same coordinate on
        every sharding dimension (DP/FSDP replicas). A rank whose coordinate on a sharding
        dimension is unknown is a set of its own. Sets sorted by their first rank."""
        return [list(x) for x in self._cached("replica_peers", self._replica_peers)]

    def _replica_peers(self) -> list[list[int]]:
        dims = self.sharding_dims()
        out: list[list[int]] = []
        for group in self.program_peers():
            by: dict[tuple, list[int]] = {}
            for r in group:
                c = self.coord(r)
                if any(d not in c for d in dims):
                    out.append([r])
                    continue
                by.setdefault(tuple(c[d] for d in dims), []).append(r)
            out.extend(by.values())
        return sorted(out, key=lambda g: g[0])

    def dim_names(self) -> list[str]:
        """Every mesh dimension name, in mesh order."""
        out: list[str] = []
        for m in self.meshes:
            out.extend(d for d in m["dim_names"] if d not in out)
        return out

    def dim_groups(self, dim: str) -> list[list[int]]:
        """The groups of ranks along mesh dimension ``dim`` (ranks varying on ``dim``, every other
        coordinate fixed), over every mesh that has it; for ``"pp"`` with no such mesh dimension,
        the recorded pipelines' ``stage_ranks``. ``[]`` for an unknown dimension."""
        return [list(x) for x in self._cached(("dim_groups", dim), lambda: self._dim_groups(dim))]

    def _dim_groups(self, dim: str) -> list[list[int]]:
        import numpy as np

        seen: list[list[int]] = []
        for m in self.meshes:
            if dim not in m["dim_names"]:
                continue
            arr = np.asarray(m["ranks"], dtype=np.int64)
            axis = m["dim_names"].index(dim)
            for row in np.moveaxis(arr, axis, -1).reshape(-1, arr.shape[axis]).tolist():
                if row not in seen:
                    seen.append(row)
        if not seen and dim in PP_DIMS:
            for r in sorted(self.records):
                ranks = (self._pipeline(r) or {}).get("stage_ranks")
                if isinstance(ranks, list) and ranks and list(ranks) not in seen:
                    seen.append([int(x) for x in ranks])
        return seen

    # ------------------------------------------------------------------ parameters

    def param(self, fqn: str, rank: int) -> dict | None:
        """The record of parameter ``fqn`` on ``rank`` (see the payload's ``params``), or None."""
        for p in (self.records.get(rank) or {}).get("params") or []:
            if isinstance(p, dict) and p.get("fqn") == fqn:
                return p
        return None

    def placements(self, fqn: str, rank: int) -> list[str] | None:
        """``str(placement)`` per mesh dimension of DTensor parameter ``fqn`` on ``rank``, e.g.
        ``["Shard(0)", "Shard(1)"]``; None when the rank recorded no such DTensor parameter."""
        p = self.param(fqn, rank)
        return list(p["placements"]) if p and isinstance(p.get("placements"), list) else None

    def expected_local_shape(self, fqn: str, rank: int) -> list[int] | None:
        """The local shape the placements give ``rank`` for ``fqn`` (torch.chunk sizes: each
        ``Shard(d)`` on a mesh dimension of size n splits dim d into ceil(s/n) pieces, applied
        in mesh-dimension order), or None when it cannot be computed (unknown coordinate,
        ``_StridedShard`` or a malformed record)."""
        p = self.param(fqn, rank)
        if not p:
            return None
        try:
            shape = [int(s) for s in p["global_shape"]]
            dims = self.mesh_dims_of(rank, p)
            sizes = self._dim_sizes()
            c = self.coord(rank)
            for dim, pl in zip(dims, p["placements"]):
                m = _SHARD.match(str(pl))
                if not m:
                    continue
                if str(pl).startswith("_S"):  # _StridedShard: its chunks interleave with another dim's
                    return None
                d = int(m.group(1)) % len(shape)
                n, i = sizes[dim], c[dim]
                full = math.ceil(shape[d] / n) if n else 0
                shape[d] = max(0, min(full, shape[d] - i * full))
            return shape
        except (KeyError, TypeError, ValueError, ZeroDivisionError, IndexError):
            return None

    def explains_shape(self, fqn: str, rank_a: int, rank_b: int) -> bool:
        """Whether the local shapes of ``fqn`` on the two ranks are what their placements imply:
        both recorded it as a DTensor with the same global shape, mesh dims and placements, and
        each local shape equals :meth:`expected_local_shape` (for ``_StridedShard``: the shapes
        differ only in dimensions a placement shards). False when either record is missing."""
        pa, pb = self.param(fqn, rank_a), self.param(fqn, rank_b)
        if not pa or not pb:
            return False
        if (pa.get("global_shape") != pb.get("global_shape") or pa.get("placements") != pb.get("placements")
                or pa.get("mesh_dims") != pb.get("mesh_dims")):
            return False
        ea, eb = self.expected_local_shape(fqn, rank_a), self.expected_local_shape(fqn, rank_b)
        if ea is not None and eb is not None:
            return ea == list(pa.get("local_shape") or []) and eb == list(pb.get("local_shape") or [])
        try:
            rank_n = len(pa["global_shape"])
            sharded = {int(m.group(1)) % rank_n for m in (_SHARD.match(str(x)) for x in pa["placements"]) if m}
            la, lb = list(pa["local_shape"]), list(pb["local_shape"])
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            return False
        return len(la) == len(lb) == rank_n and all(a == b or i in sharded for i, (a, b) in enumerate(zip(la, lb)))

    def _dim_sizes(self) -> dict[str, int]:
        sizes: dict[str, int] = {}
        for m in self.meshes:
            for name, n in zip(m["dim_names"], m["shape"]):
                sizes.setdefault(name, int(n))
        return sizes

    def global_mesh_key(self, rank: int, local_key: str) -> str | None:
        """The merged mesh key of the mesh ``rank`` recorded as ``local_key``."""
        return self._mesh_key.get((rank, local_key))

    # ------------------------------------------------------------------ JSON

    def to_dict(self) -> dict:
        """JSON for ``GET /api/runs/{id}/layout``: the fields above plus ``coords`` (rank →
        :meth:`coord`), ``stages`` (rank → :meth:`stage_of`), ``dim_groups`` (dim →
        :meth:`dim_groups`), ``program_peers``, ``replica_peers``, ``sharding_dims``,
        ``dp_dims``, ``container_dims``; ``records`` keyed by the rank as a string (JSON object keys)."""
        everyone = range(self.world_size)
        dims = self.dim_names()
        if self.has_pipeline() and not any(d in PP_DIMS for d in dims):
            dims.append("pp")
        return {
            "version": VERSION,
            "world_size": self.world_size,
            "ranks": self.ranks,
            "missing_ranks": self.missing_ranks,
            "meshes": self.meshes,
            "coords": {str(r): self.coord(r) for r in everyone},
            "stages": {str(r): self.stage_of(r) for r in everyone},
            "dim_groups": {d: self.dim_groups(d) for d in dims},
            "program_peers": self.program_peers(),
            "replica_peers": self.replica_peers(),
            "sharding_dims": self.sharding_dims(),
            "dp_dims": sorted(self.dp_dims()),
            "container_dims": sorted(self.container_dims()),
            "records": {str(r): self.records[r] for r in self.ranks},
        }


def _valid_mesh(m) -> bool:
    import numpy as np

    try:
        arr = np.asarray(m["ranks"], dtype=np.int64)
        return (isinstance(m.get("dim_names"), list) and arr.ndim == len(m["dim_names"]) >= 1
                and list(arr.shape) == [int(s) for s in m.get("shape") or arr.shape])
    except (KeyError, TypeError, ValueError, AttributeError):
        return False


def build_layout(records: dict[int, dict], world_size: int | None = None) -> RunLayout:
    """A :class:`RunLayout` from payloads (rank → payload dict, the stored record's JSON);
    ``world_size`` (the run's) is a lower bound on the layout's world size. Malformed meshes
    are left out. Used by :func:`load_layout` and by tests and generators of large layouts."""
    import numpy as np

    ws = max([int(world_size or 0), len(records)]
             + [int(p["world_size"]) for p in records.values() if isinstance(p.get("world_size"), int)]
             + [r + 1 for r in records])
    meshes: list[dict] = []
    index: dict[tuple, str] = {}
    mesh_key: dict[tuple[int, str], str] = {}
    # Every rank's record holds the same global rank tensors (load_records shares one list per
    # distinct tensor): each is checked and keyed once, by identity (the lists live in ``records``).
    seen: dict[tuple, tuple[bool, str]] = {}
    for rank in sorted(records):
        for m in records[rank].get("meshes") or []:
            if not isinstance(m, dict):
                continue
            memo_key = (id(m.get("ranks")), repr(m.get("dim_names")), repr(m.get("shape")))
            if memo_key not in seen:
                valid = _valid_mesh(m)
                seen[memo_key] = (valid, json.dumps(m["ranks"]) if valid else "")
            valid, ranks_text = seen[memo_key]
            if not valid:
                continue
            ident = (tuple(str(d) for d in m["dim_names"]), ranks_text)
            if ident not in index:
                key = f"mesh{len(meshes)}"
                index[ident] = key
                arr = np.asarray(m["ranks"], dtype=np.int64)
                merged = {"key": key, "device_type": m.get("device_type"), "shape": list(arr.shape),
                          "dim_names": [str(d) for d in m["dim_names"]], "ranks": arr.tolist()}
                if m.get("flattened_from"):  # a flattened sub-mesh (one per group of its ranks)
                    merged["flattened"] = True
                meshes.append(merged)
                ws = max(ws, int(arr.max()) + 1 if arr.size else 0)
            mesh_key[(rank, str(m.get("key")))] = index[ident]
    ranks = sorted(records)
    return RunLayout(world_size=ws, ranks=ranks, missing_ranks=[r for r in range(ws) if r not in records],
                     meshes=meshes, records=dict(records), _mesh_key=mesh_key)


#: A mesh's rank tensor in a record's JSON: nested lists of integers under ``"ranks"``.
_RANKS_ARRAY = re.compile(r'"ranks":\s*(\[[-\d,\s\[\]]*\])')
_MARK = "\x00graphdeck-ranks:"


def _parse_record(text: str, arrays: dict[str, list]) -> object:
    """``json.loads(text)``, with each mesh's ``"ranks"`` tensor parsed once per distinct text
    (``arrays``, shared by the records of a run) and shared: every rank's record holds the whole
    global mesh (1,024 ranks: a million integers parsed again per record otherwise). Only long
    integer tensors under ``meshes[i]["ranks"]`` are shared; anything else is parsed as it is."""
    found: list[str] = []

    def cut(m: re.Match) -> str:
        if len(m.group(1)) < 256:
            return m.group(0)
        found.append(m.group(1))
        return f'"ranks": "\\u0000graphdeck-ranks:{len(found) - 1}"'

    stripped = _RANKS_ARRAY.sub(cut, text)
    if not found:
        return json.loads(text)
    data = json.loads(stripped)
    restored = 0
    for m in (data.get("meshes") if isinstance(data, dict) else None) or []:
        v = m.get("ranks") if isinstance(m, dict) else None
        if isinstance(v, str) and v.startswith(_MARK):
            t = found[int(v[len(_MARK):])]
            if t not in arrays:
                arrays[t] = json.loads(t)
            m["ranks"] = arrays[t]
            restored += 1
    return data if restored == len(found) else json.loads(text)  # a "ranks" elsewhere: as it is


def load_records(session: Session, run_id: int) -> dict[int, dict]:
    """rank → the payload of its last (highest id) readable ``graphdeck_parallel_layout`` row
    (ranks in the order of their first row). Older rows of a rank are not parsed."""
    out: dict[int, dict] = {}
    first: dict[int, int] = {}
    arrays: dict[str, list] = {}
    rows = session.connection().execute(select(CompileEvent.rank, CompileEvent.id, CompileEvent.payload).where(
        CompileEvent.run_id == run_id, CompileEvent.name == EVENT_NAME).order_by(CompileEvent.id.desc()))
    for rank, row_id, payload in rows:
        rank = int(rank)
        first[rank] = row_id
        if rank in out:
            continue
        try:
            data = _parse_record(payload or "", arrays)
        except ValueError:
            continue
        if isinstance(data, dict):
            out[rank] = data
    return {r: out[r] for r in sorted(out, key=first.__getitem__)}


def load_layout(session: Session, run_id: int) -> RunLayout | None:
    """The run's :class:`RunLayout`, or None when no rank wrote a (readable) layout record.
    The run's own ``world_size`` (when set) bounds the world size from below.

    Kept in ``session.info`` while the run's layout rows (newest id, count) and world size stay
    the same, so the checks of one request (the map: check-ranks, check-grads, the grid) read
    and parse 1,024 records once; the layout returned is shared: read it, do not change it."""
    from sqlalchemy import func

    newest, count = session.execute(select(func.max(CompileEvent.id), func.count()).where(
        CompileEvent.run_id == run_id, CompileEvent.name == EVENT_NAME)).one()
    run = session.get(Run, run_id)
    stamp = (newest, count, run.world_size if run is not None else None)
    cache = session.info.setdefault("graphdeck.layout", {})
    if run_id in cache and cache[run_id][0] == stamp:
        return cache[run_id][1]
    records = load_records(session, run_id) if count else {}
    layout = build_layout(records, run.world_size if run is not None else None) if records else None
    cache[run_id] = (stamp, layout)
    return layout
