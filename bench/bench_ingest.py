"""Benchmark: streaming trace ingest vs. loading the whole file.

For each trace: ``ingest_trace`` into a fresh SQLite store in a temp dir, and the anchor, a plain
``json.load`` of the same (decompressed) file plus a pandas DataFrame of its events when pandas is
installed. Each measurement runs in its own forked child so that its peak RSS
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``) is its own; the child's RSS before the work is
reported too, so the growth is visible.

    python bench/bench_ingest.py                       # the two large corpus traces + a small one
    python bench/bench_ingest.py path/to/trace.json.gz --write-results

``--write-results`` replaces the "Trace ingest" section of bench/RESULTS.md with the table.
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing
import os
import platform
import re
import resource
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO.parent / "shared" / "data" / "traces"
DEFAULT = [
    "hta/trace_filter/sampled_rank-0.json.gz",
    "tracelens/h100/google_owlv2-large-patch14-ensemble__1016001.json.gz",
    "tracelens/inference/xdit_sd_3.5/profile_trace_rank_0.json.gz",
]
RESULTS = REPO / "bench" / "RESULTS.md"
SECTION = "## Trace ingest"


def _rss_mib() -> float:
    """Peak RSS of this process so far, MiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _current_rss_mib() -> float:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return float("nan")


def _ingest(path: str) -> dict:
    from graphdeck.store.db import open_engine
    from graphdeck.store.traces import ingest_trace

    with tempfile.TemporaryDirectory() as tmp:
        engine = open_engine(Path(tmp) / "bench.db")
        start_rss = _current_rss_mib()
        t0 = time.perf_counter()
        result = ingest_trace(engine, path, run_name="bench")
        seconds = time.perf_counter() - t0
        engine.dispose()
    return {"seconds": seconds, "events": result.stats["events_total"], "stored": result.num_events,
            "start_rss_mib": start_rss, "peak_rss_mib": _rss_mib()}


def _anchor(path: str) -> dict:
    try:
        import pandas as pd
    except ImportError:
        pd = None
    start_rss = _current_rss_mib()
    t0 = time.perf_counter()
    with open(path, "rb") as fh:
        head = fh.read(2)
    opener = gzip.open if head == b"\x1f\x8b" else open
    with opener(path, "rb") as fh:
        doc = json.load(fh)
    events = doc["traceEvents"]
    if pd is not None:
        pd.DataFrame(events)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "events": len(events), "start_rss_mib": start_rss, "peak_rss_mib": _rss_mib(),
            "what": "json.load + pandas.DataFrame" if pd is not None else "json.load (pandas not installed)"}


def _in_child(fn, path: str) -> dict:
    with multiprocessing.get_context("fork").Pool(1) as pool:
        return pool.apply(fn, (path,))


def _raw_size(path: Path) -> int:
    with open(path, "rb") as fh:
        if fh.read(2) != b"\x1f\x8b":
            return path.stat().st_size
    n = 0
    with gzip.open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            n += len(chunk)
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="*", help="trace files (default: corpus files under ../shared/data/traces)")
    parser.add_argument("--write-results", action="store_true", help="Rewrite the 'Trace ingest' section of bench/RESULTS.md.")
    args = parser.parse_args()
    paths = [Path(p) for p in args.traces] or [TRACES / p for p in DEFAULT]
    missing = [p for p in paths if not p.exists()]
    if missing:
        sys.exit(f"missing: {', '.join(map(str, missing))}")
    rows = []
    anchor_what = ""
    for path in paths:
        raw_mb = _raw_size(path) / 1e6
        ing = _in_child(_ingest, str(path))
        anc = _in_child(_anchor, str(path))
        anchor_what = anc["what"]
        row = {
            "file": path.name if len(path.name) < 48 else path.name[:45] + "…",
            "raw_mb": raw_mb,
            "events": ing["events"],
            "stored": ing["stored"],
            "ingest_s": ing["seconds"],
            "ingest_ev_s": ing["events"] / ing["seconds"],
            "ingest_rss": (ing["start_rss_mib"], ing["peak_rss_mib"]),
            "anchor_s": anc["seconds"],
            "anchor_ev_s": anc["events"] / anc["seconds"],
            "anchor_rss": (anc["start_rss_mib"], anc["peak_rss_mib"]),
        }
        row["ratio"] = row["ingest_s"] / row["anchor_s"]
        rows.append(row)
        print(
            f"{row['file']}: {raw_mb:.1f} MB JSON, {row['events']} events ({row['stored']} stored)\n"
            f"  ingest_trace: {row['ingest_s']:.2f} s, {row['ingest_ev_s']:,.0f} events/s, "
            f"RSS {ing['start_rss_mib']:.0f} -> peak {ing['peak_rss_mib']:.0f} MiB\n"
            f"  anchor ({anc['what']}): {row['anchor_s']:.2f} s, {row['anchor_ev_s']:,.0f} events/s, "
            f"RSS {anc['start_rss_mib']:.0f} -> peak {anc['peak_rss_mib']:.0f} MiB\n"
            f"  ingest / anchor time: {row['ratio']:.1f}x",
            flush=True,
        )
    if args.write_results:
        _write_results(rows, anchor_what)


def _write_results(rows: list[dict], anchor_what: str) -> None:
    import ijson
    import sqlalchemy

    lines = [
        SECTION,
        "",
        f"`python bench/bench_ingest.py --write-results` on {time.strftime('%Y-%m-%d')}: "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"ijson {ijson.__version__} ({ijson.backend}), SQLAlchemy {sqlalchemy.__version__}, SQLite store in a temp dir, "
        f"load average {os.getloadavg()[0]:.1f} at the end (a shared host: times vary by ~20% between runs). "
        f"Anchor: {anchor_what} of the same file. Each side runs in its own forked child; RSS is "
        "the child's resident set before the work → its peak (`ru_maxrss`).",
        "",
        "| trace | JSON MB | events (stored) | ingest s | ingest events/s | ingest RSS MiB | anchor s | "
        "anchor events/s | anchor RSS MiB | time ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| `{r['file']}` | {r['raw_mb']:.1f} | {r['events']:,} ({r['stored']:,}) | {r['ingest_s']:.2f} | "
            f"{r['ingest_ev_s']:,.0f} | {r['ingest_rss'][0]:.0f} → {r['ingest_rss'][1]:.0f} | {r['anchor_s']:.2f} | "
            f"{r['anchor_ev_s']:,.0f} | {r['anchor_rss'][0]:.0f} → {r['anchor_rss'][1]:.0f} | {r['ratio']:.1f}x |"
        )
    lines += [
        "",
        "Peak RSS of the ingest stays within ~10 MiB of its start whatever the file size (batches of 5000 "
        "events); the anchor holds the whole document. Where ingest time goes, profiled once on the 62 MB "
        "xdit trace: tokenising + building events in Python from ijson's `basic_parse` ≈ 45%, converting "
        "events (µs→ns decimals, args JSON) ≈ 30%, SQLite writes and interning ≈ 25%. ijson's C `items()` "
        "builds events ~40% faster but cannot also see top-level keys written after `traceEvents` "
        "(Kineto writes `baseTimeNanoseconds` there) in the same pass.",
    ]
    section = "\n".join(lines) + "\n"
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n\n"
    pattern = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.S | re.M)
    text = pattern.sub(lambda _m: section + "\n", text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + section
    RESULTS.write_text(text)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
