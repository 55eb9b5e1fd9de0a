"""Upload routes stream with the size cap checked while reading (issue 18, item 4).

An upload over ``max_upload_bytes`` is a 413 having written at most the cap plus one network chunk
(and the multipart envelope, for the TORCH_TRACE route) to disk, whatever its size and whether it
comes with a ``Content-Length`` or chunked; nothing of it stays behind (no run, no temp file). A
streamed upload (chunked, no length, larger than the in-memory spool) still ingests exactly as the
CLI does. The server runs as its own process (``graphdeck serve``), so its ``/proc/PID/io`` counts
only its own writes. Memory is measured in bench/bench_upload_memory.py, not here.
"""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from graphdeck.server.auth import BODY_ENVELOPE_BYTES
from graphdeck.server.routes.traces import SPOOL_MEMORY_BYTES
from graphdeck.store.db import open_engine
from graphdeck.store.torch_trace import import_torch_trace
from graphdeck.store.traces import ingest_trace
from tests.conftest import LiveServer, free_port, shared_path

MiB = 1024 * 1024
CAP = 12 * MiB  # above the trace route's in-memory spool, so a refused upload does reach the disk
#: One network read of the server, rounded up generously (uvicorn reads at most 256 KiB at a time).
ONE_CHUNK = 1 * MiB
CLIENT = {"X-Graphdeck-Client": "1"}
BOUNDARY = "graphdeckTestBoundary7"
TRACE = ("data", "traces", "hta", "negative_queue_length_values_check", "rank0.json.gz")
LOGS = ("data", "torch_trace", "generated_torch2.13_cpu_gloo", "ddp")


