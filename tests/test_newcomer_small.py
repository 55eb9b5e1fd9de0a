"""A newcomer's small faults (issue 36, item 4), each against the repository's demo store
(tests/data/demo_warm_bucket) through the real CLI:

* ``delete-run`` counted only the rows its DELETE matched, not those the same statement removed
  by ``ON DELETE CASCADE`` (a graph's child graphs): "2 graphs" for 20;
"""

from __future__ import annotations

import gzip
import re
import shutil
import sqlite3
import subprocess
import sys

import pytest

from tests.conftest import REPO

RUN = "demo"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("newcomer") / "demo.db"
    with gzip.open(REPO / "tests/data/demo_warm_bucket/demo.db.gz") as src, open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return path


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "graphdeck.cli", *args], capture_output=True, text=True, timeout=300)


def test_delete_run_counts_every_row_it_deleted(store, tmp_path):
    copy = tmp_path / "copy.db"
    shutil.copy(store, copy)
    with sqlite3.connect(copy) as c:
        before = {t: c.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in ("graphs", "nodes", "traces")}
    proc = cli("delete-run", str(copy), "--run", RUN)
    assert proc.returncode == 0, proc.stderr
    said = {t: int(n) for n, t in re.findall(r"(\d+) (\w+)", proc.stdout.split(": ", 1)[1])}
    assert before["graphs"] == 20 and said["graphs"] == 20, (before, proc.stdout)
    assert all(said[t] == n for t, n in before.items()), (before, said)
    with sqlite3.connect(copy) as c:
        assert c.execute("SELECT count(*) FROM graphs").fetchone()[0] == 0
