"""Real training frameworks on 2 gloo CPU ranks (issue 34 item 2): healthy runs must be green on
every check, the parallel map right, and the capture must not change the losses.

* Hugging Face ``Trainer`` + accelerate (tests/hf_trainer_job.py): DDP, a tiny GPT-2, the user's
  ``torch_compile=True`` run as the reference and the same run plus one line,
  ``callbacks=[graphdeck.integrations.hf.GraphdeckCallback(...)]`` (issue 39), in one launch.
* PyTorch Lightning 2.6 (tests/lightning_job.py): ``strategy="ddp"``, ``torch.compile(model,
  backend="aot_eager")``, the reference run and the same run plus
  ``graphdeck.integrations.lightning.GraphdeckCallback()``, in one launch.

* The same two scripts exactly as the user wrote them (``--plain``: no graphdeck imported, no
  callback) under ``graphdeck run --store S --run NAME --profile-steps 2:3 -- python -m
  torch.distributed.run ...`` (issue 39: zero lines): the same assertions as the callback run, the
  same store as the callback run (graphs, parameters, bindings, per-step evidence, a profiled step,
  layout, communication and process groups, Flight Recorder), and the losses of the reference run
  bit for bit.

Two module-scoped fixtures per framework (the callback launch, the ``graphdeck run`` launch; ~1
min each on 2 CPUs); every assertion on a framework shares them. The fast test below pins the DDP
layout without a framework.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.cli import main as cli
from graphdeck.store.db import open_engine
from graphdeck.store.schema import Run
from tests.conftest import run_python

HERE = Path(__file__).parent

DDP_LAYOUT = r"""
import sys, tempfile
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP
from graphdeck.capture import Agent
store = sys.argv[1]
dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
class Net(torch.nn.Module):  # a user module: Dynamo does not compile torch.nn's own forwards as frames
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
    def forward(self, x):
        return self.lin(x).relu()
for run in ("ddp", "ddp-on-mesh"):
    torch._dynamo.reset()
    agent = Agent(store=store, run=run)
    model = Net()
    if run == "ddp":
        ddp = DDP(model)
    else:  # DDP over a DeviceMesh dimension: that dimension is the replica dimension, no second one
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        agent.watch_pipeline(mesh)
        ddp = DDP(model, process_group=mesh.get_group("dp"))
    agent.watch(model)
    compiled = torch.compile(ddp, backend=agent.backend("aot_eager"))
    compiled(torch.randn(2, 4)).sum().backward()
    agent.close()
