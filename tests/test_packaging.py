"""Packaging: the console script and the dynamo backend entry point (compose: tests/test_compose.py)."""

from __future__ import annotations

import shutil
import subprocess
from importlib.metadata import entry_points


def test_dynamo_backend_entry_point_registered():
    names = {ep.name: ep.value for ep in entry_points(group="torch_dynamo_backends")}
    assert names.get("graphdeck") == "graphdeck.capture.backend:graphdeck_backend"


def test_console_script_has_subcommands():
    exe = shutil.which("graphdeck")
    assert exe, "pip install -e . puts the graphdeck console script on PATH"
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, check=True).stdout
    for sub in ("demo", "serve", "check-grads", "ingest-trace", "upload", "db", "stack", "replay"):
        assert sub in out, f"graphdeck --help lists {sub}"
