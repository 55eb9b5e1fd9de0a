"""Benchmark: graphdeck's streaming trace ingest vs HTA's trace load vs bare ijson streaming, and
the timeline window query on a 1M-event store.

Per trace file, three sides, each in its own forked child (so ``ru_maxrss`` is that side's
peak RSS; the child's RSS before the work is reported too):

* ``graphdeck``: :func:`graphdeck.store.traces.ingest_trace` into a fresh SQLite store;
* ``HTA``: ``hta.trace_analysis.TraceAnalysis(trace_dir=...)`` (HolisticTraceAnalysis, pip
  ``HolisticTraceAnalysis``) on a folder holding only that file (as ``rank-0.json.gz``);
* ``ijson``: ``for e in ijson.items(f, "traceEvents.item"): pass`` (yajl2_c, exact decimals;
  the floor: parsing with no work done).

Each side runs ``--repeat`` times; the median is reported with ratios taken inside this one
command (the host is shared: absolute times move, ratios much less).

The window query: a store with one trace of ``--window-events`` events (the events of the
largest corpus trace repeated with shifted timestamps, streamed into ``ingest_trace``); then
``--queries`` random windows (1/1000 to 1/2 of the span) through the server's code path
(:class:`graphdeck.analysis.traces.window.WindowIndex` select + row fetch + ``timeline_figure``),
after one warm-up query that builds the index; p50/p95 reported.

    python bench/bench_ingest.py                       # the two largest corpus traces
    python bench/bench_ingest.py --write-results       # also rewrite our RESULTS.md section
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import multiprocessing
import os
import platform
import random
import re
import resource
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO.parent / "shared" / "data" / "traces"
DEFAULT = [
    "tracelens/h100/google_owlv2-large-patch14-ensemble__1016001.json.gz",
    "tracelens/inference/xdit_sd_3.5/profile_trace_rank_0.json.gz",
]
RESULTS = REPO / "bench" / "RESULTS.md"
SECTION = "## Trace ingest"
NOTES = "### Notes"  # the part of the section that --write-results keeps


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _cpu_s() -> float:
    """CPU seconds (user + system) of this process so far, all threads."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _new_store(path: str) -> None:
    from graphdeck.store.db import open_engine

    open_engine(path).dispose()
    return None


def _side_graphdeck(path: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "bench.db")
        # The store exists before the ingest, as when a captured run made it. Another process
        # creates it: creating a store loads Alembic (+14 MiB RSS); opening one at the head does not.
        made = _in_child(_new_store, store)
        if made and "error" in made:
            return made
        return _in_child(_ingest, path, store)


def _ingest(path: str, store: str) -> dict:
    from graphdeck.store.db import open_engine
    from graphdeck.store.traces import ingest_trace

    engine = open_engine(store)
    start = _rss_mib()
    t0, c0 = time.perf_counter(), _cpu_s()
    result = ingest_trace(engine, path, run_name="bench")
    seconds, cpu = time.perf_counter() - t0, _cpu_s() - c0
    engine.dispose()
    return {"seconds": seconds, "cpu_s": cpu, "start_mib": start, "peak_mib": _peak_mib(),
            "events": result.stats["events_total"]}


def _side_hta(path: str) -> dict:
    import logging

    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        os.symlink(os.path.abspath(path), Path(tmp) / "rank-0.json.gz")
        start = _rss_mib()
        t0, c0 = time.perf_counter(), _cpu_s()
        from hta.trace_analysis import TraceAnalysis

        analysis = TraceAnalysis(trace_dir=tmp)
        n = sum(len(analysis.t.get_trace(r)) for r in analysis.t.get_ranks())
        seconds, cpu = time.perf_counter() - t0, _cpu_s() - c0
    return {"seconds": seconds, "cpu_s": cpu, "start_mib": start, "peak_mib": _peak_mib(), "events": n}


