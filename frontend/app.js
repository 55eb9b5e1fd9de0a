// graphdeck dashboard: a hash-routed page over the JSON API served by graphdeck.server.
//
// Pages: #/runs, #/runs/<id>, #/runs/<id>/rank/<r>, #/runs/<id>/ranks, #/runs/<id>/map, #/graphs/<id>/memory, #/graphs/<id>[?node=<fx node name>], #/traces/<id>,
// #/diff?a=<run>&b=<run>.
//
// Modules (ES modules, no build step):
//   app.js      this router
//   common.js   DOM and formatting helpers, the JSON API, breadcrumbs (see NOTE: [Untrusted text])
//   run.js      the runs list, the run page and its gradient-path report
//   overview.js the run page's overview: each check drawn as it answers
//   heatmap.js  the rank heatmap (a large run's ranks in one canvas) and one rank's page
//   grads.js    the gradient-path report: its page (#/runs/<id>/grads) and the run page's section
//   compile.js  the run page's compile records (frame compile metrics, graph-break reasons)
//   compare.js  two graphs side by side: diff marks, forward/backward seq_nr links
//   diff.js     run B against run A (#/diff?a=&b=): findings of diff-runs, each linking both runs' graphs
//   graph.js    the graph page: node search and selection, long-edge stubs, node details, related graphs
//   viewer.js   the graph page's SVG viewer: safe import, pan/zoom, the initial view
//   map.js      the parallel map (#/runs/<id>/map): stage → TP group → replicas, per-rank badges
//   trace.js    the trace page: Plotly timeline (zoom fetches the window), analyses and ingest stats
//   replay.js   trace replay (cursor over the timeline, the running kernel's graph node lit) and
//               the multi-rank timeline of a run
//
// A page renderer is `async (page, match, query)`; `page.alive()` turns false once the user has
// navigated away, so a late answer never draws over the next page. A renderer may set
// `page.update(query)` to take a change of the ?query part without a full redraw.

import {$app, ApiError, errorBox, h} from "./common.js";
import {renderCompare} from "./compare.js";
import {renderDiff} from "./diff.js";
import {renderGraph} from "./graph.js";
import {renderGrads} from "./grads.js";
import {renderMap} from "./map.js";
import {renderMemory} from "./memory.js";
import {renderRanks} from "./ranks.js";
import {rankSection, renderRun, renderRuns} from "./run.js";
import {renderRankPage} from "./heatmap.js";
import {renderReplay, renderRunTimeline} from "./replay.js";
import {renderTrace} from "./trace.js";

const routes = [
  [/^\/runs\/?$/, renderRuns],
  [/^\/runs\/([^/]+)$/, renderRun], // a run's id or its name
  [/^\/runs\/([^/]+)\/ranks$/, renderRanks], // cross-rank consistency
  [/^\/runs\/([^/]+)\/rank\/(\d+)$/, (page, m, q) => renderRankPage(page, m, q, rankSection)], // one rank (?step=)
  [/^\/runs\/([^/]+)\/grads$/, renderGrads], // gradient-path report (?status=&rank=)
  [/^\/runs\/([^/]+)\/map$/, renderMap], // parallel map: stages, TP groups, replicas, badges
  [/^\/graphs\/(\d+)$/, renderGraph],
  [/^\/graphs\/(\d+)\/memory$/, renderMemory], // graph-derived memory, measured beside it
  [/^\/compare\/(\d+)\/(\d+)$/, renderCompare], // two graphs side by side (diff, fwd/bwd)
  [/^\/traces\/(\d+)$/, renderTrace],
  [/^\/traces\/(\d+)\/replay$/, renderReplay], // ?step=&step_interval_ms=&highlight=
  [/^\/runs\/([^/]+)\/timeline$/, renderRunTimeline], // every rank on one aligned axis
  [/^\/diff$/, renderDiff], // run B against run A (?a=&b=): diff-runs' findings, both runs' graphs linked
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
