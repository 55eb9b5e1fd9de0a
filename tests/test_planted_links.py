"""A symbolic link planted beside a store (issue 36, item 7): the upload folder ``<store>.uploads``
or SQLite's ``<store>-wal`` / ``-shm`` / ``-journal`` as a link is refused with a message naming
it, as a 403 (the server) and exit 2 (the CLI); ``graphdeck upload`` stops at once instead of
retrying a 500 ten times, and nothing is written through the link.

Real parts: SQLite stores in tmp dirs, the app served by uvicorn (LiveServer), the real CLI in
subprocesses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from graphdeck.store.db import open_engine
from tests.conftest import LiveServer

TRACE = {"traceEvents": [{"ph": "X", "name": "aten::mm", "ts": 1, "dur": 2, "pid": 1, "tid": 1}]}


def cli(*args: str, timeout_s: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "graphdeck.cli", *args], capture_output=True, text=True,
                          timeout=timeout_s)


def test_a_linked_upload_folder_is_refused_once_not_retried(tmp_path):
    store = tmp_path / "s.db"
    open_engine(store).dispose()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "s.db.uploads").symlink_to(elsewhere)
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps(TRACE))
    with LiveServer(store) as srv:
        r = httpx.post(f"{srv.url}/api/uploads", headers={"X-Graphdeck-Client": "1"}, timeout=60,
                       json={"kind": "trace", "run": "x", "rank": 0, "size_bytes": 10, "sha256": "0" * 64})
        assert r.status_code == 403 and "s.db.uploads" in r.json()["error"] and "symbolic link" in r.json()["error"], r.text
        try:
            proc = cli("upload", str(trace), "--url", srv.url, "--run", "x", "--rank", "0", timeout_s=60)
        except subprocess.TimeoutExpired:
            pytest.fail("graphdeck upload kept retrying a refusal that cannot change")
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "s.db.uploads" in proc.stderr and "symbolic link" in proc.stderr, proc.stderr
    assert "retry" not in proc.stderr, proc.stderr
    assert list(elsewhere.iterdir()) == [], "nothing was written through the link"


@pytest.mark.parametrize("sidecar", ["-wal", "-shm", "-journal"])
def test_a_linked_sqlite_sidecar_is_named_not_called_not_a_store(tmp_path, sidecar):
    store = tmp_path / "s.db"
    open_engine(store).dispose()
    target = tmp_path / "target"
    target.write_bytes(b"")
    link = tmp_path / f"s.db{sidecar}"
    link.symlink_to(target)
    for args in (["summary", "x", "--store", str(store)], ["delete-run", str(store), "--run", "x"]):
        proc = cli(*args)
        assert proc.returncode == 2, (args, proc.returncode, proc.stderr[-2000:])
        assert str(link) in proc.stderr and "symbolic link" in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr and "not a graphdeck store" not in proc.stderr, proc.stderr
    assert target.read_bytes() == b"", "nothing was written through the link"
    os.unlink(link)
    assert cli("delete-run", str(store), "--run", "x").returncode == 2  # the store itself is fine: no run x
