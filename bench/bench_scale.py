"""What reading an N-rank run costs at 64, 256 and 1,024 ranks, on SQLite and PostgreSQL (issue 26).

Input: :func:`bench.scale_harness.make_scale_run` with the 2 x H200 DDP traces (``traces="gpu"``),
each rank's trace repeated to ~50k events (``repeat=2``: 140 NCCL all-reduces, 10 profiled
steps), clocks skewed, one straggler, one divergent and one missing rank. Ranks up to
``--full-max`` (64) get the whole ~50k events; larger runs get ``--analysis-events`` events a rank
sampled from the same 50k (every collective, its launch and every step kept, the rest sampled), so
what the analyses read — the collectives and steps — is the same as at 50k, while the ingest (whose
cost is per rank, independent of the other ranks) is measured in full at 64 ranks.

Measured per run (CPU seconds from ``time.process_time``; medians and min–max of ``--repeat``):

* ingest: the events stored, the CPU seconds of the ingests themselves (each worker times its
  ``ingest_trace``), events per CPU second (per core), and the wall time of ``--workers``
  processes; against one 50k-event trace ingested alone into a fresh store (same code, 3 times);
* ``align_and_match`` (matching, clock alignment, stragglers, divergence, missing ranks) and
  whether it names the harness's straggler, divergent and missing rank;
* ``rank_report`` (check-ranks) and ``validate_backward`` (check-grads), fresh sessions;
* the store's size per rank (SQLite: the file; PostgreSQL: ``pg_database_size``).

Results go to ``--out`` (JSON lines, one per run, appended as each finishes) and the table and a
log-log plot (``--plot``, PNG, matplotlib) are made from that file (``--report-only``).

    python bench/bench_scale.py --ranks 64 256 1024 --stores sqlite postgresql [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.scale_harness import make_scale_run  # noqa: E402


def _timed(fn, repeat: int) -> tuple[list[float], object]:
    cpu, out = [], None
    for _ in range(repeat):
        c0 = time.process_time()
        out = fn()
        cpu.append(time.process_time() - c0)
    return cpu, out


def _store_bytes(url: str) -> int:
    if "://" not in url:
        return sum(os.path.getsize(f"{url}{s}") for s in ("", "-wal") if os.path.exists(f"{url}{s}"))
    from sqlalchemy import create_engine, text

    eng = create_engine(url)
    with eng.connect() as c:
        size = c.execute(text("SELECT pg_database_size(current_database())")).scalar()
    eng.dispose()
    return int(size)


def single_trace_rate(work: Path, events: int, repeat: int = 3) -> dict:
    """One rank's ~``events``-event trace ingested alone, in this process, into a fresh 4-rank
    store, ``repeat`` times: CPU s and events per CPU s."""
    import isal.igzip as igzip

    from bench import scale_harness as h
    from graphdeck.store.db import open_engine
    from graphdeck.store.traces import ingest_trace

    docs = h.source_docs(h.gpu_source_docs(), events, 0, 2)
    plan = h._Plan(4, 0, 1, 2, 5, 3000.0, 200.0, 5000.0)
    path = work / "single.pt.trace.json.gz"
    with igzip.open(path, "wb", compresslevel=1) as fh:
        fh.write(h.rank_doc(docs[0], 0, plan, h.transfer_times(docs)))
    cpu, n = [], 0
    for i in range(repeat):
        store = work / f"single{i}.db"
        h.build_records(store, 4, "scale", 2, 5)
        engine = open_engine(store)
        c0 = time.process_time()
        n = ingest_trace(engine, path, run_name="scale").num_events
        cpu.append(time.process_time() - c0)
        engine.dispose()
        store.unlink()
    return {"events": n, "cpu_s": cpu, "events_per_cpu_s": n / statistics.median(cpu)}


def measure(url: str, kind: str, n: int, events: int, repeat: int, workers: int, check_repeat: int | None = None) -> dict:
    from sqlalchemy.orm import Session

    from graphdeck.analysis.gradients.core import validate_backward
    from graphdeck.analysis.ranks.core import rank_report
    from graphdeck.analysis.traces.collectives import align_and_match
    from graphdeck.store.db import open_engine
    from graphdeck.store.schema import Run

    t0 = time.perf_counter()
    run = make_scale_run(url, n, seed=0, traces="gpu", events_per_rank=events, repeat=2, workers=workers)
    made = time.perf_counter() - t0
    engine = open_engine(url, read_only=True)

    def in_session(fn):
        def go():
            with Session(engine) as s:
                return fn(s)
        return go

    align_cpu, a = _timed(in_session(lambda s: align_and_match(s, run.run_id)), repeat)
    errors = {}
    try:
        ranks_cpu, rep = _timed(in_session(lambda s: rank_report(s, s.get(Run, run.run_id))), check_repeat or repeat)
    except Exception as exc:  # noqa: BLE001 - recorded in the row, the other measurements go on
        ranks_cpu, rep, errors["check_ranks"] = [float("nan")], None, f"{type(exc).__name__}: {str(exc)[:300]}"
    try:
        grads_cpu, g = _timed(lambda: validate_backward(engine, run.run_name), max(1, repeat // 3))
    except Exception as exc:  # noqa: BLE001
        grads_cpu, g, errors["check_grads"] = [float("nan")], None, f"{type(exc).__name__}: {str(exc)[:300]}"
    engine.dispose()
    row = {
        "store": kind, "ranks": n, "events_per_rank": events, "events": run.ingested_events,
        "records_s": run.records_s, "make_wall_s": made, "ingest_wall_s": run.ingest_wall_s,
        "ingest_cpu_s": run.ingest_cpu_s, "events_per_cpu_s": run.ingested_events / run.ingest_cpu_s,
        "link_s": run.link_s, "align_cpu_s": align_cpu, "check_ranks_cpu_s": ranks_cpu, "check_grads_cpu_s": grads_cpu,
        "found_straggler": a["timing"]["straggler"] == run.straggler,
        "found_divergent": [d["rank"] for d in a["divergent"]] == [run.divergent]
        and a["divergent"][0]["seq"] == run.diverge_seq,
        "missing_incomplete": a["missing_ranks"] == [run.missing] and a["verdict"] == "INCOMPLETE",
        "check_ranks_verdict": rep and rep.verdict, "check_grads_verdict": g and g.verdict, "errors": errors,
        "collectives": len(a["collectives"]), "suspect": a["suspect"],
        "bytes_per_rank": _store_bytes(url) / n, "workers": workers,
        "load": os.getloadavg()[0], "at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    return row


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}–{max(xs):.2f})"


def report(rows: list[dict], single: dict | None, plot: Path | None) -> str:
    lines = ["| store | ranks | events / rank | events ingested | ingest CPU s | events / CPU s (per core) | "
             "single-trace rate ÷ this | ingest wall s | align + match + stragglers CPU s | check-ranks CPU s | "
             "check-grads CPU s | found | store MiB / rank |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in sorted(rows, key=lambda r: (r["store"], r["ranks"])):
        ratio = f"{single['events_per_cpu_s'] / r['events_per_cpu_s']:.2f}×" if single else "—"
        found = ("straggler, divergent, missing" if r["found_straggler"] and r["found_divergent"]
                 and r["missing_incomplete"] else "NOT ALL")
        lines.append(f"| {r['store']} | {r['ranks']:,} | {r['events_per_rank']:,} | {r['events']:,} | "
                     f"{r['ingest_cpu_s']:.1f} | {r['events_per_cpu_s']:,.0f} | {ratio} | {r['ingest_wall_s']:.0f} | "
                     f"{_fmt(r['align_cpu_s'])} | {_fmt(r['check_ranks_cpu_s'])} | {_fmt(r['check_grads_cpu_s'])} | "
                     f"{found} | {r['bytes_per_rank'] / 2**20:.2f} |")
    if single:
        lines.append(f"\nSingle trace alone: {single['events']:,} events, CPU s {_fmt(single['cpu_s'])}, "
                     f"{single['events_per_cpu_s']:,.0f} events / CPU s.")
    if plot is not None and rows:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for store, style in (("sqlite", "-"), ("postgresql", "--")):
            rs = sorted((r for r in rows if r["store"] == store), key=lambda r: r["ranks"])
            if not rs:
                continue
            xs = [r["ranks"] for r in rs]
            for key, label, marker in (("align_cpu_s", "align + match + stragglers", "o"),
                                       ("check_ranks_cpu_s", "check-ranks", "s"),
                                       ("check_grads_cpu_s", "check-grads", "^")):
                ax.plot(xs, [statistics.median(r[key]) for r in rs], style, marker=marker, label=f"{label} ({store})")
        ax.axhline(60, color="grey", lw=0.8, ls=":")
        ax.axhline(5, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.set_ylabel("CPU s (median)")
        ax.set_title("Reading an N-rank run (bench/bench_scale.py)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(plot, dpi=110)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--stores", nargs="+", choices=["sqlite", "postgresql"], default=["sqlite", "postgresql"])
    ap.add_argument("--events-per-rank", type=int, default=50_000)
    ap.add_argument("--analysis-events", type=int, default=3_000)
    ap.add_argument("--full-max", type=int, default=64, help="runs up to this many ranks get every event")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--check-repeat", type=int, default=None, help="repeats of check-ranks (default --repeat)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / ".cache" / "scale.jsonl")
    ap.add_argument("--plot", type=Path, default=ROOT / "bench" / "scale.png")
    ap.add_argument("--single", action="store_true", help="also measure one trace ingested alone")
    ap.add_argument("--report-only", action="store_true", help="table and plot from --out, nothing run")
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gd-bench-scale-"))
    if not args.report_only:
        pg = None
        if args.single:
            single = single_trace_rate(work, args.events_per_rank)
            with open(args.out, "a") as fh:
                fh.write(json.dumps({"single": single}) + "\n")
            print("single trace:", single, flush=True)
        for kind in args.stores:
            if kind == "postgresql" and pg is None:
                from graphdeck.pg_local import LocalPostgres

                url = os.environ.get("GRAPHDECK_TEST_PG_URL")
                pg = url or LocalPostgres(fast=True).start()
            for n in args.ranks:
                events = args.events_per_rank if n <= args.full_max else args.analysis_events
                if kind == "sqlite":
                    url = str(work / f"scale{n}.db")
                else:
                    from graphdeck.pg_local import create_database

                    url = create_database(pg if isinstance(pg, str) else pg.url, f"scale{n}_{os.getpid()}")
                row = measure(url, kind, n, events, args.repeat, args.workers, args.check_repeat)
                with open(args.out, "a") as fh:
                    fh.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)
                if kind == "sqlite":
                    for s in ("", "-wal", "-shm"):
                        Path(f"{url}{s}").unlink(missing_ok=True)
        if pg is not None and not isinstance(pg, str):
            pg.stop()
    rows, single = [], None
    for line in args.out.read_text().splitlines():
        d = json.loads(line)
        if "single" in d:
            single = d["single"]
        else:
            rows.append(d)
    latest = {}
    for r in rows:  # the newest run of each (store, ranks)
        latest[(r["store"], r["ranks"])] = r
    print(report(list(latest.values()), single, args.plot))


if __name__ == "__main__":
    main()
