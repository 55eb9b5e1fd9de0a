"""What ``graphdeck run`` costs (issue 39 benchmark), two figures, each from paired runs:

1. **Start-up per process**: the CPU seconds (user + system, from ``getrusage`` of the children)
   of ``python -c "import torch"`` with the bootstrap (``graphdeck run``'s ``sitecustomize`` first
   on ``PYTHONPATH`` and its settings in the environment) and without, alternated ``--pairs``
   times; also ``python -c pass`` (an interpreter that never imports torch, such as a launcher's
   helper). Reported: the medians, the median of the pairs' differences and their spread.
2. **Steady step**: the demo's model (GPT-2, 2 blocks, ``graphdeck.demo.build_model``) under DDP
   on a 1-rank gloo group, compiled with aot_eager, AdamW, one process per run: **agent** (the
   Agent written into the code: ``watch``, ``backend("aot_eager")``, ``close``) and **run** (the
   same code with no graphdeck in it, under ``graphdeck run``), alternated. Per run, the median
   CPU seconds (``time.process_time``: all threads) and wall seconds of the steps after
   ``--warmup``; reported per pair run/agent - 1, their median and spread.

    OMP_NUM_THREADS=1 python bench/bench_run_launcher.py [--pairs 10] [--step-pairs 3] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def _child_cpu(cmd: list[str], env: dict) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, env=env, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _spread(xs: list[float]) -> str:
    return f"{min(xs):+.3f} .. {max(xs):+.3f}"


def startup(pairs: int, tmp: str) -> dict:
    from graphdeck.cli_run import SITECUSTOMIZE, run_env

    site = os.path.join(tmp, "site")
    os.makedirs(site, exist_ok=True)
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(SITECUSTOMIZE)
    plain_env = dict(os.environ)
    boot_env = run_env(os.path.join(tmp, "startup.db"), "bench", None, True, site)
    out = {}
    for name, code in (("import torch", "import torch"), ("pass", "pass")):
        plain, boot = [], []
        for i in range(pairs):
            order = ((plain, plain_env), (boot, boot_env)) if i % 2 == 0 else ((boot, boot_env), (plain, plain_env))
            for acc, env in order:
                acc.append(_child_cpu([sys.executable, "-c", code], env))
        diffs = [b - p for p, b in zip(plain, boot)]
        out[name] = {"plain_cpu_s": statistics.median(plain), "boot_cpu_s": statistics.median(boot),
                     "diff_median_s": statistics.median(diffs), "diff_spread": _spread(diffs)}
        assert not os.path.exists(os.path.join(tmp, "startup.db")), "the bootstrap opened the store"
    return out


def job(mode: str, store: str, steps: int, warmup: int, out: str) -> None:
    """One run (``mode`` agent or run) in this process; writes its per-step medians to ``out``."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from graphdeck.demo import build_model

    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    agent = None
    model = build_model(n_layer=2)
    if mode == "agent":
        from graphdeck.capture import Agent

        agent = Agent(store=store, run="bench")
        agent.watch(model)
    ddp = DDP(model, bucket_cap_mb=1)
    compiled = torch.compile(ddp, backend=agent.backend("aot_eager") if agent else "aot_eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1000)
    cpu, wall = [], []
    for step in range(steps):
        tokens = torch.randint(0, model.config.vocab_size, (4, 64), generator=gen)
        c0, w0 = time.process_time(), time.perf_counter()
        compiled(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= warmup:
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - w0)
    if agent is not None:
        agent.close()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump({"cpu_s": statistics.median(cpu), "wall_s": statistics.median(wall)}, f)


def steady(pairs: int, steps: int, warmup: int, tmp: str) -> dict:
    import socket

    def one(mode: str, i: int) -> dict:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(os.environ, MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        store, out = os.path.join(tmp, f"{mode}{i}.db"), os.path.join(tmp, f"{mode}{i}.json")
        me = [sys.executable, os.path.abspath(__file__), "--job", mode, store, str(steps), str(warmup), out]
        cmd = me if mode == "agent" else [sys.executable, "-m", "graphdeck.cli", "run", "--store", store,
                                          "--run", "bench", "--", *me]
        subprocess.run(cmd, env=env, check=True, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)

    rows = []
    for i in range(pairs):
        modes = ("agent", "run") if i % 2 == 0 else ("run", "agent")
        got = {m: one(m, i) for m in modes}
        rows.append(got)
        print(f"pair {i}: agent {got['agent']['cpu_s'] * 1e3:.2f} ms CPU/step, run {got['run']['cpu_s'] * 1e3:.2f}",
              flush=True)
    cpu = [r["run"]["cpu_s"] / r["agent"]["cpu_s"] - 1 for r in rows]
    wall = [r["run"]["wall_s"] / r["agent"]["wall_s"] - 1 for r in rows]
    return {"agent_cpu_ms": statistics.median(r["agent"]["cpu_s"] for r in rows) * 1e3,
            "run_cpu_ms": statistics.median(r["run"]["cpu_s"] for r in rows) * 1e3,
            "cpu_ratio_median": statistics.median(cpu), "cpu_ratio_spread": _spread(cpu),
            "wall_ratio_median": statistics.median(wall), "wall_ratio_spread": _spread(wall)}


def main() -> None:
    if sys.argv[1:2] == ["--job"]:
        mode, store, steps, warmup, out = sys.argv[2:7]
        job(mode, store, int(steps), int(warmup), out)
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=10, help="start-up pairs")
    ap.add_argument("--step-pairs", type=int, default=3, help="steady-step pairs (one process per run)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        res = {"startup": startup(args.pairs, tmp),
               "steady": steady(args.step_pairs, args.steps, args.warmup, tmp) if args.step_pairs else None,
               "load": os.getloadavg()}
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
