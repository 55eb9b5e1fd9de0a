"""Shared fixtures: real stores made by real captures, real inputs from ../shared.

``captured_store`` is a SQLite file holding run ``tiny``: a 1-process capture of a small GPT-2
(transformers, random weights, fixed seed) compiled with ``aot_eager`` through the graphdeck
backend, trained for 3 steps with a profiled window, so it has Dynamo, AOT forward and AOT
backward graphs, a parameter list, compile records and a Kineto trace of rank 0.
"""

from __future__ import annotations

import os
import shutil
import socket
import sqlite3
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
IN_CI = os.environ.get("CI") == "true"


def shared_path(*parts: str) -> Path:
    """A file under ../shared; skips the test outside CI when it is missing, fails under CI."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        if IN_CI:
            pytest.fail(f"{path} is missing under CI=true: ../shared must be beside the clone")
        pytest.skip(f"{path} not present (../shared is only guaranteed in CI)")
    return path


TINY_SCRIPT = r"""
import sys, torch
from graphdeck.capture import Agent
from graphdeck.demo import build_model
store = sys.argv[1]
torch.manual_seed(0)
agent = Agent(store=store, run="tiny")
model = agent.watch(build_model(n_layer=1, n_embd=32, vocab_size=256, n_positions=32))
compiled = torch.compile(model, backend=agent.backend("aot_eager"))
gen = torch.Generator().manual_seed(0)
with agent.profile(wait_steps=1, warmup_steps=0, active_steps=1) as prof:
    for step in range(3):
        tokens = torch.randint(0, 256, (2, 16), generator=gen)
        compiled(input_ids=tokens, labels=tokens).loss.backward()
        prof.step()
agent.close()
"""


def run_python(code: str, *args: str, env: dict | None = None, timeout_s: int = 600) -> subprocess.CompletedProcess:
    """Run ``code`` as ``python -c code args...`` in an interpreter of its own (a clean torch/Dynamo
    state: forked from a zygote that has only imported torch, :func:`tests.launch.start_python`);
    raise with its output on failure, or after ``timeout_s`` s (the job killed). One intra-op
    thread (``OMP_NUM_THREADS=1``, as torchrun gives its ranks) unless ``env`` says otherwise:
    libraries start no thread pool at import, so the zygote may fork."""
    from tests.launch import run_python_job

    proc = run_python_job(["-c", code, *args], env=dict(os.environ, **{"OMP_NUM_THREADS": "1", **(env or {})}),
                          timeout=timeout_s)
    if proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


@pytest.fixture(scope="session")
def captured_store(tmp_path_factory) -> Path:
    """This worker's own copy of run ``tiny``; TINY_SCRIPT runs once per session (:func:`made_once`)."""
    made = made_once(tmp_path_factory, "tiny", lambda d: run_python(TINY_SCRIPT, str(d / "tiny.db")))
    return copy_store(made / "tiny.db", tmp_path_factory.mktemp("captured") / "tiny.db")


DEMO_RUN = "demo"


def run_demo(store: Path, run: str, *, backend: str, steps: int, layers: int, profile: bool = True,
             env: dict | None = None) -> None:
    """The main job (``graphdeck.demo``: GPT-2 under DDP ``bucket_cap_mb=1`` + torch.compile through
    the capture agent) on 2 gloo ranks started as torchrun would (:func:`tests.launch.run_ranks`)."""
    from tests.launch import run_ranks

    argv = ["-m", "graphdeck.demo", "--store", str(store), "--run-name", run, "--backend", backend,
            "--steps", str(steps), "--layers", str(layers)] + ([] if profile else ["--no-profile"])
    full_env = dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1", KINETO_LOG_LEVEL="6",
                    **(env or {}))
    proc = run_ranks(argv, 2, env=full_env, timeout=900)
    assert proc.returncode == 0, f"the demo job failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


@pytest.fixture(scope="module")
def demo_store(tmp_path_factory) -> Path:
    """This module's own copy of run ``demo``: the main job, ``aot_eager``, 2 GPT-2 blocks, 4 steps
    (2 profiled), 2 gloo ranks; run once per session (:func:`made_once`) for test_main_job's
    capture checks and test_replay_runs' replays."""
    made = made_once(tmp_path_factory, "demo", lambda d: run_demo(d / "demo.db", DEMO_RUN, backend="aot_eager",
                                                                   steps=4, layers=2))
    return copy_store(made / "demo.db", tmp_path_factory.mktemp("demo") / "demo.db")


