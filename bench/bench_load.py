"""Bench: the server under load on loopback — N concurrent uploaders and M concurrent readers of
graph SVGs and trace timelines for a bounded time; throughput, p50/p95 latency, errors (must be 0).

One command, two phases against one server process (the real app under uvicorn, token auth on):

1. **Anchor**: the M readers alone for ``--anchor-s`` seconds (read latency on an idle server).
2. **Load**: the M readers plus N uploaders for ``--duration-s`` seconds. Each uploader loops:
   a resumable upload (``graphdeck.capture.upload``) of the Kineto trace, then of the capture
   bundle, each under a new run name (so every upload is really ingested / merged).

Inputs (real, from the repo): ``tests/data/gpt2_inductor/gpt2_rank0.pt.trace.json.gz`` (an H200
GPT-2 trace, 6,812 events) and ``tests/data/gpt2_inductor/gpt2.db.gz`` (the same run's store:
5 graphs, 9,387 nodes, the trace), migrated once to the current schema as the bundle. Readers
request ``/api/graphs/{id}/svg`` of the bundle's graphs (rotating, with a rotating ``node=`` so the
SVG cache does not answer every request) and ``/api/traces/{id}/timeline?limit=5000``.

Prints a table and the ratio of read latency under load to the anchor's; exits 1 on any error.

Run::

    python bench/bench_load.py --uploaders 4 --readers 4 --duration-s 30 [--store-url postgresql+psycopg://...]
        [--write-results]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gzip
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data" / "gpt2_inductor"
RESULTS = Path(__file__).with_name("RESULTS.md")
SECTION = "## Server under load (uploads + reads)"
TOKEN = "bench-load-token"
SERVER = r"""
import sys, uvicorn
from graphdeck.server.app import create_app
from graphdeck.server.settings import Settings
app = create_app(Settings(store=sys.argv[1], data_dir=sys.argv[2], write_tokens=(sys.argv[4],)))
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[3]), log_level="warning")
"""


class Stats:
    """Latencies (s) and errors per kind, appended from many threads."""

    def __init__(self):
        self.lock = threading.Lock()
        self.lat: dict[str, list[float]] = {}
        self.errors: dict[str, list[str]] = {}
        self.bytes_up = 0
        self.retries = 0

    def add(self, kind: str, seconds: float, error: str | None = None, nbytes: int = 0) -> None:
        with self.lock:
            if error is None:
                self.lat.setdefault(kind, []).append(seconds)
                self.bytes_up += nbytes
            else:
                self.errors.setdefault(kind, []).append(error)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def start_server(store: str, data_dir: Path) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", SERVER, store, str(data_dir), str(port), TOKEN])
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/api/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("server did not start")


def make_bundle(tmp: Path) -> Path:
    """The shipped H200 store, migrated once to this graphdeck's schema."""
    from graphdeck.store.db import open_engine

    raw = tmp / "gpt2.db"
    with gzip.open(DATA / "gpt2.db.gz", "rb") as fin, open(raw, "wb") as fout:
        shutil.copyfileobj(fin, fout)
    open_engine(raw).dispose()
    return raw


def reader(url: str, stop: threading.Event, stats: Stats, graph_ids: list[int], nodes: dict[int, list[str]],
           trace_id: int, seed: int) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=url, headers=headers, timeout=120) as c:
        k = seed
        while not stop.is_set():
            k += 1
            if k % 3:
                gid = graph_ids[k % len(graph_ids)]
                names = nodes[gid]
                kind, path, params = "svg", f"/api/graphs/{gid}/svg", {"node": names[k % len(names)]}
            else:
                kind, path, params = "timeline", f"/api/traces/{trace_id}/timeline", {"limit": 5000}
            t0 = time.perf_counter()
            try:
                r = c.get(path, params=params)
                err = None if r.status_code == 200 else f"HTTP {r.status_code}: {r.text[:200]}"
            except httpx.HTTPError as exc:
                err = f"{type(exc).__name__}: {exc}"
            stats.add(kind, time.perf_counter() - t0, err)


def uploader(url: str, stop: threading.Event, stats: Stats, trace: Path, bundle_gz: Path, index: int) -> None:
    from graphdeck.capture.upload import Uploader

    k = 0
    with Uploader(url, token=TOKEN, attempts=3, backoff_s=0.5) as up:
        while not stop.is_set():
            k += 1
            for kind, path in (("upload_trace", trace), ("upload_bundle", bundle_gz)):
                if stop.is_set():
                    break
                t0 = time.perf_counter()
                try:
                    status = up.upload(path, kind=kind.split("_")[1], run=f"load-{index}-{k}", rank=0,
                                       chunk_bytes=1 << 20)
                    err = None if status["state"] == "done" else f"state {status['state']}"
                except Exception as exc:  # noqa: BLE001 - every failure is counted and reported
                    err = f"{type(exc).__name__}: {exc}"
                stats.add(kind, time.perf_counter() - t0, err, path.stat().st_size)
        with stats.lock:
            stats.retries += up.retries


