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
import shutil
from pathlib import Path

import pytest

from graphdeck.store.db import open_engine
from graphdeck.store.torch_trace import import_torch_trace
from tests.conftest import shared_path
from tests.verdict_surfaces import disagreements

DATA = Path(__file__).parent / "data"
LOGS = ["generated_torch2.13_cpu_gloo/ddp", "generated_torch2.13_cpu_gloo/unused",
        "generated_torch2.13_cpu_gloo/graphbreak", "generated_torch2.13_cpu_gloo/detach",
        "tlparse_tests/inputs/multi_rank_logs", "tlparse_tests/inputs/collectives_parity"]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """``[(store, run name)]``: the logs imported into one store, and the H200 DDP store with its traces."""
    tmp = tmp_path_factory.mktemp("surfaces")
    logs = tmp / "logs.db"
    engine = open_engine(logs)
    for rel in LOGS:
        import_torch_trace(engine, shared_path("data", "torch_trace", *rel.split("/")), run_name=rel)
    engine.dispose()
    from graphdeck.analysis.traces.mapping import link_kernels
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


def test_every_check_says_the_same_on_cli_json_and_api(cases):
    by_store: dict[Path, list[str]] = {}
    for store, run in cases:
        by_store.setdefault(store, []).append(run)
    disagree = [d for store, runs in by_store.items() for d in disagreements(store, runs)]
    assert not disagree, "\n".join(disagree)
