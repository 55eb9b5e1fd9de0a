"""The trace page of a GPU trace fits a 1440-px window (issue 36, item 4): the "Largest gaps on a
stream" table printed kernel names unbroken (Triton's run 200+ characters), so the page scrolled
sideways. Real parts: Kineto-format traces ingested into a SQLite store (the repository's H200
DDP trace, and one whose kernels carry 240-character names and no launch, so the gaps table
names them), the app over HTTP, Debian Chromium via Playwright.
"""

from __future__ import annotations

import json

import pytest

from graphdeck.store.db import open_engine
from graphdeck.store.traces import ingest_trace
from tests.conftest import REPO, LiveServer

pytestmark = pytest.mark.browser


LONG = "triton_red_fused__native_batch_norm_legit_functional_add_convolution_backward_" * 3


def long_names(path):
    kernels = [{"ph": "X", "cat": "kernel", "name": f"{LONG}{i}", "ts": 1000 + i * 400, "dur": 100, "pid": 0, "tid": 7,
                "args": {"device": 0, "stream": 7}} for i in range(6)]
    path.write_text(json.dumps({"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H200"}],
                                "traceEvents": kernels}))
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tracewidth")
    engine = open_engine(tmp / "s.db")
    ids = [ingest_trace(engine, REPO / "tests/data/ddp_h200x2/ddp_rank0.pt.trace.json.gz", run_name="ddp", rank=0).trace_id,
           ingest_trace(engine, long_names(tmp / "long.json"), run_name="long", rank=0).trace_id]
    engine.dispose()
    with LiveServer(tmp / "s.db") as srv:
        yield srv, ids


@pytest.mark.parametrize("which", [0, 1], ids=["h200-ddp", "long-kernel-names"])
def test_the_trace_page_fits_a_1440_px_window(server, browser, which):
    srv, ids = server
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{srv.url}/#/traces/{ids[which]}")
    page.wait_for_selector("#gaps-table tbody tr", timeout=120_000)
    page.wait_for_selector("#delays-table")
    longest = page.evaluate("() => Math.max(...[...document.querySelectorAll('.trace-page td')]"
                            ".map((td) => td.textContent.length))")
    if which == 1:
        assert longest > 200, f"the page holds a long kernel name (the case this test is about): {longest}"
    widths = page.evaluate("() => [document.documentElement.scrollWidth, window.innerWidth]")
    assert widths[0] <= widths[1], f"the page scrolls sideways: {widths[0]} px wide in a {widths[1]} px window"
    assert not errors, errors
    page.close()
