"""A private PostgreSQL server in a folder, from the distribution's binaries (no Docker, no service).

Used by ``graphdeck stack`` (the compose services without Docker) and by the tests' ``pg_url``
fixture. It runs ``initdb`` and ``pg_ctl`` from Debian's ``postgresql`` package
(``/usr/lib/postgresql/<major>/bin``, or ``$GRAPHDECK_PG_BIN``, or whatever ``initdb`` is on
``PATH``). ``initdb`` refuses to run as root, so under root the server runs as the ``postgres``
user when it exists (the Debian package creates it), else ``nobody``; its folder is then created
under the system temp dir (a pytest ``tmp_path`` is ``0700`` root and unreadable to that user).

The server listens on ``127.0.0.1:<port>`` and on a Unix socket in its own folder, with ``trust``
authentication for one superuser (``graphdeck``): it is for one machine's tests and demos, never
for a shared deployment (use a managed PostgreSQL, or the compose file's service, there).

    >>> pg = LocalPostgres().start()          # doctest: +SKIP
    >>> pg.url                                 # doctest: +SKIP
    'postgresql+psycopg://graphdeck@127.0.0.1:54873/postgres'
    >>> pg.create_database("t1")               # doctest: +SKIP
    'postgresql+psycopg://graphdeck@127.0.0.1:54873/t1'
    >>> pg.stop()                              # doctest: +SKIP
"""

from __future__ import annotations

import glob
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

from graphdeck.errors import StoreError

SUPERUSER = "graphdeck"


def find_pg_bin() -> Path | None:
    """The folder holding ``initdb``/``pg_ctl``: ``$GRAPHDECK_PG_BIN``, ``PATH``, or the newest
    ``/usr/lib/postgresql/<major>/bin``; ``None`` when PostgreSQL is not installed."""
    env = os.environ.get("GRAPHDECK_PG_BIN")
    if env and (Path(env) / "initdb").exists():
        return Path(env)
    on_path = shutil.which("initdb")
    if on_path:
        return Path(on_path).parent
    found = [Path(p) for p in glob.glob("/usr/lib/postgresql/*/bin") if (Path(p) / "initdb").exists()]
    if not found:
        return None
    return max(found, key=lambda p: int(re.sub(r"\D", "", p.parent.name) or 0))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_user() -> str | None:
    """The unprivileged user to run the server as when we are root; ``None`` when not root."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    raise StoreError("running as root and neither a 'postgres' nor a 'nobody' user exists to run PostgreSQL")


class LocalPostgres:
    """One PostgreSQL server in ``data_dir`` (a fresh temp folder by default), on ``port``.

    ``fast=True`` turns off fsync and synchronous commit: right for tests, wrong for data you
    keep. Raises :class:`~graphdeck.errors.StoreError` when the binaries are missing or the
    server does not start (its log's tail is in the message).
    """

    def __init__(self, data_dir: str | os.PathLike | None = None, *, port: int | None = None,
                 fast: bool = True, bin_dir: str | os.PathLike | None = None):
        found = Path(bin_dir) if bin_dir else find_pg_bin()
        if found is None:
            raise StoreError("PostgreSQL is not installed: no initdb found (Debian: apt-get install postgresql)")
        self.bin_dir = found
        self.user = _run_user()
        self._own_dir = data_dir is None
        if data_dir is None:
            data_dir = tempfile.mkdtemp(prefix="graphdeck-pg-")
        self.data_dir = Path(data_dir).resolve()
        self.port = port or _free_port()
        self.fast = fast
        self.started = False

    @property
    def url(self) -> str:
        return self.url_for("postgres")

    def url_for(self, database: str) -> str:
        return f"postgresql+psycopg://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def _cmd(self, *args: str) -> list[str]:
        if self.user is None:
            return list(args)
        return ["runuser", "-u", self.user, "--", *args]

    def _run(self, *args: str, timeout_s: float = 120) -> None:
        proc = subprocess.run(self._cmd(*args), capture_output=True, text=True, timeout=timeout_s,
                              cwd=self.data_dir.parent)
        if proc.returncode != 0:
            log = self.data_dir / "server.log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise StoreError(f"{Path(args[0]).name} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}\n{tail}")

    def start(self) -> "LocalPostgres":
        """initdb (when the folder holds no cluster yet) and start; returns ``self``."""
        pgdata = self.data_dir / "data"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.user is not None:
            uid = pwd.getpwnam(self.user).pw_uid
            os.chown(self.data_dir, uid, -1)
            self.data_dir.chmod(0o700)
        if not (pgdata / "PG_VERSION").exists():
            args = [str(self.bin_dir / "initdb"), "-D", str(pgdata), "-U", SUPERUSER, "--auth=trust",
                    "-E", "UTF8", "--no-locale"]
            if self.fast:
                args.append("--no-sync")
            self._run(*args)
        opts = f"-p {self.port} -k {self.data_dir} -c listen_addresses=127.0.0.1 -c max_connections=200"
        if self.fast:
            opts += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        self._run(str(self.bin_dir / "pg_ctl"), "-D", str(pgdata), "-l", str(self.data_dir / "server.log"),
                  "-o", opts, "-w", "-t", "60", "start")
        self.started = True
        return self

    def stop(self, *, remove: bool | None = None) -> None:
        """Stop the server (fast shutdown); remove its folder when we created it (or ``remove``)."""
        if self.started:
            try:
                self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir / "data"), "-m", "fast",
                          "-w", "stop", timeout_s=60)
            finally:
                self.started = False
        if remove if remove is not None else self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def create_database(self, name: str) -> str:
        """``CREATE DATABASE name``; returns its SQLAlchemy URL."""
        return create_database(self.url, name)

    def __enter__(self) -> "LocalPostgres":
        return self.start() if not self.started else self

    def __exit__(self, *exc) -> None:
        self.stop()


def create_database(server_url: str, name: str) -> str:
    """Create database ``name`` (letters, digits, ``_``) on the server of ``server_url``; returns
    the URL of the new database. Used to give each test its own empty database."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,62}", name):
        raise ValueError(f"database name {name!r}: letters, digits and _ only")
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url

    url = make_url(server_url)
    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}"')
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    finally:
        engine.dispose()
    return url.set(database=name).render_as_string(hide_password=False)


def drop_database(server_url: str, name: str) -> None:
    """``DROP DATABASE name WITH (FORCE)`` (ends its open connections first)."""
    from sqlalchemy import create_engine

    engine = create_engine(server_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        engine.dispose()


def main(argv: list[str] | None = None) -> None:
    """``python -m graphdeck.pg_local start DIR [PORT]`` prints the server's URL;
    ``python -m graphdeck.pg_local stop DIR`` stops it (``.ci/run`` uses both)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2 or args[0] not in ("start", "stop"):
        raise SystemExit("usage: python -m graphdeck.pg_local start DIR [PORT] | stop DIR")
    pg = LocalPostgres(args[1], port=int(args[2]) if len(args) > 2 else None, fast=True)
    if args[0] == "start":
        print(pg.start().url)
    else:
        pg.started = True
        pg.stop(remove=False)


if __name__ == "__main__":
    main()
