"""The server and ``graphdeck stack`` on a shared host (issue 18, items 1 and 2), with a second
real local user: ``nobody`` (via ``setpriv``) is the attacker, we run as root (here and in CI).

1. The PostgreSQL of ``graphdeck.pg_local`` (the tests' and ``graphdeck stack``'s) takes only the
   ``graphdeck`` role with its password (scram-sha-256): ``nobody`` cannot connect over TCP or
   through the socket folder, so ``COPY … TO PROGRAM`` is out of reach; root's client with the
   password file works; an old ``trust`` cluster is hardened when started again.
2. The upload folder of a PostgreSQL store is private (0700, under the user's data dir by default);
   a folder another user made (with a symlink inside into a root-only folder) is refused with a
   message naming it, and nothing is written through the symlink.
"""

from __future__ import annotations

import hashlib
import os
import pwd
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import LiveServer, free_port, require

TOKEN = "shared-host-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]


def needs_root_and_nobody() -> None:
    if os.geteuid() != 0:
        pytest.skip("a second local user needs root here (setpriv --reuid=nobody)")
    require(shutil.which("setpriv") is not None, "setpriv (util-linux) is missing")
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        pytest.fail("no 'nobody' user on this host")


def nobody(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``args`` run as ``nobody`` with a bare environment (no PGPASSWORD, no readable ~/.pgpass)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/nonexistent", "LC_ALL": "C"}
    return subprocess.run([*AS_NOBODY, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd="/")


def psql(*args: str) -> list[str]:
    exe = shutil.which("psql")
    require(exe is not None, "psql is missing (Debian: postgresql-client)")
    return [exe, "-w", "-X", "-At", *args]  # -w: never prompt for a password


def assert_nobody_is_refused(port: int, socket_dir: Path, database: str, marker: Path) -> None:
    """Every way in as ``nobody``, without the password: TCP and socket, the server's role and
    the default ones; the ``COPY … TO PROGRAM`` shell command never runs."""
    sql = f"COPY (SELECT 1) TO PROGRAM 'touch {marker}'"
    for host in ("127.0.0.1", str(socket_dir)):
        for user in ("graphdeck", "postgres", "nobody"):
            proc = nobody(*psql("-h", host, "-p", str(port), "-U", user, "-d", database, "-c", sql))
            assert proc.returncode != 0, f"nobody connected as {user} via {host}: {proc.stdout}{proc.stderr}"
            assert re.search(r"password|Permission denied|pg_hba.conf rejects|no pg_hba.conf entry", proc.stderr), \
                proc.stderr
    assert not marker.exists(), "nobody ran a shell command as the server's user"


def root_psql_works(port: int, host: str, database: str, password: str) -> str:
    proc = subprocess.run(psql("-h", host, "-p", str(port), "-U", "graphdeck", "-d", database, "-c", "SELECT 41 + 1"),
                          capture_output=True, text=True, timeout=60, env=dict(os.environ, PGPASSWORD=password))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def is_private(path: Path, mode: int) -> bool:
    st = os.lstat(path)
    return stat.S_ISLNK(st.st_mode) is False and stat.S_IMODE(st.st_mode) == mode


@pytest.fixture
def marker():
    path = Path(tempfile.gettempdir()) / f"graphdeck-pwned-{os.getpid()}-{time.monotonic_ns()}"
    yield path
    path.unlink(missing_ok=True)


# ---------------------------------------------------------------------------- 1. PostgreSQL


def test_local_postgres_takes_only_its_role_with_the_password(marker):
    from graphdeck.pg_local import LocalPostgres, _run_user, find_pg_bin

    needs_root_and_nobody()
    require(find_pg_bin() is not None, "no PostgreSQL binaries (Debian package postgresql)")
    if _run_user() == "nobody":
        pytest.skip("no 'postgres' user: PostgreSQL itself would run as nobody")
    with LocalPostgres(fast=True) as pg:
        assert_nobody_is_refused(pg.port, pg.data_dir, "postgres", marker)
        password_file = pg.data_dir / "password"
        assert is_private(password_file, 0o600), oct(os.lstat(password_file).st_mode)
        password = password_file.read_text().strip()
        assert len(password) >= 24 and password in pg.url, "the URL carries the generated password"
        assert root_psql_works(pg.port, "127.0.0.1", "postgres", password) == "42"
        assert root_psql_works(pg.port, str(pg.data_dir), "postgres", password) == "42"
        from sqlalchemy import create_engine

        engine = create_engine(pg.url)
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT current_user").scalar() == "graphdeck"
        engine.dispose()
        wrong = subprocess.run(psql("-h", "127.0.0.1", "-p", str(pg.port), "-U", "graphdeck", "-c", "SELECT 1"),
                               capture_output=True, text=True, env=dict(os.environ, PGPASSWORD="wrong"))
        assert wrong.returncode != 0 and "password authentication failed" in wrong.stderr, wrong.stderr
        hba = (pg.data_dir / "data" / "pg_hba.conf").read_text()
        rules = [line.split() for line in hba.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        assert rules and not any("trust" in r for r in rules), hba
        assert all(r[-1] in ("scram-sha-256", "reject") for r in rules), hba
        assert stat.S_IMODE(os.stat(pg.data_dir).st_mode) == 0o700, "the socket folder is the owner's only"


def test_an_old_trust_cluster_is_hardened_when_started_again(tmp_path, marker):
    """A cluster made by an older graphdeck (``initdb --auth=trust``, no password): starting it
    sets a generated password and rewrites pg_hba.conf before it listens."""
    from graphdeck.pg_local import SUPERUSER, LocalPostgres, _run_user, find_pg_bin

    needs_root_and_nobody()
    require(find_pg_bin() is not None, "no PostgreSQL binaries (Debian package postgresql)")
    user = _run_user()
    if user == "nobody":
        pytest.skip("no 'postgres' user: PostgreSQL itself would run as nobody")
    folder = Path(tempfile.mkdtemp(prefix="graphdeck-oldpg-"))
    try:
        os.chown(folder, pwd.getpwnam(user).pw_uid, -1)
        subprocess.run(["runuser", "-u", user, "--", str(find_pg_bin() / "initdb"), "-D", str(folder / "data"),
                        "-U", SUPERUSER, "--auth=trust", "-E", "UTF8", "--no-locale", "--no-sync"],
                       check=True, capture_output=True, cwd="/")
        assert "trust" in (folder / "data" / "pg_hba.conf").read_text()
        pg = LocalPostgres(folder, fast=True)
        with pg:
            assert_nobody_is_refused(pg.port, pg.data_dir, "postgres", marker)
            assert root_psql_works(pg.port, "127.0.0.1", "postgres", (folder / "password").read_text().strip()) == "42"
        again = LocalPostgres(folder, fast=True)  # the kept password file opens it again
        with again:
            assert root_psql_works(again.port, "127.0.0.1", "postgres", (folder / "password").read_text().strip())
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_stack_postgres_refuses_other_users_and_prints_how_to_connect(tmp_path, marker):
    from graphdeck.pg_local import _run_user, find_pg_bin

    needs_root_and_nobody()
    require(find_pg_bin() is not None, "no PostgreSQL binaries (Debian package postgresql)")
    if _run_user() == "nobody":
        pytest.skip("no 'postgres' user: PostgreSQL itself would run as nobody")
    port, pg_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("GRAPHDECK_TOKEN", "GRAPHDECK_STORE")}
    proc = subprocess.Popen([sys.executable, "-m", "graphdeck.cli", "stack", "--dir", str(tmp_path / "st"), "--port",
                             str(port), "--pg-port", str(pg_port), "--no-demo"], env=dict(env, XDG_DATA_HOME=str(
                                 tmp_path / "xdg")), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, ready = [], threading.Event()

    def pump():
        for line in proc.stdout:
            lines.append(line)
            if "[stack] serving" in line:
                ready.set()
        ready.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        assert ready.wait(120) and proc.poll() is None, "".join(lines[-30:])
        log = "".join(lines)
        password_file = tmp_path / "st" / "db-password"
        assert is_private(password_file, 0o600), oct(os.lstat(password_file).st_mode)
        password = password_file.read_text().strip()
        assert password not in log, "the password is never printed"
        connect = next(line for line in lines if "psql" in line)
        assert str(password_file) in connect and f"-p {pg_port}" in connect, connect
        socket_dir = Path(re.search(r"socket in (\S+?)\)?$", connect.strip()).group(1))
        assert_nobody_is_refused(pg_port, socket_dir, "graphdeck", marker)
        assert root_psql_works(pg_port, "127.0.0.1", "graphdeck", password) == "42"
        assert root_psql_works(pg_port, str(socket_dir), "graphdeck", password) == "42"
        for pid in filter(str.isdigit, os.listdir("/proc")):  # /proc/PID/cmdline is world-readable
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            assert password.encode() not in cmdline, f"process {pid} has the password on its command line"
        assert httpx.get(f"http://127.0.0.1:{port}/api/runs", timeout=30).json() == []
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    reader.join(timeout=30)  # every line written is read before the last one is looked for
    assert "[stack] stopped" in "".join(lines), "".join(lines[-30:])


# ---------------------------------------------------------------------------- 2. upload folder


def legacy_upload_folder(store: str) -> Path:
    """The folder the server used for a URL store before: predictable, in the shared temp dir."""
    from sqlalchemy.engine import make_url

    u = make_url(store)
    key = repr((u.drivername, u.username, u.host, u.port, u.database, sorted(u.query.items())))
    return Path(tempfile.gettempdir()) / f"graphdeck-uploads-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def upload_id(data: bytes, run: str) -> str:
    from graphdeck.server.upload_area import UploadSpec

    return UploadSpec("trace", run, 0, len(data), hashlib.sha256(data).hexdigest(), 64 * 1024).upload_id()


@pytest.fixture
def planted(pg_url, tmp_path):
    """As ``nobody``: the predictable upload folder of ``pg_url`` (0777), and in it, under the
    id of the upload the test will make, a symlink to a root-only folder."""
    needs_root_and_nobody()
    data = b'{"traceEvents": []}\n'
    folder = legacy_upload_folder(pg_url)
    shutil.rmtree(folder, ignore_errors=True)
    secret = tmp_path / "root-only"
    secret.mkdir(mode=0o700)
    assert nobody("mkdir", "-m", "0777", str(folder)).returncode == 0
    link = folder / upload_id(data, "planted")
    assert nobody("ln", "-s", str(secret), str(link)).returncode == 0
    assert folder.stat().st_uid == pwd.getpwnam("nobody").pw_uid and link.is_symlink()
    yield folder, secret, data
    shutil.rmtree(folder, ignore_errors=True)


def send(url: str, data: bytes) -> httpx.Response:
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as c:
        spec = {"kind": "trace", "run": "planted", "rank": 0, "size_bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(), "chunk_bytes": 64 * 1024}
        r = c.post("/api/uploads", json=spec)
        if r.status_code >= 400:
            return r
        uid = r.json()["id"]
        put = c.put(f"/api/uploads/{uid}/chunks/0", content=data,
                    headers={"X-Chunk-Sha256": hashlib.sha256(data).hexdigest()})
        if put.status_code >= 400:
            return put
        return c.post(f"/api/uploads/{uid}/complete")


def test_postgres_store_uploads_go_to_a_private_folder_not_the_planted_one(pg_url, planted, tmp_path, monkeypatch):
    folder, secret, data = planted
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    with LiveServer(pg_url, write_tokens=(TOKEN,)) as srv:
        r = send(srv.url, data)
        assert r.status_code == 200, r.text
        assert r.json()["upload"]["state"] == "done", r.text
    assert list(secret.iterdir()) == [], "nothing was written through nobody's symlink"
    assert sorted(p.name for p in folder.iterdir()) == [upload_id(data, "planted")], "nobody's folder is untouched"
    home = tmp_path / "xdg" / "graphdeck"
    used = [p for p in home.rglob("*") if (p / "meta.json").exists()]
    assert len(used) == 1 and used[0].parent.parent == home / "uploads", used
    for p in (home, home / "uploads", used[0].parent, used[0]):
        assert is_private(p, 0o700), (p, oct(os.lstat(p).st_mode))
    assert is_private(used[0] / "meta.json", 0o600)


def test_a_data_dir_made_by_another_user_is_refused_naming_it(pg_url, planted, monkeypatch):
    folder, secret, data = planted
    with LiveServer(pg_url, write_tokens=(TOKEN,), data_dir=folder) as srv:
        r = send(srv.url, data)
    assert r.status_code == 403, r.text  # refused, not a 5xx a client retries
    message = r.json()["error"]
    assert str(folder) in message and "nobody" in message, message
    assert list(secret.iterdir()) == [], "nothing was written through nobody's symlink"


def test_upload_area_refuses_unsafe_folders_and_makes_private_ones(tmp_path):
    from graphdeck.server.upload_area import UnsafeFolderError, UploadArea, UploadSpec

    needs_root_and_nobody()
    area = UploadArea(tmp_path / "new" / "uploads")
    assert is_private(tmp_path / "new", 0o700) and is_private(tmp_path / "new" / "uploads", 0o700)
    data = b"x" * 10
    spec = UploadSpec("trace", "r", 0, len(data), hashlib.sha256(data).hexdigest(), 64 * 1024)
    uid = area.create(spec)["id"]
    for p in (area.root / uid, area.root / uid / "chunks"):
        assert is_private(p, 0o700), p
    assert is_private(area.root / uid / "meta.json", 0o600)

    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(UnsafeFolderError, match="symbolic link"):
        UploadArea(tmp_path / "link")
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(UnsafeFolderError, match=re.escape(str(open_dir))):
        UploadArea(open_dir)
    readable = tmp_path / "readable"
    readable.mkdir(mode=0o755)
    readable.chmod(0o755)
    UploadArea(readable)  # ours and writable by no one else: tightened, not refused
    assert is_private(readable, 0o700)

    shared = Path(tempfile.mkdtemp(prefix="graphdeck-shared-"))
    try:
        shared.chmod(0o1777)  # a sticky, world-writable folder, like /tmp
        theirs = shared / "theirs"
        assert nobody("mkdir", "-m", "0700", str(theirs)).returncode == 0
        with pytest.raises(UnsafeFolderError, match="owned by nobody"):
            UploadArea(theirs)
        with pytest.raises(UnsafeFolderError, match="owned by nobody"):
            UploadArea(theirs / "below")
        hop = shared / "hop"
        assert nobody("ln", "-s", str(tmp_path / "real"), str(hop)).returncode == 0
        with pytest.raises(UnsafeFolderError, match="symbolic link .*owned by nobody"):
            UploadArea(hop / "uploads")
        assert not (tmp_path / "real" / "uploads").exists(), "nothing made through nobody's symlink"
    finally:
        shutil.rmtree(shared, ignore_errors=True)
