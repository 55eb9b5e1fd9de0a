"""Server memory of the upload routes: RSS of a ``graphdeck serve`` process before, at its peak
during and after one upload of a 25 MiB and a 250 MiB Kineto trace and TORCH_TRACE log, sent
over real HTTP on loopback (issue 18, item 4: growth ≤ 64 MiB whatever the size).

Inputs are built once under ``/tmp/graphdeck-bench/upload-mem`` (never in git) from the shared
corpus by repeating real files with shifted identities:

* trace: the events of ``hta/negative_queue_length_values_check/rank0.json.gz`` (rank 0 of 16,
  108,936 events, 25.8 MB of JSON) written again and again, each copy's ``ts`` shifted past the
  previous copy's end and its ``correlation`` / ``External id`` past the previous copy's ids (as
  one long profile numbers its launches: a correlation id names one launch), metadata (``ph: M``)
  events once, until the file reaches the size (files ``trace_<N>mib_ids.json``; before
  2026-12-07 the ids were repeated, so every copy's kernels named the first copy's launches);
* log: ``generated_torch2.13_cpu_gloo/ddp`` rank 0 (a real DDP TORCH_TRACE log) repeated, each
  copy's envelope ``frame_id`` shifted past the previous copy's frames.

Each measurement starts a fresh server process on a fresh SQLite store, sends one small upload
of the same route (imports and caches warm), resets the process's peak RSS
(``/proc/PID/clear_refs`` ← 5), reads VmRSS, sends the big upload and reads VmHWM (peak) and
VmRSS again, and the server's CPU seconds (utime + stime) spent on it. Routes:

* ``trace-raw``: ``POST /api/runs/{run}/traces`` with the file as the body (streamed, chunked);
* ``trace-form``: the same route, multipart field ``file``;
* ``trace-resumable``: ``graphdeck upload`` 's client (:func:`graphdeck.capture.upload.upload_trace`):
  ``/api/uploads`` declaration, 8 MiB chunks, complete;
* ``log-form``: ``POST /api/runs/{run}/torch-trace``, multipart field ``files``;
* ``log-form-parts``: the same log cut at record boundaries into files under 900 kB (one rank
  each; under Starlette's 1 MiB in-memory spool per file), all in one upload;
* ``trace-unique`` (only when named): ``trace-raw`` with every event given a name of its own
  (``"<name> #<offset>"``), the worst case for the ingest's interned-string tables.

Usage::

    python bench/bench_upload_memory.py [--sizes 25,250] [--repeat 3] [--routes trace-raw,...]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
TRACE_SRC = DATA / "traces" / "hta" / "negative_queue_length_values_check" / "rank0.json.gz"
LOG_DIR = DATA / "torch_trace" / "generated_torch2.13_cpu_gloo" / "ddp"
CACHE = Path("/tmp/graphdeck-bench/upload-mem")
MiB = 1024 * 1024
CLIENT = {"X-Graphdeck-Client": "1"}
#: Event args that number launches: shifted per copy of the trace.
ID_ARGS = {"correlation", "External id", "external id"}
ROUTES = ("trace-raw", "trace-form", "trace-resumable", "log-form", "log-form-parts")
#: Not run unless named in ``--routes``.
EXTRA_ROUTES = ("trace-unique", "trace-raw-gz", "trace-resumable-gz", "bundle-resumable")


# ---------------------------------------------------------------------------- inputs


def make_trace(mib: int, unique: bool = False) -> Path:
    out = CACHE / f"trace_{mib}mib_ids{'_unique' if unique else ''}.json"
    if out.exists():
        return out
    import gzip

    doc = orjson.loads(gzip.decompress(TRACE_SRC.read_bytes()))
    events = doc.pop("traceEvents")
    meta = [e for e in events if e.get("ph") == "M"]
    timed = [e for e in events if e.get("ph") != "M"]
    t0 = min(e["ts"] for e in timed if isinstance(e.get("ts"), (int, float)))
    t1 = max(e["ts"] + (e.get("dur") or 0) for e in timed if isinstance(e.get("ts"), (int, float)))
    span = int(t1 - t0) + 1000
    ids = 1 + max((v for e in timed for k, v in (e.get("args") or {}).items()
                   if k in ID_ARGS and isinstance(v, int) and not isinstance(v, bool)), default=0)
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    with open(tmp, "wb") as f:
        head = orjson.dumps(doc)[:-1]  # the top-level keys, without the closing brace
        f.write(head + b', "traceEvents": [\n')
        f.write(b",\n".join(orjson.dumps(e) for e in meta))
        size, k, sep = f.tell(), 0, b",\n" if meta else b""
        while size < mib * MiB:
            for e in timed:
                if isinstance(e.get("ts"), (int, float)):
                    e = {**e, "ts": e["ts"] + k * span}
                if k and isinstance(e.get("args"), dict) and ID_ARGS & e["args"].keys():
                    e = {**e, "args": {a: v + k * ids if a in ID_ARGS and isinstance(v, int) else v
                                       for a, v in e["args"].items()}}
                if unique:  # every event a name of its own: the interned-string tables grow with the file
                    e = {**e, "name": f"{e.get('name')} #{size}"}
                line = sep + orjson.dumps(e)
                f.write(line)
                size, sep = size + len(line), b",\n"
                if size >= mib * MiB:
                    break
            k += 1
        f.write(b"\n]}\n")
    tmp.rename(out)
    return out


def gzipped(path: Path) -> Path:
    out = path.with_name(path.name + ".gz")
    if not out.exists():
        import gzip

        tmp = out.with_suffix(".part")
        with open(path, "rb") as src, gzip.open(tmp, "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst, 8 * MiB)
        tmp.rename(out)
    return out


def bundle(path: Path) -> Path:
    """A capture store holding the trace ``path`` (as a rank's agent leaves it): the bundle route."""
    out = path.with_name(path.stem + ".bundle.db")
    if not out.exists():
        from graphdeck.store.db import open_engine
        from graphdeck.store.traces import ingest_trace

        tmp = out.with_suffix(".part")
        tmp.unlink(missing_ok=True)
        engine = open_engine(tmp)
        ingest_trace(engine, path, run_name="bundle", rank=0)
        engine.dispose()
        tmp.rename(out)
    return out


def inputs(route: str, mib: int):
    if route.endswith("-gz"):
        return gzipped(make_trace(mib))
    if route == "bundle-resumable":
        return bundle(make_trace(mib))
    if route == "log-form-parts":
        return make_log_parts(mib)
    if route.startswith("log"):
        return make_log(mib)
    return make_trace(mib, unique=route == "trace-unique")


def make_log(mib: int) -> Path:
    out = CACHE / f"dedicated_log_torch_trace_rank_0_{mib}mib.log"
    if out.exists():
        return out
    src = next(LOG_DIR.glob("dedicated_log_torch_trace_rank_0_*.log")).read_bytes()
    frames = [int(m) for m in re.findall(rb'"frame_id": (\d+)', src)]
    step = max(frames) + 1
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    with open(tmp, "wb") as f:
        k = 0
        while f.tell() < mib * MiB:
            f.write(re.sub(rb'"frame_id": (\d+)', lambda m: b'"frame_id": %d' % (int(m[1]) + k * step), src))
            k += 1
    tmp.rename(out)
    return out


def make_log_parts(mib: int, part_bytes: int = 900_000) -> list[Path]:
    """The log of :func:`make_log` cut at record boundaries into files under ``part_bytes``
    (below Starlette's 1 MiB in-memory spool), one rank each."""
    out = CACHE / f"log_parts_{mib}mib"
    if not out.exists():
        tmp = out.with_suffix(".part")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        with open(make_log(mib), "rb") as f:
            piece, n = [], 0
            for line in f:
                if line[:1] in b"VIWEDC" and n and n + len(line) > part_bytes:
                    (tmp / f"dedicated_log_torch_trace_rank_{len(list(tmp.iterdir()))}.log").write_bytes(b"".join(piece))
                    piece, n = [], 0
                piece.append(line)
                n += len(line)
            if piece:
                (tmp / f"dedicated_log_torch_trace_rank_{len(list(tmp.iterdir()))}.log").write_bytes(b"".join(piece))
        tmp.rename(out)
    return sorted(out.iterdir(), key=lambda p: int(p.stem.rsplit("_", 1)[1]))


# ---------------------------------------------------------------------------- server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM of ``pid`` in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Server:
    def __init__(self, work: Path, store: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "GRAPHDECK_DATA_DIR": str(work / "uploads")}
        env.pop("GRAPHDECK_WRITE_TOKENS", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "graphdeck.cli", "serve", store or str(work / "store.db"), "--port", str(self.port)]
            + ([] if store else ["--create"]),
            env=env, stdout=subprocess.DEVNULL, stderr=open(work / "server.log", "wb"))

    def __enter__(self) -> Server:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/api/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                time.sleep(0.2)
        raise RuntimeError("server did not start within 60 s")

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def file_chunks(path: Path, size: int = MiB):
    with open(path, "rb") as f:
        while block := f.read(size):
            yield block


