"""The services of ``docker-compose.yml`` without Docker: PostgreSQL, the server, a 2-rank demo job.

``graphdeck stack`` (a thin command over :func:`run_stack`) starts, on this machine:

1. ``db``: a PostgreSQL server from the distribution's binaries in ``<dir>/pg`` (see
   :mod:`graphdeck.pg_local`), database ``graphdeck``; or none when ``--store`` names a store;
2. ``server``: ``graphdeck serve <store> --host H --port P`` with the write token in
   ``GRAPHDECK_WRITE_TOKENS``, its upload chunks in ``<dir>/uploads`` (``GRAPHDECK_DATA_DIR``),
   up when ``GET /api/health`` answers (the compose healthcheck);
3. ``demo`` (``--demo``): ``torchrun --nproc-per-node 2 -m graphdeck.demo --upload-url
   http://H:P`` with ``GRAPHDECK_TOKEN``: each rank captures locally and uploads over HTTP.

It then serves until interrupted (SIGINT/SIGTERM) or, with ``--exit-after-demo``, stops once the job
is done; either way it stops what it started, in reverse order. Lines starting ``[stack]`` report
progress; ``[stack] ready`` and ``[stack] demo job finished`` are what scripts wait for.

Same names as the compose file: ``GRAPHDECK_STORE``, ``GRAPHDECK_WRITE_TOKENS``,
``GRAPHDECK_TOKEN``, ``GRAPHDECK_DATA_DIR``.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from graphdeck.errors import StoreError


@dataclass
class StackOptions:
    """What :func:`run_stack` starts. ``store=None`` means a local PostgreSQL in ``data_dir/pg``."""

    data_dir: Path
    store: str | None = None
    host: str = "127.0.0.1"
    port: int = 8765
    pg_port: int | None = None
    token: str | None = None
    demo: bool = True
    demo_run: str = "stack-demo"
    demo_steps: int = 2
    demo_backend: str = "aot_eager"
    demo_layers: int = 1
    exit_after_demo: bool = False
    log: Callable[[str], None] = field(default=print)


def _say(opts: StackOptions, msg: str) -> None:
    opts.log(f"[stack] {msg}")


def wait_healthy(url: str, timeout_s: float = 120, proc: subprocess.Popen | None = None) -> None:
    """Poll ``url`` (``/api/health``) until it answers 200. Raises :class:`StoreError` on timeout
    or when ``proc`` exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise StoreError(f"the server exited with {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise StoreError(f"{url} did not answer within {timeout_s:.0f} s")


def _stop(proc: subprocess.Popen | None, timeout_s: float = 20) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_stack(opts: StackOptions) -> int:
    """Start the services, run the demo job, serve until stopped; returns the exit code (the demo
    job's when it failed, else 0)."""
    from graphdeck.pg_local import LocalPostgres, create_database
    from graphdeck.store.db import display_url

    opts.data_dir.mkdir(parents=True, exist_ok=True)
    token = opts.token or os.environ.get("GRAPHDECK_TOKEN") or secrets.token_urlsafe(24)
    pg = server = job = None
    stopping = []

    def on_signal(signum, _frame):
        stopping.append(signum)
        raise KeyboardInterrupt

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    code = 0
    try:
        store = opts.store
        if store is None:
            pg_dir = opts.data_dir / "pg"
            if os.geteuid() == 0:  # initdb refuses root; the server user must reach its folder
                pg_dir = None
            pg = LocalPostgres(pg_dir, port=opts.pg_port, fast=False).start()
            store = pg.url_for("graphdeck") if _has_db(pg.url, "graphdeck") else create_database(pg.url, "graphdeck")
            _say(opts, f"db: PostgreSQL at {display_url(store)} (data in {pg.data_dir})")
        env = dict(os.environ, GRAPHDECK_WRITE_TOKENS=token, GRAPHDECK_DATA_DIR=str(opts.data_dir / "uploads"))
        server = subprocess.Popen([sys.executable, "-m", "graphdeck.cli", "serve", store, "--host", opts.host,
                                   "--port", str(opts.port)], env=env)
        base = f"http://{opts.host}:{opts.port}"
        wait_healthy(f"{base}/api/health", proc=server)
        _say(opts, f"server: {base}/ (store {display_url(store)}) ready")
        if opts.demo:
            job_env = dict(os.environ, GRAPHDECK_TOKEN=token, OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   "-m", "graphdeck.demo", "--upload-url", base, "--run-name", opts.demo_run,
                   "--backend", opts.demo_backend, "--steps", str(opts.demo_steps), "--layers", str(opts.demo_layers)]
            _say(opts, f"demo: {' '.join(cmd[3:])}")
            job = subprocess.Popen(cmd, env=job_env)
            code = job.wait()
            job = None
            if code != 0:
                _say(opts, f"demo job failed with exit code {code}")
                return code
            _say(opts, f"demo job finished: run {opts.demo_run!r} at {base}/#/runs/{opts.demo_run}")
        if opts.exit_after_demo:
            return code
        _say(opts, "serving; Ctrl-C stops every service")
        server.wait()
        return server.returncode or 0
    except KeyboardInterrupt:
        _say(opts, "stopping")
        return 0
    finally:
        _stop(job)
        _stop(server)
        if pg is not None:
            pg.stop()  # its folder is removed only when it was a temp one
        for s, handler in old.items():
            signal.signal(s, handler)
        _say(opts, "stopped")


def _has_db(server_url: str, name: str) -> bool:
    from sqlalchemy import create_engine, text

    engine = create_engine(server_url)
    try:
        with engine.connect() as conn:
            return conn.execute(text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}).scalar() is not None
    finally:
        engine.dispose()
