"""One verdict per fact, the same on every surface (issue 34): on every shared case this suite builds
from ../shared/data without running a job — the TORCH_TRACE logs of generated_torch2.13_cpu_gloo
(ddp, unused, graphbreak, detach: 2 CPU DDP ranks), tlparse's multi-rank fixtures (C4's
multi_rank_logs, collectives_parity) and the 2 x H200 DDP store with both ranks' Kineto traces
(tests/data/ddp_h200x2) — each check's verdict is read from the CLI's text and exit code, from its
``--json``, and from the real app's HTTP API (uvicorn on a free port), and they must agree:

* check-grads: text header, exit code, ``--json``, ``GET /api/runs/{id}/gradients``;
* check-ranks: the last text line, exit code, ``--json``, ``GET /api/runs/{id}/rank-consistency``,
  ``GET /api/runs/{id}/collectives`` (its ``verdict``) and the per-rank "diverged" state of the JSON,
  the API and the parallel map when the run has a layout;
* check-compile: the first text line, exit code, ``--json``, ``GET /api/runs/{id}/compile-health``;
* summary: its text, exit code, ``--json`` and ``GET /api/runs/{id}/summary``, each check's line
  there carrying that check's own verdict.
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from graphdeck.cli import main as cli
from graphdeck.store.db import open_engine
from graphdeck.store.torch_trace import import_torch_trace
from tests.conftest import LiveServer, shared_path

DATA = Path(__file__).parent / "data"
LOGS = ["generated_torch2.13_cpu_gloo/ddp", "generated_torch2.13_cpu_gloo/unused",
        "generated_torch2.13_cpu_gloo/graphbreak", "generated_torch2.13_cpu_gloo/detach",
        "tlparse_tests/inputs/multi_rank_logs", "tlparse_tests/inputs/collectives_parity"]
EXIT = {"PASS": 0, "OK": 0, "WARN": 0, "FAIL": 1, "INCOMPLETE": 3}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """``[(store, run name)]``: the logs imported into one store, and the H200 DDP store with its traces."""
    tmp = tmp_path_factory.mktemp("surfaces")
    logs = tmp / "logs.db"
    engine = open_engine(logs)
    for rel in LOGS:
        import_torch_trace(engine, shared_path("data", "torch_trace", *rel.split("/")), run_name=rel)
    engine.dispose()
    from graphdeck.analysis.traces.trace_map import link_kernels
    from graphdeck.store.traces import ingest_trace

    h200 = tmp / "ddp.db"
    with gzip.open(DATA / "ddp_h200x2" / "ddp.db.gz") as src, open(h200, "wb") as dst:
        shutil.copyfileobj(src, dst)
    engine = open_engine(h200)
    for rank in (0, 1):
        ingest_trace(engine, DATA / "ddp_h200x2" / f"ddp_rank{rank}.pt.trace.json.gz", run_name="ddp", strict=True)
    link_kernels(engine, 1)
    engine.dispose()
    return [(logs, rel) for rel in LOGS] + [(h200, "ddp")]


def _cli(*args) -> tuple[int, str]:
    res = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    return res.exit_code, res.output


def _text_verdict(check: str, text: str) -> str:
    if check == "check-grads":
        return re.search(r"\]: (PASS|FAIL|INCOMPLETE) ·", text.splitlines()[0]).group(1)
    if check == "check-ranks":
        return re.match(r"(OK|FAIL|INCOMPLETE):", text.strip().splitlines()[-1]).group(1)
    if check == "check-compile":
        return re.match(r"check-compile .*: (PASS|WARN|FAIL|INCOMPLETE)\b", text.splitlines()[0]).group(1)
    return re.match(r"graphdeck summary .*: (PASS|WARN|FAIL|INCOMPLETE)$", text.splitlines()[0]).group(1)


API = {"check-grads": "gradients", "check-ranks": "rank-consistency", "check-compile": "compile-health",
       "summary": "summary"}
SUMMARY_KEY = {"check-grads": "gradients", "check-ranks": "ranks", "check-compile": "compile"}


def test_every_check_says_the_same_on_cli_json_and_api(cases):
    disagree = []
    by_store: dict[Path, list[str]] = {}
    for store, run in cases:
        by_store.setdefault(store, []).append(run)
    for store, runs in by_store.items():
        with LiveServer(store) as srv:
            ids = {r["name"]: r["id"] for r in httpx.get(f"{srv.url}/api/runs", timeout=60).json()}
            for run in runs:
                rid = ids[run]
                seen: dict[str, dict[str, str]] = {}
                for check, api in API.items():
                    args = [check, store, "--run", run] if check != "summary" else [check, store, "--run", run]
                    code, text = _cli(*args)
                    jcode, js = _cli(*args, "--json")
                    doc = httpx.get(f"{srv.url}/api/runs/{rid}/{api}", timeout=300).json()
                    got = {"text": _text_verdict(check, text), "exit": code, "json": json.loads(js)["verdict"],
                           "json_exit": jcode, "api": doc["verdict"]}
                    seen[check] = got
                    v = got["text"]
                    if not (got["json"] == got["api"] == v and code == jcode == EXIT[v]):
                        disagree.append(f"{run} {check}: {got}")
                    if check == "check-ranks":
                        colls = httpx.get(f"{srv.url}/api/runs/{rid}/collectives", timeout=300).json()
                        if colls["verdict"] != v:
                            disagree.append(f"{run} /collectives verdict {colls['verdict']} vs check-ranks {v}")
                        if json.loads(js)["diverged_ranks"] != doc["diverged_ranks"]:
                            disagree.append(f"{run} diverged ranks: json {json.loads(js)['diverged_ranks']} "
                                            f"vs api {doc['diverged_ranks']}")
                        pm = httpx.get(f"{srv.url}/api/runs/{rid}/parallel-map", timeout=300)
                        if pm.status_code == 200 and pm.json().get("checks"):
                            badge = next((c for c in pm.json()["checks"] if c["key"] == "diverged"), None)
                            if badge and badge.get("ran") and badge["verdict"] != v:
                                disagree.append(f"{run} parallel map diverged badge {badge['verdict']} vs {v}")
                summary = json.loads(_cli("summary", store, "--run", run, "--json")[1])
                for check, key in SUMMARY_KEY.items():
                    line = next(c for c in summary["checks"] if c["key"] == key)
                    if line["native_verdict"] != seen[check]["text"]:
                        disagree.append(f"{run} summary's {key} line says {line['native_verdict']}, "
                                        f"{check} says {seen[check]['text']}")
    assert not disagree, "\n".join(disagree)