def upload(route: str, url: str, path: Path, run: str) -> dict:
    timeout = httpx.Timeout(1800, connect=10)
    if route == "trace-raw":
        r = httpx.post(f"{url}/api/runs/{run}/traces", params={"rank": 0, "name": path.name},
                       content=file_chunks(path), headers={**CLIENT, "Content-Type": "application/json"},
                       timeout=timeout)
    elif route == "trace-form":
        with open(path, "rb") as f:
            r = httpx.post(f"{url}/api/runs/{run}/traces", params={"rank": 0}, headers=CLIENT,
                           files={"file": (path.name, f, "application/json")}, timeout=timeout)
    elif route == "log-form":
        with open(path, "rb") as f:
            r = httpx.post(f"{url}/api/runs/{run}/torch-trace", headers=CLIENT,
                           files=[("files", (path.name, f, "text/plain"))], timeout=timeout)
    elif route == "log-form-parts":
        handles = [open(p, "rb") for p in path]
        try:
            r = httpx.post(f"{url}/api/runs/{run}/torch-trace", headers=CLIENT, timeout=timeout,
                           files=[("files", (p.name, f, "text/plain")) for p, f in zip(path, handles)])
        finally:
            for f in handles:
                f.close()
    elif route == "trace-unique":
        return upload("trace-raw", url, path, run)
    elif route in ("trace-raw-gz", "trace-resumable-gz"):
        return upload(route.removesuffix("-gz"), url, path, run)
    elif route == "bundle-resumable":
        from graphdeck.capture.upload import upload_store

        return upload_store(url, path, run=run, rank=0)["result"]
    elif route == "trace-resumable":
        from graphdeck.capture.upload import upload_trace

        status = upload_trace(url, path, run=run, rank=0)
        return status["result"]
    else:
        raise ValueError(route)
    if r.status_code != 201:
        raise RuntimeError(f"{route}: {r.status_code} {r.text[:300]}")
    return r.json()