def run_phase(url: str, seconds: float, readers: int, uploaders: int, setup: dict, seed: int) -> tuple[Stats, float]:
    """Readers start at node ``seed + 1000 * i`` of the rotation (phases use different seeds, so
    neither answers from the other's SVG cache)."""
    stats, stop = Stats(), threading.Event()
    threads = [threading.Thread(target=reader, args=(url, stop, stats, setup["graph_ids"], setup["nodes"],
                                                     setup["trace_id"], seed + 1000 * i)) for i in range(readers)]
    threads += [threading.Thread(target=uploader, args=(url, stop, stats, setup["trace"], setup["bundle_gz"], i))
                for i in range(uploaders)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(timeout=600)
    return stats, time.perf_counter() - t0


def prepare(url: str, tmp: Path) -> dict:
    from graphdeck.capture.upload import snapshot_store, upload_store

    bundle = make_bundle(tmp)
    status = upload_store(url, bundle, run="served", rank=0, token=TOKEN)
    run_id = status["result"]["run_id"]
    with httpx.Client(base_url=url) as c:
        graphs = c.get(f"/api/runs/{run_id}/graphs").json()
        graph_ids = [g["id"] for g in graphs]
        nodes = {g: [n["name"] for n in c.get(f"/api/graphs/{g}/nodes").json()] for g in graph_ids}
        trace_id = status["result"]["created"]["traces"][0]
    return {"graph_ids": graph_ids, "nodes": nodes, "trace_id": trace_id, "trace": DATA / "gpt2_rank0.pt.trace.json.gz",
            "bundle_gz": snapshot_store(bundle, tmp / "bundle.db.gz")}


def summarise(stats: Stats, wall_s: float) -> dict:
    out = {}
    for kind in sorted(set(stats.lat) | set(stats.errors)):
        lat = stats.lat.get(kind, [])
        out[kind] = {"n": len(lat), "per_s": len(lat) / wall_s, "p50_ms": 1e3 * pct(lat, 0.5),
                     "p95_ms": 1e3 * pct(lat, 0.95), "errors": len(stats.errors.get(kind, []))}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--uploaders", type=int, default=4, help="concurrent uploaders (N)")
    ap.add_argument("--readers", type=int, default=4, help="concurrent SVG/timeline readers (M)")
    ap.add_argument("--duration-s", type=float, default=30.0, help="length of the loaded phase")
    ap.add_argument("--anchor-s", type=float, default=10.0, help="length of the readers-only phase")
    ap.add_argument("--store-url", default=None, help="server store (default: a fresh SQLite file)")
    ap.add_argument("--write-results", action="store_true", help="replace this bench's section of bench/RESULTS.md")
    args = ap.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="graphdeck-bench-load-"))
    store = args.store_url or str(tmp / "server.db")
    proc, url = start_server(store, tmp / "data")
    try:
        setup = prepare(url, tmp)
        anchor, anchor_wall = run_phase(url, args.anchor_s, args.readers, 0, setup, seed=0)
        load, load_wall = run_phase(url, args.duration_s, args.readers, args.uploaders, setup, seed=100_000)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)
    a, b = summarise(anchor, anchor_wall), summarise(load, load_wall)
    backend = "PostgreSQL" if args.store_url and args.store_url.startswith("postgres") else "SQLite"
    lines = ["| phase | request | n | per s | p50 ms | p95 ms | errors |", "|---|---|---:|---:|---:|---:|---:|"]
    for phase, summ in (("readers only (anchor)", a), (f"{args.uploaders} uploaders + {args.readers} readers", b)):
        for kind, s in summ.items():
            lines.append(f"| {phase} | {kind} | {s['n']} | {s['per_s']:.2f} | {s['p50_ms']:.0f} | {s['p95_ms']:.0f} "
                         f"| {s['errors']} |")
    ratios = {k: b[k]["p50_ms"] / a[k]["p50_ms"] for k in a if k in b and a[k]["p50_ms"]}
    errors = sum(s["errors"] for s in (*a.values(), *b.values()))
    mb_s = load.bytes_up / 1e6 / load_wall
    summary = (f"Store {backend}; uploaded {load.bytes_up / 1e6:.1f} MB in {load_wall:.1f} s ({mb_s:.2f} MB/s of "
               f"gzip payload, every upload ingested/merged); read p50 under load / idle: "
               + ", ".join(f"{k} {v:.1f}x" for k, v in ratios.items())
               + f"; errors: {errors}; client retries (5xx / connection): {load.retries}.")
    table = "\n".join(lines)
    print(table)
    print(summary)
    for kind, errs in {**anchor.errors, **load.errors}.items():
        for e in errs[:3]:
            print(f"error {kind}: {e}", file=sys.stderr)
    if args.write_results:
        cmd = "python bench/bench_load.py " + " ".join(argv if argv is not None else sys.argv[1:])
        load_avg = os.getloadavg()[0]
        head = (f"`{cmd.replace(' --write-results', '')}` on {_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M} UTC: "
                f"{platform.machine()}, {os.cpu_count()} CPUs shared with other developers (load average "
                f"{load_avg:.1f} at the end), Python {platform.python_version()}; server = one uvicorn process "
                "(the real app, token auth on), clients = threads of the bench process, loopback.")
        _write_section(f"{backend}, {args.uploaders} uploaders + {args.readers} readers",
                       head + "\n\n" + table + "\n\n" + summary)
    return 1 if errors else 0


def _write_section(backend: str, body: str) -> None:
    text = RESULTS.read_text()
    sub = f"### {backend}"
    block = f"{sub}\n\n{body}\n"
    if SECTION not in text:
        text = text.rstrip() + f"\n\n{SECTION}\n\n{block}"
    else:
        start = text.index(SECTION)
        end = text.find("\n## ", start + len(SECTION))
        end = len(text) if end < 0 else end
        section = text[start:end]
        if sub in section:
            s0 = section.index(sub)
            s1 = section.find("\n### ", s0 + len(sub))
            s1 = len(section) if s1 < 0 else s1
            section = section[:s0] + block + section[s1:]
        else:
            section = section.rstrip() + "\n\n" + block
        text = text[:start] + section.rstrip() + "\n" + text[end:]
    RESULTS.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
