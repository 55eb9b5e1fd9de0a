"""Which package may import which (issue 37 item 2): pyproject's ``[tool.importlinter]`` contracts,
checked by import-linter's ``lint-imports`` on the tree laid out as it installs (pyproject's
``package-dir``: ``graphdeck.analysis`` is ``analysis/``, which a tool reading the checkout itself
cannot see). A probe import per contract shows each one bites. What only a running interpreter can
tell (start-up without torch or a web framework) is tests/test_imports.py's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import tomllib

from tests.conftest import REPO

PYPROJECT = REPO / "pyproject.toml"


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """The source tree copied into the installed layout (``graphdeck/analysis/...``)."""
    root = tmp_path_factory.mktemp("layout")
    dirs = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]["package-dir"]
    for pkg, src in sorted(dirs.items(), key=lambda kv: kv[0].count(".")):
        dest = root / pkg.replace(".", "/")
        if not dest.exists():  # a sub-package inside an already copied folder
            shutil.copytree(REPO / src, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return root


def lint(tree: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` over ``tree`` (run there: it puts its working directory first on the path, so
    ``graphdeck`` is the copy, not this checkout's editable install)."""
    code = ("import sys\nfrom importlinter.cli import lint_imports\n"
            f"sys.exit(lint_imports(config_filename={str(PYPROJECT)!r}, no_cache=True, no_logo=True))")
    env = {**os.environ, "COLUMNS": "400"}  # one line per contract in rich's report
    return subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True, timeout=300)


def test_every_layer_contract_is_kept(tree):
    out = lint(tree)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    contracts = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]
    assert f"Contracts: {len(contracts)} kept, 0 broken." in out.stdout, out.stdout[-3000:]


@pytest.mark.parametrize("module, line, contract", [
    ("analysis/_probe.py", "from graphdeck.server.deps import get_session", "the analysis never imports"),
    ("analysis/_probe.py", "import graphdeck.capture.agent", "the analysis never imports"),
    ("capture/_probe.py", "def f():\n    import fastapi", "the capture (inside training jobs)"),
    ("store/_probe.py", "import graphdeck.analysis.summary", "server and capture above analysis above store"),
    ("server/_probe.py", "def f():\n    import torch", "no module of the server imports torch"),
    ("cli_summary.py", "def f():\n    from graphdeck.cli import main", "the CLI: graphdeck.cli above"),
    ("cli_diff.py", "from graphdeck.cli_export import export_trace_cmd", "the CLI: graphdeck.cli above"),
    ("cli_common.py", "def f():\n    import graphdeck.cli_ingest", "the CLI: graphdeck.cli above"),
])
def test_each_contract_catches_a_forbidden_import(tmp_path, tree, module, line, contract):
    probe_tree = tmp_path / "t"
    shutil.copytree(tree, probe_tree)
    (probe_tree / "graphdeck" / module).write_text(line + "\n")
    out = lint(probe_tree)
    assert out.returncode != 0, f"{module} ({line!r}) passed the contracts:\n{out.stdout[-3000:]}"
    broken = [ln for ln in out.stdout.splitlines() if " BROKEN" in ln]
    assert any(contract in ln for ln in broken), out.stdout[-3000:]


def test_renamed_public_modules_keep_their_old_paths():
    """Module paths named in docs/ before issue 37 renamed them stay importable (same module object)."""
    import graphdeck.analysis.gradients.report as report
    import graphdeck.analysis.traces.mapping as mapping

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # what the alias says, on first import only
        from graphdeck.analysis.gradients.grad_report import GradReport, combine
        from graphdeck.analysis.traces.trace_map import node_time_ns
    assert (GradReport, combine, node_time_ns) == (report.GradReport, report.combine, mapping.node_time_ns)
    assert sys.modules["graphdeck.analysis.gradients.grad_report"] is report
    assert sys.modules["graphdeck.analysis.traces.trace_map"] is mapping
