"""The gradient report's run-time evidence over HTTP and in a real browser (issue 17).

One store, three runs, served by the real app: ``skip3`` (a real compiled capture whose box head's
loss term is skipped at step 3, so box_head.* are zero-filled there: FAIL), ``unused`` (the imported
TORCH_TRACE logs of ../shared/data/torch_trace/generated_torch2.13_cpu_gloo/unused, which hold no
parameter list and no run-time evidence: INCOMPLETE, never green) and ``hostile`` (the same logs
with head.weight renamed to HTML markup in the graphs' inputs and gradients). The steps API (``/gradients/steps``), ``allow_incomplete`` on ``/gradients``, and the
gradients page's verdict, coverage box and step × rank strips, in one reused Chromium page.
"""

from __future__ import annotations

import httpx
import pytest
from sqlalchemy import text

from graphdeck.store.db import open_engine
from tests.conftest import LiveServer, shared_path
from tests.test_browser import page  # noqa: F401  (fixture: a page failing on console errors and dialogs)
from tests.test_gradients_evidence import _train

torch_trace = pytest.importorskip("graphdeck.store.torch_trace", reason="the TORCH_TRACE importer (issue #6)")

HOSTILE = "<img src=x onerror=alert(1)>"
BOX_W = [[0, 2, "ok"], [3, 3, "zero"], [4, 7, "ok"]]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    store = tmp_path_factory.mktemp("grad_evidence_ui") / "s.db"
    _train(store, "skip3", compiled=True, steps=8, skip_step=3)
    logs = sorted(shared_path("data", "torch_trace", "generated_torch2.13_cpu_gloo", "unused").glob("*.log"))
    assert logs, "the unused scenario's TORCH_TRACE logs"
    engine = open_engine(store)
    for name in ("unused", "hostile"):
        torch_trace.import_torch_trace(engine, logs, run_name=name, strict=False)
    with engine.begin() as c:  # a parameter named like markup in the graphs' inputs and gradients
        rid = c.execute(text("SELECT id FROM runs WHERE name = 'hostile'")).scalar_one()
        n = c.execute(text("UPDATE graph_io SET param_fqn = :new WHERE param_fqn = 'head.weight' AND graph_id IN "
                           "(SELECT id FROM graphs WHERE run_id = :r)"), {"new": HOSTILE, "r": rid}).rowcount
    assert n > 0, "head.weight is read by the imported graphs"
    engine.dispose()
    with LiveServer(store) as srv:
        yield srv


