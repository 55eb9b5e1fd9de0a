"""A private PostgreSQL server in a folder, from the distribution's binaries (no Docker, no service).

Used by ``graphdeck stack`` (the compose services without Docker) and by the tests' ``pg_url``
fixture. It runs ``initdb`` and ``pg_ctl`` from Debian's ``postgresql`` package
(``/usr/lib/postgresql/<major>/bin``, or ``$GRAPHDECK_PG_BIN``, or whatever ``initdb`` is on
``PATH``). ``initdb`` refuses to run as root, so under root the server runs as the ``postgres``
user when it exists (the Debian package creates it), else ``nobody``; its folder is then created
under the system temp dir (a pytest ``tmp_path`` is ``0700`` root and unreadable to that user).

The server listens on ``127.0.0.1:<port>`` and on a Unix socket in its own folder (``0700``,
so only its owner, and root, reach the socket). It takes one role, the superuser ``graphdeck``,
with a password (``scram-sha-256``): ``pg_hba.conf`` is rewritten at every start with those two
lines and nothing else (no ``trust``, no other role), so another local user cannot connect,
let alone run ``COPY … TO PROGRAM``. The password is generated once and kept in a ``0600`` file
(``<folder>/password`` unless ``password_file`` names another); a cluster made without one (an
older graphdeck's ``trust`` cluster, or a lost password file) is given a new one before it
listens (single-user mode, no connection). It is for one machine's tests and demos; a shared
deployment should use a managed PostgreSQL, or the compose file's service.

When no ``postgres`` user exists, root runs the server as ``nobody``, and every process running
as ``nobody`` can then read the cluster's files: install Debian's package, which creates
``postgres``.

    >>> pg = LocalPostgres().start()          # doctest: +SKIP
    >>> pg.url                                 # doctest: +SKIP
    'postgresql+psycopg://graphdeck:Xq…@127.0.0.1:54873/postgres'
    >>> pg.create_database("t1")               # doctest: +SKIP
    'postgresql+psycopg://graphdeck:Xq…@127.0.0.1:54873/t1'
    >>> pg.stop()                              # doctest: +SKIP
"""

from __future__ import annotations

import glob
import os
import pwd
import re
import secrets
import shutil
import socket
import stat
import subprocess
import tempfile
from pathlib import Path

from graphdeck.errors import StoreError

SUPERUSER = "graphdeck"
#: What a generated password looks like (``secrets.token_urlsafe``): safe in a URL and in SQL.
PASSWORD_RE = re.compile(r"[A-Za-z0-9_-]{24,128}")
#: The whole of ``pg_hba.conf``: the one role, with its password, over the socket and loopback.
PG_HBA = f"""# Written by graphdeck.pg_local at every start; edits are lost.
# One role ({SUPERUSER}) with its password; no other role, no trust, no peer.
local   all   {SUPERUSER}                  scram-sha-256
host    all   {SUPERUSER}   127.0.0.1/32   scram-sha-256
local   all   all                          reject
host    all   all           0.0.0.0/0      reject
host    all   all           ::/0           reject
"""


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


def write_secret(path: Path, text: str, *, uid: int = -1) -> None:
    """Create ``path`` holding ``text``: ``0600``, never through a symlink, never over an
    existing file (``O_EXCL``); owned by ``uid`` when given.

    Raises:
        FileExistsError: ``path`` exists (a symlink included).
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        if uid != -1:
            os.fchown(fd, uid, -1)
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def read_password(path: Path) -> str:
    """The password kept in ``path``, once its file is checked private.

    Raises:
        StoreError: ``path`` is a symlink, not a regular file, owned by another user, readable or
            writable by group or others, or does not hold a generated password (the message names
            the file and what to do).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise StoreError(f"cannot open the PostgreSQL password file {path}: {exc.strerror} "
                         "(a symbolic link is refused)") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise StoreError(f"the PostgreSQL password file {path} must be a regular file owned by uid "
                             f"{os.geteuid()} with mode 0600 (it is uid {st.st_uid}, mode "
                             f"{oct(stat.S_IMODE(st.st_mode))}); remove it and a new password is set at the next start")
        text = os.read(fd, 4096).decode(errors="replace").strip()
    finally:
        os.close(fd)
    if not PASSWORD_RE.fullmatch(text):
        raise StoreError(f"the PostgreSQL password file {path} does not hold a generated password; "
                         "remove it and a new password is set at the next start")
    return text


