"""Import boundaries: the capture agent lives inside training jobs (no web framework); the server
runs on small machines with no GPU stack (no torch). Checked in fresh interpreters, so nothing
pytest or another test imported leaks in (click's ``tests/test_imports.py`` is the model).

Which package may import which is pyproject's import-linter contracts (tests/test_layers.py); these
two stay because only a running interpreter tells what start-up loads, third-party imports included
(torch may load jinja2, the capture's upload imports httpx when it runs)."""

from __future__ import annotations

import json
import subprocess
import sys

WEB = ("fastapi", "starlette", "uvicorn", "plotly", "jinja2", "graphviz", "httpx")


def modules_after(code: str) -> set[str]:
    probe = code + "\nimport sys, json; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"the probe failed:\n{out.stderr[-4000:]}"
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_capture_agent_imports_no_web_framework():
    mods = modules_after("import graphdeck.capture; from graphdeck.capture import Agent; "
                         "import graphdeck.capture.backend, graphdeck.capture.profile")
    leaked = sorted(m for m in mods if m.split(".")[0] in WEB)
    assert not leaked, f"the capture agent must stay light inside training jobs; it imported {leaked[:10]}"


def test_server_starts_without_torch(tmp_path):
    mods = modules_after(
        "from graphdeck.server.app import create_app; from graphdeck.server.settings import Settings; "
        f"app = create_app(Settings(store={str(tmp_path / 's.db')!r})); "
        "from fastapi.testclient import TestClient; c = TestClient(app); "
        "assert c.get('/api/runs').status_code == 200; "
        "assert c.get('/api/graphs/1/svg').status_code == 404; "
        "assert '/api/graphs/{graph_id}/svg' in c.get('/openapi.json').json()['paths']; "
        "import graphdeck.server.render.svg, graphdeck.analysis.graphs.view")
    assert "torch" not in mods, "the server (app, routes, SVG, timeline, gradient report) never imports torch"
    assert "fastapi" in mods, "sanity: the probe did load the server"
