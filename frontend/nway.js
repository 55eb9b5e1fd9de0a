// graphdeck dashboard: the N-way rank diff (#/runs/<id>/nway?graph=<key>&ranks=<0,2-5>&base=<rank>),
// from GET /api/runs/<id>/graphs/nway (analysis/ranks/nway.py, NOTE: [N-way rank diff]).
//
// One graph across the ranks of a run, drawn once: the server's SVG of the merged graph
// (GET .../graphs/nway.svg; nodes where a rank differs carry diff-changed / diff-removed /
// diff-added, or diff-note where the parallel layout explains the difference). Beside it: the
// classes of identical ranks (base, same, note, differs, missing, with why), the nodes where ranks
// differ (ranks grouped by what they do there) and a per-rank column of node time. A click on a
// node selects its row and a click on a row selects the node. Nothing here computes a verdict: the
// page draws the API's JSON; text from the store goes through h() (textContent), never markup.

import {api, badge, h, setCrumbs, table} from "./common.js";
import {rankRanges} from "./heatmap.js";
import {importSvg, makeViewer} from "./viewer.js";

const STATUS_CLASS = {base: "status-ok", same: "status-ok", note: "status-partial", differs: "status-NO_GRAD",
  missing: "status-partial"};

const ranksText = (rs) => rankRanges(rs, 12);

const us = (ns) => (ns == null ? "—" : (ns / 1e3).toFixed(1));

function classItem(c) {
  return h("li", {class: `nway-class nway-${c.status}`, "data-testid": "nway-class", "data-status": c.status},
    badge(c.status, `status ${STATUS_CLASS[c.status] || ""}`), " ",
    h("strong", {}, `rank${c.ranks.length > 1 ? "s" : ""} ${ranksText(c.ranks)}`),
    c.graph_id != null ? [" ", h("a", {href: `#/graphs/${c.graph_id}`}, `graph #${c.graph_id}`)] : null,
    c.why ? h("span", {class: "muted"}, ` — ${c.why}`) : null);
}

function nodeRows(report) {
  return report.nodes.flatMap((n) => n.differs.map((d, i) => h("tr", {"data-node": n.id,
    class: `nway-row nway-${d.status}`},
  i === 0 ? h("td", {rowspan: n.differs.length}, h("code", {}, n.id)) : null,
  h("td", {"data-testid": "nway-ranks"}, ranksText(d.ranks)),
  h("td", {}, badge(d.status === "note" ? "note" : "differs", `status ${d.status === "note" ? "status-partial" : "status-NO_GRAD"}`),
    " ", d.detail))));
}

function timeRows(report, marked) {
  const ids = Object.keys(report.times);
  const peak = (id) => Math.max(...Object.values(report.times[id]));
  ids.sort((a, b) => (marked.has(b) - marked.has(a)) || peak(b) - peak(a));
  return ids.map((id) => h("tr", {"data-node": id, class: marked.has(id) ? "nway-marked" : null},
    h("td", {}, h("code", {}, id), marked.has(id) ? " *" : ""),
    report.time_ranks.map((r) => h("td", {class: "num"}, us(report.times[id][String(r)])))));
}

