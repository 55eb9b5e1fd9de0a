"""Cross-site writes (issue 18, item 3): with no write tokens a loopback client may write, and a
browser on the same machine is one. A page of another origin must not be able to create, complete,
change or delete anything: every write must be a request such a page cannot send (NOTE: [No
simple writes] in graphdeck.server.auth), while graphdeck's own clients keep working.

Real parts only: the app over HTTP (LiveServer), a second small HTTP server on another port serving
the attacker's page, Debian's chromium submitting forms and ``fetch(..., {mode: "no-cors"})`` (and
CORS fetches for the methods that need a preflight) to every write route the app has.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from graphdeck.server.app import create_app
from graphdeck.server.settings import Settings
from graphdeck.server.upload_area import UploadSpec
from graphdeck.store.db import open_engine
from tests.conftest import LiveServer, shared_path

CLIENT = {"X-Graphdeck-Client": "1"}
TRACE = {"traceEvents": [{"ph": "X", "name": "aten::mm", "ts": 1, "dur": 2, "pid": 1, "tid": 1}]}
TRACE_BYTES = json.dumps(TRACE).encode()
LOG = ("generated_torch2.13_cpu_gloo", "ddp")
SIMPLE_KINDS = ("none", "text/plain", "multipart/form-data", "application/x-www-form-urlencoded")


def write_routes(store: Path) -> list[tuple[str, str]]:
    """``(method, path template)`` of every route of the app that takes a write (its OpenAPI)."""
    app = create_app(Settings(store=store))
    out = [(method.upper(), path) for path, ops in app.openapi()["paths"].items() for method in ops
           if method.upper() not in ("GET", "HEAD", "OPTIONS")]
    app.state.engine.dispose()
    app.state.read_engine.dispose()
    return sorted(out)


def spec_for(data: bytes, run: str) -> dict:
    return {"kind": "trace", "run": run, "rank": 0, "size_bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(), "chunk_bytes": len(data)}


#: The upload declaration the attacks send to ``POST /api/uploads``.
DECLARED = spec_for(b"declared by a page" + TRACE_BYTES, "csrf-declared")


class Target:
    """The server under attack, with a victim run and two pending uploads the attacks aim at."""

    def __init__(self, srv: LiveServer):
        self.srv = srv
        self.c = httpx.Client(base_url=srv.url, headers=CLIENT, timeout=60)
        r = self.c.post("/api/runs/victim/traces", params={"rank": 0}, content=TRACE_BYTES,
                        headers={"Content-Type": "application/json"})
        assert r.status_code == 201, r.text
        self.victim_id = r.json()["run_id"]
        # one upload with its chunk sent (only "complete" is missing), one with its chunk missing
        self.full_data = json.dumps({**TRACE, "n": "full"}).encode()
        self.full = self.c.post("/api/uploads", json=spec_for(self.full_data, "csrf-complete")).json()
        r = self.c.put(f"/api/uploads/{self.full['id']}/chunks/0", content=self.full_data,
                       headers={"X-Chunk-Sha256": hashlib.sha256(self.full_data).hexdigest()})
        assert r.status_code == 201, r.text
        self.empty_data = json.dumps({**TRACE, "n": "empty"}).encode()
        self.empty = self.c.post("/api/uploads", json=spec_for(self.empty_data, "csrf-chunk")).json()

    def url(self, template: str, tag: str) -> str:
        params = {"run_name": f"csrf-{tag}", "upload_id": self.full["id"] if "complete" in template else
                  self.empty["id"], "index": "0", "run_id": str(self.victim_id)}
        path = template
        for name, value in params.items():
            path = path.replace("{" + name + "}", value)
        assert "{" not in path, f"a write route with a parameter this test does not know: {template}"
        return self.srv.url + path + ("?rank=0" if path.endswith("/traces") else "")

    def assert_untouched(self) -> None:
        names = sorted(r["name"] for r in self.c.get("/api/runs").json())
        assert "victim" in names and not [n for n in names if n.startswith("csrf-")], f"runs: {names}"
        full = self.c.get(f"/api/uploads/{self.full['id']}").json()
        assert full["state"] != "done" and full["missing"] == [], full
        empty = self.c.get(f"/api/uploads/{self.empty['id']}").json()
        assert empty["missing"] == [0] and empty["state"] != "done", empty
        declared = UploadSpec(**{**DECLARED, "sha256": DECLARED["sha256"].lower()}).upload_id()
        assert self.c.get(f"/api/uploads/{declared}").status_code == 404, "the attacks declared no upload"


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    store = tmp_path_factory.mktemp("csrf") / "s.db"
    open_engine(store).dispose()
    with LiveServer(store) as srv:
        t = Target(srv)
        t.routes = write_routes(store)
        yield t
        t.c.close()


class AttackerSite:
    """Another origin: a tiny HTTP server on another port serving one page."""

    def __init__(self, html: str):
        body = html.encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/attack.html"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def attack_page(posts: list[str], others: list[tuple[str, str]], log_text: str) -> str:
    """Forms (text/plain with the JSON trick, multipart, urlencoded) into iframes, then no-cors
    fetches of every simple kind to each POST route, then CORS fetches for the other methods.
    The body is the trace, or the upload declaration :data:`DECLARED` for ``/api/uploads``."""
    trace, spec = json.dumps(TRACE), json.dumps(DECLARED)
    bodies = {url: spec if url.split("?")[0].endswith("/api/uploads") else trace for url in posts}
    forms = []
    for i, url in enumerate(posts):
        body = bodies[url]
        name, value = body[:-1] + ', "x": "', '"}'  # a text/plain form sends name=value: {..., "x": "="}
        forms.append(f'<form method="POST" target="f{i}a" enctype="text/plain" action="{url}">'
                     f"<input name='{name}' value='{value}'></form><iframe name=\"f{i}a\"></iframe>")
        forms.append(f'<form method="POST" target="f{i}b" enctype="multipart/form-data" action="{url}">'
                     f"<textarea name=\"file\">{body}</textarea><textarea name=\"files\">{log_text[:2000]}</textarea>"
                     f'</form><iframe name="f{i}b"></iframe>')
        forms.append(f'<form method="POST" target="f{i}c" action="{url}"><input name="file" value=\'{body}\'>'
                     f'</form><iframe name="f{i}c"></iframe>')
    return f"""<!doctype html><html><body>{''.join(forms)}
