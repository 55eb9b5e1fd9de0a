// graphdeck dashboard: a hash-routed page over the JSON API served by graphdeck.server.
//
// Pages: #/runs, #/runs/<id>, #/runs/<id>/rank/<r>, #/runs/<id>/ranks, #/runs/<id>/nway, #/runs/<id>/map, #/graphs/<id>/memory, #/graphs/<id>[?node=<fx node name>], #/traces/<id>,
// #/diff?a=<run>&b=<run>, #/parity?a=<sharded run>&b=<reference run>.
//
// Modules (ES modules, no build step):
//   app.js      this router
//   common.js   DOM and formatting helpers, the JSON API, breadcrumbs (see NOTE: [Untrusted text])
//   run.js      the runs list, the run page and its gradient-path report
//   overview.js the run page's overview: each check drawn as it answers
//   live.js     the run page's live section: a running job's heartbeats and live hang report (polled)
//   heatmap.js  the rank heatmap (a large run's ranks in one canvas) and one rank's page
//   grads.js    the gradient-path report: its page (#/runs/<id>/grads) and the run page's section
//   compile.js  the run page's compile records (frame compile metrics, graph-break reasons)
//   compare.js  two graphs side by side: diff marks, forward/backward seq_nr links
//   nway.js     the N-way rank diff (#/runs/<id>/nway?graph=): one graph across all ranks, classes of
//               identical ranks, the nodes where they differ, node time per rank
//   diff.js     run B against run A (#/diff?a=&b=): findings of diff-runs, each linking both runs' graphs
//   parity.js   a sharded run against its unsharded reference (#/parity?a=&b=): gradients per parameter
//   graph.js    the graph page: node search and selection, long-edge stubs, node details, related graphs
//   viewer.js   the graph page's SVG viewer: safe import, pan/zoom, the initial view
//   map.js      the parallel map (#/runs/<id>/map): stage → TP group → replicas, per-rank badges
//   cost.js     one cost table per rank (#/runs/<id>/cost): step time, collectives, memory, compile
//   trace.js    the trace page: Plotly timeline (zoom fetches the window), analyses and ingest stats
//   replay.js   trace replay (cursor over the timeline, the running kernel's graph node lit) and
//               the multi-rank timeline of a run
//
// A page renderer is `async (page, match, query)`; `page.alive()` turns false once the user has
// navigated away, so a late answer never draws over the next page. A renderer may set
// `page.update(query)` to take a change of the ?query part without a full redraw.

import {$app, ApiError, errorBox, h} from "./common.js";
// Page modules are imported when their route is first opened (a run page loads run.js and what it
// imports, not the graph viewer, Plotly's loader or the diff page): fewer requests before the
// first picture of a large run (issue 26 item 2).
const lazy = (file, name) => async (page, m, q) => (await import(file))[name](page, m, q);

const routes = [
  [/^\/runs\/?$/, lazy("./run.js", "renderRuns")],
  [/^\/runs\/([^/]+)$/, lazy("./run.js", "renderRun")], // a run's id or its name
  [/^\/runs\/([^/]+)\/ranks$/, lazy("./ranks.js", "renderRanks")], // cross-rank consistency
  [/^\/runs\/([^/]+)\/nway$/, lazy("./nway.js", "renderNway")], // one graph across all ranks (?graph=&ranks=&base=)
  [/^\/runs\/([^/]+)\/rank\/(\d+)$/, async (page, m, q) => { // one rank (?step=): the heatmap's drill-down
    const [{renderRankPage}, {rankSection}] = await Promise.all([import("./heatmap.js"), import("./run.js")]);
    return renderRankPage(page, m, q, rankSection);
  }],
  [/^\/runs\/([^/]+)\/grads$/, lazy("./grads.js", "renderGrads")], // gradient-path report (?status=&rank=)
  [/^\/runs\/([^/]+)\/map$/, lazy("./map.js", "renderMap")], // parallel map: stages, TP groups, replicas, badges
  [/^\/runs\/([^/]+)\/cost$/, lazy("./cost.js", "renderCost")], // one cost table per rank (?step=&sort=&desc=)
  [/^\/graphs\/(\d+)$/, lazy("./graph.js", "renderGraph")],
  [/^\/graphs\/(\d+)\/memory$/, lazy("./memory.js", "renderMemory")], // graph-derived memory, measured beside it
  [/^\/compare\/(\d+)\/(\d+)$/, lazy("./compare.js", "renderCompare")], // two graphs side by side (diff, fwd/bwd)
  [/^\/traces\/(\d+)$/, lazy("./trace.js", "renderTrace")],
  [/^\/traces\/(\d+)\/replay$/, lazy("./replay.js", "renderReplay")], // ?step=&step_interval_ms=&highlight=
  [/^\/runs\/([^/]+)\/timeline$/, lazy("./replay.js", "renderRunTimeline")], // every rank on one aligned axis
  [/^\/diff$/, lazy("./diff.js", "renderDiff")], // run B against run A (?a=&b=): diff-runs' findings, both runs' graphs linked
  [/^\/parity$/, lazy("./parity.js", "renderParity")], // sharded run A against its reference B (?a=&b=): gradients per parameter
];

let current = null; // the page on screen: {path, alive(), update?(query)}
let generation = 0;

function parseHash() {
  const raw = location.hash.replace(/^#/, "");
  const cut = raw.indexOf("?");
  const path = (cut < 0 ? raw : raw.slice(0, cut)) || "/runs";
  return {path: path === "/" ? "/runs" : path, query: new URLSearchParams(cut < 0 ? "" : raw.slice(cut + 1))};
}

async function route() {
  const {path, query} = parseHash();
  if (current && current.path === path && current.update) { current.update(query); return; }
  const gen = ++generation;
  const page = {path, alive: () => gen === generation};
  current = page;
  const match = routes.map(([re, render]) => [path.match(re), render]).find(([m]) => m);
  document.body.dataset.page = path.split("/")[1] || "runs";
  $app.replaceChildren(h("p", {class: "loading"}, "Loading…"));
  try {
    if (!match) throw new ApiError(`no page at #${path}`, 404);
    await match[1](page, match[0], query);
  } catch (err) {
    if (page.alive()) { console.error(err); $app.replaceChildren(errorBox(err)); }
  }
}

window.addEventListener("hashchange", route);
route();