export async function renderNway(page, m, query) {
  const run = encodeURIComponent(m[1]);
  const index = await api(`/api/runs/${run}/graphs/nway`);
  if (!page.alive()) return;
  const graph = query.get("graph") || (index.graphs.find((g) => g.fingerprints > 1) || index.graphs[0] || {}).key;
  setCrumbs([["Runs", "#/runs"], [index.run, `#/runs/${run}`], ["rank consistency", `#/runs/${run}/ranks`],
    ["N-way rank diff", null]]);
  if (!graph) {
    document.getElementById("app").replaceChildren(h("p", {class: "muted"}, "This run stored no graph."));
    return;
  }
  const params = new URLSearchParams({graph});
  for (const k of ["ranks", "base"]) if (query.get(k)) params.set(k, query.get(k));
  const [report, svgText] = await Promise.all([api(`/api/runs/${run}/graphs/nway?${params}`),
    api(`/api/runs/${run}/graphs/nway.svg?${params}`, {text: true})]);
  if (!page.alive()) return;
  const picker = h("select", {id: "nway-graph", "data-testid": "nway-graph",
    onchange: (e) => { location.hash = `#/runs/${run}/nway?graph=${encodeURIComponent(e.target.value)}`; }},
  index.graphs.map((g) => h("option", {value: g.key, selected: g.key === report.key ? true : null},
    `${g.key} — ${g.ranks} ranks, ${g.fingerprints} fingerprint${g.fingerprints === 1 ? "" : "s"}`)));
  const host = h("div", {id: "nway-svg", class: "svg-host", "data-testid": "nway-svg"});
  const marked = new Set(report.nodes.map((n) => n.id));
  const ok = report.verdict === "OK";
  const info = h("p", {id: "nway-selection", class: "muted"}, "Click a node or a row.");
  document.getElementById("app").replaceChildren(h("section", {class: "nway-page"},
    h("h1", {}, `N-way rank diff — ${report.run}`),
    h("p", {}, "Graph ", picker),
    h("p", {class: "verdict", "data-testid": "nway-verdict"},
      h("strong", {class: ok ? "verdict-ok" : "verdict-bad"}, {
        OK: "every rank has the same graph", FAIL: "ranks differ", INCOMPLETE: "incomplete: evidence missing",
        WARN: "some ranks did not compile this graph (see rank consistency for whether it can hang)",
      }[report.verdict]),
      `   ${report.ranks.length} ranks in ${report.classes.length} class${report.classes.length === 1 ? "" : "es"}; base: rank ${report.base_rank}`),
    h("ul", {class: "nway-classes", "data-testid": "nway-classes"}, report.classes.map(classItem)),
    report.notes.map((n) => h("p", {class: "muted", "data-testid": "nway-note"}, n)),
    report.missing_evidence.map((n) => h("p", {class: "hang-note"}, badge("missing evidence", "status status-partial"), " ", n)),
    info,
    h("div", {class: "graph-layout"}, h("div", {class: "viewer"}, host),
      h("div", {class: "nway-side"},
        h("h2", {}, "Nodes where ranks differ"),
        table("nway-nodes", ["node", "ranks", "what they do"], nodeRows(report), "",
          {empty: "every rank has the same nodes"}),
        h("h2", {}, "Node time per rank (µs)"),
        table("nway-times", ["node", ...report.time_ranks.map((r) => `r${r}`)], timeRows(report, marked), "",
          {empty: "no profiler trace mapped onto this graph"})))));
  const svg = importSvg(svgText);
  host.replaceChildren(svg);
  const gMap = new Map([...svg.querySelectorAll("g.node[data-name]")].map((g) => [g.dataset.name, g]));
  const viewer = makeViewer(svg, host, [...gMap.values()]);
  function select(name) {
    for (const el of document.querySelectorAll(".nway-page .selected")) el.classList.remove("selected");
    const g = gMap.get(name);
    if (g) { g.classList.add("selected"); viewer.centerOn(g); }
    for (const tr of document.querySelectorAll(`.nway-page tr[data-node]`)) {
      if (tr.dataset.node === name) tr.classList.add("selected");
    }
    const node = report.nodes.find((n) => n.id === name);
    info.replaceChildren(h("code", {}, name), ": ", node
      ? node.differs.map((d) => `ranks ${ranksText(d.ranks)} ${d.status === "note" ? "(note)" : "differ"}: ${d.detail}`).join("; ")
      : "the same on every rank",
    report.times[name] ? ` · time per rank (µs): ${report.time_ranks.map((r) => `r${r} ${us(report.times[name][String(r)])}`).join(", ")}` : "");
    info.dataset.node = name;
  }
  host.addEventListener("click", (e) => {
    const g = e.target.closest("g.node[data-name]");
    if (g && !viewer.justDragged()) select(g.dataset.name);
  });
  for (const tr of document.querySelectorAll(".nway-page tr[data-node]")) {
    tr.addEventListener("click", () => select(tr.dataset.node));
  }
}
