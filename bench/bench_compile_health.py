"""check-compile on the import of the large generated TORCH_TRACE log (issue 21: under 2 s).

The log is bench/bench_import.py's (``--make-big``: a 20-block LayerNorm/Linear/GELU stack
compiled with Inductor, fw+bw, again after each ``torch._dynamo.reset()`` until the log passes
the size; cached under ``/tmp/graphdeck-bench/big``), or ``--big PATH``. It is imported once
into a SQLite store (``graphdeck import``, timed for context only), then measured ``--repeat``
times (at least 3):

* ``graphdeck check-compile STORE --run big`` as a child process: CPU seconds (user + system of
  the child, ``resource.getrusage(RUSAGE_CHILDREN)`` differences) and wall seconds, interpreter
  start and imports included: what a CI step pays;
* :func:`graphdeck.analysis.compilation.health.compile_health` in this process: CPU seconds
  (``time.process_time``) of the analysis alone, on a fresh engine each time.

Prints the median, min, max and spread (max - min) of each, as a Markdown table.

Usage::

    python bench/bench_compile_health.py [--big PATH] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_import import big_log, make_big  # noqa: E402


def child_cpu(cmd: list[str]) -> tuple[float, float, int]:
    """(CPU s, wall s, exit code) of ``cmd`` run to completion."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode not in (0, 1, 3):
        raise RuntimeError(f"{cmd[:4]} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return cpu, wall, proc.returncode


def stats(xs: list[float]) -> str:
    return (f"{statistics.median(xs):.3f} | {min(xs):.3f} | {max(xs):.3f} | {max(xs) - min(xs):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--big", type=Path, default=None, help="the large TORCH_TRACE log (default: bench_import's)")
    ap.add_argument("--make-big", action="store_true", help="generate the large log first (minutes)")
    ap.add_argument("--big-mb", type=int, default=104)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    if args.repeat < 3:
        ap.error("--repeat must be at least 3")
    if args.make_big:
        make_big(args.big_mb)
    big = args.big or big_log()
    if big is None or not big.exists():
        sys.exit("no large log: run with --make-big, or give --big PATH")
    tmp = Path(tempfile.mkdtemp(prefix="bench-compile-health-"))
    store = tmp / "big.db"
    _, import_wall, _ = child_cpu([sys.executable, "-m", "graphdeck.cli", "import", str(big), "--store", str(store),
                                   "--run", "big", "--no-progress"])

    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from graphdeck.analysis.compilation.health import compile_health
    from graphdeck.store.db import open_engine
    from graphdeck.store.schema import CompileEvent, Run

    cli_cpu, cli_wall, fn_cpu = [], [], []
    for _ in range(args.repeat):
        cpu, wall, rc = child_cpu([sys.executable, "-m", "graphdeck.cli", "check-compile", str(store), "--run", "big"])
        cli_cpu.append(cpu)
        cli_wall.append(wall)
        engine = open_engine(store, read_only=True)
        with Session(engine) as s:
            run = s.scalar(select(Run).where(Run.name == "big"))
            t0 = time.process_time()
            report = compile_health(s, run)
            fn_cpu.append(time.process_time() - t0)
            events = s.query(CompileEvent).filter(CompileEvent.run_id == run.id).count()
        engine.dispose()
    s = report.summary()
    print(f"log: {big} ({big.stat().st_size / 2**20:.1f} MiB), imported in {import_wall:.1f} s wall; "
          f"{events} compile records, {len(report.ranks)} rank(s), "
          f"{sum(r.stats.compiles for r in report.ranks.values())} compile(s) of {s['frames']} frame id(s), "
          f"{s['recompiles']} recompile(s), {s['graph_break_records']} break record(s); verdict {report.verdict} "
          f"(exit {rc}); host {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    print(f"\n{args.repeat} repeats | median | min | max | spread")
    print("---|---:|---:|---:|---:")
    print(f"`graphdeck check-compile` child, CPU s | {stats(cli_cpu)}")
    print(f"`graphdeck check-compile` child, wall s | {stats(cli_wall)}")
    print(f"`compile_health()` in process, CPU s | {stats(fn_cpu)}")


if __name__ == "__main__":
    main()
