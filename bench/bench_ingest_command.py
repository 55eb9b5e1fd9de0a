"""Benchmark: CPU seconds of the whole ``graphdeck ingest-trace`` command (start-up, store, ingest,
indexes, links and its coverage headline) per trace, against a bare ``ijson.items`` parse of the
same file, each in its own process: the child's user + system CPU (``os.wait4``), median of
``--repeat`` with the spread. Each ingest goes into a fresh SQLite store made first by another
process (as bench_ingest.py does). Issue 41 goal 1: the command ≤ 1.5× ijson.

    python bench/bench_ingest_command.py            # the two largest corpus traces
    python bench/bench_ingest_command.py --before /tmp/before   # also an older tree, interleaved

``--before TREE``: a source tree of another commit (``git archive <commit> | tar -x -C TREE``, its
bytecode compiled with ``python -m compileall``) run the same way in the same loop through
``PYTHONPATH=TREE`` and in TREE as the working directory (``-c`` puts the working directory
first on ``sys.path``; the tree's ``graphdeck/`` shadows this checkout's: NOTE: [Running from the
repository root]), so the two commits see the same host load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO.parent / "shared" / "data" / "traces"
DEFAULT = ["tracelens/h100/google_owlv2-large-patch14-ensemble__1016001.json.gz",
           "tracelens/inference/xdit_sd_3.5/profile_trace_rank_0.json.gz"]
MAKE = "import sys\nfrom graphdeck.store.db import open_engine\nopen_engine(sys.argv[1]).dispose()"
CLI = "import sys\nfrom graphdeck.cli import main\nsys.argv[0] = 'graphdeck'\nsys.exit(main())"
IJSON = ("import gzip, sys, ijson\nraw = open(sys.argv[1], 'rb')\nfh = gzip.open(raw) if raw.read(2) == b'\\x1f\\x8b' "
         "else raw\nraw.seek(0)\nfor _ in ijson.items(fh, 'traceEvents.item'):\n    pass")


def child_cpu(argv: list[str], env: dict | None = None) -> float:
    cwd = env.get("PYTHONPATH") if env else None  # ``-c``'s sys.path[0] is the working directory
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=cwd)
    _, status, ru = os.wait4(p.pid, 0)
    if status:
        raise SystemExit(f"{argv} exited {status}")
    return ru.ru_utime + ru.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="*", help="trace files (default: the two largest corpus traces)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--before", type=Path, default=None, help="another commit's source tree, run alike (see above)")
    args = ap.parse_args()
    before_env = {**os.environ, "PYTHONPATH": str(args.before)} if args.before else None

    def ingest(env: dict | None) -> float:
        store = str(Path(tempfile.mkdtemp()) / "s.db")
        subprocess.run([sys.executable, "-c", MAKE, store], check=True, env=env, cwd=env and env["PYTHONPATH"])
        return child_cpu([sys.executable, "-c", CLI, "ingest-trace", "--store", store, "--run", "r", trace], env)

    print(f"load average at start: {os.getloadavg()[0]:.1f}")
    for trace in args.traces or [str(TRACES / t) for t in DEFAULT]:
        cmd, bare, old = [], [], []
        for _ in range(args.repeat):  # interleaved
            cmd.append(ingest(None))
            bare.append(child_cpu([sys.executable, "-c", IJSON, trace]))
            if before_env:
                old.append(ingest(before_env))
        c, b = statistics.median(cmd), statistics.median(bare)
        line = (f"{Path(trace).name}: ingest-trace {c:.2f} CPU s ({min(cmd):.2f}-{max(cmd):.2f}), "
                f"ijson {b:.2f} ({min(bare):.2f}-{max(bare):.2f}): {c / b:.2f}x")
        if old:
            o = statistics.median(old)
            line += f"; before {o:.2f} ({min(old):.2f}-{max(old):.2f}): {o / b:.2f}x ijson, now/before {c / o:.2f}"
        print(line, flush=True)
    print(f"load average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
