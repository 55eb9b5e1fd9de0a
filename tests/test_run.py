"""``graphdeck run -- COMMAND`` (graphdeck/cli_run.py, capture/autorun.py): the agent in every
Python process without a line of training code (issue 39 item 1).

Fast: exit status and signals pass through; the start-up hook imports no torch, chains to the
``sitecustomize`` it hides, and a process that only imports torch.distributed (a launcher) gets no
agent. Slow (one shared fixture of real 2-rank gloo jobs under torchrun, aot_eager):
* the unmodified twin of tests/ddp_overlap_job.py (tests/run_ddp_job.py) under ``graphdeck run``
  stores what the Agent-instrumented job stores (graphs, bindings, buckets, per-step gradient
  evidence, layout, communication groups, process groups, Flight Recorder, ProfilerStep#2-3) and
  prints the same losses as without ``graphdeck run``;
* the twin raising at step 2 keeps what was recorded until then; the status is torchrun's;
* FSDP2 from torch's public APIs (tests/run_fsdp2_job.py): the FSDP2 layout and every parameter;
* the capture matrix's invisibility check (tests/capture_matrix_job.py, plain mode) under the
  bootstrap, profiler on: losses, parameter/gradient digests, compiles and shape guards unchanged;
  the same for its pipelining variant (tests/capture_matrix_pipeline.py), whose stages are watched.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
MATRIX = ("dynamic", "ddp", "fsdp2", "tp")


def _gd_run(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "graphdeck.cli", "run", *args], capture_output=True, text=True,
                          env=env or dict(os.environ, OMP_NUM_THREADS="1"), timeout=timeout, cwd=REPO)


# ----------------------------------------------------------------------------- fast
def test_exit_status_is_the_commands():
    assert _gd_run("--", sys.executable, "-c", "import sys; sys.exit(7)").returncode == 7
    killed = _gd_run("--", sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)")
    assert killed.returncode == 128 + signal.SIGTERM
    bad = _gd_run("--profile-steps", "0:2", "--", sys.executable, "-c", "pass")
    assert bad.returncode == 2 and "1 <= A < B" in bad.stderr, bad.stderr


def test_sigterm_is_forwarded(tmp_path):
    ready, got = tmp_path / "ready", tmp_path / "got"
    child = ("import pathlib, signal, sys, time\n"
             f"signal.signal(signal.SIGTERM, lambda *a: (pathlib.Path({str(got)!r}).write_text('term'), sys.exit(3)))\n"
             f"pathlib.Path({str(ready)!r}).write_text('1')\n"
             "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-m", "graphdeck.cli", "run", "--store", str(tmp_path / "s.db"), "--",
                             sys.executable, "-c", child], cwd=REPO)
    try:
        for _ in range(600):
            if ready.exists():
                break
            time.sleep(0.1)
        assert ready.exists()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 3
    finally:
        proc.kill()
    assert got.read_text() == "term"


def test_start_up_hook_is_lazy_chains_and_skips_launchers(tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import os\nos.environ['USER_SITE_RAN'] = '1'\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(user), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    store = tmp_path / "s.db"
    probe = ("import os, sys; print(os.environ.get('USER_SITE_RAN'), 'torch' in sys.modules, "
             "'graphdeck.capture.autorun' in sys.modules, 'sqlalchemy' in sys.modules)")
    out = _gd_run("--store", str(store), "--", sys.executable, "-c", probe, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "False", "True", "False"], out.stdout
    # A launcher: imports torch.distributed (as torchrun's parent does), starts no rank's work.
    launcher = _gd_run("--store", str(store), "--", sys.executable, "-c",
                       "import torch, torch.distributed, torch.nn.parallel; import torch.distributed.run", env=env)
    assert launcher.returncode == 0, launcher.stderr
    assert not store.exists(), "a process that trains nothing opened the store"


# ----------------------------------------------------------------------------- slow
def _free_port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _job(cmd: list[str]) -> dict:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PORT=_free_port()))
    # (two ranks write to one pipe: a line may hold both ranks' prints)
    lines = sorted(re.findall(r"rank \d+ step \d+ -?0x[0-9a-f.]+p[+-]\d+", proc.stdout))
    return {"rc": proc.returncode, "lines": lines, "log": proc.stdout[-3000:] + proc.stderr[-6000:]}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    (out / "plain").mkdir()
    (out / "boot").mkdir()
    gd = [sys.executable, "-m", "graphdeck.cli", "run"]
    twin = [*TORCHRUN, str(REPO / "tests" / "run_ddp_job.py")]
    cmds = {
        "agent": [*TORCHRUN, str(REPO / "tests" / "ddp_overlap_job.py"), str(out / "agent.db"), "split"],
        "plain": twin,
        "run": [*gd, "--store", str(out / "run.db"), "--run", "split", "--profile-steps", "2:4", "--", *twin],
        "crash": [*gd, "--store", str(out / "crash.db"), "--run", "crash", "--", *twin, "--crash-at", "2"],
        "fsdp2": [*gd, "--store", str(out / "fsdp2.db"), "--run", "fsdp2", "--",
                  *TORCHRUN, str(REPO / "tests" / "run_fsdp2_job.py")],
        "matrix_plain": [sys.executable, str(REPO / "tests" / "capture_matrix_job.py"), "--batch", "plain",
                         str(out / "plain"), *MATRIX],
        "matrix_boot": [*gd, "--store", str(out / "boot.db"), "--run", "inv", "--profile-steps", "1:3", "--",
                        sys.executable, str(REPO / "tests" / "capture_matrix_job.py"), "--batch", "plain",
                        str(out / "boot"), *MATRIX],
        "pipe_plain": [sys.executable, str(REPO / "tests" / "capture_matrix_pipeline.py"), "plain",
                       str(out / "unused.db"), str(out / "pipe-plain.json")],
        "pipe_boot": [*gd, "--store", str(out / "pipe.db"), "--run", "pipe", "--", sys.executable,
                      str(REPO / "tests" / "capture_matrix_pipeline.py"), "plain", str(out / "unused.db"),
                      str(out / "pipe-boot.json")],
    }
    with ThreadPoolExecutor(2) as pool:
        futures = {k: pool.submit(_job, c) for k, c in cmds.items()}
        res = {k: f.result() for k, f in futures.items()}
    res["dir"] = out
    return res


def _facts(db: Path) -> dict:
    """What a run stored, comparable across two runs of the same job (ids, times, pids left out)."""
    c = sqlite3.connect(db)
    q = lambda sql: sorted(c.execute(sql).fetchall(), key=repr)  # noqa: E731
    f = {
        "ranks": q("SELECT r.name, k.rank, k.world_size, k.backend FROM ranks k JOIN runs r ON r.id = k.run_id"),
        "graphs": q("SELECT rank, kind, name, partition_index, num_nodes, structural_hash FROM graphs"),
        "params": q("SELECT rank, fqn, kind, shape_json, requires_grad FROM params"),
        "bindings": q("SELECT g.rank, g.kind, g.partition_index, io.direction, io.position, io.param_fqn, io.has_grad "
                      "FROM graph_io io JOIN graphs g ON g.id = io.graph_id"),
        "buckets": q('SELECT rank, kind, "index", size_bytes, params_json FROM partitions'),
        "evidence": q("SELECT rank, step_first, step_last, n_backward, step_source, closed FROM grad_steps"),
        "profiled": q("SELECT t.rank, s.value FROM trace_events e JOIN traces t ON t.id = e.trace_id "
                      "JOIN strings s ON s.id = e.name_id WHERE s.value LIKE 'ProfilerStep#%'"),
        "flight": q("SELECT rank, json_extract(metadata_json, '$.reason'), json_extract(metadata_json, '$.entries') "
                    "FROM compile_events WHERE name = 'flight_recorder'"),
    }
    for name in ("graphdeck_parallel_layout", "graphdeck_comm_groups", "graphdeck_process_groups", "graphdeck_watch"):
        last = {}
        for rank, payload in c.execute("SELECT rank, payload FROM compile_events WHERE name = ? ORDER BY id", (name,)):
            last[rank] = json.loads(payload)
        f[name] = last
    return f


@pytest.mark.slow
def test_unmodified_ddp_script_stores_what_the_agent_stores(jobs):
    for k in ("agent", "plain", "run"):
        assert jobs[k]["rc"] == 0, (k, jobs[k]["log"])
    agent, run = _facts(jobs["dir"] / "agent.db"), _facts(jobs["dir"] / "run.db")
    assert run["ranks"] == [("split", 0, 2, "gloo"), ("split", 1, 2, "gloo")]  # the launcher is no rank
    assert {kind for _, kind, *_ in run["graphs"]} == {"dynamo", "ddp_partition", "aot_forward", "aot_backward"}
    assert len(run["profiled"]) == 4 and run["evidence"] and len(run["flight"]) == 2, run
    assert run["graphdeck_parallel_layout"] and run["graphdeck_comm_groups"] and run["graphdeck_process_groups"]
    for key in agent:
        assert run[key] == agent[key], (key, agent[key], run[key])
    # The script's printed losses, bit for bit, with and without graphdeck run.
    assert len(jobs["plain"]["lines"]) == 8 and jobs["run"]["lines"] == jobs["plain"]["lines"]


@pytest.mark.slow
def test_a_crash_keeps_what_was_recorded(jobs):
    crash = jobs["crash"]
    assert crash["rc"] == 1, crash["log"]  # torchrun's status for a failed rank
    assert "the job fails in step 2" in crash["log"] and len(crash["lines"]) == 4  # steps 0 and 1 on 2 ranks
    f = _facts(jobs["dir"] / "crash.db")
    for rank in (0, 1):
        kinds = {kind for r, kind, *_ in f["graphs"] if r == rank}
        assert kinds == {"dynamo", "ddp_partition", "aot_forward", "aot_backward"}, kinds
        assert len([p for p in f["params"] if p[0] == rank]) == 8
        assert (rank, 0, 1, 2, "optimizer", 0) in f["evidence"], f["evidence"]  # 2 steps, not closed
        assert (rank, "exception") in {(r, why) for r, why, _n in f["flight"]}, f["flight"]
        assert rank in f["graphdeck_parallel_layout"] and rank in f["graphdeck_comm_groups"]
        assert rank in f["graphdeck_process_groups"]


@pytest.mark.slow
def test_fsdp2_from_public_apis_layout_and_every_parameter(jobs):
    assert jobs["fsdp2"]["rc"] == 0, jobs["fsdp2"]["log"]
    from graphdeck import validate_backward

    f = _facts(jobs["dir"] / "fsdp2.db")
    block = ("ln.weight", "ln.bias", "fc.weight", "fc.bias", "proj.weight", "proj.bias")
    expected = {f"blocks.{b}.{p}" for b in range(3) for p in block} | {
        f"{m}.{p}" for m in ("embed", "head") for p in ("weight", "bias")}
    report = validate_backward(jobs["dir"] / "fsdp2.db", "fsdp2")
    for rank in (0, 1):
        assert {fqn for r, fqn, *_ in f["params"] if r == rank} == expected
        groups = f["graphdeck_parallel_layout"][rank]["fsdp_groups"]
        assert {g["module"] for g in groups} == {"", "blocks.0", "blocks.1", "blocks.2"}, groups
        assert {p for g in groups for p in g["params"]} == expected
        assert {g["mesh_dims"][0] for g in groups} == {"dp"}
        rows = {r.fqn: r.status for r in report.rows if r.rank == rank}
        assert rows == dict.fromkeys(expected, "OK"), rows


@pytest.mark.slow
@pytest.mark.parametrize("variant", MATRIX)
def test_the_bootstrap_changes_nothing(jobs, variant):
    assert jobs["matrix_plain"]["rc"] == 0 and jobs["matrix_boot"]["rc"] == 0, jobs["matrix_boot"]["log"]
    plain = json.loads((jobs["dir"] / "plain" / f"{variant}-plain.json").read_text())
    boot = json.loads((jobs["dir"] / "boot" / f"{variant}-plain.json").read_text())
    assert "error" not in plain and "error" not in boot, (plain.get("error"), boot.get("error"))
    for key in ("losses", "digests", "compiles", "shapes"):
        assert boot[key] == plain[key], (variant, key, plain[key], boot[key])
    f = _facts(jobs["dir"] / "boot.db")
    assert f["graphs"] and f["params"] and len(f["profiled"]) == 2, "the bootstrap captured nothing"


def test_each_kind_of_backend_keeps_its_compiler():
    """What the wrapped lookup hands the agent as the inner compiler (no compile runs here)."""
    import torch
    from torch._dynamo.backends.registry import lookup_backend

    from graphdeck.capture.autorun import captured
    from graphdeck.capture.backend import graphdeck_backend

    eager = captured("aot_eager", lookup_backend("aot_eager"))
    assert eager.graphdeck_inner == "aot_eager" and eager.graphdeck_extra == {}
    assert captured("aot_eager", lookup_backend("aot_eager")) is eager  # one wrapper per backend: no new guards
    tuned = torch._TorchCompileInductorWrapper("max-autotune-no-cudagraphs", None, None)
    got = captured(tuned, tuned)
    assert got.graphdeck_inner == "inductor" and got.graphdeck_extra["config_patches"] == tuned.config
    assert got.get_compiler_config is not None and got.compiler_name == "inductor"
    named = torch._TorchCompileWrapper("aot_eager", None, None, None)
    assert captured(named, named).graphdeck_inner == "aot_eager"

    def mine(gm, example_inputs):
        return gm.forward

    assert captured(mine, mine).graphdeck_inner is mine  # a custom backend: it compiles, the agent records
    assert captured("graphdeck", graphdeck_backend) is graphdeck_backend  # the agent's own: not twice


def test_a_custom_backend_is_captured_and_still_compiles(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import torch\n"
        "calls = []\n"
        "def my_backend(gm, example_inputs):\n"
        "    calls.append(len(gm.graph.nodes))\n"
        "    return gm.forward\n"
        "f = torch.compile(lambda x: (x * 2).sin(), backend=my_backend)\n"
        "print('out', f(torch.ones(3)).sum().item().hex())\n"
        "print('calls', len(calls))\n")
    store = tmp_path / "s.db"
    out = _gd_run("--store", str(store), "--run", "custom", "--", sys.executable, str(script))
    assert out.returncode == 0, out.stderr
    assert "calls 1" in out.stdout, out.stdout
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert plain.stdout == out.stdout
    kinds = sqlite3.connect(store).execute("SELECT kind FROM graphs").fetchall()
    assert ("dynamo",) in kinds, kinds



def test_the_last_flight_recorder_dump_is_stored_at_interpreter_exit(tmp_path):
    """A job with no compile and no ``destroy_process_group()``: its agent closes at interpreter
    exit, where an import that registers an exit hook raises (``concurrent.futures`` did, from
    the Flight Recorder loader): the dump was lost with "can't register atexit after shutdown"."""
    script = tmp_path / "job.py"
    script.write_text(
        "import tempfile, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo', init_method=f'file://{tempfile.mktemp()}', rank=0, world_size=1)\n"
        "t = torch.ones(4)\n"
        "for _ in range(3):\n"
        "    dist.all_reduce(t)\n"
        "print('sum', float(t.sum()))\n")
    store = tmp_path / "s.db"
    out = _gd_run("--store", str(store), "--run", "fr", "--", sys.executable, str(script))
    assert out.returncode == 0 and "sum 4.0" in out.stdout, out.stderr
    assert "not stored" not in out.stderr, out.stderr
    rows = sqlite3.connect(store).execute(
        "SELECT payload FROM compile_events WHERE name = 'flight_recorder'").fetchall()
    assert rows and any("all_reduce" in (p or "") for (p,) in rows), rows

FRAMEWORK_DDP = """
import tempfile
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
class FrameworkDDP(DistributedDataParallel):  # a framework's own DDP (a subclass of torch's)
    pass
