"""Token auth (graphdeck.server.auth) over the real app: every write route refuses without a
token when tokens are configured, reads optionally need one, and with no tokens writes are taken
from loopback clients only.

The app's routes are enumerated, so a write route added later is covered (or fails this test).
The non-loopback client address is the one declared seam: Starlette's TestClient sets the
client address the app sees; everything else is the real app.
"""

from __future__ import annotations

import re

import httpx
import pytest
from fastapi.routing import APIRoute
from starlette.testclient import TestClient

from graphdeck.server import auth
from graphdeck.server.app import create_app
from graphdeck.server.settings import Settings
from tests.conftest import LiveServer

WRITE = "w-token-0123456789"
READ = "r-token-abcdef"
SAFE = {"GET", "HEAD", "OPTIONS"}
#: Write routes that exist today; the enumeration must find at least these.
KNOWN_WRITES = {
    ("POST", "/api/runs/{run_name}/traces"),
    ("POST", "/api/runs/{run_name}/torch-trace"),
    ("POST", "/api/uploads"),
    ("PUT", "/api/uploads/{upload_id}/chunks/{index}"),
    ("POST", "/api/uploads/{upload_id}/complete"),
}


def _fill(path: str) -> str:
    """A concrete URL for a route path: ids as numbers, upload ids as 32 hex digits."""
    path = path.replace("{upload_id}", "0" * 32)
    return re.sub(r"\{[^}]+\}", "1", path)


def _write_routes(app) -> list[tuple[str, str]]:
    """Every (method, path) of a non-GET route, walking included routers (FastAPI keeps them as
    nested routers), cross-checked with the OpenAPI schema."""
    out: list[tuple[str, str]] = []

    def walk(routes):
        for route in routes:
            if isinstance(route, APIRoute):
                out.extend((m, route.path) for m in sorted(route.methods - SAFE))
            elif hasattr(route, "original_router"):  # an included router (FastAPI >= 0.12x)
                walk(route.original_router.routes)

    walk(app.routes)
    schema = {(m.upper(), path) for path, ops in app.openapi()["paths"].items() for m in ops}
    assert {w for w in schema if w[0] not in SAFE} <= set(out), "the walk missed a route the schema lists"
    return sorted(set(out))


@pytest.fixture
def store(tmp_path):
    return tmp_path / "auth.db"


def test_every_write_route_needs_a_write_token(store):
    with LiveServer(store, write_tokens=(WRITE,), read_tokens=(READ,)) as srv:
        writes = _write_routes(create_app(Settings(store=store)))  # the same routes as the live app
        assert KNOWN_WRITES <= set(writes), f"route enumeration missed writes: {KNOWN_WRITES - set(writes)}"
        with httpx.Client(base_url=srv.url) as c:
            for method, path in writes:
                url = _fill(path)
                r = c.request(method, url)
                assert r.status_code == 401, f"{method} {url} without a token: {r.status_code} {r.text[:200]}"
                body = r.json()
                assert body["ok"] is False and body["status"] == 401 and "token" in body["error"]
                assert r.headers.get("www-authenticate") == "Bearer"
                for bad in (f"Bearer {WRITE}x", f"Bearer {READ}", "Bearer", f"Basic {WRITE}", WRITE, f"bearer  {WRITE[:-1]}"):
                    r = c.request(method, url, headers={"Authorization": bad})
                    assert r.status_code in (401, 403), f"{method} {url} with {bad!r}: {r.status_code}"
                # A read token does not write; a cookie never writes (no cross-site write).
                r = c.request(method, url, headers={"Cookie": f"{auth.COOKIE_NAME}={WRITE}"})
                assert r.status_code == 401, f"{method} {url} with only a cookie: {r.status_code}"
                r = c.request(method, url, headers={"Authorization": f"Bearer {WRITE}"})
                assert r.status_code not in (401, 403), f"{method} {url} with the write token: {r.status_code}"