def made_once(tmp_path_factory, name: str, make: Callable[[Path], object]) -> Path:
    """The folder ``name``, filled by ``make(folder)`` once per test session — once across all of
    pytest-xdist's workers too (a file lock in the workers' shared temporary root; the other
    workers wait for it, then reuse it). For an expensive job whose output several test modules
    read: each module takes its own copy (:func:`copy_store`), so none sees another's writes.
    A ``make`` that raises leaves nothing behind: the next user runs it again (and fails the same)."""
    from filelock import FileLock  # a dependency of torch

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's root, shared by the workers' popen-gwN folders
    folder = root / f"made-once-{name}"
    with FileLock(str(folder) + ".lock"):
        done = folder / ".done"
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            make(folder)
            done.touch()
    return folder


def copy_store(src: Path, dst: Path) -> Path:
    """A consistent copy of SQLite store ``src`` at ``dst`` (SQLite's backup API: WAL included)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(src) as a, sqlite3.connect(dst) as b:
        a.backup(b)
    a.close()
    b.close()
    return dst


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: Debian's Chromium, the only browser Playwright can run here (`playwright install` cannot download).
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


def require(ok: bool, why: str) -> None:
    """Skip when a prerequisite is missing, but fail under CI=true, where it must be there."""
    if ok:
        return
    if IN_CI:
        pytest.fail(f"{why} (CI=true, so this is a failure, not a skip)")
    pytest.skip(why)


@pytest.fixture(scope="module")
def browser():
    """Chromium through Playwright's sync API, one per test module (a module's Playwright session
    ends before the next module may start its own)."""
    require(CHROMIUM.exists(), f"{CHROMIUM} is missing (Debian package chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield b
        b.close()


class LiveServer:
    """The real app served by uvicorn in a thread on a free loopback port."""

    def __init__(self, store: Path, **settings):
        import uvicorn

        from graphdeck.server.app import create_app
        from graphdeck.server.settings import Settings

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = create_app(Settings(store=store, **settings))
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start within 20 s")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


# ---------------------------------------------------------------------------- PostgreSQL

#: Set by .ci/run (a server started from Debian's postgresql package): a superuser URL such as
#: ``postgresql+psycopg://graphdeck@127.0.0.1:5433/postgres``. Unset, the tests start a private
#: server from the installed binaries; with neither, Postgres tests skip (never under CI=true).
PG_URL_ENV = "GRAPHDECK_TEST_PG_URL"


@pytest.fixture(scope="session")
def pg_server() -> str:
    """A PostgreSQL server's superuser URL for the whole session (see ``PG_URL_ENV``)."""
    import importlib.util

    require(importlib.util.find_spec("psycopg") is not None, "psycopg is not installed (extra graphdeck[postgres])")
    url = os.environ.get(PG_URL_ENV)
    if url:
        yield url
        return
    from graphdeck.pg_local import LocalPostgres, find_pg_bin

    require(find_pg_bin() is not None, f"no PostgreSQL: set {PG_URL_ENV} or install Debian's postgresql")
    pg = LocalPostgres(fast=True).start()
    try:
        yield pg.url
    finally:
        pg.stop()


_pg_counter = iter(range(1_000_000))


