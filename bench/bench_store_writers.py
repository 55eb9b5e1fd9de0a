"""Many ranks writing one store: SQLite (one file, serialised writers) vs PostgreSQL.

Runs ``tests/programs/store_writers.py`` (forked rank processes, each the capture agent's writer:
registration, parameters, one transaction per graph of 19 nodes / 22 edges, a compile record)
with 1 rank (the anchor) and with N ranks, into a fresh SQLite file and a fresh PostgreSQL
database (a private server from the installed binaries, fsync off), and prints graphs/s and the
ratio to the 1-rank SQLite anchor of the same command.

    python bench/bench_store_writers.py [--ranks 16] [--graphs 20]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(store: str, ranks: int, graphs: int) -> float:
    out = subprocess.run([sys.executable, str(REPO / "tests/programs/store_writers.py"), store, str(ranks),
                          str(graphs)], capture_output=True, text=True, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert not report["errors"] and set(report["exit_codes"]) == {0}, report
    return report["write_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--graphs", type=int, default=20, help="graphs per rank")
    args = ap.parse_args()
    from graphdeck.pg_local import LocalPostgres

    rows = []
    with tempfile.TemporaryDirectory() as tmp, LocalPostgres(fast=True) as pg:
        for ranks in (1, args.ranks):
            sqlite_s = run(str(Path(tmp) / f"w{ranks}.db"), ranks, args.graphs)
            pg_s = run(pg.create_database(f"w{ranks}"), ranks, args.graphs)
            rows.append((ranks, sqlite_s, pg_s))
    anchor = args.graphs / rows[0][1]
    print(f"{'ranks':>5} {'backend':>10} {'graphs':>7} {'write_s':>8} {'graphs/s':>9} {'vs 1-rank SQLite':>17}")
    for ranks, sqlite_s, pg_s in rows:
        for name, secs in (("sqlite", sqlite_s), ("postgresql", pg_s)):
            rate = ranks * args.graphs / secs
            print(f"{ranks:>5} {name:>10} {ranks * args.graphs:>7} {secs:>8.2f} {rate:>9.1f} {rate / anchor:>16.2f}x")


if __name__ == "__main__":
    main()