def _side_ijson(path: str) -> dict:
    import ijson

    start = _rss_mib()
    t0, c0 = time.perf_counter(), _cpu_s()
    n = 0
    with open(path, "rb") as raw:
        fh = gzip.open(raw) if raw.read(2) == b"\x1f\x8b" else raw
        raw.seek(0)
        for _ in ijson.items(fh, "traceEvents.item"):
            n += 1
    return {"seconds": time.perf_counter() - t0, "cpu_s": _cpu_s() - c0, "start_mib": start, "peak_mib": _peak_mib(),
            "events": n}


SIDES = {"graphdeck": _side_graphdeck, "HTA": _side_hta, "ijson": _side_ijson}


def _in_child(fn, *args) -> dict:
    with multiprocessing.get_context("fork").Pool(1, maxtasksperchild=1) as pool:
        try:
            return pool.apply(fn, args)
        except Exception as exc:  # noqa: BLE001 - an anchor that fails is reported, not fatal
            return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}


def _median(runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[0]
    return {"seconds": statistics.median(r["seconds"] for r in ok), "cpu_s": statistics.median(r["cpu_s"] for r in ok),
            "peak_mib": statistics.median(r["peak_mib"] for r in ok),
            "start_mib": statistics.median(r["start_mib"] for r in ok), "events": ok[0]["events"], "runs": len(ok)}


def bench_file(path: Path, repeat: int, sides: list[str]) -> dict:
    out = {}
    for _ in range(repeat):  # interleaved, so a load spike hits every side alike
        for side in sides:
            run = SIDES[side] if side == "graphdeck" else partial(_in_child, SIDES[side])  # graphdeck forks its own
            out.setdefault(side, []).append(run(str(path)))
    return {side: _median(runs) for side, runs in out.items()}


# ---------------------------------------------------------------------------- window query


def _repeated_stream(path: Path, copies: int):
    doc = json.loads(gzip.decompress(path.read_bytes()))
    events = doc.pop("traceEvents")
    timed = [e for e in events if isinstance(e.get("ts"), (int, float))]
    span = max(e["ts"] + e.get("dur", 0) for e in timed) - min(e["ts"] for e in timed) + 1

    def parts():
        yield b'{"traceEvents": ['
        for c in range(copies):
            chunk = [dict(e, ts=e["ts"] + c * span) if "ts" in e else e for e in events]
            yield (b"," if c else b"") + json.dumps(chunk)[1:-1].encode()
        yield b"]}"

    class Stream(io.RawIOBase):
        def __init__(self):
            self.it, self.buf = parts(), b""

        def readable(self):
            return True

        def readinto(self, b):
            while len(self.buf) < len(b):
                nxt = next(self.it, None)
                if nxt is None:
                    break
                self.buf += nxt
            n = min(len(b), len(self.buf))
            b[:n], self.buf = self.buf[:n], self.buf[n:]
            return n

    return io.BufferedReader(Stream(), 1 << 16), len(events)


def bench_window(path: Path, target_events: int, queries: int, max_shapes: int, seed: int = 0) -> dict:
    from sqlalchemy.orm import Session

    from graphdeck.analysis.traces.window import IndexCache, fetch_rows
    from graphdeck.server.render.timeline import timeline_figure
    from graphdeck.store.db import open_engine
    from graphdeck.store.schema import Trace
    from graphdeck.store.traces import ingest_trace

    with tempfile.TemporaryDirectory() as tmp:
        engine = open_engine(Path(tmp) / "big.db")
        stream, per_copy = _repeated_stream(path, copies=1)
        copies = max(1, -(-target_events // per_copy))
        stream, _ = _repeated_stream(path, copies)
        t0 = time.perf_counter()
        result = ingest_trace(engine, stream, run_name="big", name="repeated")
        ingest_s = time.perf_counter() - t0
        ro = open_engine(Path(tmp) / "big.db", read_only=True)
        cache = IndexCache()
        rng = random.Random(seed)
        with Session(ro) as s:
            trace = s.get(Trace, result.trace_id)
            t0 = time.perf_counter()
            idx = cache.get(s, trace.id)
            build_s = time.perf_counter() - t0
            lo, hi = idx.span
            times, figure_times, shown = [], [], []
            for i in range(queries + 1):
                width = (hi - lo) * rng.uniform(0.001, 0.5)
                a = rng.uniform(lo, hi - width)
                t0 = time.perf_counter()
                ids, _total = cache.get(s, trace.id).select(int(a), int(a + width), max_shapes)
                rows = fetch_rows(s, ids)
                t1 = time.perf_counter()
                timeline_figure(rows, start_ns=trace.start_ns)
                t2 = time.perf_counter()
                if i:  # the first query is the warm-up
                    times.append(t1 - t0)
                    figure_times.append(t2 - t0)
                    shown.append(len(rows))
        ro.dispose()
        engine.dispose()

    def pct(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]

    return {"events": result.num_events, "copies": copies, "ingest_s": ingest_s, "index_build_s": build_s,
            "query_p50_ms": 1e3 * pct(times, 0.5), "query_p95_ms": 1e3 * pct(times, 0.95),
            "figure_p50_ms": 1e3 * pct(figure_times, 0.5), "figure_p95_ms": 1e3 * pct(figure_times, 0.95),
            "max_shown": max(shown), "queries": queries}


# ---------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(
        description="Trace ingest benchmark: graphdeck's ingest vs HTA's trace load and bare ijson streaming "
                    "of the same files (wall and CPU time, peak RSS), then timeline window queries on a "
                    "1M-event store.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("traces", nargs="*", help="trace files (default: the two largest corpus traces)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per side, interleaved; the median is reported")
    ap.add_argument("--sides", default="graphdeck,HTA,ijson",
                    help="comma-separated subset of graphdeck, HTA, ijson")
    ap.add_argument("--window-events", type=int, default=1_000_000,
                    help="events in the store the window queries run on (copies of the largest trace)")
    ap.add_argument("--queries", type=int, default=40, help="random timeline windows queried")
    ap.add_argument("--max-shapes", type=int, default=2000, help="bars per window answer (level of detail)")
    ap.add_argument("--no-window", action="store_true", help="skip the window-query part")
    ap.add_argument("--write-results", action="store_true", help="rewrite the 'Trace ingest' section of bench/RESULTS.md")
    args = ap.parse_args()
    args.load_start = os.getloadavg()[0]
    paths = [Path(p) if Path(p).exists() else TRACES / p for p in args.traces or DEFAULT]
    sides = args.sides.split(",")
    rows = []
    for path in paths:
        res = bench_file(path, args.repeat, sides)
        rows.append((path, res))
        print(f"{path.name}:", flush=True)
        for side, r in res.items():
            if "error" in r:
                print(f"  {side}: FAILED {r['error']}")
                continue
            print(f"  {side}: {r['seconds']:.2f} s ({r['cpu_s']:.2f} s CPU), peak RSS {r['peak_mib']:.0f} MiB "
                  f"(start {r['start_mib']:.0f}), "
                  f"{r['events']:,} events", flush=True)
        g, h, j = (res.get(k, {}) for k in ("graphdeck", "HTA", "ijson"))
        if "seconds" in g and "seconds" in h:
            print(f"  HTA / graphdeck time {h['seconds'] / g['seconds']:.2f}x (CPU {h['cpu_s'] / g['cpu_s']:.2f}x), "
                  f"peak RSS {h['peak_mib'] / g['peak_mib']:.2f}x")
        if "seconds" in g and "seconds" in j:
            print(f"  graphdeck / ijson time {g['seconds'] / j['seconds']:.2f}x (CPU {g['cpu_s'] / j['cpu_s']:.2f}x)")
        print(f"  load average {os.getloadavg()[0]:.1f}", flush=True)
    window = None
    if not args.no_window:
        window = bench_window(paths[-1], args.window_events, args.queries, args.max_shapes)
        print(f"window query on {window['events']:,} events: p50 {window['query_p50_ms']:.1f} ms, "
              f"p95 {window['query_p95_ms']:.1f} ms (with the Plotly figure: p50 {window['figure_p50_ms']:.1f}, "
              f"p95 {window['figure_p95_ms']:.1f} ms); index built in {window['index_build_s']:.2f} s", flush=True)
    if args.write_results:
        _write_results(rows, window, args)


def _write_results(rows, window, args) -> None:
    import ijson
    import sqlalchemy

    try:
        import importlib.metadata as md

        hta_version = md.version("HolisticTraceAnalysis")
    except Exception:  # noqa: BLE001
        hta_version = "?"
    cmd = "python bench/bench_ingest.py " + " ".join(a for a in sys.argv[1:])
    lines = [
        SECTION, "",
        f"`{cmd}` on {time.strftime('%Y-%m-%d %H:%M')} UTC: {platform.machine()}, {os.cpu_count()} CPUs shared with "
        f"other developers (load average {args.load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; "
        "wall times stretch with the load, so the CPU seconds of each side, all threads, are given too), "
        f"Python {platform.python_version()}, "
        f"ijson {ijson.__version__} ({ijson.backend}), SQLAlchemy {sqlalchemy.__version__}, HolisticTraceAnalysis "
        f"{hta_version}. Median of {args.repeat} interleaved runs per side, each side in its own forked child "
        "(peak = the child's `ru_maxrss`; graphdeck's store is created by another process first, as when a captured "
        "run made it). HTA = `TraceAnalysis(trace_dir=...)` on a folder with only that file; "
        "ijson = `ijson.items(f, 'traceEvents.item')` doing nothing with the events.",
        "",
        "| trace | JSON MB | events | graphdeck s (CPU) | HTA s (CPU) | ijson s (CPU) | HTA/graphdeck time (CPU) | "
        "graphdeck/ijson time (CPU) | graphdeck peak MiB | HTA peak MiB | ijson peak MiB | HTA/graphdeck memory |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for path, res in rows:
        g, h, j = (res.get(k, {}) for k in ("graphdeck", "HTA", "ijson"))
        raw = len(gzip.decompress(path.read_bytes())) / 1e6 if path.read_bytes()[:2] == b"\x1f\x8b" else path.stat().st_size / 1e6

        def s(r):
            return f"{r['seconds']:.2f} ({r['cpu_s']:.2f})" if "seconds" in r else "failed"

        def ratio(a, b):
            return f"{a['seconds'] / b['seconds']:.2f}x ({a['cpu_s'] / b['cpu_s']:.2f}x)" if "seconds" in a and "seconds" in b else "—"

        def m(r):
            return f"{r['peak_mib']:.0f}" if "peak_mib" in r else "—"

        ratio_t, ratio_j = ratio(h, g), ratio(g, j)
        ratio_m = f"{h['peak_mib'] / g['peak_mib']:.2f}x" if "peak_mib" in h and "peak_mib" in g else "—"
        lines.append(f"| `{path.name[:40]}` | {raw:.1f} | {g.get('events', 0):,} | {s(g)} | {s(h)} | {s(j)} | {ratio_t} | "
                     f"{ratio_j} | {m(g)} | {m(h)} | {m(j)} | {ratio_m} |")
    if window:
        lines += ["", f"Window query on one trace of {window['events']:,} stored events ({window['copies']} copies of "
                  f"the xdit trace, shifted): {window['queries']} random windows (1/1000 to 1/2 of the span), at most "
                  f"{args.max_shapes} bars each: index select + row fetch p50 {window['query_p50_ms']:.1f} ms, "
                  f"**p95 {window['query_p95_ms']:.1f} ms**; including the Plotly figure dict p50 "
                  f"{window['figure_p50_ms']:.1f} ms, p95 {window['figure_p95_ms']:.1f} ms. The per-trace index "
                  f"(built once, then cached by the server) took {window['index_build_s']:.2f} s."]
    section = "\n".join(lines) + "\n"
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n\n"
    pattern = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.S | re.M)
    old = pattern.search(text)
    if old and NOTES in old.group(0):  # hand-written notes below the table are kept
        section += "\n" + old.group(0)[old.group(0).index(NOTES):].rstrip("\n") + "\n"
    text = pattern.sub(lambda _m: section + "\n", text) if old else text.rstrip("\n") + "\n\n" + section
    RESULTS.write_text(text)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