<script>
const posts = {json.dumps(posts)}, others = {json.dumps(others)}, bodies = {json.dumps(bodies)};
const trace = {json.dumps(trace)}, log = {json.dumps(log_text)};
function submitForms() {{
  const frames = [...document.querySelectorAll("iframe")];
  const loaded = frames.map(f => new Promise(ok => f.addEventListener("load", ok, {{once: true}})));
  document.querySelectorAll("form").forEach(f => f.submit());
  return Promise.all(loaded).then(() => frames.length);
}}
async function fetches() {{
  const out = [];
  const go = (url, init) => fetch(url, init).then(r => out.push([url, init.method, r.type]),
                                                  e => out.push([url, init.method, "refused: " + e]));
  for (const url of posts) {{
    const trace = bodies[url];
    const fd = new FormData();
    fd.append("file", new Blob([trace]), "host_rank_0.json");
    fd.append("files", new Blob([log]), "dedicated_log_torch_trace_rank_0.log");
    await go(url, {{method: "POST", mode: "no-cors", body: trace}});
    await go(url, {{method: "POST", mode: "no-cors", body: fd}});
    await go(url, {{method: "POST", mode: "no-cors", body: new Blob([trace], {{type: "application/json"}})}});
    await go(url, {{method: "POST", mode: "no-cors", body: new URLSearchParams({{file: trace}})}});
    await go(url, {{method: "POST", mode: "no-cors", body: trace,
                   headers: {{"X-Graphdeck-Client": "1", "Content-Type": "application/json"}}}});
    await go(url, {{method: "POST", mode: "cors", body: trace,
                   headers: {{"X-Graphdeck-Client": "1", "Content-Type": "application/json"}}}});
  }}
  for (const [method, url] of others) {{
    await go(url, {{method, mode: "cors", body: method === "DELETE" ? undefined : trace,
                   headers: {{"X-Graphdeck-Client": "1", "X-Chunk-Sha256": "0".repeat(64)}}}});
  }}
  return out;
}}
</script></body></html>"""


def test_a_page_of_another_origin_cannot_write(target, browser):
    log_text = sorted(shared_path("data", "torch_trace", *LOG).glob("*rank_0*.log"))[0].read_text()[:20_000]
    posts = [target.url(path, f"{i}") for i, (m, path) in enumerate(target.routes) if m == "POST"]
    others = [(m, target.url(path, f"o{i}")) for i, (m, path) in enumerate(target.routes) if m != "POST"]
    assert {p.split("?")[0].rsplit("/", 1)[-1] for p in posts} >= {"traces", "torch-trace", "uploads", "complete"}
    assert any(m == "PUT" for m, _ in others)
    site = AttackerSite(attack_page(posts, others, log_text))
    context = browser.new_context()
    page = context.new_page()
    seen: list[tuple[str, str, int]] = []
    page.on("response", lambda r: seen.append((r.request.method, r.url, r.status))
            if r.url.startswith(target.srv.url) else None)
    try:
        page.goto(site.url)
        assert page.evaluate("submitForms()") == 3 * len(posts)
        results = page.evaluate("fetches()")
    finally:
        context.close()
        site.close()
    # every form and no-cors fetch reached the server and was refused; nothing else got through
    writes = [(m, u, s) for m, u, s in seen if m not in ("GET", "OPTIONS")]
    assert len(writes) >= 3 * len(posts) + 5 * len(posts), (writes, results)
    assert all(s == 403 for _, _, s in writes), writes
    refused = [r for r in results if r[2].startswith("refused")]
    assert len(refused) == len(posts) + len(others), "CORS fetches never get past the preflight: " + str(results)
    target.assert_untouched()


@pytest.mark.parametrize("kind", SIMPLE_KINDS)
def test_a_direct_write_without_the_header_is_403(target, kind):
    headers = {} if kind == "none" else {"Content-Type": kind + ("; boundary=x" if "multipart" in kind else "")}
    for method, path in target.routes:
        if method != "POST":
            continue
        r = httpx.post(target.url(path, "direct"), content=TRACE_BYTES, headers=headers, timeout=30)
        assert r.status_code == 403 and "X-Graphdeck-Client" in r.json()["error"], (path, r.text)
    target.assert_untouched()


def test_origin_and_fetch_site_are_checked(target):
    url = target.url("/api/runs/{run_name}/traces", "origin")
    json_ct = {**CLIENT, "Content-Type": "application/json"}
    for extra in ({"Origin": "http://evil.example"}, {"Origin": "null"},
                  {"Origin": f"http://127.0.0.1:{target.srv.port + 1}"}, {"Sec-Fetch-Site": "same-site"},
                  {"Sec-Fetch-Site": "cross-site"}, {"Origin": "http://[::1"}):
        r = httpx.post(url, content=TRACE_BYTES, headers={**json_ct, **extra}, timeout=30)
        assert r.status_code == 403, (extra, r.text)
    target.assert_untouched()
    same = httpx.post(url.replace("csrf-origin", "legit-origin"), content=TRACE_BYTES, timeout=30,
                      headers={**json_ct, "Origin": target.srv.url, "Sec-Fetch-Site": "same-origin"})
    assert same.status_code == 201, same.text


def test_non_simple_requests_need_no_header(target):
    """A JSON (or gzip) body, or a bearer token, is as good as the header: no page can send those."""
    r = httpx.post(target.url("/api/uploads", "x"), json=spec_for(b"json" + TRACE_BYTES, "legit-json"), timeout=30)
    assert r.status_code == 201, r.text
    r = httpx.post(target.url("/api/runs/{run_name}/traces", "x"), content=b"not json",
                   headers={"Content-Type": "application/gzip"}, timeout=30)
    assert r.status_code == 400 and "X-Graphdeck-Client" not in r.text, r.text
    assert httpx.post(f"{target.srv.url}/api/runs").status_code == 405, "no such write route: 405 as before"


def test_same_origin_page_with_the_header_writes(target, browser):
    """The dashboard's own origin may write with the header (what its JS would send)."""
    context = browser.new_context()
    page = context.new_page()
    try:
        page.goto(target.srv.url + "/")
        status = page.evaluate("""async (body) => (await fetch('/api/runs/legit-dashboard/traces?rank=0', {
            method: 'POST', body, headers: {'X-Graphdeck-Client': '1', 'Content-Type': 'application/json'}})).status""",
                               json.dumps(TRACE))
    finally:
        context.close()
    assert status == 201


def test_cli_upload_still_writes(tmp_path):
    trace = tmp_path / "host_rank_0.json"
    trace.write_bytes(TRACE_BYTES)
    store = tmp_path / "cli.db"
    open_engine(store).dispose()
    with LiveServer(store) as srv:
        proc = subprocess.run([sys.executable, "-m", "graphdeck.cli", "upload", str(trace), "--url", srv.url,
                               "--run", "from-cli", "--rank", "0"], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert httpx.get(f"{srv.url}/api/runs/from-cli").status_code == 200
