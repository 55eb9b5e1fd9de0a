"""Issue 18, item 6 (render side), over real HTTP against the real app: names holding characters
XML forbids (NUL, other C0 controls, U+FFFE/U+FFFF, lone surrogates) still give graph and compare
SVGs that parse; names holding markup or links stay text in the Plotly figures (checked in
Chromium with the Plotly the dashboard ships)."""

from __future__ import annotations

import json
import sqlite3
import xml.etree.ElementTree as ET
from urllib.parse import quote

import httpx
import pytest

from graphdeck.analysis.graphs.view import GraphView, ViewEdge, ViewNode
from graphdeck.capture.upload import upload_store
from graphdeck.server.render.svg import fallback_svg, note_svg, render_graph_svg
from graphdeck.server.render.timeline import timeline_figure
from tests.conftest import LiveServer

TOKEN = "render-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FORBIDDEN = "\x00\x01\x1f\ufffe\uffff"
LINK = '<a href="https://evil.example/x">click</a><b>bold</b>'
SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture
def server(tmp_path):
    with LiveServer(tmp_path / "server.db", write_tokens=(TOKEN,), data_dir=tmp_path / "data") as srv, \
            httpx.Client(base_url=srv.url, headers=AUTH, timeout=120) as c:
        srv.client = c
        yield srv


def parse(body: bytes) -> ET.Element:
    """The SVG as an XML parser (a browser's DOMParser) reads it: bytes, UTF-8."""
    return ET.fromstring(body)


