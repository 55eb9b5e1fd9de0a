"""Small inputs fast (issue 26 item 4): what a command loads before it works, a new store made
without Alembic yet identical to an Alembic-stamped one, batched string interning, and running
``python -m graphdeck.cli`` from the repository root over a non-editable install (NOTE: [Running
from the repository root] in graphdeck/__init__.py). Timings are bench/RESULTS.md's, not asserted
here (a shared 2-core host); what is asserted is what the time was spent on."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from graphdeck.store import migrate
from graphdeck.store.db import Interner, open_engine, store_url
from graphdeck.store.schema import SCHEMA_VERSION, Base, InternedString
from tests.conftest import REPO, shared_path

HEAVY = ("sqlalchemy", "alembic", "numpy", "torch", "pandas", "fastapi", "tqdm")
#: Strips setuptools' editable-install finder, so the interpreter sees what a machine with only a
#: non-editable install sees (the declared seam: this checkout is installed editable).
NO_EDITABLE = ("import runpy, sys\n"
               "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]\n"
               "sys.argv[0] = 'graphdeck'\n"
               "runpy.run_module('graphdeck.cli', run_name='__main__', alter_sys=True)\n")


def _loaded_after(code: str, cwd: Path | None = None) -> dict:
    """Run ``code`` in a fresh interpreter; which of :data:`HEAVY` it loaded, and what it printed."""
    probe = (f"{code}\nimport json, sys\n"
             f"print('@@' + json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("@@"))
    return {"modules": json.loads(line[2:]), "stdout": proc.stdout}


def _cli(*args: str) -> str:
    """Run the CLI in-process in a probe interpreter, without exiting it."""
    return (f"from graphdeck.cli import main\n"
            f"try:\n    main({list(args)!r})\nexcept SystemExit as exc:\n    assert exc.code in (0, None, 3), exc.code\n")


def test_cli_import_loads_no_heavy_library():
    got = _loaded_after("import graphdeck.cli")
    assert got["modules"] == [], f"graphdeck.cli imports {got['modules']} at start-up; import them in the command"


def test_new_and_current_stores_open_without_alembic(tmp_path):
    store = tmp_path / "new.db"
    got = _loaded_after(f"from graphdeck.store.db import open_engine\nopen_engine({str(store)!r})")
    assert "alembic" not in got["modules"], "creating a store loaded Alembic"
    for ro in (False, True):
        got = _loaded_after(f"from graphdeck.store.db import open_engine\n"
                            f"e = open_engine({str(store)!r}, read_only={ro})\nwith e.connect() as c: pass")
        assert "alembic" not in got["modules"], f"opening a current store (read_only={ro}) loaded Alembic"


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_store_made_without_alembic_is_the_one_alembic_makes(backend, tmp_path, request):
    """Revision, version row and tables as Alembic's migrations leave them; later opens and
    ``graphdeck db upgrade`` take it as current."""
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    url = str(tmp_path / "s.db") if backend == "sqlite" else request.getfixturevalue("pg_url")
    engine = open_engine(url)
    with engine.connect() as conn:
        assert migrate.current_revision(conn) == migrate.head_revision() == migrate.revision_of(SCHEMA_VERSION)
        assert conn.execute(text("SELECT value FROM store_meta WHERE key = 'schema_version'")).scalar() == \
            str(SCHEMA_VERSION)
        assert compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata) == []
        assert migrate.describe(conn)["state"] == "current"
    assert migrate.upgrade(engine) == migrate.head_revision()
    engine.dispose()
    if backend == "sqlite":  # Alembic's own stamp writes the same version table
        other = tmp_path / "alembic.db"
        raw = create_engine(store_url(other))
        migrate.upgrade(raw, "head")
        raw.dispose()
        ddl = "SELECT sql FROM sqlite_master WHERE name = 'alembic_version'"
        with create_engine(store_url(url)).connect() as a, create_engine(store_url(other)).connect() as b:
            assert a.execute(text(ddl)).scalar() == b.execute(text(ddl)).scalar()


def test_interner_many_matches_one_by_one(tmp_path):
    engine = open_engine(tmp_path / "i.db")
    with Session(engine) as s, s.begin():
        one = Interner(s)
        before = {v: one(v) for v in ("aten.mm.default", "a/b")}
        batch = Interner(s)
        values = ["a/b", None, "x" * 5000, "aten.mm.default", "new", "new"] + [f"s{i}" for i in range(1200)]
        batch.many(values)
        assert {v: batch(v) for v in before} == before  # existing strings keep their ids
        ids = {v: batch(v) for v in values if v is not None}
        assert len(set(ids.values())) == len(ids)
        stored = dict(s.execute(text("SELECT value, id FROM strings")).all())
        assert all(stored[v] == i for v, i in ids.items())
        assert s.query(InternedString).count() == len(stored) == len(ids)
    engine.dispose()


def test_import_and_check_ranks_load_neither_alembic_nor_numpy(tmp_path):
    folder = shared_path("data", "torch_trace", "generated_torch2.13_cpu_gloo", "ddp")
    store = str(tmp_path / "b.db")
    got = _loaded_after(_cli("import", str(folder), "--store", store, "--run", "b", "--no-progress"))
    assert not {"alembic", "numpy", "torch"} & set(got["modules"]), got["modules"]
    got = _loaded_after(_cli("check-ranks", store, "--run", "b"))
    assert not {"alembic", "numpy", "torch"} & set(got["modules"]), got["modules"]
    # A Kineto trace into a run without graphs: nothing to map (no numpy), no terminal (no tqdm).
    kineto = str(shared_path("data", "traces", "kineto", "tb_plugin_test_gpu_metrics_input.json"))
    ing = _loaded_after(_cli("ingest-trace", kineto, "--store", str(tmp_path / "k.db"), "--run", "k"))
    assert not {"alembic", "numpy", "torch", "tqdm"} & set(ing["modules"]), ing["modules"]
    assert "status ok" in ing["stdout"], ing["stdout"][-2000:]
    assert "ranks agree" in got["stdout"].lower() or "OK" in got["stdout"], got["stdout"][-2000:]
    # Run as the program, a read command ends without teardown (NOTE: [Quick exit]): same report, same code.
    for args in (["check-ranks", store, "--run", "b"], ["check-ranks", store, "--run", "b", "--format", "json"],
                 ["summary", "b", "--store", store], ["check-ranks", store, "--run", "nope"]):
        prog = subprocess.run([sys.executable, "-m", "graphdeck.cli", *args], capture_output=True, text=True,
                              timeout=300)
        inproc = subprocess.run([sys.executable, "-c", "import sys\nfrom click.testing import CliRunner\n"
                                 "from graphdeck.cli import main\n"
                                 f"r = CliRunner().invoke(main, {args!r})\n"
                                 "sys.stdout.write(r.stdout); sys.exit(r.exit_code)"],
                                capture_output=True, text=True, timeout=300)
        assert (prog.returncode, prog.stdout) == (inproc.returncode, inproc.stdout), (args, prog.stderr[-2000:])
        assert prog.returncode in (0, 1, 2, 3) and "Traceback" not in prog.stderr, prog.stderr[-2000:]


@pytest.mark.slow
def test_cli_from_repo_root_over_a_non_editable_install(tmp_path):
    """``pip install --target`` (not editable) of this checkout, then the CLI run in the
    repository root, whose ``graphdeck/`` folder comes first on ``sys.path``."""
    src, target = tmp_path / "src", tmp_path / "site"
    files = subprocess.run(["git", "ls-files", "pyproject.toml", "README.md", "graphdeck", "store", "capture",
                            "analysis", "server", "frontend", "replay"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()
    for f in files:
        if (REPO / f).exists():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, src / f)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(src)], check=True, capture_output=True, timeout=300)
    assert (target / "graphdeck" / "store" / "db.py").exists()
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}
    folder = shared_path("data", "torch_trace", "generated_torch2.13_cpu_gloo", "ddp")
    store = tmp_path / "b.db"
    for args in (["--help"], ["import", str(folder), "--store", str(store), "--run", "b", "--no-progress"],
                 ["check-ranks", str(store), "--run", "b"]):
        proc = subprocess.run([sys.executable, "-c", NO_EDITABLE, *args], cwd=REPO, capture_output=True, text=True,
                              env=env, timeout=300)
        assert proc.returncode == 0, (args, proc.stderr[-3000:])
        assert "ModuleNotFoundError" not in proc.stderr
    # Away from the root, the installed copy is the one imported, sub-packages and all.
    proc = subprocess.run([sys.executable, "-c", "import sys; sys.meta_path[:] = [f for f in sys.meta_path if "
                           "'editable' not in repr(f).lower()]\nimport graphdeck.store.db as d; print(d.__file__)"],
                          cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().startswith(str(target)), proc.stdout + proc.stderr