def test_reads_open_by_default_and_token_required_when_configured(store):
    with LiveServer(store, write_tokens=(WRITE,)) as srv:
        assert httpx.get(f"{srv.url}/api/runs").status_code == 200, "reads are open when no read token is set"
    with LiveServer(store, write_tokens=(WRITE,), read_tokens=(READ, "second")) as srv, \
            httpx.Client(base_url=srv.url) as c:
        r = c.get("/api/runs")
        assert r.status_code == 401 and r.json()["status"] == 401
        assert c.get("/api/runs", headers={"Authorization": "Bearer nope"}).status_code == 403
        for token in (READ, "second", WRITE):  # a write token also reads
            assert c.get("/api/runs", headers={"Authorization": f"Bearer {token}"}).status_code == 200
        assert c.get("/api/health").status_code == 200, "the healthcheck is public"
        assert c.get("/").status_code == 200, "the dashboard page holds no data and is public"
        assert c.get("/static/app.js").status_code == 200
        # The browser logs in once with ?token=; the HttpOnly cookie then carries reads.
        r = c.get("/", params={"token": READ})
        cookie = r.headers.get("set-cookie", "")
        assert auth.COOKIE_NAME in cookie and "HttpOnly" in cookie and "SameSite=Strict" in cookie
        assert c.get("/api/runs").status_code == 200, "the cookie set by /?token= reads"
        assert c.get("/", params={"token": "wrong"}).headers.get("set-cookie") is None


def test_no_tokens_keeps_loopback_writes_and_refuses_other_hosts(store):
    app = create_app(Settings(store=store))
    trace = b'{"traceEvents": [{"ph": "X", "name": "a", "ts": 1, "dur": 2, "pid": 1, "tid": 1}]}'
    with LiveServer(store) as srv:  # a loopback client, as today
        r = httpx.post(f"{srv.url}/api/runs/local/traces", params={"rank": 0}, content=trace,
                       headers={"X-Graphdeck-Client": "1"})
        assert r.status_code == 201, r.text
    remote = TestClient(app, client=("10.1.2.3", 40000), raise_server_exceptions=False)
    with remote:
        r = remote.post("/api/runs/remote/traces", params={"rank": 0}, content=trace)
        assert r.status_code == 403, r.text
        assert "10.1.2.3" in r.json()["error"] and auth.WRITE_TOKENS_ENV in r.json()["error"]
        assert remote.get("/api/runs").status_code == 200, "reads stay open"
    app = create_app(Settings(store=store, write_tokens=(WRITE,)))
    remote = TestClient(app, client=("10.1.2.3", 40000), headers={"Authorization": f"Bearer {WRITE}"})
    with remote:
        r = remote.post("/api/runs/remote/traces", params={"rank": 0}, content=trace)
        assert r.status_code == 201, "with a write token a remote rank may write"


def test_tokens_and_data_dir_from_env():
    env = {auth.WRITE_TOKENS_ENV: " a, b ,,", auth.READ_TOKENS_ENV: "", auth.DATA_DIR_ENV: "/srv/gd"}
    assert auth.settings_from_env(env) == {"write_tokens": ("a", "b"), "read_tokens": (), "data_dir": "/srv/gd"}
    assert auth.token_matches("b", ("a", "b")) and not auth.token_matches("c", ("a", "b"))
    assert not auth.token_matches("", ("",)), "an empty token never matches"
    assert not auth.token_matches("é", ("e",)), "non-ASCII compares as bytes, no TypeError"
    assert auth.warn_if_exposed("127.0.0.1", Settings(store="x.db")) is None
    assert auth.warn_if_exposed("0.0.0.0", Settings(store="x.db", write_tokens=("a",))) is None
    assert auth.WRITE_TOKENS_ENV in auth.warn_if_exposed("0.0.0.0", Settings(store="x.db"))
    assert "secret-a" not in repr(Settings(store="x.db", write_tokens=("secret-a",))), \
        "tokens stay out of the settings' repr (logs)"


def test_ipv4_mapped_loopback_is_loopback():
    """``::ffff:127.0.0.1`` (a dual-stack socket's view of 127.0.0.1) is loopback (issue 18)."""
    from graphdeck.server.auth import is_loopback

    assert is_loopback("::ffff:127.0.0.1") and is_loopback("127.0.0.1") and is_loopback("::1")
    assert not is_loopback("::ffff:10.0.0.1") and not is_loopback("10.0.0.1") and not is_loopback(None)