_db_counter = iter(range(1_000_000))


def measure(route: str, big: Path, small: Path, pg=None) -> dict:
    """One fresh server (on a fresh SQLite file, or a fresh database of ``pg``, a started
    :class:`~graphdeck.pg_local.LocalPostgres`), one warm-up upload, then the measured one."""
    store = pg.create_database(f"upmem_{os.getpid()}_{next(_db_counter)}") if pg is not None else None
    with tempfile.TemporaryDirectory(prefix="gd-upmem-") as work, Server(Path(work), store) as srv:
        pid = srv.proc.pid
        upload(route, srv.url, small, "warm")
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # peak RSS := current RSS
        before = proc_status(pid)["VmRSS"]
        c0, t0 = cpu_s(pid), time.perf_counter()
        upload(route, srv.url, big, "big")
        wall, cpu = time.perf_counter() - t0, cpu_s(pid) - c0
        st = proc_status(pid)
    return {"before": before, "peak": st["VmHWM"], "after": st["VmRSS"], "cpu_s": cpu, "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="25,250", help="file sizes, MiB, comma-separated")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--routes", default=",".join(ROUTES))
    ap.add_argument("--postgres", action="store_true",
                    help="store on a private PostgreSQL server (graphdeck.pg_local), a new database per upload")
    args = ap.parse_args()
    pg = None
    if args.postgres:
        from graphdeck.pg_local import LocalPostgres

        pg = LocalPostgres().start()
    try:
        run_all(args, pg)
    finally:
        if pg is not None:
            pg.stop()


def run_all(args, pg) -> None:
    sizes = [int(s) for s in args.sizes.split(",")]
    routes = args.routes.split(",")
    started = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load0 = os.getloadavg()[0]
    rows = []
    for mib in sizes:
        for route in routes:
            big, small = inputs(route, mib), inputs(route, 1)
            size = sum(p.stat().st_size for p in big) if isinstance(big, list) else big.stat().st_size
            runs = [measure(route, big, small, pg) for _ in range(args.repeat)]
            rows.append((route, mib, size, runs))
            g = [(r["peak"] - r["before"]) / MiB for r in runs]
            print(f"{route:16s} {mib:4d} MiB  peak growth {statistics.median(g):7.1f} MiB "
                  f"({min(g):.1f}-{max(g):.1f})  cpu {statistics.median(r['cpu_s'] for r in runs):.1f} s",
                  file=sys.stderr, flush=True)
    flags = f"--sizes {args.sizes} --repeat {args.repeat}" + (" --postgres" if pg else "")
    if args.routes != ",".join(ROUTES):
        flags += f" --routes {args.routes}"
    print(f"`python bench/bench_upload_memory.py {flags}` on {started}: "
          f"{platform.machine()}, {os.cpu_count()} CPUs (load average {load0:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end), Python {platform.python_version()}; one fresh `graphdeck serve` "
          f"process per upload ({'PostgreSQL' if pg else 'SQLite'} store), median of {args.repeat} and min–max.\n")
    print("| route | file | MiB sent | RSS before MiB | peak growth MiB (min–max) | growth after MiB "
          "| server CPU s (min–max) | wall s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for route, mib, size, runs in rows:
        med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
        growth = [(r["peak"] - r["before"]) / MiB for r in runs]
        after = [(r["after"] - r["before"]) / MiB for r in runs]
        cpu = [r["cpu_s"] for r in runs]
        kind = "log" if route.startswith("log") else "trace"
        if route == "log-form-parts":
            kind = f"log in {len(inputs(route, mib))} files"
        elif route == "trace-unique":
            kind = "trace, unique names"
        print(f"| {route} | {kind} {mib} MiB | {size / MiB:.1f} | {med('before') / MiB:.0f} "
              f"| {statistics.median(growth):.1f} ({min(growth):.1f}–{max(growth):.1f}) "
              f"| {statistics.median(after):.1f} | {statistics.median(cpu):.1f} ({min(cpu):.1f}–{max(cpu):.1f}) "
              f"| {med('wall_s'):.1f} |")


if __name__ == "__main__":
    main()