dist.destroy_process_group()
"""


def _cli(*args: str):
    return CliRunner().invoke(cli, list(args))


def test_ddp_is_a_replica_dimension(tmp_path):
    """NOTE: [DDP as a mesh dimension]: a DDP job records no DeviceMesh; its process group is
    recorded as a 1-D ``ddp`` dimension, so the map draws the replicas and the summary's layout
    line is PASS (before: no layout, ``N/A``, and an empty map). DDP over a mesh's ``dp``
    dimension adds no second dimension."""
    from graphdeck.analysis.parallel.layout import load_layout

    store = tmp_path / "s.db"
    run_python(DDP_LAYOUT, str(store))
    with Session(open_engine(store, read_only=True)) as s:
        runs = {r.name: r for r in s.scalars(select(Run))}
        layouts = {name: load_layout(s, r.id) for name, r in runs.items()}
    assert [m["dim_names"] for m in layouts["ddp"].meshes] == [["ddp"]]
    assert layouts["ddp"].replica_peers() == [[0]] and layouts["ddp"].sharding_dims() == []
    assert [m["dim_names"] for m in layouts["ddp-on-mesh"].meshes] == [["dp"]]
    res = _cli("summary", "ddp", "--store", str(store))
    layout_line = next(ln for ln in res.output.splitlines() if ln.split()[1:2] == ["layout"])
    assert layout_line.startswith("PASS") and "mesh ddp (1)" in layout_line, res.output


# ------------------------------------------------------------------ the frameworks, for real

def _launch(script: str, out: Path, *args: str, env: dict | None = None, under: tuple[str, ...] = ()) -> None:
    """torchrun (this interpreter's: the ``torchrun`` shim may run another Python) of ``script`` on
    2 ranks; ``under``: the command it runs under (``graphdeck run ... --``)."""
    cmd = [*under, sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(HERE / script), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=900)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def _graphdeck_run(store: Path, run: str) -> tuple[str, ...]:
    """``graphdeck run`` with every option a user gives it for full evidence (docs/run.md)."""
    return (sys.executable, "-m", "graphdeck.cli", "run", "--store", str(store), "--run", run,
            "--profile-steps", "2:3", "--")


@pytest.fixture(scope="module")
def hf_job(tmp_path_factory) -> tuple[Path, Path]:
    pytest.importorskip("accelerate")
    out = tmp_path_factory.mktemp("hf")
    _launch("hf_trainer_job.py", out, str(out / "s.db"), str(out))
    return out / "s.db", out


@pytest.fixture(scope="module")
def lightning_job(tmp_path_factory) -> tuple[Path, Path]:
    pytest.importorskip("lightning")
    out = tmp_path_factory.mktemp("lightning")
    _launch("lightning_job.py", out, str(out), env={"GRAPHDECK_STORE": str(out / "s.db"), "GRAPHDECK_RUN": "lightning"})
    return out / "s.db", out


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory) -> tuple[Path, Path]:
    """The user's HF script as written (``--plain``), under ``graphdeck run``: no line of graphdeck."""
    pytest.importorskip("accelerate")
    out = tmp_path_factory.mktemp("hf-run")
    _launch("hf_trainer_job.py", out, "--plain", str(out), under=_graphdeck_run(out / "s.db", "hf"))
    return out / "s.db", out


@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory) -> tuple[Path, Path]:
    """The user's Lightning script as written (``--plain``), under ``graphdeck run``."""
    pytest.importorskip("lightning")
    out = tmp_path_factory.mktemp("lightning-run")
    _launch("lightning_job.py", out, "--plain", str(out), under=_graphdeck_run(out / "s.db", "lightning"))
    return out / "s.db", out


def _captured(request, framework: str, way: str) -> tuple[Path, list[tuple[list, list]]]:
    """The store of ``framework``'s captured run made ``way`` ("callback" or "graphdeck run"),
    and each rank's (reference losses, captured losses). The reference is always the callback
    launch's first run, the user's script without graphdeck; ``graphdeck run`` also stores what
    the callback stored (``_facts`` of tests/test_run.py, the same for both)."""
    store, out = request.getfixturevalue(f"{framework}_job")
    pairs = [(r["reference"], r["captured"]) for r in _losses(out)]
    if way == "callback":
        return store, pairs
    from tests.test_run import _facts

    run_store, run_out = request.getfixturevalue(f"{framework}_run")
    pairs = [(ref, plain["plain"]) for (ref, _), plain in zip(pairs, _losses(run_out))]
    by_callback, by_run = _facts(store), _facts(run_store)
    # The callback's launch also ran the reference in the same processes: its Flight Recorder holds
    # both runs' collectives. Each rank's dump at close is all this one compares.
    assert {(r, why) for r, why, _n in by_run.pop("flight")} == {(0, "close"), (1, "close")}
    by_callback.pop("flight")
    for key, value in by_callback.items():
        assert by_run[key] == value, (key, value, by_run[key])
    return run_store, pairs


WAYS = ("callback", "graphdeck run")


def _losses(out: Path) -> list[dict]:
    return [json.loads((out / f"losses_rank{r}.json").read_text()) for r in (0, 1)]


