"""The verdict of each check as every surface shows it (issue 34: one verdict per fact, shown the
same in CLI, JSON, API and page): :func:`disagreements` reads check-grads, check-ranks,
check-compile and summary for one run from the CLI's text and exit code (the real CLI, in
process), its ``--json``, and the real app's HTTP API served by uvicorn
(:class:`tests.conftest.LiveServer`), and lists every place where they differ. Used by
tests/test_verdict_surfaces.py on the shared logs and by the slow tests on the stores their jobs
made (N5, the Flight Recorder hangs, the DDP predictions)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from click.testing import CliRunner

from graphdeck.cli import main as cli
from tests.conftest import LiveServer

EXIT = {"PASS": 0, "OK": 0, "WARN": 0, "FAIL": 1, "INCOMPLETE": 3}


def _cli(*args) -> tuple[int, str]:
    res = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    return res.exit_code, res.output


def _text_verdict(check: str, text: str) -> str:
    if check == "check-grads":
        return re.search(r"\]: (PASS|FAIL|INCOMPLETE) ·", text.splitlines()[0]).group(1)
    if check == "check-ranks":
        return re.match(r"(OK|WARN|FAIL|INCOMPLETE):", text.strip().splitlines()[-1]).group(1)
    if check == "check-compile":
        return re.match(r"check-compile .*: (PASS|WARN|FAIL|INCOMPLETE)\b", text.splitlines()[0]).group(1)
    return re.match(r"graphdeck summary .*: (PASS|WARN|FAIL|INCOMPLETE)$", text.splitlines()[0]).group(1)


API = {"check-grads": "gradients", "check-ranks": "rank-consistency", "check-compile": "compile-health",
       "summary": "summary"}
SUMMARY_KEY = {"check-grads": "gradients", "check-ranks": "ranks", "check-compile": "compile"}


def disagreements(store: Path, runs: list[str]) -> list[str]:
    """Every difference between the surfaces for ``runs`` of ``store`` (empty: they agree)."""
    disagree: list[str] = []
    with LiveServer(store) as srv:
        ids = {r["name"]: r["id"] for r in httpx.get(f"{srv.url}/api/runs", timeout=60).json()}
        for run in runs:
            disagree += _one_run(srv, store, run, ids[run])
    return disagree


def _one_run(srv, store: Path, run: str, rid: int) -> list[str]:
    disagree: list[str] = []
    seen: dict[str, str] = {}
    for check, api in API.items():
        args = [check, store, "--run", run]
        code, text = _cli(*args)
        jcode, js = _cli(*args, "--json")
        doc = httpx.get(f"{srv.url}/api/runs/{rid}/{api}", timeout=300).json()
        v = seen[check] = _text_verdict(check, text)
        got = {"text": v, "exit": code, "json": json.loads(js)["verdict"], "json_exit": jcode, "api": doc["verdict"]}
        if not (got["json"] == got["api"] == v and code == jcode == EXIT[v]):
            disagree.append(f"{run} {check}: {got}")
        if check != "check-ranks":
            continue
        colls = httpx.get(f"{srv.url}/api/runs/{rid}/collectives", timeout=300).json()
        if colls["verdict"] != v:
            disagree.append(f"{run} /collectives verdict {colls['verdict']} vs check-ranks {v}")
        if json.loads(js)["diverged_ranks"] != doc["diverged_ranks"]:
            disagree.append(f"{run} diverged ranks: json {json.loads(js)['diverged_ranks']} vs api {doc['diverged_ranks']}")
        timed = {f["verdict"] for f in doc.get("time_findings") or []}  # NOTE: [Time verdicts]
        if (v == "FAIL") != bool(doc["diverged_ranks"] or (doc.get("flight") or {}).get("mismatches")
                                 or "FAIL" in timed):
            disagree.append(f"{run} check-ranks {v} but diverged ranks {doc['diverged_ranks']}")
        pm = httpx.get(f"{srv.url}/api/runs/{rid}/parallel-map", timeout=300)
        badge = next((c for c in (pm.json().get("checks") or []) if c["key"] == "diverged"), None) \
            if pm.status_code == 200 else None
        if badge and badge.get("ran"):
            if badge["verdict"] != v:
                disagree.append(f"{run} parallel map diverged badge {badge['verdict']} vs {v}")
            m = pm.json()
            shown = {r for r, k in enumerate(m["ranks"]["kind"]) if m["kinds"][k]["diverged"] == "diverged"}
            if shown != {int(r) for r in doc["diverged_ranks"]}:
                disagree.append(f"{run} parallel map marks ranks {sorted(shown)} diverged, check-ranks "
                                f"{sorted(doc['diverged_ranks'])}")
    summary = json.loads(_cli("summary", store, "--run", run, "--json")[1])
    for check, key in SUMMARY_KEY.items():
        line = next(c for c in summary["checks"] if c["key"] == key)
        if line["native_verdict"] != seen[check]:
            disagree.append(f"{run} summary's {key} line says {line['native_verdict']}, {check} says {seen[check]}")
    return disagree