def io_written(pid: int) -> int:
    """Bytes ``pid`` passed to write(2) and friends (files and pipes; not socket sends)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise AssertionError("no wchar in /proc/PID/io")


class ServerProcess:
    """``graphdeck serve`` in its own process, with a private temp dir and upload data dir."""

    def __init__(self, work: Path, **options):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tmp = work / "tmp"
        self.tmp.mkdir(mode=0o700)
        env = {**os.environ, "TMPDIR": str(self.tmp), "GRAPHDECK_DATA_DIR": str(work / "uploads")}
        env.pop("GRAPHDECK_WRITE_TOKENS", None)
        args = [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
        self.log = open(work / "server.log", "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "graphdeck.cli", "serve", str(work / "s.db"),
                                      "--create", "--port", str(self.port), *args], env=env, stdout=self.log, stderr=self.log)

    def __enter__(self) -> ServerProcess:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited with {self.proc.returncode}"
            try:
                if httpx.get(f"{self.url}/api/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                time.sleep(0.1)
        raise AssertionError("server did not start within 60 s")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(tmp_path_factory.mktemp("stream"), max_upload_bytes=CAP) as srv:
        yield srv


def blocks(total: int, head: bytes = b"", tail: bytes = b"", size: int = 256 * 1024):
    """A body made as it is sent: ``head``, ``total`` bytes of JSON whitespace, ``tail``."""
    yield head
    for _ in range(total // size):
        yield b" " * size
    yield tail


def multipart(field: str, filename: str) -> tuple[bytes, bytes]:
    """The head of one file part and the closing boundary."""
    head = (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{field}\"; filename=\"{filename}\"\r\n"
            "Content-Type: application/octet-stream\r\n\r\n").encode()
    return head, f"\r\n--{BOUNDARY}--\r\n".encode()


BIG = [
    ("trace, raw body", "/api/runs/big-raw/traces", "application/json", b"{", b""),
    ("trace, multipart", "/api/runs/big-form/traces", f"multipart/form-data; boundary={BOUNDARY}",
     *multipart("file", "host_rank_0.json")),
    ("TORCH_TRACE, multipart", "/api/runs/big-log/torch-trace", f"multipart/form-data; boundary={BOUNDARY}",
     *multipart("files", "dedicated_log_torch_trace_rank_0.log")),
]


@pytest.mark.parametrize("framing", ["chunked", "content-length"])
@pytest.mark.parametrize("what,path,content_type,head,tail", BIG, ids=[b[0] for b in BIG])
def test_over_the_cap_is_413_having_written_at_most_the_cap(server, what, path, content_type, head, tail, framing):
    body = blocks(4 * CAP, head, tail)
    if framing == "content-length":
        body = b"".join(body)
    before = io_written(server.proc.pid)
    r = httpx.post(server.url + path, content=body, headers={**CLIENT, "Content-Type": content_type}, timeout=120)
    written = io_written(server.proc.pid) - before
    assert r.status_code == 413 and r.json()["status"] == 413, r.text[:500]
    assert "limit" in r.json()["error"]
    bound = CAP + ONE_CHUNK + (BODY_ENVELOPE_BYTES if "TORCH_TRACE" in what else 0)
    assert written <= bound, f"{what}: {written / MiB:.1f} MiB written for a {CAP / MiB:.0f} MiB cap"
    if framing == "content-length":
        assert written < ONE_CHUNK, "a too-long Content-Length is refused before the body is read"
    run = path.split("/")[3]
    assert httpx.get(f"{server.url}/api/runs/{run}").status_code == 404, "no run kept"
    assert list(server.tmp.iterdir()) == [], "no temp file kept"


@pytest.mark.parametrize("extra,status", [(0, 201), (1, 413)])
def test_the_cap_is_exact_for_a_streamed_trace(server, extra, status):
    """A chunked trace of exactly the cap is taken, one byte more is refused."""
    events = b'{"traceEvents": [{"ph": "X", "name": "aten::mm", "ts": 1, "dur": 2, "pid": 1, "tid": 1}]}'
    data = events + b" " * (CAP - len(events) + extra)
    r = httpx.post(f"{server.url}/api/runs/exact-{extra}/traces", params={"rank": 0}, content=blocks_of(data),
                   headers={**CLIENT, "Content-Type": "application/json"}, timeout=120)
    assert r.status_code == status, r.text[:500]
    assert httpx.get(f"{server.url}/api/runs/exact-{extra}").status_code == (200 if status == 201 else 404)


def blocks_of(data: bytes, size: int = MiB):
    for i in range(0, len(data), size):
        yield data[i:i + size]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    store = tmp_path_factory.mktemp("live") / "s.db"
    open_engine(store).dispose()
    with LiveServer(store) as srv, httpx.Client(base_url=srv.url, headers=CLIENT, timeout=300) as c:
        yield c


def local_ingest(tmp_path: Path, data: bytes, name: str):
    engine = open_engine(tmp_path / f"{name}.db")
    src = tmp_path / name
    src.write_bytes(data)
    try:
        with open(src, "rb") as f:
            return ingest_trace(engine, f, run_name="cli", rank=0, name=name)
    finally:
        engine.dispose()


@pytest.mark.parametrize("form", ["raw", "multipart"])
def test_a_streamed_trace_ingests_as_the_cli_does(live, tmp_path, form):
    gz = shared_path(*TRACE).read_bytes()
    raw = gzip.decompress(gz)
    assert len(raw) > SPOOL_MEMORY_BYTES, "the upload must spool to disk"
    data = raw if form == "raw" else gz
    if form == "raw":
        r = live.post(f"/api/runs/stream-{form}/traces", params={"rank": 0, "name": "rank0.json"},
                      content=blocks_of(data), headers={"Content-Type": "application/json"})
    else:
        head, tail = multipart("file", "rank0.json.gz")
        r = live.post(f"/api/runs/stream-{form}/traces", params={"rank": 0}, content=blocks_of(head + data + tail),
                      headers={"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"})
    assert r.status_code == 201, r.text[:500]
    body = r.json()
    cli = local_ingest(tmp_path, data, "rank0.json" if form == "raw" else "rank0.json.gz")
    assert (body["status"], body["num_events"], body["rank"]) == (cli.status, cli.num_events, cli.rank)
    same = {k: v for k, v in body["stats"].items() if k not in ("file",)}
    assert same == {k: v for k, v in cli.stats.items() if k not in ("file",)}
    timeline = live.get(f"/api/traces/{body['trace_id']}/timeline", params={"limit": 10}).json()
    assert timeline["data"], "the stored trace is readable"


def test_a_streamed_torch_trace_upload_imports_as_the_cli_does(live, tmp_path):
    logs = sorted(shared_path(*LOGS).glob("*.log"))
    parts = b""
    for log in logs:
        head, _ = multipart("files", log.name)
        parts += head + log.read_bytes() + b"\r\n"
    body = parts + f"--{BOUNDARY}--\r\n".encode()
    r = live.post("/api/runs/stream-log/torch-trace", content=blocks_of(body, 64 * 1024),
                  headers={"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"})
    assert r.status_code == 201, r.text[:500]
    engine = open_engine(tmp_path / "cli.db")
    try:
        cli = import_torch_trace(engine, logs, run_name="cli").to_dict()
    finally:
        engine.dispose()
    got = r.json()
    assert (got["ranks"], got["stats"], got["dropped"]) == (cli["ranks"], cli["stats"], cli["dropped"])
