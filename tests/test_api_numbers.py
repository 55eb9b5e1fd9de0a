"""Numbers a hand-typed URL may carry (issue 36, item 7): ``nan``, ``inf``, ``-inf``, ``1e308`` in
any float query parameter of the API answer a 4xx naming the parameter, never a 500
(``/api/traces/{id}/window`` and ``/api/runs/{id}/timeline`` gave ``OverflowError`` on
``t0_ms``/``t1_ms``).

Real parts: the app served by uvicorn (LiveServer) over HTTP, a real SQLite store in a tmp dir
holding one uploaded trace. Every route's float query parameters are found from the app itself,
so a new one is covered without editing this test.
"""

from __future__ import annotations

import json

import httpx
import pytest

from graphdeck.store.db import open_engine
from tests.conftest import LiveServer

TRACE = json.dumps({"traceEvents": [{"ph": "X", "name": "aten::mm", "ts": 1, "dur": 2, "pid": 1, "tid": 1}]})
CLIENT = {"X-Graphdeck-Client": "1", "Content-Type": "application/json"}
BAD = ("nan", "inf", "-inf", "1e308", "-1e308")


def _float_queries(app) -> list[tuple[str, str]]:
    """(GET path, parameter) for every float (``number``) query parameter in the app's OpenAPI."""
    found = []
    for path, ops in app.openapi()["paths"].items():
        for param in (ops.get("get") or {}).get("parameters", []):
            schema = param.get("schema", {})
            types = {schema.get("type")} | {s.get("type") for s in schema.get("anyOf", [])}
            if param["in"] == "query" and "number" in types:
                found.append((path, param["name"]))
    return found


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    store = tmp_path_factory.mktemp("numbers") / "s.db"
    open_engine(store).dispose()
    with LiveServer(store) as srv:
        r = httpx.post(f"{srv.url}/api/runs/one/traces", params={"rank": 0}, content=TRACE, headers=CLIENT, timeout=60)
        assert r.status_code == 201, r.text
        yield srv, r.json()


def test_non_finite_and_huge_numbers_are_a_4xx_naming_the_parameter(served):
    srv, up = served
    ids = {"trace_id": up["trace_id"], "run_id": up["run_id"], "graph_id": 1}
    queries = _float_queries(srv.server.config.app)
    paths = {p for p, _ in queries}
    assert {"/api/traces/{trace_id}/window", "/api/runs/{run_id}/timeline"} <= paths, queries
    extra = {"/api/diff": {"run_a": "one", "run_b": "one"}}
    failures = []
    for path, name in queries:
        url = srv.url + path.format(**ids)
        ok = httpx.get(url, params=extra.get(path, {}), timeout=60)
        for value in BAD:
            r = httpx.get(url, params={**extra.get(path, {}), name: value}, timeout=60)
            body = r.json()
            if not (400 <= r.status_code < 500 and name in body.get("error", "")):
                failures.append(f"{path} {name}={value}: {r.status_code} {body.get('error')!r} (plain: {ok.status_code})")
    assert not failures, "\n".join(failures)


def test_a_finite_window_still_answers(served):
    srv, up = served
    r = httpx.get(f"{srv.url}/api/traces/{up['trace_id']}/window", params={"t0_ms": 0, "t1_ms": 1}, timeout=60)
    assert r.status_code == 200 and r.json()["layout"]["meta"]["window_ms"] == [0.0, 1.0], r.text
    r = httpx.get(f"{srv.url}/api/runs/{up['run_id']}/timeline", params={"t0_ms": -5, "t1_ms": 5}, timeout=60)
    assert r.status_code == 200, r.text
