"""Algorithm and bus bandwidth per collective (issue 42 item 2; NOTE: [Bus bandwidth] in
analysis/traces/bandwidth.py), on real NCCL traces of the shared corpus (SOURCES.md): HTA's
``nccl_parser_config`` (A100, 2 ranks: all_reduce and broadcast), TraceLens' MI300X ResNet (8
ranks: all_reduce, broadcast) and B200 eager trace (8 ranks: ``_allgather_base``). Every expected
number is computed by hand below from the kernel's args in the file (nelems × dtype size / the
kernel's duration; × the nccl-tests factor), served by the real app, and read on the trace page.
"""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import LiveServer, shared_path
from tests.test_browser import page  # noqa: F401  (fixture: a page failing on console errors)

LINK = 50.0  # GB/s, the server's --link-gbps


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from graphdeck.store.db import open_engine
    from graphdeck.store.traces import ingest_trace

    files = {"a100": shared_path("data", "traces", "hta", "nccl_parser_config", "nccl_data.json.gz"),
             "mi300": shared_path("data", "traces", "tracelens", "mi300", "resnet_act_checkpoint.json.gz"),
             "b200": shared_path("data", "traces", "tracelens", "b200", "eager_trace.json.gz")}
    store = tmp_path_factory.mktemp("bandwidth") / "bw.db"
    engine = open_engine(store)
    ids = {name: ingest_trace(engine, path, run_name=name).trace_id for name, path in files.items()}
    engine.dispose()
    with LiveServer(store, link_gbps=LINK) as srv:
        srv.ids = ids
        yield srv


def _bw(server, name: str, **params) -> dict:
    resp = httpx.get(f"{server.url}/api/traces/{server.ids[name]}/bandwidth", params=params, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_two_rank_all_reduce_and_broadcast_on_a100(server):
    doc = _bw(server, "a100")
    rows = doc["collectives"]
    assert len(rows) == 21 and doc["device"] == "NVIDIA A100-PG509-200" and doc["link_gbps"] == LINK
    first = rows[0]  # broadcast of 53,120 floats in 30.975 us; busbw factor 1
    assert (first["type"], first["group_size"], first["bytes"], first["dur_ns"]) == ("broadcast", 2, 212480, 30975)
    assert first["algbw_gbps"] == pytest.approx(212480 / 30975) == pytest.approx(6.8597, abs=1e-4)
    assert first["busbw_gbps"] == pytest.approx(first["algbw_gbps"])
    ar = rows[3]  # all_reduce of 7,875,584 floats in 2424.415 us; 2(n-1)/n = 1 at n = 2
    assert (ar["type"], ar["bytes"], ar["dur_ns"], ar["formula"]) == ("all_reduce", 31502336, 2424415, "2(n-1)/n")
    assert ar["busbw_gbps"] == pytest.approx(12.9938, abs=1e-4)
    assert ar["link_share"] == pytest.approx(12.9938 / LINK, abs=1e-5)
    # Step 4 (group 0): 7 collectives; the slowest is its longest kernel, #2 (8,196,000 B in 3306.963 us)
    step4 = next(g for g in doc["by_group_step"] if g["step"] == 4)
    assert step4["count"] == 7 and step4["slowest"] == 2 and step4["slowest_dur_ns"] == 3306963
    assert step4["slowest_busbw_gbps"] == pytest.approx(8196000 / 3306963)
    assert step4["lowest_busbw"] == 1, "the 424-byte broadcast of longs: latency-bound"
    assert [r["index"] for r in rows if r["slowest"]] == [g["slowest"] for g in doc["by_group_step"]] == [2, 10, 16]
    assert _bw(server, "a100", link_gbps=100)["collectives"][3]["link_share"] == pytest.approx(0.129938, abs=1e-6)


def test_eight_rank_all_reduce_takes_2_n_minus_1_over_n(server):
    doc = _bw(server, "mi300")
    ar = next(r for r in doc["collectives"] if r["type"] == "all_reduce")
    # 2,873,320 bf16 = 5,746,640 B in 6911.678 us: algbw 0.83144 GB/s, busbw × 2·7/8 = 1.75
    assert (ar["group_size"], ar["bytes"], ar["dur_ns"]) == (8, 5746640, 6911678)
    assert ar["algbw_gbps"] == pytest.approx(0.831439, abs=1e-6)
    assert ar["busbw_gbps"] == pytest.approx(0.831439 * 1.75, abs=1e-6)
    bc = next(r for r in doc["collectives"] if r["type"] == "broadcast")
    assert bc["busbw_gbps"] == pytest.approx(bc["algbw_gbps"]) and bc["group_size"] == 8
    assert doc["device"] == "AMD Instinct MI300X"


def test_all_gather_counts_the_gathered_output_and_takes_n_minus_1_over_n(server):
    [ag] = _bw(server, "b200")["collectives"]
    # _allgather_base: 25,136 bf16 in, 201,088 out (8 ranks) = 402,176 B in 21.953 us; busbw × 7/8
    assert (ag["type"], ag["group"], ag["group_size"], ag["bytes"], ag["dur_ns"]) == ("all_gather", "3", 8, 402176, 21953)
    assert ag["algbw_gbps"] == pytest.approx(18.31987, abs=1e-5)
    assert ag["busbw_gbps"] == pytest.approx(18.31987 * 7 / 8, abs=1e-5)


def test_formula_per_collective_type():
    from graphdeck.analysis.traces.bandwidth import bus_factor, collective_type

    cases = {"allreduce": ("all_reduce", 1.75), "_allgather_base": ("all_gather", 0.875),
             "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0.875), "_reduce_scatter_base": ("reduce_scatter", 0.875),
             "all_to_all": ("all_to_all", 0.875), "alltoall_base": ("all_to_all", 0.875), "broadcast": ("broadcast", 1.0),
             "reduce": ("reduce", 1.0), "send": ("send", 1.0), "recv": ("recv", 1.0)}
    for name, (kind, factor) in cases.items():
        got, formula = collective_type(name)
        assert (got, bus_factor(formula, 8)) == (kind, factor), name
    assert collective_type(None, "ncclDevKernel_AllGather_RING_LL(x)")[0] == "all_gather"
    assert collective_type("barrier")[1] is None and bus_factor(None, 8) is None


@pytest.mark.browser
def test_trace_page_shows_busbw_per_collective(page, server):  # noqa: F811
    page.goto(f"{server.url}/#/traces/{server.ids['a100']}")
    table = page.get_by_test_id("bandwidth-table")
    table.wait_for()
    heads = table.locator("thead th").all_inner_texts()
    assert heads[8:11] == ["algbw GB/s", "busbw GB/s", "of link peak"], heads
    row = table.locator('tr[data-index="3"] td').all_inner_texts()
    assert row[3] == "all_reduce" and row[9] == "12.99" and row[10] == "26.0%", row
    assert table.locator('tr[data-slowest="true"]').count() == 3
    assert "2(n-1)/n" in page.get_by_test_id("bandwidth-summary").inner_text()
    steps = page.get_by_test_id("bandwidth-steps").locator("tbody tr").first.locator("td").all_inner_texts()
    assert steps[:3] == ["0", "4", "7"] and steps[5] == "#2 all_reduce", steps
