"""The services of ``docker-compose.yml`` without Docker: PostgreSQL, the server, a 2-rank demo job.

``graphdeck stack`` (a thin command over :func:`run_stack`) starts, on this machine:

1. ``db``: a PostgreSQL server from the distribution's binaries in ``<dir>/pg`` (see
   :mod:`graphdeck.pg_local`), database ``graphdeck``; or none when ``--store`` names a store.
   It takes only the role ``graphdeck`` with its password (scram-sha-256), generated once and
   kept in ``<dir>/db-password`` (``0600``, never printed); it listens on ``127.0.0.1`` and on a
   socket in a ``0700`` folder. How to connect (``psql`` with the password file) is printed;
2. ``server``: ``graphdeck serve --host H --port P`` with the store URL (password included) in
   ``GRAPHDECK_STORE``, never on a command line (``/proc/PID/cmdline`` is readable by every local
   user), the write token in ``GRAPHDECK_WRITE_TOKENS``, its upload chunks in ``<dir>/uploads``
   (``GRAPHDECK_DATA_DIR``, ``0700``), up when ``GET /api/health`` answers (the compose
   healthcheck);
3. ``demo`` (``--demo``): ``torchrun --nproc-per-node 2 -m graphdeck.demo --upload-url
   http://H:P`` with ``GRAPHDECK_TOKEN``: each rank captures locally and uploads over HTTP.

It then serves until interrupted (SIGINT/SIGTERM) or, with ``--exit-after-demo``, stops once the job
is done; either way it stops what it started, in reverse order. The cluster stays in ``<dir>/pg``
between sessions (as root, when the ``postgres`` user cannot reach it, it runs in a temp folder
seeded from there and is copied back at stop: :func:`_pg_folder`). A random write token (no
``--token`` / ``GRAPHDECK_TOKEN``) is printed with its ``export`` line. The server and the demo
ranks run with ``cwd=<dir>`` and ``PYTHONSAFEPATH``, so a ``graphdeck/`` folder where the stack
was started does not shadow the installed package. Lines starting ``[stack]`` report
progress; ``[stack] ready`` and ``[stack] demo job finished`` are what scripts wait for.

Same names as the compose file: ``GRAPHDECK_STORE``, ``GRAPHDECK_WRITE_TOKENS``,
``GRAPHDECK_TOKEN``, ``GRAPHDECK_DATA_DIR``.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from graphdeck.errors import StoreError

#: The file under ``--dir`` holding the PostgreSQL role's password (``0600``).
PASSWORD_FILE = "db-password"


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
    job's when it failed, else 0).

    Raises:
        UnsafeFolderError: ``opts.data_dir`` is another user's, writable by others, or reached
            through a folder or symlink another user controls (the message names it).
        StoreError: PostgreSQL did not start, its password file is not private, or the server
            did not become healthy.
    """
    from graphdeck.pg_local import LocalPostgres, _run_user, create_database
    from graphdeck.server.upload_area import private_dir
    from graphdeck.store.db import display_url

    # Ours, writable by no one else (it holds the password file and pg/, chowned to postgres);
    # new: 0700, or 0711 when root runs PostgreSQL as another user, who must traverse it.
    private_dir(opts.data_dir, mode=0o711 if _run_user() else 0o700, what="stack folder", tighten=False)
    token = opts.token or os.environ.get("GRAPHDECK_TOKEN")
    if not token:
        token = secrets.token_urlsafe(24)
        _say(opts, f"write token (random, this session only): {token}  -- for uploads from elsewhere: "
                   f"export GRAPHDECK_TOKEN={token}; pass --token or set GRAPHDECK_TOKEN to keep one")
    pg = server = job = kept = None
    stopping = []

    def on_signal(signum, _frame):
        stopping.append(signum)
        raise KeyboardInterrupt

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    code = 0
    try:
        store = opts.store
        if store is None:
            pg_dir, kept = _pg_folder(opts.data_dir)
            if kept is not None:
                _say(opts, f"db: running as root and the 'postgres' user cannot reach {opts.data_dir}: the cluster "
                           f"runs in {pg_dir} and is copied back to {kept} when the stack stops (a killed stack "
                           "loses this session's runs; a --dir the postgres user can reach avoids the copy)")
            password_file = opts.data_dir / PASSWORD_FILE
            pg = LocalPostgres(pg_dir, port=opts.pg_port, fast=False, password_file=password_file).start()
            store = pg.url_for("graphdeck") if _has_db(pg.url, "graphdeck") else create_database(pg.url, "graphdeck")
            _say(opts, f"db: PostgreSQL at {display_url(store)} (data in {kept or pg.data_dir}, kept after a stop; "
                       f"role graphdeck only, password in {password_file})")
            _say(opts, f"db: connect with: PGPASSWORD=\"$(cat {password_file})\" psql -h 127.0.0.1 -p {pg.port} "
                       f"-U graphdeck graphdeck  (or -h {pg.data_dir}: the socket in {pg.data_dir})")
        # PYTHONSAFEPATH and a cwd of our own: a 'graphdeck/' folder where the stack was started
        # cannot shadow the installed package in the server or the demo ranks. The store URL (with
        # its password) goes in the environment: a command line is readable by every local user.
        env = dict(os.environ, GRAPHDECK_STORE=str(store), GRAPHDECK_WRITE_TOKENS=token,
                   GRAPHDECK_DATA_DIR=str(opts.data_dir / "uploads"), PYTHONSAFEPATH="1")
        server = subprocess.Popen([sys.executable, "-P", "-m", "graphdeck.cli", "serve", "--host", opts.host,
                                   "--port", str(opts.port)], env=env, cwd=opts.data_dir)
        base = f"http://{opts.host}:{opts.port}"
        wait_healthy(f"{base}/api/health", proc=server)
        _say(opts, f"server: {base}/ (store {display_url(store)}) ready")
        if opts.demo:
            job_env = dict(os.environ, GRAPHDECK_TOKEN=token, OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1",
                           PYTHONSAFEPATH="1")
            cmd = [sys.executable, "-P", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   "-m", "graphdeck.demo", "--upload-url", base, "--run-name", opts.demo_run,
                   "--backend", opts.demo_backend, "--steps", str(opts.demo_steps), "--layers", str(opts.demo_layers)]
            _say(opts, f"demo: {' '.join(cmd[4:])}")
            job = subprocess.Popen(cmd, env=job_env, cwd=opts.data_dir)
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
            pg.stop(remove=False)
            if kept is not None:
                _copy_back(pg.data_dir, kept)
                _say(opts, f"db: cluster copied back to {kept}")
                shutil.rmtree(pg.data_dir, ignore_errors=True)
        for s, handler in old.items():
            signal.signal(s, handler)
        _say(opts, "stopped")