@pytest.fixture
def pg_url(pg_server, request) -> str:
    """The URL of a fresh, empty PostgreSQL database for this test (dropped afterwards), for
    ``open_engine(pg_url)`` / ``Agent(store=pg_url)`` / ``Settings(store=pg_url)``."""
    from graphdeck.pg_local import create_database, drop_database

    name = f"t{os.getpid()}_{next(_pg_counter)}"
    url = create_database(pg_server, name)
    yield url
    try:
        from sqlalchemy.orm import close_all_sessions

        close_all_sessions()
        drop_database(pg_server, name)
    except Exception:  # noqa: BLE001 - a leftover test database is harmless
        pass


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request, tmp_path) -> str:
    """One store per backend: a SQLite file in ``tmp_path``, then a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return str(tmp_path / "store.db")
    return request.getfixturevalue("pg_url")


# ---------------------------------------------------------------------------- scheduling

#: The test files that take longest (bench/RESULTS.md, "The test suite"), longest first. With
#: ``--dist loadfile`` pytest-xdist hands files to the workers one at a time in collection order
#: (``--no-loadscope-reorder`` in pyproject: its default order, most tests first, put these
#: few-test, long files last, where one worker ran them alone while the other had finished). The
#: other files follow, those with a slow-marked test first. Only the order of files changes, never
#: the order of the tests inside a file.
LONGEST_FILES = (
    "test_torchtitan.py", "test_capture_matrix.py", "test_main_job.py", "test_replay_runs.py",
    "test_rank_timing.py", "test_cpu_trace_map.py", "test_frameworks.py", "test_compose.py",
    "test_gradients_parity.py", "test_gradients_ddp.py", "test_executor_config.py", "test_time_verdicts.py",
    "test_mesh_checks.py", "test_live_watch.py", "test_ranks.py", "test_gradients_evidence.py",
)


# ---------------------------------------------------------------------------- CPU profile

#: ``GRAPHDECK_TEST_CPU_LOG=path``: each test appends one tab-separated line to ``path`` (several
#: xdist workers append to the same file): the worker, the test id, its wall s, the test process's
#: own user and system CPU s, its children's user and system CPU s (``getrusage`` SELF and
#: CHILDREN deltas over setup + call + teardown, so a module or session fixture counts in the test
#: that first needs it; plus the jobs its zygotes forked, tests/launch.py ``FORKED_CPU``; a
#: zygote's own start-up counts when it is closed, at the session's end), the processes the test
#: process started (``subprocess.Popen``, and ``forked:`` jobs) and the first few of their command
#: lines. Off when unset.
CPU_LOG_ENV = "GRAPHDECK_TEST_CPU_LOG"


class _PopenCounter:
    """Counts the processes this process starts (``subprocess.Popen._execute_child``)."""

    def __init__(self) -> None:
        self.argvs: list[str] = []
        original = subprocess.Popen._execute_child

        def counted(popen, args, *rest, **kwargs):
            words = [args] if isinstance(args, (str, bytes)) else list(args)
            self.argvs.append(" ".join(str(w) for w in words[:4])[:120])
            return original(popen, args, *rest, **kwargs)

        subprocess.Popen._execute_child = counted


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = os.environ.get(CPU_LOG_ENV)
    if not path:
        yield
        return
    import resource

    from tests import launch

    counter = item.config.__dict__.setdefault("_graphdeck_popen", _PopenCounter())
    start_argv, start_forked, forked0 = len(counter.argvs), len(launch.FORKED), list(launch.FORKED_CPU)
    own0, kids0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    yield
    wall = time.monotonic() - t0
    own1, kids1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    started = counter.argvs[start_argv:] + ["forked: " + a for a in launch.FORKED[start_forked:]]
    row = [os.environ.get("PYTEST_XDIST_WORKER", "-"), item.nodeid, f"{wall:.2f}",
           f"{own1.ru_utime - own0.ru_utime:.2f}", f"{own1.ru_stime - own0.ru_stime:.2f}",
           f"{kids1.ru_utime - kids0.ru_utime + launch.FORKED_CPU[0] - forked0[0]:.2f}",
           f"{kids1.ru_stime - kids0.ru_stime + launch.FORKED_CPU[1] - forked0[1]:.2f}",
           str(len(started)), " | ".join(started[:6]).replace("\t", " ").replace("\n", " ")]
    with open(path, "a") as f:
        f.write("\t".join(row) + "\n")


def pytest_sessionfinish(session, exitstatus) -> None:
    """The zygotes (tests/launch.py) end with the session, waited for: their CPU time counts in
    the session's (``/usr/bin/time``), and none outlives it."""
    from tests.launch import close_zygotes

    close_zygotes()


def pytest_collection_modifyitems(config, items) -> None:
    longest = {name: i for i, name in enumerate(LONGEST_FILES)}
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}

    def file_key(path: Path) -> tuple:
        if path.name in longest:
            return (0, longest[path.name])
        return (1, 0 if path in slow_files else 1)

    items.sort(key=lambda item: file_key(item.path))  # stable: each file's own order is kept
