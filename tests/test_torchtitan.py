"""torchtitan's llama3 debug model on 2 gloo CPU ranks, captured by graphdeck (issue 34): a healthy
run is green on every check, its layout drawn right, and the capture changes no loss.

Two configurations, one module-scoped fixture each, 4 steps of 128 tokens compiled with
``aot_eager``, launched by the shim ``tests/titan_launch.py`` (docs/frameworks.md, "torchtitan on
CPU: the shim"):

* FSDP2 over the 2 ranks (torchtitan's default parallelism on 2 ranks), captured through
  torchtitan's own config hook, ``--override.imports graphdeck.integrations.torchtitan.capture``
  with ``--compile.backend aot_eager`` (issue 39, docs/integrations.md);
* TP=2 (``--parallelism.tensor-parallel-degree 2 --parallelism.data-parallel-shard-degree 1``),
  whose vocab-parallel loss bakes each rank's vocab offset into its graph, captured through
  ``--compile.backend graphdeck`` with ``GRAPHDECK_INNER=aot_eager`` and the shim's watch/profile.

Each fixture runs the configuration twice: without graphdeck (``--compile.backend aot_eager``, the
reference) and with it (profiling steps 2-3); rank 0 writes each step's loss and gradient norm as
torchtitan logs them. About a minute a run on a quiet 2-core host.

``summary``'s trace line needs the ATen ops FlexAttention runs under ``aot_eager`` mapped to its
node and coverage taken of the ops' own CPU time (analysis/traces/cpu_mapping.py, NOTE [Ops of
a higher-order op], from the trace-coverage work of issue 34): 15-19% mapped without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from tests.conftest import REPO, free_port, require

pytestmark = pytest.mark.slow

STEPS = 4
ARGS = ["--module", "llama3", "--config", "llama3_debugmodel", "--dataloader.dataset", "c4_test",
        "--training.seq-len", "128", "--training.local-batch-size", "2", "--training.steps", str(STEPS),
        "--compile.enable", "--parallelism.spmd-backend", "partial_dtensor", "--checkpoint.no-enable",
        "--validator.no-enable", "--debug.seed", "0"]  # seeded: the same init each run
TP = ["--parallelism.tensor-parallel-degree", "2", "--parallelism.data-parallel-shard-degree", "1"]


def _have_torchtitan() -> bool:
    try:
        import tokenizers  # noqa: F401
        import torchtitan  # noqa: F401
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    require(_have_torchtitan(), "torchtitan, triton and tokenizers are in the test extra")
    sys.path.insert(0, str(REPO / "tests"))
    try:
        from titan_launch import make_assets
    finally:
        sys.path.remove(str(REPO / "tests"))
    return Path(make_assets(str(tmp_path_factory.mktemp("titan_assets"))))


def _launch(assets: Path, out: Path, name: str, extra: list[str], capture: str | None) -> list[dict]:
    """Run the shim under torchrun; rank 0's logged steps ``[{"step", "loss", "grad_norm"}]``.
    ``capture``: None (no graphdeck), ``"backend"`` (``--compile.backend graphdeck``, the shim
    watches and profiles) or ``"override"`` (torchtitan's own ``--override.imports
    graphdeck.integrations.torchtitan.capture``, the backend left as ``aot_eager``)."""
    losses = out / f"{name}.losses.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAPHDECK_")}
    env.update({"TITAN_LOSSES": str(losses), "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"})
    backend = "aot_eager"
    if capture == "backend":
        env.update({"GRAPHDECK_STORE": str(out / "titan.db"), "GRAPHDECK_RUN": name,
                    "GRAPHDECK_INNER": "aot_eager", "TITAN_PROFILE": "1"})
        backend = "graphdeck"
    elif capture == "override":  # the one line of docs/integrations.md (steps 2-3 profiled by default)
        env.update({"GRAPHDECK_STORE": str(out / "titan.db"), "GRAPHDECK_RUN": name, "TITAN_HOOK": "override"})
        extra = [*extra, "--override.imports", "graphdeck.integrations.torchtitan.capture"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(REPO / "tests" / "titan_launch.py"), *ARGS,
           "--hf-assets-path", str(assets), "--dataloader.dataset-path", str(assets / "data"),
           "--dump-folder", str(out / f"dump_{name}"), "--compile.backend", backend, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=out, timeout=900)
    assert proc.returncode == 0, f"torchtitan run {name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return [json.loads(line) for line in losses.read_text().splitlines()]


def _run(assets: Path, out: Path, name: str, extra: list[str], capture: str = "backend") -> dict:
    reference = _launch(assets, out, name + "-reference", extra, capture=None)
    captured = _launch(assets, out, name, extra, capture=capture)
    return {"store": out / "titan.db", "run": name, "reference": reference, "captured": captured}


@pytest.fixture(scope="module")
def fsdp(assets, tmp_path_factory) -> dict:
    # captured through torchtitan's own config hook (issue 39): FSDP2 layout and every parameter named
    return _run(assets, tmp_path_factory.mktemp("titan_fsdp"), "fsdp", [], capture="override")


@pytest.fixture(scope="module")
def tp(assets, tmp_path_factory) -> dict:
    return _run(assets, tmp_path_factory.mktemp("titan_tp"), "tp", TP)


def _cli(command: str, job: dict, *extra: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("graphdeck")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "graphdeck.cli"]
    return subprocess.run([*cmd, command, str(job["store"]), "--run", job["run"], *extra], capture_output=True,
                          text=True, timeout=600, cwd=REPO)


def _map(job: dict) -> dict:
    from graphdeck.server.routes.parallel_map import parallel_map
    from graphdeck.store.db import open_engine
    from graphdeck.store.schema import Run

    engine = open_engine(job["store"], read_only=True)
    try:
        with Session(engine) as s:
            return parallel_map(s, s.scalars(select(Run).where(Run.name == job["run"])).one(), checks=["layout"])
    finally:
        engine.dispose()


def _cells(stage: dict) -> list[list]:
    return [[c and c["ranks"] for c in row["cells"]] for row in stage["rows"]]


@pytest.mark.parametrize("config", ["fsdp", "tp"])
def test_healthy_run_is_green(config, request):
    job = request.getfixturevalue(config)
    for command in ("summary", "check-grads", "check-ranks", "check-compile"):
        proc = _cli(command, job)
        assert proc.returncode == 0, f"{command} {config}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    summary = json.loads(_cli("summary", job, "--json").stdout)
    verdicts = {c["key"]: c["verdict"] for c in summary["checks"]}
    assert set(verdicts.values()) == {"PASS"} and {"traces", "gradients", "ranks", "compile", "layout"} <= set(
        verdicts), verdicts
    grads = json.loads(_cli("check-grads", job, "--json").stdout)
    names = {p["fqn"] for p in grads["params"]}
    assert len(names) == 45 and all(p["status"] == "OK" for p in grads["params"]), names  # each counted once
    assert not any("freqs" in n or "rope" in n for n in names)
    steps = grads["coverage"]["steps"]
    assert {(s["first"], s["last"]) for s in steps.values()} == {(0, STEPS - 1)}, steps  # optimizer steps


def test_losses_are_those_of_the_run_without_capture(fsdp, tp):
    for job in (fsdp, tp):
        assert [s["step"] for s in job["captured"]] == list(range(1, STEPS + 1))
        assert job["captured"] == job["reference"], job["run"]  # loss and grad norm, bit for bit


def test_fsdp2_map_is_one_dimension(fsdp):
    m = _map(fsdp)
    assert m["dims"] == {"stage": None, "rows": ["fsdp"], "cols": []}, m["dims"]
    (stage,) = m["stages"]
    assert _cells(stage) == [[[0]], [[1]]]  # one cell per rank, no hole (was a 2×2 diagonal)
    ranks = json.loads(_cli("check-ranks", fsdp, "--format", "json").stdout)
    assert ranks["verdict"] == "OK" and ranks["groups"] == [[0, 1]]


def test_tp_map_is_one_by_two_and_vocab_offset_a_note(tp):
    m = _map(tp)
    assert m["dims"]["cols"] == ["tp"] and "world" not in m["dims"]["rows"], m["dims"]
    (stage,) = m["stages"]
    assert stage["cols"] == ["tp 0", "tp 1"] and _cells(stage) == [[[0], [1]]]
    text = _cli("check-ranks", tp).stdout
    (note,) = [line for line in text.splitlines() if "per-rank constants" in line]
    assert "0 vs 1024" in note and "over tp" in note and "Shard(0) of [2048, 256]" in note, note