def _pg_folder(data_dir: Path) -> tuple[Path, Path | None]:
    """``(folder PostgreSQL runs in, folder its cluster is copied back to at stop or None)``.

    ``data_dir/pg`` itself, unless we are root and the user PostgreSQL runs as (``initdb``
    refuses root) cannot reach it (e.g. under ``/root``, ``0700``): then a temp folder, seeded
    from ``data_dir/pg`` (ownership given to that user) and copied back when the stack stops.
    """
    import pwd
    import tempfile

    from graphdeck.pg_local import _run_user

    pg_dir = data_dir / "pg"
    user = _run_user()
    if user is None:
        return pg_dir, None
    pg_dir.mkdir(parents=True, exist_ok=True)
    uid = pwd.getpwnam(user).pw_uid
    os.chown(pg_dir, uid, -1)
    pg_dir.chmod(0o700)
    reach = subprocess.run(["runuser", "-u", user, "--", "test", "-w", str(pg_dir), "-a", "-x", str(pg_dir)],
                           capture_output=True)
    if reach.returncode == 0:
        return pg_dir, None
    tmp = Path(tempfile.mkdtemp(prefix="graphdeck-stack-pg-"))
    if (pg_dir / "data" / "PG_VERSION").exists():
        shutil.copytree(pg_dir, tmp, dirs_exist_ok=True, symlinks=True)
        for root, dirs, files in os.walk(tmp):
            for name in (*dirs, *files):
                os.lchown(os.path.join(root, name), uid, -1)
    return tmp, pg_dir


def _copy_back(src: Path, dest: Path) -> None:
    """Replace ``dest`` by a copy of the stopped cluster folder ``src`` (via a sibling, renamed)."""
    staging = dest.with_name(dest.name + ".new")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(src, staging, symlinks=True)
    old = dest.with_name(dest.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        os.replace(dest, old)
    os.replace(staging, dest)
    shutil.rmtree(old, ignore_errors=True)


def _has_db(server_url: str, name: str) -> bool:
    from sqlalchemy import create_engine, text

    engine = create_engine(server_url)
    try:
        with engine.connect() as conn:
            return conn.execute(text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}).scalar() is not None
    finally:
        engine.dispose()
