"""DNS rebinding (issue 36, item 5): a page of ``http://rebind.attacker.example:PORT`` whose name
the attacker re-points at 127.0.0.1 is same-origin with a loopback graphdeck server as far as the
browser knows, so it may send ``X-Graphdeck-Client`` and an ``Origin`` equal to its ``Host``. What
it cannot change is that ``Host``: a request that comes in over loopback must name this machine
(NOTE: [DNS rebinding] in graphdeck.server.auth).

Real parts: the app served by uvicorn on 127.0.0.1 (LiveServer), requests over HTTP carrying the
``Host`` / ``Origin`` a rebinding page's requests carry.
"""

from __future__ import annotations

import json

import httpx
import pytest

from graphdeck.server.auth import settings_from_env
from graphdeck.store.db import open_engine
from tests.conftest import LiveServer

TRACE = json.dumps({"traceEvents": [{"ph": "X", "name": "aten::mm", "ts": 1, "dur": 2, "pid": 1, "tid": 1}]})
CLIENT = {"X-Graphdeck-Client": "1", "Content-Type": "application/json"}
EVIL = "rebind.attacker.example"


def as_host(srv: LiveServer, name: str, **extra) -> httpx.Client:
    """A client of ``srv`` (connecting to 127.0.0.1) whose requests carry ``Host``/``Origin`` ``name:PORT``."""
    host = f"{name}:{srv.port}"
    return httpx.Client(base_url=srv.url, timeout=60,
                        headers={**CLIENT, "Host": host, "Origin": f"http://{host}", **extra})


def seed(srv: LiveServer, name: str, **headers) -> int:
    r = httpx.post(f"{srv.url}/api/runs/{name}/traces", params={"rank": 0}, content=TRACE,
                   headers={**CLIENT, **headers}, timeout=60)
    assert r.status_code == 201, r.text
    return r.json()["run_id"]


def run_names(srv: LiveServer, **headers) -> list[str]:
    return sorted(r["name"] for r in httpx.get(f"{srv.url}/api/runs", headers=headers, timeout=60).json())


@pytest.fixture(scope="module")
def open_server(tmp_path_factory):
    """A server with no tokens (single-user mode)."""
    store = tmp_path_factory.mktemp("rebind") / "s.db"
    open_engine(store).dispose()
    with LiveServer(store) as srv:
        yield srv


def test_a_rebinding_host_can_neither_list_nor_upload_nor_delete(open_server):
    srv = open_server
    victim = seed(srv, "victim")
    for name in (EVIL, "evil.localhost.attacker.example", "127.0.0.1.nip.io", "[::1"):
        with as_host(srv, name) as c:
            answers = {"list": c.get("/api/runs"),
                       "read": c.get(f"/api/runs/{victim}"),
                       "upload": c.post("/api/runs/stolen/traces", params={"rank": 0}, content=TRACE),
                       "delete": c.delete(f"/api/runs/{victim}")}
        for what, r in answers.items():
            assert r.status_code == 400, (name, what, r.status_code, r.text)
            assert "GRAPHDECK_ALLOWED_HOSTS" in r.json()["error"] and "--allowed-host" in r.json()["error"], r.text
    assert run_names(srv) == ["victim"], "nothing uploaded, nothing deleted"


@pytest.mark.parametrize("name", ["localhost", "127.0.0.1", "[::1]", "LOCALHOST.", "app.localhost"])
def test_loopback_names_keep_working(open_server, name):
    upload_list_delete(open_server, name)


def test_configured_names_work_and_only_those(tmp_path):
    store = tmp_path / "c.db"
    open_engine(store).dispose()
    with LiveServer(store, allowed_hosts=("graphdeck.proxy.lab", "Other.Lab:9")) as srv:
        upload_list_delete(srv, "graphdeck.proxy.lab")
        upload_list_delete(srv, "other.lab")
        with as_host(srv, EVIL) as c:
            assert c.get("/api/runs").status_code == 400


def upload_list_delete(srv: LiveServer, name: str) -> None:
    tag = "ok-" + name.strip("[].").replace(":", "").replace(".", "-").lower()
    with as_host(srv, name) as c:
        assert c.get("/api/runs").status_code == 200
        r = c.post(f"/api/runs/{tag}/traces", params={"rank": 0}, content=TRACE)
        assert r.status_code == 201, r.text
        assert tag in [x["name"] for x in c.get("/api/runs").json()]
        r = c.delete(f"/api/runs/{r.json()['run_id']}")
        assert r.status_code == 200, r.text
    assert tag not in run_names(srv)


def test_a_token_protected_server_is_unaffected(tmp_path):
    """Tokens authorise whatever the Host: a client behind any name keeps working; a rebinding page
    holds no token. A server with write tokens only still keeps its open reads from the page."""
    store = tmp_path / "t.db"
    open_engine(store).dispose()
    with LiveServer(store, write_tokens=("w-token",), read_tokens=("r-token",)) as srv:
        bearer = {"Authorization": "Bearer w-token"}
        with as_host(srv, "graphdeck.corp.example", **bearer) as c:
            assert c.get("/api/runs").status_code == 200
            r = c.post("/api/runs/tok/traces", params={"rank": 0}, content=TRACE)
            assert r.status_code == 201, r.text
            assert c.delete(f"/api/runs/{r.json()['run_id']}").status_code == 200
        with as_host(srv, EVIL) as c:  # no token: the usual 401, whatever the name
            assert c.get("/api/runs").status_code == 401
    store = tmp_path / "w.db"
    open_engine(store).dispose()
    with LiveServer(store, write_tokens=("w-token",)) as srv:
        seed(srv, "kept", Authorization="Bearer w-token")
        with as_host(srv, EVIL) as c:
            assert c.get("/api/runs").status_code == 400, "open reads are not open to a rebinding page"
        with as_host(srv, EVIL, Authorization="Bearer w-token") as c:
            assert c.get("/api/runs").status_code == 200


def test_allowed_hosts_from_the_environment():
    assert settings_from_env({"GRAPHDECK_ALLOWED_HOSTS": " a.lab, b.lab:8080 ,"})["allowed_hosts"] == ("a.lab",
                                                                                                        "b.lab:8080")
    assert "allowed_hosts" not in settings_from_env({})