@pytest.fixture(scope="module")
def api(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def test_steps_api_gives_each_parameters_strip_per_rank(api):
    full = api.get("/api/runs/skip3/gradients/steps").json()
    assert full["verdict"] == "FAIL" and full["steps"] == {"first": 0, "last": 7} and full["ranks"] == [0]
    assert set(full["strips"]) == {"box_head.weight", "box_head.bias"}, "only parameters with a step not ok"
    assert full["strips"]["box_head.weight"]["0"] == BOX_W
    assert full["first_bad"]["box_head.weight"] == {"0": 3}
    assert full["all_ok"] == 4, "trunk.* and cls_head.* got a gradient at every step"
    assert full["coverage"]["steps"]["0"]["backward_passes"] == 8 and full["incomplete"] == []
    one = api.get("/api/runs/skip3/gradients/steps", params=[("fqn", "trunk.weight"), ("fqn", "box_head.weight"),
                                                             ("rank", 0)]).json()
    assert one["strips"] == {"trunk.weight": {"0": [[0, 7, "ok"]]}, "box_head.weight": {"0": BOX_W}}
    assert api.get("/api/runs/skip3/gradients/steps", params={"rank": 5}).json()["strips"] == {}
    bad_rank = api.get("/api/runs/skip3/gradients/steps", params={"rank": "one"})
    assert bad_rank.status_code == 422 and "rank" in bad_rank.text, "FastAPI's validation error, as on /gradients"
    missing = api.get("/api/runs/skip3/gradients/steps", params={"fqn": "no.such"})
    assert missing.status_code == 404 and "no.such" in missing.json()["error"]
    # A run without run-time evidence: no strips, no step range, and it says why.
    unused = api.get("/api/runs/unused/gradients/steps").json()
    assert unused["steps"] is None and unused["strips"] == {} and unused["verdict"] == "INCOMPLETE"
    assert any("parameter list is incomplete" in g for g in unused["incomplete"])


def test_allow_incomplete_turns_incomplete_into_pass(api):
    plain = api.get("/api/runs/unused/gradients").json()
    assert plain["verdict"] == "INCOMPLETE" and plain["ok"] is False and not plain["allow_incomplete"]
    allowed = api.get("/api/runs/unused/gradients", params={"allow_incomplete": "true"}).json()
    assert allowed["allow_incomplete"] is True and allowed["verdict"] == "PASS" and allowed["ok"] is True
    assert allowed["incomplete"] == plain["incomplete"], "the reasons are still listed"
    assert all(p["steps"] is None and p["status"] == "OK" for p in plain["params"]), "no evidence, no strips"
    skip3 = api.get("/api/runs/skip3/gradients", params={"allow_incomplete": "true"}).json()
    assert skip3["verdict"] == "FAIL", "allowing missing evidence never hides a failure"


@pytest.mark.browser
def test_gradients_page_verdict_coverage_and_strips(page, server):  # noqa: F811
    page.goto(f"{server.url}/#/runs/skip3/grads")
    page.locator("#grad-report").wait_for()
    verdict = page.locator("#grad-verdict")
    assert verdict.get_attribute("data-verdict") == "FAIL" and "FAIL" in verdict.inner_text()
    assert "verdict-bad" in verdict.get_attribute("class")
    cov = page.locator("#grad-coverage")
    assert "rank 0: steps 0–7" in cov.inner_text() and "the model's own" in cov.inner_text()
    assert page.locator("#grad-incomplete").count() == 0
    row = page.locator('#grad-report tbody tr[data-fqn="box_head.weight"]')
    segs = row.locator(".step-strip .seg")
    assert segs.evaluate_all("els => els.map(e => [+e.dataset.first, +e.dataset.last, e.dataset.state])") == BOX_W
    zero = row.locator('.seg[data-state="zero"]')
    assert zero.get_attribute("title") == "steps 3–3: zero"
    box = zero.bounding_box()
    assert box and box["width"] > 0 and box["height"] > 0, "the zero block is drawn"
    assert "from step 3" in row.locator("td.steps").inner_text()
    ok_row = page.locator('#grad-report tbody tr[data-fqn="trunk.weight"]')
    assert ok_row.locator(".seg").count() == 1 and "from step" not in ok_row.inner_text()
    # The filters still work with the new column.
    page.select_option("#grad-status", "DEAD_END")
    assert page.locator("#grad-report tbody tr:visible").count() == 2
    page.select_option("#grad-status", "UNKNOWN")
    assert page.locator("#grad-report tbody tr:visible").count() == 0
    page.select_option("#grad-status", "")

    # Same page, the imported run: INCOMPLETE (not green), the reason listed, no strips.
    page.goto(f"{server.url}/#/runs/unused/grads")
    page.locator("#grad-verdict[data-verdict=INCOMPLETE]").wait_for()
    verdict = page.locator("#grad-verdict")
    assert "INCOMPLETE" in verdict.inner_text() and "OK" not in verdict.inner_text()
    assert "verdict-ok" not in verdict.get_attribute("class")
    assert verdict.evaluate("e => getComputedStyle(e).color") != page.evaluate(
        "() => { const s = document.createElement('span'); s.className = 'verdict-ok'; document.body.append(s);"
        " const c = getComputedStyle(s).color; s.remove(); return c; }"), "INCOMPLETE is not drawn in the PASS colour"
    reasons = page.locator("#grad-incomplete li").all_inner_texts()
    assert any("parameter list is incomplete" in r for r in reasons), reasons
    assert page.locator("#grad-report .step-strip").count() == 0
    assert page.locator("#grad-report td.steps").first.inner_text() == "no run-time evidence"

    # A parameter named like markup: text in its rows (and their filter text), no element injected.
    page.goto(f"{server.url}/#/runs/hostile/grads")
    page.locator("#grad-report").wait_for()
    assert page.locator("#grad-report tbody tr").filter(has_text=HOSTILE).count() == 2, "on both ranks, as text"
    page.fill("#grad-filter", "onerror")
    assert page.locator("#grad-report tbody tr:visible").count() == 2
    assert page.locator("#app img").count() == 0, "no element injected from a parameter name"
