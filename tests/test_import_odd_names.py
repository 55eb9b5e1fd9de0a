"""File names that are not UTF-8 in an import folder (issue 36, item 7): ``graphdeck import`` of a
folder whose files are named with byte 0xff imports each (a TORCH_TRACE log, a Kineto trace, a
Flight Recorder dump) or skips and counts it (a file of none of those kinds), never ends in a
traceback; the store keeps the names with ``\\xff`` escapes (``fs_text``) and the API serves
them. Before, the Kineto trace's name reached SQLite as a lone surrogate: ``UnicodeEncodeError``.

Real parts: files under a tmp dir, the CLI in a subprocess, a SQLite store, the app over HTTP.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import httpx

from tests.conftest import REPO, LiveServer, shared_path

LOG = ("data", "torch_trace", "generated_torch2.13_cpu_gloo", "detach")
KINETO = {"schemaVersion": 1, "distributedInfo": {"rank": 1},
          "traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1, "dur": 2, "pid": 1, "tid": 1}]}


def test_names_that_are_not_utf8_are_imported_or_skipped_never_a_traceback(tmp_path):
    folder = os.fsencode(tmp_path / "in")
    os.mkdir(folder)
    log = sorted(shared_path(*LOG).glob("*rank_0_*.log"))[0]
    shutil.copy(log, folder + b"/dedicated_log_torch_trace_rank_0_\xff.log")
    with open(folder + b"/tr\xffce.json", "w") as f:
        json.dump(KINETO, f)
    shutil.copy(REPO / "tests/data/flight/fr_dump_0", folder + b"/fr\xfe_dump_0")
    with open(folder + b"/notes\xff.txt", "wb") as f:
        f.write(b"not a log, a trace or a dump\n")
    store = tmp_path / "s.db"
    proc = subprocess.run([sys.executable, "-m", "graphdeck.cli", "import", os.fsdecode(folder), "--store", str(store),
                           "--run", "odd"], capture_output=True, timeout=600)
    out, err = proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace")
    assert proc.returncode == 0 and "Traceback" not in err, (proc.returncode, out, err[-3000:])
    assert "ranks [0]" in out and "Kineto trace" in out and "Flight Recorder: ranks [0]" in out, out
    assert "skipped notes" in err, err

    with LiveServer(store) as srv:
        run = httpx.get(f"{srv.url}/api/runs/odd", timeout=60)
        assert run.status_code == 200, run.text
        assert [t["name"] for t in run.json()["traces"]] == ["tr\\xffce.json"], run.json()["traces"]
        for path in ("ranks", "summary"):
            r = httpx.get(f"{srv.url}/api/runs/{run.json()['id']}/{path}", timeout=60)
            assert r.status_code == 200, (path, r.text[:500])


def test_upload_of_a_file_named_with_bytes_that_are_not_utf8(tmp_path):
    """``graphdeck upload`` put the name in its JSON declaration as it came: the client's own JSON
    encoder then raised UnicodeEncodeError (a traceback, nothing sent)."""
    from graphdeck.store.db import open_engine

    name = os.fsencode(tmp_path) + b"/tr\xffce.json"
    with open(name, "w") as f:
        json.dump(KINETO, f)
    store = tmp_path / "s.db"
    open_engine(store).dispose()
    with LiveServer(store) as srv:
        proc = subprocess.run([sys.executable, "-m", "graphdeck.cli", "upload", os.fsdecode(name), "--url", srv.url,
                               "--run", "up", "--rank", "0"], capture_output=True, timeout=120)
        err = proc.stderr.decode(errors="replace")
        assert proc.returncode == 0 and "Traceback" not in err, err[-3000:]
        run = httpx.get(f"{srv.url}/api/runs/up", timeout=60).json()
    assert [t["name"] for t in run["traces"]] == ["tr\\xffce.json"], run["traces"]
