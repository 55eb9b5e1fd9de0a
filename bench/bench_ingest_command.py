"""Benchmark: CPU seconds of the whole ``graphdeck ingest-trace`` command (start-up, store, ingest,
indexes, links and its coverage headline) per trace, against a bare ``ijson.items`` parse of the
same file, each in its own process: the child's user + system CPU (``os.wait4``), median of
``--repeat`` with the spread. Each ingest goes into a fresh SQLite store made first by another
process (as bench_ingest.py does). Issue 41 goal 1: the command ≤ 1.5× ijson.

    python bench/bench_ingest_command.py            # the two largest corpus traces
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


def child_cpu(argv: list[str]) -> float:
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    _, status, ru = os.wait4(p.pid, 0)
    if status:
        raise SystemExit(f"{argv} exited {status}")
    return ru.ru_utime + ru.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="*", help="trace files (default: the two largest corpus traces)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    for trace in args.traces or [str(TRACES / t) for t in DEFAULT]:
        cmd, bare = [], []
        for _ in range(args.repeat):  # interleaved
            store = str(Path(tempfile.mkdtemp()) / "s.db")
            subprocess.run([sys.executable, "-c", MAKE, store], check=True)
            cmd.append(child_cpu([sys.executable, "-c", CLI, "ingest-trace", "--store", store, "--run", "r", trace]))
            bare.append(child_cpu([sys.executable, "-c", IJSON, trace]))
        c, b = statistics.median(cmd), statistics.median(bare)
        print(f"{Path(trace).name}: ingest-trace {c:.2f} CPU s ({min(cmd):.2f}-{max(cmd):.2f}), "
              f"ijson {b:.2f} ({min(bare):.2f}-{max(bare):.2f}): {c / b:.2f}x")


if __name__ == "__main__":
    main()