class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
    def forward(self, x):
        return self.lin(x).relu()
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(4, 4)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.embed(x)
model = Net()
for block in model.blocks:  # regional compilation, then the whole model wrapped in DDP
    block.compile(backend="aot_eager")
ddp = FrameworkDDP(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ddp(torch.randn(2, 4)).sum().backward()
opt.step()
dist.destroy_process_group()
"""


def test_the_model_a_framework_wraps_is_watched_whole(tmp_path):
    """Blocks compiled one by one, then the model wrapped in a framework's own subclass of
    ``DistributedDataParallel``: the model is watched, every parameter under its own name, with
    DDP's settings. Before: each block watched at its ``compile`` (``lin.weight``,
    ``Block[1].lin.weight``, no ``embed``); a DDP subclass taken for a plain module
    (``module.embed.weight``, no ``ddp`` in the watch record)."""
    script, store = tmp_path / "job.py", tmp_path / "s.db"
    script.write_text(FRAMEWORK_DDP)
    out = _gd_run("--store", str(store), "--run", "fw", "--", sys.executable, str(script))
    assert out.returncode == 0, out.stderr
    c = sqlite3.connect(store)
    assert sorted(fqn for (fqn,) in c.execute("SELECT fqn FROM params")) == [
        "blocks.0.lin.bias", "blocks.0.lin.weight", "blocks.1.lin.bias", "blocks.1.lin.weight", "embed.bias",
        "embed.weight"]
    watch = [json.loads(p) for (p,) in c.execute("SELECT payload FROM compile_events WHERE name = 'graphdeck_watch'")]
    assert watch and all(w.get("ddp") is True for w in watch), watch


@pytest.mark.slow
def test_a_pipeline_stage_is_watched_and_unchanged(jobs):
    """Two pipeline stages (``torch.distributed.pipelining``, mp.spawn'd ranks), each compiled:
    under the bootstrap the losses, digests and compiles are the plain run's, and each rank's
    layout names its stage and the stage's parameters."""
    assert jobs["pipe_plain"]["rc"] == 0 and jobs["pipe_boot"]["rc"] == 0, jobs["pipe_boot"]["log"]
    plain = json.loads((jobs["dir"] / "pipe-plain.json").read_text())
    boot = json.loads((jobs["dir"] / "pipe-boot.json").read_text())
    for key in ("losses", "digests", "compiles", "shapes"):
        assert boot[key] == plain[key], (key, plain[key], boot[key])
    layout = _facts(jobs["dir"] / "pipe.db")["graphdeck_parallel_layout"]
    assert {r: layout[r]["pipeline"]["stage_index"] for r in layout} == {0: 0, 1: 1}, layout
    assert layout[0]["pipeline"]["params"] == ["a.weight", "a.bias", "b.weight", "b.bias"]
    assert not (jobs["dir"] / "unused.db").exists()  # the plain job wrote nothing itself