def test_graph_and_compare_svgs_parse_with_characters_xml_forbids(server, captured_store, tmp_path):
    path = tmp_path / "odd.db"
    con = sqlite3.connect(captured_store)
    con.execute("VACUUM INTO ?", (str(path),))
    con.close()
    con = sqlite3.connect(path)
    con.execute("UPDATE nodes SET name = name || ?", (FORBIDDEN,))
    con.execute("UPDATE strings SET value = value || ?", (FORBIDDEN,))  # targets, module paths, stack traces
    con.execute("UPDATE graphs SET name = name || ?", (FORBIDDEN,))
    con.commit()
    con.close()
    run_id = upload_store(server.url, path, run="odd" + FORBIDDEN[1:], rank=0, token=TOKEN)["result"]["run_id"]
    c = server.client
    graphs = c.get(f"/api/runs/{run_id}/graphs").json()
    assert len(graphs) >= 3
    checked = 0
    for g in graphs:
        nodes = c.get(f"/api/graphs/{g['id']}/nodes").json()
        assert all(n["name"].endswith(FORBIDDEN) for n in nodes), "the names are stored and served as they are"
        other = next(o["id"] for o in graphs if o["id"] != g["id"])
        views = [{}, {"max_depth": 99}, {"diff_against": other}, {"diff_against": other, "max_depth": 99},
                 {"filter_by_op": ".*mm.*", "max_depth": 99}, {"overlay": "bytes", "max_depth": 99},
                 {"node": nodes[len(nodes) // 2]["name"]}, {"download": "true"}]
        for params in views:
            r = c.get(f"/api/graphs/{g['id']}/svg", params=params)
            assert r.status_code == 200, (params, r.text[:300])
            root = parse(r.content)  # raises on a character XML forbids
            checked += 1
            if params.get("max_depth") == 99 and "diff_against" not in params:
                shown = {e.get("data-name") for e in root.iter(f"{SVG}g") if e.get("data-name")}
                assert shown
                assert {n["name"].rstrip(FORBIDDEN) for n in nodes} >= shown, "names lose only what XML forbids"
    assert checked == len(graphs) * 8


def _view(name: str) -> GraphView:
    nodes = [ViewNode(id=f"x{name}", idx=0, label=f"x{name}", op="placeholder", target=f"x{name}",
                      category="placeholder", namespace=f"block{name}/inner", shape=[2], dtype="torch.float32"),
             ViewNode(id=f"relu{name}", idx=1, label="relu", op="call_function", target=f"aten.relu{name}",
                      category="elementwise", namespace=f"block{name}"),
             ViewNode(id="output", idx=2, label="output", op="output", target="output", category="output")]
    edges = [ViewEdge(src=f"x{name}", dst=f"relu{name}", size_bytes=8), ViewEdge(src=f"relu{name}", dst="output")]
    return GraphView(graph_id=1, name=f"g{name}", kind="dynamo", nodes=nodes, edges=edges)


@pytest.mark.parametrize("odd", [FORBIDDEN, "\ud800", "\udfff tail", "\x0b\x0c\x7f"])
def test_every_svg_builder_drops_what_xml_forbids(odd):
    view = _view(odd)
    for svg in (render_graph_svg(view), render_graph_svg(view, max_depth=0), render_graph_svg(view, max_depth=9),
                render_graph_svg(view, marks={f"x{odd}": "added"}, max_depth=9),
                fallback_svg(view, None, f"why{odd}"), note_svg(f"note{odd}")):
        parse(svg.encode("utf-8"))  # a lone surrogate would not even encode


def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def test_plotly_figures_show_markup_in_names_as_text(server, browser):
    c = server.client
    events = [{"ph": "X", "name": f"op {LINK}", "cat": f"cat {LINK}", "ts": 1, "dur": 5, "pid": 1, "tid": 7},
              {"ph": "X", "name": "aten::mm", "cat": "cpu_op", "ts": 2, "dur": 1, "pid": 1, "tid": 7},
              {"ph": "i", "name": f"mark {LINK}", "cat": f"cat {LINK}", "ts": 3, "pid": 1, "tid": 7, "s": "t"},
              {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": f"thread {LINK}"}}]
    run = 'run <a href="https:evil.example">click'  # no '/': the name is a path segment of this route
    r = c.post(f"/api/runs/{quote(run, safe='')}/traces", params={"name": f"trace {LINK}"},
               content=json.dumps({"traceEvents": events}).encode())
    assert r.status_code == 201, r.text
    trace_id, run_id = r.json()["trace_id"], r.json()["run_id"]
    figures = {"trace": c.get(f"/api/traces/{trace_id}/timeline").json(),
               "run": c.get(f"/api/runs/{run_id}/timeline").json(),
               "pure": timeline_figure([{**e, "ts_ns": e["ts"] * 1000, "dur_ns": e.get("dur", 0) * 1000}
                                        for e in events if e["ph"] != "M"], title=f"title {LINK}",
                                       thread_names={"1/7": f"thread {LINK}"})}
    for what, fig in figures.items():
        texts = _strings(fig.get("data")) + _strings({k: v for k, v in fig.get("layout", {}).items() if k != "meta"})
        assert not [t for t in texts if "<a" in t or "<b>" in t], f"{what}: markup reaches Plotly as markup"
        assert any("&lt;a href=" in t for t in texts), f"{what}: the names are still shown"

    page = browser.new_page()
    try:
        page.set_content('<div id="plot" style="width:1000px;height:600px"></div>')
        page.add_script_tag(url=f"{server.url}/static/vendor/plotly.min.js")
        for what, fig in figures.items():
            links = page.evaluate(
                """async (fig) => {
                    const div = document.getElementById('plot');
                    await Plotly.newPlot(div, fig.data, fig.layout, {displayModeBar: false});
                    const shown = [...div.querySelectorAll('svg text')].map((t) => t.textContent).join(' ');
                    return {links: div.querySelectorAll('svg a').length, bold: div.querySelectorAll('svg tspan[style*="bold"]').length,
                            shown};
                }""", fig)
            assert links["links"] == 0 and links["bold"] == 0, f"{what}: Plotly made links or bold text: {links}"
            assert '<a href="https://evil.example/x">' in links["shown"], f"{what}: the name shows as text"
    finally:
        page.close()


def test_cleaned_text_keeps_tabs_newlines_and_unicode():
    """What XML allows survives: tabs and newlines in tooltips, non-ASCII names, emoji (astral)."""
    from graphdeck.server.render.xmltext import clean, plotly_text, xml_safe

    assert clean("a\tb\nc", newlines=True) == "a b\nc"
    assert clean("κόμβος 🙂\x00\uffff") == "κόμβος 🙂"
    assert xml_safe("<t>\t\n\r ok \x00\ufffe</t>") == "<t>\t\n\r ok </t>"
    assert plotly_text("a<b>&c") == "a&lt;b&gt;&amp;c"
