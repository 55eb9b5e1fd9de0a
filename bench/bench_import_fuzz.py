"""Type-mutation fuzz of the Flight Recorder (pickle, JSON) and memory snapshot importers at full
count (issue 36, item 7): ``--count`` mutants each (default 300; the suite runs 50), every one
through the whole import into a real SQLite store (tests/fuzz_importers.py), each under a
``--timeout`` alarm. Prints, per importer, mutants, tracebacks, hangs, imported-or-refused, and
the wall time; exits 1 on any traceback or hang.

Usage::

    python bench/bench_import_fuzz.py [--count 300] [--seed 0] [--timeout 30]
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fuzz_importers import load_source, mutate, run_one  # noqa: E402


class Hang(Exception):
    pass


def _alarm(_sig, _frame):
    raise Hang()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=30, help="seconds one mutant may take before it is a hang")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    signal.signal(signal.SIGALRM, _alarm)
    import random

    from graphdeck.store.db import open_engine

    bad = 0
    for kind in ("fr_pickle", "fr_json", "snapshot"):
        rng = random.Random(f"{kind}:{args.seed}")
        base = load_source(kind)
        crashes, hangs, t0 = [], 0, time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            engine = open_engine(Path(tmp) / f"{kind}.db")
            for i in range(args.count):
                mutant = mutate(base, rng, n=rng.randint(1, 4))
                signal.alarm(args.timeout)
                try:
                    crash = run_one(kind, mutant, Path(tmp), i, engine)
                except Hang:
                    hangs += 1
                    crash = None
                finally:
                    signal.alarm(0)
                if crash:
                    crashes.append(crash)
            engine.dispose()
        wall = time.perf_counter() - t0
        print(f"{kind:10s} mutants {args.count}  tracebacks {len(crashes)}  hangs {hangs}  "
              f"imported or refused cleanly {args.count - len(crashes) - hangs}  ({wall:.1f} s)")
        for c in crashes[:3]:
            print("   ", c.strip().splitlines()[0], "|", c.strip().splitlines()[-1][:200])
        bad += len(crashes) + hangs
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