def _green(store: Path, run: str) -> dict[str, str]:
    """Every check and the summary exit 0 on the run; returns each command's output."""
    outputs = {}
    for name, args in (("summary", ["summary", run, "--store", str(store)]),
                       ("check-grads", ["check-grads", str(store), "--run", run]),
                       ("check-ranks", ["check-ranks", str(store), "--run", run]),
                       ("check-compile", ["check-compile", str(store), "--run", run])):
        res = _cli(*args)
        assert res.exit_code == 0, f"{name} exits {res.exit_code} on the healthy {run} run:\n{res.output}"
        outputs[name] = res.output
    return outputs


def _map(store: Path, run: str) -> dict:
    from graphdeck.server.routes.parallel_map import parallel_map

    with Session(open_engine(store, read_only=True)) as s:
        return parallel_map(s, s.scalar(select(Run).where(Run.name == run)))


def _full_evidence(store: Path, run: str, summary: str) -> None:
    """What the hand-written Agent code gave, from the one callback line: each rank's graphs
    (Dynamo and AOT forward/backward), a profiled step, the DDP layout, and no verdict
    INCOMPLETE for want of evidence."""
    from graphdeck.store.schema import Graph, Trace

    with Session(open_engine(store, read_only=True)) as s:
        run_id = s.scalar(select(Run.id).where(Run.name == run))
        kinds = {(r, k) for r, k in s.execute(select(Graph.rank, Graph.kind).where(Graph.run_id == run_id))}
        traced = set(s.scalars(select(Trace.rank).where(Trace.run_id == run_id)))
    for rank in (0, 1):
        assert {(rank, "dynamo"), (rank, "aot_forward"), (rank, "aot_backward")} <= kinds, kinds
    assert traced == {0, 1}, traced
    assert "INCOMPLETE" not in summary and "mesh ddp (2)" in summary, summary


def _replica_column(m: dict) -> None:
    """DDP on 2 ranks: one program, no sharding column, the two replicas on the ``ddp`` dimension."""
    assert m["has_layout"] and m["dims"] == {"stage": None, "rows": ["ddp"], "cols": []}, m
    [block] = m["stages"]
    assert [[c["ranks"] for c in row["cells"]] for row in block["rows"]] == [[[0]], [[1]]]
    assert not m["unplaced"] and not m["notes"]


@pytest.mark.slow
@pytest.mark.parametrize("way", WAYS)
def test_hf_trainer_ddp_is_green(request, way):
    store, pairs = _captured(request, "hf", way)
    for reference, captured in pairs:  # the Trainer's logged loss (the mean over ranks), step for step
        assert len(reference) == 4 and captured == reference, (reference, captured)
    text = _green(store, "hf")
    assert "all 28 parameters get a gradient on every rank" in text["summary"], text["summary"]
    assert "steps 0–3 (4 backward)" in text["check-grads"], text["check-grads"]
    # transformers' warning_once about loss_type: transformers' break, not the user's
    assert "[logging, framework: transformers]" in text["check-compile"], text["check-compile"]
    assert "graph breaks: 0 distinct in user code" in text["check-compile"]
    # accelerate compiled the DDP wrapper (DDP's own forward is a compiled frame), through graphdeck
    assert "_pre_forward (distributed.py" in text["check-compile"], text["check-compile"]
    _full_evidence(store, "hf", text["summary"])
    _replica_column(_map(store, "hf"))


@pytest.mark.slow
@pytest.mark.parametrize("way", WAYS)
def test_lightning_ddp_is_green(request, way):
    store, pairs = _captured(request, "lightning", way)
    for reference, captured in pairs:  # this rank's loss, step for step
        assert len(reference) == 4 and captured == reference, (reference, captured)
    text = _green(store, "lightning")
    assert "all 4 parameters get a gradient on every rank" in text["summary"], text["summary"]
    assert "steps 0–3 (4 backward)" in text["check-grads"], text["check-grads"]
    _full_evidence(store, "lightning", text["summary"])
    _replica_column(_map(store, "lightning"))
