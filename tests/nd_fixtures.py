"""N-D parallel test material (issue 20): the three multi-rank jobs as fixtures, and a
builder of parallel-layout payloads for unit tests.

Fixtures (each job runs once per test session, across xdist workers; every test module that
imports a fixture gets its own copy of the store; tests using them are slow)::

    from tests.nd_fixtures import nd_fsdp_tp_store  # noqa: F401
    from tests.nd_fixtures import nd_pipeline_store, nd_pipeline_cut_store  # noqa: F401

- ``nd_fsdp_tp_store``: run ``nd_fsdp_tp`` of ``tests/programs/nd_fsdp_tp.py`` — 4 gloo ranks, a
  2 x 2 ``("dp", "tp")`` mesh, two MLP blocks (``blocks.0``, and ``blocks.1`` in a
  ``checkpoint_wrapper``: parameters ``blocks.1._checkpoint_wrapped_module.w1.weight``, ...) with
  ``ColwiseParallel`` / ``RowwiseParallel`` on ``tp`` and ``fully_shard`` on ``dp`` (per block and
  at the root), compiled with ``aot_eager``, 3 steps.
- ``nd_pipeline_store``: run ``nd_pipeline`` of ``tests/programs/nd_pipeline.py`` — 2 gloo
  ranks, 2 stages, ``PipelineStage`` + ``ScheduleGPipe`` (4 microbatches), each stage compiled.
- ``nd_pipeline_cut_store``: run ``nd_pipeline_cut``: the same with ``--cut-backward`` (stage 1
  detaches its input: stage 0 receives a zero gradient, its parameters all-zero ones).

Each returns the SQLite store's :class:`~pathlib.Path` (one run in it, named as above).

``layout_record(rank, ...)`` builds a ``graphdeck_parallel_layout`` payload (NOTE: [Parallel
layout] in graphdeck/analysis/parallel/layout.py) the way the capture writes it.
"""

from __future__ import annotations

import itertools
import math
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import copy_store, made_once
from tests.launch import run_ranks

REPO = Path(__file__).resolve().parents[1]
PROGRAMS = REPO / "tests" / "programs"

RUN_FSDP_TP = "nd_fsdp_tp"
RUN_PIPELINE = "nd_pipeline"
RUN_PIPELINE_CUT = "nd_pipeline_cut"


