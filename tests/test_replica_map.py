"""DDP and the default process group on the parallel map (issue 42 item 5; NOTE: [Replica row] in
analysis/parallel/replicas.py).

Inputs: the main job's own store (tests/data/demo_warm_bucket: ``graphdeck demo``, GPT-2 under DDP
on 2 gloo ranks, 3 gradient buckets of 1 MB), served by the real app; plus runs whose records are
written as the capture writes them: a plain ``torch.distributed`` job (only the default group, no
DDP), a 64-rank DDP job one rank of which wrote no record, and a DDP record whose process-group
name is markup. Before, each said "no parallel layout record".
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import httpx
import pytest

from tests.conftest import LiveServer
from tests.test_browser import page  # noqa: F401  (fixture: a page failing on console errors)

WARM = Path(__file__).resolve().parent / "data" / "demo_warm_bucket" / "demo.db.gz"
HOSTILE = "<img src=x onerror=alert(1)>"
#: The demo's rebuilt buckets (rank 0's newest graphdeck_comm_groups record), bytes.
DEMO_BUCKETS = [1055744, 1049600, 595968]


def _pg_record(ranks: list[int], name: str = "0") -> dict:
    return {"groups": [{"name": name, "desc": "default_pg", "backend": "gloo", "ranks": ranks, "timeout_s": 1800.0}]}


def _ddp_record(ws: int, pg: str, sizes: list[int]) -> dict:
    return {"world_size": ws, "fsdp": [], "ddp": [{
        "process_group": pg, "find_unused_parameters": False, "static_graph": False,
        "buckets": [{"index": i, "params": [f"p{i}"], "numel": n // 4, "size_bytes": n} for i, n in enumerate(sizes)]}]}


def _add_run(store: Path, name: str, ws: int, records: dict[str, dict[int, dict]]) -> None:
    from graphdeck.store.db import open_engine, write_session
    from graphdeck.store.schema import CompileEvent, Rank, Run

    engine = open_engine(store)
    with write_session(engine) as s:
        run = Run(name=name, world_size=ws)
        s.add(run)
        s.flush()
        s.add_all([Rank(run_id=run.id, rank=r, world_size=ws, backend="gloo") for r in range(ws)])
        s.add_all([CompileEvent(run_id=run.id, rank=r, name=event, compile_id=None, payload=json.dumps(p))
                   for event, by_rank in records.items() for r, p in sorted(by_rank.items())])
    engine.dispose()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    store = tmp_path_factory.mktemp("replica_map") / "demo.db"
    with gzip.open(WARM, "rb") as fin, open(store, "wb") as fout:
        shutil.copyfileobj(fin, fout)
    _add_run(store, "plain", 2, {"graphdeck_process_groups": {r: _pg_record([0, 1]) for r in (0, 1)}})
    big = [r for r in range(64) if r != 37]
    _add_run(store, "ddp64", 64, {"graphdeck_process_groups": {r: _pg_record(list(range(64))) for r in big},
                                  "graphdeck_comm_groups": {r: _ddp_record(64, "0", [2**20, 2**19]) for r in big}})
    _add_run(store, "hostile", 2, {"graphdeck_comm_groups": {r: _ddp_record(2, HOSTILE, [4096]) for r in (0, 1)}})
    with LiveServer(store) as srv:
        yield srv


def _map(server, run: str, **params) -> dict:
    resp = httpx.get(f"{server.url}/api/runs/{run}/parallel-map", params=params, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_demo_ddp_job_is_one_replica_row_with_its_buckets(server):
    body = _map(server, "demo", checks="layout")
    assert body["has_layout"] is True, body.get("message")
    rep = body["replica"]
    assert rep["kind"] == "ddp" and rep["process_group"] == "0" and rep["ranks"] == [0, 1]
    assert rep["backend"] == "gloo" and rep["desc"] == "default_pg"
    assert rep["ddp"]["buckets"] == 3 and rep["ddp"]["bucket_bytes"] == DEMO_BUCKETS
    assert rep["ddp"]["bytes"] == sum(DEMO_BUCKETS) == 2701312 and rep["ddp"]["ranks"] == [0, 1]
    assert "3 gradient buckets, 2.6 MiB all-reduced per step" in rep["text"], rep["text"]
    [stage] = body["stages"]
    [row] = stage["rows"]
    assert row["label"] == "DDP replicas · process group 0" and stage["cols"] == ["rank 0", "rank 1"]
    assert [c["ranks"] for c in row["cells"]] == [[0], [1]] and body["unplaced"] == []
    layout = next(c for c in body["checks"] if c["key"] == "layout")
    assert layout["counts"] == {"ok": 2} and "DDP replica group" in layout["message"]


@pytest.mark.browser
def test_demo_map_page_draws_the_replica_row(page, server):  # noqa: F811
    page.goto(f"{server.url}/#/runs/demo/map")
    page.locator('[data-complete="true"] [data-testid="parallel-map"]').wait_for()
    assert page.get_by_test_id("map-empty").count() == 0
    text = page.get_by_test_id("map-replica").inner_text()
    assert "DDP replica group: process group 0 (default_pg, gloo), 2 ranks; 3 gradient buckets" in text, text
    assert "1.01 MiB, 1.00 MiB, 0.57 MiB" in page.get_by_test_id("map-replica-buckets").inner_text()
    assert page.get_by_test_id("map-row").all_inner_texts() == ["DDP replicas · process group 0"]
    assert [c.get_attribute("data-ranks") for c in page.get_by_test_id("map-cell").all()] == ["0", "1"]
    assert page.locator('.mbadge[data-check="layout"]').count() == 0


def test_plain_distributed_job_is_its_default_group(server):
    body = _map(server, "plain", checks="layout")
    rep = body["replica"]
    assert body["has_layout"] and rep["kind"] == "default_group" and rep["ddp"] is None and rep["ranks"] == [0, 1]
    assert rep["text"].startswith("one replica group: process group 0 (default_pg, gloo), 2 ranks"), rep["text"]
    assert body["stages"][0]["rows"][0]["label"] == "replicas · process group 0"


def test_large_ddp_job_merges_identical_replicas_and_names_the_silent_rank(server):
    body = _map(server, "ddp64", checks="layout")
    rep = body["replica"]
    assert rep["ranks"] == list(range(64)) and rep["unrecorded"] == [37] and rep["ddp"]["bytes"] == 3 * 2**19
    cells = [c["ranks"] for c in body["stages"][0]["rows"][0]["cells"]]
    assert cells == [list(range(37)), [37], list(range(38, 64))], cells
    layout = next(c for c in body["checks"] if c["key"] == "layout")
    assert layout["counts"] == {"missing": 1, "ok": 63}
    full = _map(server, "ddp64", checks="layout", expand="true")
    assert len(full["stages"][0]["rows"][0]["cells"]) == 64


@pytest.mark.browser
def test_markup_in_a_group_name_stays_text(page, server):  # noqa: F811
    page.goto(f"{server.url}/#/runs/hostile/map")
    page.locator('[data-complete="true"] [data-testid="parallel-map"]').wait_for()
    assert HOSTILE in page.get_by_test_id("map-replica").inner_text()
    assert page.get_by_test_id("map-row").inner_text() == f"DDP replicas · process group {HOSTILE}"
    assert page.locator("img").count() == 0


def test_a_recorded_ddp_mesh_keeps_its_grid_and_gains_the_buckets(server, tmp_path):
    """A job captured since the capture records DDP's group as a 1-D ``ddp`` mesh: the grid is the
    mesh's (one row per replica), and the map now names DDP's buckets and bytes too."""
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from graphdeck.server.routes.parallel_map import parallel_map
    from graphdeck.store.db import open_engine
    from graphdeck.store.schema import Run
    from tests.nd_fixtures import layout_record

    store = tmp_path / "meshed.db"
    with gzip.open(WARM, "rb") as fin, open(store, "wb") as fout:
        shutil.copyfileobj(fin, fout)
    recs = {r: layout_record(r, mesh_shape=(2,), dim_names=("ddp",), world_size=2) for r in (0, 1)}
    _add_run(store, "meshed", 2, {"graphdeck_parallel_layout": recs,
                                  "graphdeck_comm_groups": {r: _ddp_record(2, "0", [2**20]) for r in (0, 1)},
                                  "graphdeck_process_groups": {r: _pg_record([0, 1]) for r in (0, 1)}})
    _add_run(store, "meshed_plain", 2, {"graphdeck_parallel_layout": recs,
                                        "graphdeck_process_groups": {r: _pg_record([0, 1]) for r in (0, 1)}})
    with Session(open_engine(store, read_only=True)) as s:
        m = parallel_map(s, s.scalar(select(Run).where(Run.name == "meshed")), checks=["layout"])
        plain = parallel_map(s, s.scalar(select(Run).where(Run.name == "meshed_plain")), checks=["layout"])
    assert m["dims"] == {"stage": None, "rows": ["ddp"], "cols": []} and len(m["stages"][0]["rows"]) == 2
    assert m["replica"]["ddp"]["buckets"] == 1 and m["replica"]["ddp"]["bytes"] == 2**20 and not m["notes"]
    assert plain["replica"] is None, "a mesh job's default group adds nothing to its map"


def test_overview_layout_line_names_the_replica_group(server):
    """The run page's layout line (the overview) says what the map draws: one fact, one text."""
    line = httpx.get(f"{server.url}/api/runs/demo/summary/layout", timeout=120).json()
    assert line["verdict"] == "N/A", "no mesh recorded: nothing to check per mesh dimension"
    rep = _map(server, "demo", checks="layout")["replica"]
    assert rep["text"] in line["headline"] and "one replica row" in line["headline"], line["headline"]
