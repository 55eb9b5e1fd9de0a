"""The N-way rank diff (issue 42; NOTE: [N-way rank diff] in analysis/ranks/nway.py) on a real
4-rank gloo job (tests/programs/nway_ranks.py, ranks started as torchrun would: tests/launch.py):
rank 2 takes a rank-dependent branch that adds ``torch.tanh`` to its compiled graph. Checked
through the analysis, the HTTP API (JSON and the merged SVG), the dashboard page in Chromium, and
— on the captured stores of tests/test_mesh_checks.py with parallel layout records added — the
layout's explanations (a pipeline stage, tensor-parallel shard shapes) as NOTEs.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.ranks.nway import nway_report
from graphdeck.store.db import open_engine
from graphdeck.store.schema import Run
from tests.conftest import REPO, LiveServer
from tests.launch import run_ranks
from tests.test_mesh_checks import TP_PARAM, layout_record, mesh_store, pipeline_records, with_layout  # noqa: F401

pytestmark = pytest.mark.slow

PROGRAM = REPO / "tests" / "programs" / "nway_ranks.py"


@pytest.fixture(scope="module")
def nway_store(tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("nway") / "nway.db"
    proc = run_ranks([PROGRAM, store], 4, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=600)
    assert proc.returncode == 0, f"the job failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return store


def report(store: Path, run: str, graph: str, **kw):
    with Session(open_engine(store, read_only=True)) as s:
        return nway_report(s, s.scalars(select(Run).where(Run.name == run)).one(), graph, **kw)


def test_rank_2_is_named_at_the_node_it_adds(nway_store):
    rep = report(nway_store, "nway", "0/0:dynamo")
    assert rep.verdict == "FAIL"
    assert [(c.status, c.ranks) for c in rep.classes] == [("base", [0, 1, 3]), ("differs", [2])]
    added = [n for n in rep.nodes if n.mark == "added"]
    assert [(n.target, n.differs[0].ranks, n.differs[0].kind) for n in added] == [("torch.tanh", [2], "added")]
    line = next(i for i, t in enumerate(PROGRAM.read_text().splitlines(), 1) if "h = torch.tanh(h)" in t)
    assert line  # the branch the program takes on rank 2
    text = rep.to_text()
    assert f"node {added[0].id}: ranks 2 differ: torch.tanh added" in text and "DIFFERS ranks [2]" in text
    # The mapped traces give every rank a time column; tanh runs on rank 2 only.
    fwd = report(nway_store, "nway", "0/0:aot_forward")
    assert fwd.time_ranks == [0, 1, 2, 3]
    tanh = next(n.id for n in fwd.nodes if n.target == "aten.tanh.default")
    assert set(fwd.times[tanh]) == {"2"} and fwd.times[tanh]["2"] > 0
    common = [k for k, v in fwd.times.items() if set(v) == {"0", "1", "2", "3"}]
    assert common, fwd.times  # the nodes every rank runs carry four times
    assert report(nway_store, "nway", "0/0:dynamo", ranks="0,1,3").verdict == "OK"


def test_api_and_merged_svg(nway_store):
    with LiveServer(nway_store) as srv:
        index = httpx.get(f"{srv.url}/api/runs/nway/graphs/nway").json()
        assert [g["key"] for g in index["graphs"]] == ["0/0:dynamo:0", "0/0:aot_forward:0", "0/0:aot_backward:0"]
        assert all(g["ranks"] == 4 and g["fingerprints"] == 2 for g in index["graphs"])
        doc = httpx.get(f"{srv.url}/api/runs/nway/graphs/nway", params={"graph": "0/0:dynamo"}).json()
        assert doc["verdict"] == "FAIL" and doc["exit_code"] == 1
        assert [c["ranks"] for c in doc["classes"]] == [[0, 1, 3], [2]]
        added = next(n for n in doc["nodes"] if n["mark"] == "added")
        svg = httpx.get(f"{srv.url}/api/runs/nway/graphs/nway.svg", params={"graph": "0/0:dynamo"})
        assert svg.status_code == 200 and svg.headers["content-type"].startswith("image/svg+xml")
        assert f'class="node cat-elementwise diff-added" data-name="{added["id"]}"' in svg.text
        for params, status in (({"graph": "9/9:x"}, 404), ({"graph": "0/0:dynamo", "ranks": "0-9"}, 400),
                               ({"graph": "0/0:dynamo", "base": 9}, 400), ({"graph": "<b>x</b>"}, 404)):
            r = httpx.get(f"{srv.url}/api/runs/nway/graphs/nway", params=params)
            assert r.status_code == status, (params, r.text)
            assert r.json()["error"]
        assert httpx.get(f"{srv.url}/api/runs/nope/graphs/nway").status_code == 404


@pytest.mark.browser
def test_page_highlights_the_node_and_names_the_rank(nway_store, browser):
    with LiveServer(nway_store) as srv:
        page = browser.new_page()
        page.goto(f"{srv.url}/#/runs/nway/ranks")
        page.get_by_test_id("nway-link").click()
        page.wait_for_selector("[data-testid=nway-verdict]")
        assert "ranks differ" in page.get_by_test_id("nway-verdict").inner_text()
        classes = page.get_by_test_id("nway-class")
        assert classes.count() == 2 and "ranks 0-1, 3" in classes.nth(0).inner_text()
        assert "rank 2" in classes.nth(1).inner_text() and "tanh" in classes.nth(1).inner_text()
        added = page.locator("#nway-svg g.node.diff-added")
        assert added.count() == 1
        name = added.get_attribute("data-name")
        row = page.locator(f"#nway-nodes tr[data-node='{name}']")
        assert "2" == row.get_by_test_id("nway-ranks").inner_text() and "torch.tanh added" in row.inner_text()
        added.click()
        assert page.locator("#nway-selection").get_attribute("data-node") == name
        assert "ranks 2 differ" in page.locator("#nway-selection").inner_text()
        # the forward graph's tanh: its time on rank 2 only, in the selection line
        page.goto(f"{srv.url}/#/runs/nway/nway?graph=0/0:aot_forward")
        page.wait_for_selector("#nway-svg g.node.diff-added")
        page.locator("#nway-nodes tr[data-node='tanh']").click()
        assert "time per rank (µs): r0 —, r1 —, r2 " in page.locator("#nway-selection").inner_text()
        page.goto(f"{srv.url}/#/runs/nway/nway")  # no graph: the first whose ranks differ
        page.wait_for_function("document.querySelector('#nway-graph')?.value === '0/0:dynamo:0'")
        # another graph from the picker: the forward graph with its per-rank time columns
        page.get_by_test_id("nway-graph").select_option("0/0:aot_forward:0")
        page.wait_for_function("document.querySelector('#nway-graph')?.value === '0/0:aot_forward:0' && "
                               "document.querySelectorAll('#nway-times thead th').length === 5")
        assert page.locator("#nway-times thead").inner_text().split() == ["node", "r0", "r1", "r2", "r3"]
        page.close()


def test_layout_explanations_are_notes(mesh_store, tmp_path):
    """Two pipeline stages (rank 0 linear+relu, rank 1 head+tanh): a divergence without a layout,
    a NOTE once the stages are recorded. TP peers holding w [8, 3] / [8, 2] of Shard(1) [8, 5]:
    the placements explain the shapes (check-ranks' explanation, reused)."""
    plain = report(mesh_store, "stages", "0/0:dynamo", times=False)
    assert plain.verdict == "FAIL" and plain.classes[1].status == "differs"
    staged = report(with_layout(mesh_store, tmp_path / "pp.db", "stages", pipeline_records()), "stages", "0/0:dynamo",
                    times=False)
    assert staged.verdict == "OK", staged.to_text()
    assert staged.classes[1].status == "note" and "pipeline stage 1 vs stage 0" in staged.classes[1].why
    assert staged.nodes and all(n.mark == "note" and all(d.status == "note" for d in n.differs) for n in staged.nodes)

    tp = {r: layout_record(r, mesh_shape=(2,), dim_names=("tp",), params=[TP_PARAM]) for r in (0, 1)}
    rep = report(with_layout(mesh_store, tmp_path / "tp.db", "tp", tp), "tp", "0/0:dynamo", times=False)
    assert rep.verdict == "OK", rep.to_text()
    assert rep.classes[1].status == "note" and "w [8, 3] vs [8, 2]" in rep.classes[1].why
    assert report(mesh_store, "tp", "0/0:dynamo", times=False).verdict == "FAIL"  # no layout: a divergence