def run_nd_job(program: str, nproc: int, store: Path, *args: str, check: bool = True,
               timeout_s: int = 600) -> subprocess.CompletedProcess:
    """``PROGRAM STORE ARGS`` on ``nproc`` ranks, started as ``torchrun --standalone`` would
    (:func:`tests.launch.run_ranks`), from the repo root, one thread per rank; raises with the
    output's tail when it fails and ``check``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1")
    proc = run_ranks([PROGRAMS / program, store, *args], nproc, env=env, cwd=REPO, timeout=timeout_s)
    if check and proc.returncode != 0:
        raise AssertionError(f"{program} {args} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return proc


def _job_store(tmp_path_factory, run: str, program: str, nproc: int, *args: str) -> Path:
    """This module's own copy of run ``run``'s store; the job itself runs once per test session,
    across xdist workers (:func:`tests.conftest.made_once`)."""
    made = made_once(tmp_path_factory, run, lambda d: run_nd_job(program, nproc, d / "nd.db", "--run-name", run,
                                                                   *args))
    return copy_store(made / "nd.db", tmp_path_factory.mktemp(run) / "nd.db")


@pytest.fixture(scope="module")
def nd_fsdp_tp_store(tmp_path_factory) -> Path:
    return _job_store(tmp_path_factory, RUN_FSDP_TP, "nd_fsdp_tp.py", 4)


@pytest.fixture(scope="module")
def nd_pipeline_store(tmp_path_factory) -> Path:
    return _job_store(tmp_path_factory, RUN_PIPELINE, "nd_pipeline.py", 2)


@pytest.fixture(scope="module")
def nd_pipeline_cut_store(tmp_path_factory) -> Path:
    return _job_store(tmp_path_factory, RUN_PIPELINE_CUT, "nd_pipeline.py", 2, "--cut-backward")


# ---------------------------------------------------------------------------- payload builder

def _chunk(size: int, n: int, i: int) -> int:
    full = math.ceil(size / n) if n else 0
    return max(0, min(full, size - i * full))


def local_shape(global_shape, placements, dim_names, coord: dict, sizes: dict) -> list[int]:
    """The local shape ``Shard(d)`` placements on mesh dims ``dim_names`` give a rank at ``coord``
    (dim → index) of a mesh with ``sizes`` (dim → size): torch.chunk sizes, in mesh-dim order."""
    shape = list(global_shape)
    for dim, pl in zip(dim_names, placements):
        if pl.startswith("Shard("):
            d = int(pl[len("Shard("):-1])
            shape[d] = _chunk(shape[d], sizes[dim], coord[dim])
    return shape


def layout_record(rank: int, *, world_size: int | None = None, mesh_shape=(2, 2), dim_names=("dp", "tp"),
                  params=(), fsdp_groups=(), tp=(), pipeline: dict | None = None, regions=(),
                  device_type: str = "cpu", mesh_ranks=None) -> dict:
    """A ``graphdeck_parallel_layout`` payload for ``rank`` (version 1).

    One mesh ``mesh0`` of ``mesh_shape`` / ``dim_names`` over ``mesh_ranks`` (nested global
    ranks; default ``arange(prod(mesh_shape))`` reshaped); ``mesh_shape=None`` records no mesh.
    ``params``: dicts ``{"fqn", "global_shape", "placements"}`` (one placement per mesh dim,
    ``mesh_dims`` default all of ``dim_names``), the local shape computed for this rank unless
    given. ``pipeline``: ``{"stage_index", "num_stages", ...}`` (defaults filled: ``stage_ranks``
    ``[0 .. num_stages-1]``, ``schedule`` ``ScheduleGPipe``, ``n_microbatches`` 4).
    """
    meshes, coord, sizes = [], {}, {}
    if mesh_shape is not None:
        arr = np.asarray(mesh_ranks if mesh_ranks is not None else np.arange(math.prod(mesh_shape)).reshape(mesh_shape))
        where = np.argwhere(arr == rank)
        c = where[0].tolist() if len(where) else None
        groups = []
        if c is not None:
            for axis, name in enumerate(dim_names):
                idx = list(c)
                idx[axis] = slice(None)
                members = arr[tuple(idx)].tolist()
                groups.append({"dim": name, "name": f"pg_{name}_{'_'.join(map(str, members))}",
                               "desc": f"mesh_{name}", "ranks": members})
            coord = dict(zip(dim_names, c))
        sizes = dict(zip(dim_names, arr.shape))
        meshes.append({"key": "mesh0", "device_type": device_type, "shape": list(arr.shape),
                       "dim_names": list(dim_names), "ranks": arr.tolist(), "coord": c, "dim_groups": groups})
        world_size = world_size or int(arr.size)
    prec = []
    for p in params:
        dims = list(p.get("mesh_dims") or dim_names)
        local = p.get("local_shape") or (local_shape(p["global_shape"], p["placements"], dims, coord, sizes)
                                         if coord else list(p["global_shape"]))
        prec.append({"fqn": p["fqn"], "mesh": p.get("mesh", "mesh0"), "mesh_dims": dims,
                     "placements": list(p["placements"]), "local_shape": list(local),
                     "global_shape": list(p["global_shape"]), "dtype": p.get("dtype", "float32")})
    pipe = None
    if pipeline is not None:
        n = pipeline.get("num_stages", 2)
        pipe = {"stage_index": pipeline["stage_index"], "num_stages": n,
                "stage_ranks": pipeline.get("stage_ranks", list(range(n))), "group": pipeline.get("group", "0"),
                "schedule": pipeline.get("schedule", "ScheduleGPipe"),
                "n_microbatches": pipeline.get("n_microbatches", 4), "params": list(pipeline.get("params", []))}
        for k, v in pipeline.items():
            pipe.setdefault(k, v)
    return {"version": 1, "rank": rank, "world_size": world_size or 1, "meshes": meshes, "params": prec,
            "fsdp_groups": [dict(g) for g in fsdp_groups], "tp": [dict(t) for t in tp], "pipeline": pipe,
            "regions": [dict(r) for r in regions]}


def fsdp_tp_records(world_size: int = 4) -> dict[int, dict]:
    """rank → payload of the 2 x 2 dp x tp MLP of ``nd_fsdp_tp.py`` as a builder would describe it:
    ``w1`` colwise (Shard(0) on tp), ``w2`` rowwise (Shard(1) on tp), both Shard(0) on dp."""
    params = [{"fqn": "mlp.w1.weight", "global_shape": [64, 32], "placements": ["Shard(0)", "Shard(0)"]},
              {"fqn": "mlp.w2.weight", "global_shape": [32, 64], "placements": ["Shard(0)", "Shard(1)"]}]
    groups = [{"module": "mlp", "params": ["mlp.w1.weight", "mlp.w2.weight"], "mesh": "mesh0",
               "mesh_dims": ["dp"], "reshard_after_forward": True}]
    return {r: layout_record(r, params=params, fsdp_groups=groups) for r in range(world_size)}


def pairs(ranks):
    """Every unordered pair of ``ranks``."""
    return list(itertools.combinations(ranks, 2))