class LocalPostgres:
    """One PostgreSQL server in ``data_dir`` (a fresh temp folder by default), on ``port``.

    ``fast=True`` turns off fsync and synchronous commit: right for tests, wrong for data you
    keep. ``password_file`` is where the role's password is kept (default
    ``<data_dir>/password``). :meth:`start` raises :class:`~graphdeck.errors.StoreError` when
    the binaries are missing, the password file is not private, or the server does not start
    (its log's tail is in the message).
    """

    def __init__(self, data_dir: str | os.PathLike | None = None, *, port: int | None = None,
                 fast: bool = True, bin_dir: str | os.PathLike | None = None,
                 password_file: str | os.PathLike | None = None):
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
        self.password_file = Path(password_file) if password_file else self.data_dir / "password"
        self._password: str | None = None

    @property
    def password(self) -> str:
        """The role's password (from :attr:`password_file`). Raises :class:`StoreError` when
        there is none yet (before the first :meth:`start`) or the file is not private."""
        if self._password is None:
            if not os.path.lexists(self.password_file):
                raise StoreError(f"no PostgreSQL password yet: {self.password_file} is made by the first start")
            self._password = read_password(self.password_file)
        return self._password

    @property
    def url(self) -> str:
        return self.url_for("postgres")

    def url_for(self, database: str) -> str:
        """The SQLAlchemy URL of ``database`` over TCP, with the role's password in it."""
        return f"postgresql+psycopg://{SUPERUSER}:{self.password}@127.0.0.1:{self.port}/{database}"

    def _cmd(self, *args: str) -> list[str]:
        if self.user is None:
            return list(args)
        return ["runuser", "-u", self.user, "--", *args]

    def _run(self, *args: str, timeout_s: float = 120, stdin: str | None = None) -> str:
        proc = subprocess.run(self._cmd(*args), capture_output=True, text=True, timeout=timeout_s,
                              cwd=self.data_dir.parent, input=stdin)
        if proc.returncode != 0:
            log = self.data_dir / "server.log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise StoreError(f"{Path(args[0]).name} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}\n{tail}")
        return proc.stdout + proc.stderr

    def _uid(self) -> int:
        return pwd.getpwnam(self.user).pw_uid if self.user is not None else -1

    def start(self) -> "LocalPostgres":
        """initdb (when the folder holds no cluster yet), make sure the role has its password and
        ``pg_hba.conf`` takes nothing else, and start; returns ``self``.

        Raises:
            StoreError: the folder is another user's or a symlink, initdb, the password reset or
                ``pg_ctl start`` failed, or the password file is not private (:func:`read_password`).
        """
        pgdata = self.data_dir / "data"
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(self.data_dir)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid not in (os.geteuid(), self._uid()):
            raise StoreError(f"refusing the PostgreSQL folder {self.data_dir}: it is not a folder of uid "
                             f"{os.geteuid()} (or of the server's user), but uid {st.st_uid}'s or a symbolic link")
        if self.user is not None:
            os.chown(self.data_dir, self._uid(), -1)
        self.data_dir.chmod(0o700)  # the socket's folder: the owner (and root) only
        fresh = not (pgdata / "PG_VERSION").exists()
        if os.path.lexists(self.password_file):
            self._password = read_password(self.password_file)
            if fresh:
                self._initdb(pgdata)
        else:  # kept only once the cluster has it: a failure here leaves no password that does not open it
            self._password = secrets.token_urlsafe(32)
            self._initdb(pgdata) if fresh else self._set_password(pgdata)
            write_secret(self.password_file, self._password)
        self._write_hba(pgdata)
        opts = (f"-p {self.port} -k {self.data_dir} -c listen_addresses=127.0.0.1 -c max_connections=200 "
                "-c unix_socket_permissions=0700 -c password_encryption=scram-sha-256")
        if self.fast:
            opts += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        self._run(str(self.bin_dir / "pg_ctl"), "-D", str(pgdata), "-l", str(self.data_dir / "server.log"),
                  "-o", opts, "-w", "-t", "60", "start")
        self.started = True
        return self

    def _initdb(self, pgdata: Path) -> None:
        # initdb reads the password from a file the server's user can read: a private one-off.
        pwfile = self.data_dir / f".initdb-pw-{secrets.token_hex(8)}"
        write_secret(pwfile, self._password + "\n", uid=self._uid())
        try:
            args = [str(self.bin_dir / "initdb"), "-D", str(pgdata), "-U", SUPERUSER, "--auth=scram-sha-256",
                    f"--pwfile={pwfile}", "-E", "UTF8", "--no-locale"]
            if self.fast:
                args.append("--no-sync")
            self._run(*args)
        finally:
            pwfile.unlink(missing_ok=True)

    def _set_password(self, pgdata: Path) -> None:
        """Give the role the kept password with the server down (single-user mode: no connection,
        no authentication, nothing listening)."""
        out = self._run(str(self.bin_dir / "postgres"), "--single", "-D", str(pgdata), "-c",
                        "password_encryption=scram-sha-256", "postgres",
                        stdin=f"ALTER ROLE {SUPERUSER} WITH LOGIN PASSWORD '{self._password}';\n")
        if "ERROR" in out:
            raise StoreError(f"could not set the password of role {SUPERUSER} in {pgdata}: {out.strip()[-2000:]}")

    def _write_hba(self, pgdata: Path) -> None:
        """Replace ``pg_hba.conf`` by :data:`PG_HBA` (atomically, owned by the server's user)."""
        tmp = pgdata / f".pg_hba-{secrets.token_hex(8)}"
        write_secret(tmp, PG_HBA, uid=self._uid())
        os.replace(tmp, pgdata / "pg_hba.conf")

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
    ``python -m graphdeck.pg_local stop DIR`` stops it (``.ci/run`` uses both). The URL carries
    the role's password (kept in ``DIR/password``, ``0600``)."""
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
