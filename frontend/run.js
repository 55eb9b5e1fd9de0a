// graphdeck dashboard: the runs list (#/runs) and a run's page (#/runs/<id or name>): its ranks,
// each rank's graphs, DDP buckets and traces, the compile records (compile.js), the
// gradient-path report and, while a captured job runs, its live state (live.js).

import {
  $app, api, badge, code, fmt, fmtBytes, fmtDate, fmtSeconds, graphLink, h, isBlank, joinComma,
  kindBadge, num, plural, setCrumbs, statusBadge, table,
} from "./common.js";
import {compileRecords} from "./compile.js";
import {gradientReport} from "./grads.js";
import {SMALL_RUN, rankHeatmap} from "./heatmap.js";
import {liveSection} from "./live.js";
import {runOverview} from "./overview.js";


// ---------------------------------------------------------------- runs list

export async function renderRuns(page) {
  const runs = await api("/api/runs");
  if (!page.alive()) return;
  setCrumbs([["Runs"]]);
  const go = (id) => (e) => { if (!e.target.closest("a")) location.hash = `#/runs/${id}`; };
  const rows = runs.map((r) => h("tr", {class: "clickable", "data-run-id": r.id, onclick: go(r.id)},
    h("td", {}, h("a", {href: `#/runs/${r.id}`}, fmt(r.name)),
      r.source_run ? h("span", {class: "muted small"}, ` replay of ${fmt(r.source_run.name)}`) : null,
      r.state === "empty" ? h("span", {class: "muted small run-empty", title: r.note}, ` ${r.note}`) : null),
    num(r.world_size), num(r.num_ranks), num(r.num_graphs), num(r.num_traces),
    h("td", {}, fmtDate(r.created_at))));
  $app.replaceChildren(h("section", {},
    h("h1", {}, "Runs"),
    runs.length
      ? table("runs-table", ["Name", "World size", "Ranks", "Graphs", "Traces", "Created"], rows)
      : h("p", {class: "empty", id: "runs-table"},
        "No runs in this store yet: capture a job with the graphdeck backend, or run `graphdeck demo`.")));
}

// ---------------------------------------------------------------- run page

/** Graphs of one rank in tree order: each root by ordinal, then its children. → [[graph, depth]] */
function graphTree(graphs) {
  const byId = new Map(graphs.map((g) => [g.id, g]));
  const kids = new Map();
  const roots = [];
  for (const g of graphs) {
    if (g.parent_id != null && byId.has(g.parent_id)) {
      if (!kids.has(g.parent_id)) kids.set(g.parent_id, []);
      kids.get(g.parent_id).push(g);
    } else roots.push(g);
  }
  const order = (a, b) => (a.partition_index ?? 0) - (b.partition_index ?? 0)
    || (a.ordinal ?? 0) - (b.ordinal ?? 0) || a.id - b.id;
  const out = [], seen = new Set();
  const walk = (g, depth) => {
    if (seen.has(g.id)) return;
    seen.add(g.id);
    out.push([g, depth]);
    (kids.get(g.id) || []).sort(order).forEach((c) => walk(c, depth + 1));
  };
  roots.sort((a, b) => (a.ordinal ?? 0) - (b.ordinal ?? 0) || a.id - b.id).forEach((g) => walk(g, 0));
  return out;
}

// DDPOptimizer marks each bucket it splits off with an "intentional graph-break" reason; that is a
// DDP split, not a graph break (NOTE: [Frames without a graph] in compile.js has the real ones).
const isDdpSplit = (reason) => /DDPOptimizer/.test(String(reason ?? ""));
const breakBadge = (reason) => (isDdpSplit(reason) ? badge("DDP split", "tag") : badge("graph break", "break"));

function graphRow(g, depth, partByGraph) {
  const part = partByGraph.get(g.id);
  const relation = [];
  if (g.kind === "ddp_partition" || g.partition_index != null) {
    relation.push(badge(`DDPOptimizer split ${fmt(g.partition_index ?? part?.index)}`, "tag"));
    if (part) relation.push(` ${fmtBytes(part.size_bytes)} · ${plural((part.params || []).length, "param")}`);
  }
  if (g.parent_id != null) relation.push(h("span", {class: "muted"}, " of "), graphLink(g.parent_id));
  const name = h("td", {class: "name", style: `padding-left: ${0.6 + depth * 1.4}em`},
    depth ? h("span", {class: "tree"}, "└ ") : null, graphLink(g.id, fmt(g.name)), h("span", {class: "gid"}, ` #${g.id}`));
  return h("tr", {class: g.break_reason && !isDdpSplit(g.break_reason) ? "has-break" : "", "data-graph-id": g.id, "data-kind": g.kind},
    num(g.ordinal), h("td", {}, kindBadge(g.kind)), name, h("td", {}, code(g.compile_id)),
    num(g.num_nodes), h("td", {class: "relation"}, relation), h("td", {class: "num"}, fmtSeconds(g.compile_time_s)),
    h("td", {class: "reason"}, g.break_reason ? [breakBadge(g.break_reason), " ", g.break_reason] : ""));
}

/**
 * The rank summary's graph-break count, from what the run page shows below it:
 * `dynamo_graph_break_reason` records of this rank (`events`: the compile-events answer for the
 * rank, or null when unavailable), split by whether their frame produced a graph, plus Dynamo
 * graphs with a break reason that no record of the same compile id covers. DDP splits do not count.
 * → [text or elements]
 */
function breakSummary(rank, graphs, events) {
  const ended = (ids) => graphs.filter((g) => g.kind === "dynamo" && g.break_reason && !isDdpSplit(g.break_reason)
    && !ids.has(g.compile_id)).length;
  if (!events) {
    const n = ended(new Set());
    return [n ? plural(n, "graph break") : "no graph breaks", " on Dynamo graphs (compile records unavailable)"];
  }
  const ops = new Map(events.filter((e) => e.name === "compilation_metrics")
    .map((e) => [e.compile_id, Number(e.fields?.graph_op_count) || 0]));
  const records = events.filter((e) => e.name === "dynamo_graph_break_reason");
  const zeroOp = records.filter((e) => !(ops.get(e.compile_id) > 0)).length;
  const inGraph = records.length - zeroOp;
  const onGraphs = ended(new Set(records.map((e) => e.compile_id)));
  const total = records.length + onGraphs;
  if (!total) return ["no graph breaks"];
  const kinds = [[zeroOp, "0-op frames"], [inGraph, "frames with a graph"], [onGraphs, "Dynamo graphs"]].filter(([n]) => n);
  const why = kinds.length === 1 ? kinds[0][1] : kinds.map(([n, what]) => `${n} in ${what}`).join(", ");
  const see = records.length ? ["; ", revealButton("see compile records", `graph-breaks-rank-${rank}`)] : null;
  return [plural(total, "graph break"), ` (${why}`, see, ")"];
}

export function rankSection(rank, graphs, traces, parts, compileEvents) {
  const partByGraph = new Map(parts.filter((p) => p.graph_id != null).map((p) => [p.graph_id, p]));
  const dynamo = graphs.filter((g) => g.kind === "dynamo");
  const ddp = graphs.filter((g) => g.kind === "ddp_partition").length;
  const breaks = h("span", {class: "break-count", "data-testid": `break-summary-rank-${rank}`}, "graph breaks: counting…");
  compileEvents.then((events) => breaks.replaceChildren(...breakSummary(rank, graphs,
    events && events.filter((e) => e.rank === rank)).flat().filter(Boolean)));
  const summary = [plural(graphs.length, "graph"), `${dynamo.length} Dynamo`, breaks,
    ddp ? `${plural(ddp, "DDP partition")} (DDPOptimizer splits, not graph breaks)` : null,
    plural(traces.length, "trace")].filter(Boolean).flatMap((part, i) => (i ? [" · ", part] : [part]));
  const graphRows = graphTree(graphs).map(([g, depth]) => graphRow(g, depth, partByGraph));
  const bucketRows = parts.map((p) => h("tr", {},
    num(p.index), h("td", {class: "num"}, fmtBytes(p.size_bytes)), num((p.params || []).length),
    h("td", {class: "params"}, (p.params || []).map((fqn) => h("code", {class: "chip"}, fmt(fqn)))),
    h("td", {}, p.graph_id != null ? graphLink(p.graph_id) : "—")));
  const traceRows = traces.map((t) => h("tr", {},
    h("td", {}, h("a", {href: `#/traces/${t.id}`}, fmt(t.name))), h("td", {}, statusBadge(t.status)),
    num(t.num_events), h("td", {}, h("a", {href: `#/traces/${t.id}`}, "timeline →"))));
  return h("section", {class: "rank", id: `rank-section-${rank}`, "data-testid": `rank-${rank}`},
    h("h2", {}, `Rank ${rank}`), h("p", {class: "summary", "data-testid": `rank-summary-${rank}`}, summary),
    graphs.length
      ? table(`graphs-rank-${rank}`, ["Ord.", "Kind", "Name", "Compile id", "Nodes", "Parent / partition",
        "Compile", "Break reason"], graphRows, "graphs-table")
      : h("p", {class: "empty"}, "No graphs captured on this rank."),
    parts.length ? [h("h3", {}, "DDPOptimizer splits (compile time)"),
      h("p", {class: "small muted", "data-testid": `buckets-note-${rank}`}, "DDPOptimizer cuts the Dynamo graph where "
        + "DDP's bucket_cap_mb would close a bucket and numbers the pieces in graph order. The reducer's own all-reduce "
        + "buckets (the ranks page's collective schedule: \"DDP reducer bucket N\") are numbered by the reducer, in "
        + "gradient-ready order; the two numberings need not match."),
      table(`buckets-rank-${rank}`, ["Split", "Size", "Params", "Parameters", "Graph"], bucketRows)] : null,
    traces.length ? [h("h3", {}, "Traces"),
      table(`traces-rank-${rank}`, ["Name", "Status", "Events", ""], traceRows)] : null);
}

/**
 * A section drawn now with a loading line and filled when `request` (a promise of JSON) answers:
 * `render(json)` gives its content; a failed request leaves a muted "unavailable" line (with id
 * `missingId`) instead.
 */
function lateSection(page, {id, title, what, request, render, missingId}) {
  const box = h("section", {id}, h("h2", {}, title), h("p", {class: "loading"}, `Loading the ${what}…`));
  const done = request.then(
    (json) => { if (page.alive()) box.replaceChildren(h("h2", {}, title), ...render(json).filter(Boolean)); },
    (err) => {
      if (page.alive()) box.replaceChildren(h("h2", {}, title),
        h("p", {class: "muted", id: missingId}, `${what[0].toUpperCase()}${what.slice(1)} unavailable: ${err.message}`));
    });
  return [box, done];
}

// The run page's details (ranks and graphs, compile records, gradient paths) sit in <details>
// blocks, closed by default under the overview. `?details=open` opens them all; `?section=<id>`
// opens the block holding element <id> (or the block <id>) and scrolls to it — the overview's
// links (compile health: `?section=compile-health`) and the jump buttons use it.
const SECTION_BLOCK = {"compile-records": "details-compile", "compile-health": "details-compile",
  "compile-index": "details-compile", "grad-section": "details-grads", "grad-report": "details-grads",
  "ranks-table": "details-ranks"};

function detailsBlock(id, summary, content) {
  return h("details", {class: "run-details", id, "data-testid": id},
    h("summary", {}, summary), h("div", {class: "run-details-body"}, content));
}

/** Open the details block of `target` (an element id or a block id) and scroll to it. */
function reveal(target) {
  const el = document.getElementById(target) || document.querySelector(`[data-testid="${CSS.escape(target)}"]`);
  const block = el?.closest("details.run-details") || document.getElementById(SECTION_BLOCK[target] || target);
  if (block && block.tagName === "DETAILS") block.open = true;
  (el || block)?.scrollIntoView({block: "start"});
}

/** In-page jump that opens the closed block first (a #fragment link would be taken by the router). */
const revealButton = (label, target) => h("button", {type: "button", class: "link", onclick: () => reveal(target)}, label);

function setAllDetails(open) {
  document.querySelectorAll("details.run-details").forEach((d) => { d.open = open; });
}

export async function renderRun(page, m, query = new URLSearchParams()) {
  const key = encodeURIComponent(decodeURIComponent(m[1]));
  // A few kB whatever the run's size; a large run's first heatmap comes with it (one round trip).
  const index = await api(`/api/runs/${key}/rank-index?heatmap=step_time`);
  if (!page.alive()) return;
  // More than SMALL_RUN ranks: the rank heatmap instead of a section per rank, compile records and
  // gradient paths loaded when their block is opened (issue 26 item 2).
  if (index.ranks.length > SMALL_RUN) return renderLargeRun(page, index, query);
  const run = await api(`/api/runs/${key}`);
  if (!page.alive()) return;
  setCrumbs([["Runs", "#/runs"], [fmt(run.name)]]);
  const graphs = run.graphs || [], traces = run.traces || [], parts = run.partitions || [];
  const rankInfo = run.ranks || [];
  const ranks = [...new Set([...rankInfo, ...graphs, ...traces, ...parts].map((x) => x.rank))]
    .filter((r) => r != null).sort((a, b) => a - b);
  const rankRows = rankInfo.map((r) => h("tr", {}, num(r.rank), num(r.world_size), h("td", {}, fmt(r.hostname)),
    num(r.pid), h("td", {}, fmt(r.backend)), h("td", {}, code(r.torch_version))));
  // One request feeds both the compile-records section and each rank's graph-break count.
  const compileRequest = api(`/api/runs/${run.id}/compile-events`);
  const compileEvents = compileRequest.catch(() => null);
  const [compileBox, compileDone] = lateSection(page, {id: "compile-records", title: "Compile records",
    what: "compile records", request: compileRequest, missingId: "compile-records-missing",
    render: (events) => compileRecords(events, graphs, run.id)});
  const [gradBox, gradDone] = lateSection(page, {id: "grad-section", title: "Gradient paths",
    what: "gradient-path report", request: api(`/api/runs/${run.id}/gradients`), missingId: "grad-report-missing",
    render: (report) => runGradients(report, run)});
  const [overviewBox, overviewDone] = runOverview(page, run);
  const [liveBox] = liveSection(page, run.id);
  const of = (list, r) => list.filter((x) => x.rank === r);
  const toggle = h("button", {type: "button", class: "link", id: "details-open-all", "data-testid": "details-open-all",
    onclick: () => {
      const open = ![...document.querySelectorAll("details.run-details")].every((d) => d.open);
      setAllDetails(open);
    }}, "open / close all");
  $app.replaceChildren(h("section", {},
    h("h1", {}, fmt(run.name)),
    h("p", {class: "summary"}, `world size ${fmt(run.world_size)} · ${plural(graphs.length, "graph")} · ${plural(traces.length, "trace")}`
      + ` · created ${fmtDate(run.created_at)}`),
    h("nav", {class: "jump", "aria-label": "sections"}, "Jump to: ",
      joinComma([...ranks.map((r) => revealButton(`rank ${r}`, `rank-section-${r}`)),
        revealButton("compile records", "compile-records"), revealButton("gradient paths", "grad-section"),
        h("a", {href: `#/runs/${run.id}/ranks`, "data-testid": "rank-consistency-link"}, "rank consistency"),
        h("a", {href: `#/runs/${run.id}/map`, "data-testid": "parallel-map-link"}, "parallel map"),
        h("a", {href: `#/runs/${run.id}/cost`, "data-testid": "cost-link"}, "costs"),
        h("a", {href: `#/diff?a=${run.id}`, "data-testid": "diff-link"}, "compare with…"),
        h("a", {href: `#/parity?a=${run.id}`, "data-testid": "parity-link"}, "gradient parity with…")])),
    replaysSection(run),
    liveBox,
    overviewBox,
    h("h2", {class: "details-heading"}, "Details ", h("span", {class: "small muted"}, "(closed: click to open; "), toggle,
      h("span", {class: "small muted"}, ")")),
    detailsBlock("details-ranks", `Ranks and graphs — ${plural(ranks.length, "rank")} · ${plural(graphs.length, "graph")}`
      + ` · ${plural(parts.length, "DDP split")} · ${plural(traces.length, "trace")}`, [
      rankInfo.length ? table("ranks-table", ["Rank", "World size", "Host", "PID", "Backend", "torch"], rankRows) : null,
      ranks.map((r) => rankSection(r, of(graphs, r), of(traces, r), of(parts, r).sort((a, b) => a.index - b.index),
        compileEvents))]),
    detailsBlock("details-compile", "Compile records — compile health, the compile index, frame metrics and graph breaks",
      compileBox),
    detailsBlock("details-grads", "Gradient paths — every parameter on every rank", gradBox)));
  const apply = (q) => {
    if (q.get("details") === "open") setAllDetails(true);
    if (q.get("section")) reveal(q.get("section"));
  };
  page.update = (q) => apply(q);
  apply(query);
  await Promise.all([compileDone, gradDone, overviewDone]);
  if (page.alive() && query.get("section")) reveal(query.get("section")); // its element may have come late
}

/**
 * A replay run names the run it replays; a captured run lists its replays (`graphdeck replay`), each
 * a run of its own so the replay never changes this run's views (NOTE: [Replay runs] in
 * store/replay_runs.py), with links to each replay trace's page (its timeline and analysis). Nothing when neither.
 */
export function replaysSection(run) {
  const src = run.source_run;
  const head = src ? h("p", {class: "summary", "data-testid": "replay-of"}, "Replay of run ",
    h("a", {href: `#/runs/${src.id}`}, fmt(src.name)), src.graph_id != null ? [" graph ", graphLink(src.graph_id)] : null,
    " (graphdeck replay: synthetic inputs, the executor's own timing)") : null;
  const replays = run.replays || [];
  if (!replays.length) return head;
  const rows = replays.flatMap((r) => (r.traces.length ? r.traces : [null]).map((t) => h("tr", {"data-replay-run": r.id},
    h("td", {}, h("a", {href: `#/runs/${r.id}`}, fmt(r.name))), h("td", {}, r.graph_id != null ? graphLink(r.graph_id) : "—"),
    num(r.workers), h("td", {}, t ? h("a", {href: `#/traces/${t.id}`}, fmt(t.name)) : "no trace"),
    t ? num(t.rank) : h("td", {}, "—"),
    h("td", {}, t ? h("a", {href: `#/traces/${t.id}`, "data-testid": "replay-trace-link"}, "timeline →") : null))));
  return [head, h("section", {id: "replays", "data-testid": "replays"},
    h("h2", {}, `Replays — ${plural(replays.length, "replay run")}`),
    h("p", {class: "small muted"}, "Each `graphdeck replay` of one of this run's graphs is a run of its own: its traces "
      + "time the executor on synthetic inputs and are not part of this run's checks, timeline or exports."),
    table("replays-table", ["Replay run", "Graph", "Workers", "Trace", "Rank", ""], rows, "compact"))];
}

/** The run page's gradient section: the report (grads.js) and a link to its own page. */
function runGradients(report, run) {
  return [h("p", {}, h("a", {href: `#/runs/${run.id}/grads`, id: "grad-page-link"}, "open the gradient-path page"),
    h("span", {class: "muted"}, " (filters in the URL, one link per cut)")), ...gradientReport(report)];
}


// ---------------------------------------------------------------- a large run's page

/**
 * A details block whose content is requested when it is first opened: `load()` → [box, done]
 * (a lateSection). → [details element, start() → promise settled once drawn]
 */
function lazyDetails(id, summary, what, load) {
  let started = null;
  const body = h("div", {class: "run-details-body"},
    h("p", {class: "muted small"}, `Loaded when opened: the ${what} of every rank of a large run take a while.`));
  const block = h("details", {class: "run-details", id, "data-testid": id, "data-lazy": "pending"},
    h("summary", {}, summary), body);
  const start = () => {
    if (!started) {
      const [box, done] = load();
      body.replaceChildren(box);
      block.dataset.lazy = "started";
      started = done;
    }
    return started;
  };
  block.addEventListener("toggle", () => { if (block.open) start(); });
  return [block, start];
}

/**
 * The run page of a run with more than SMALL_RUN ranks (from GET /api/runs/<id>/rank-index, a
 * few kB): header, the overview (each check drawn as it answers), the rank heatmap (a click opens
 * a rank's page, as does "open rank"), then compile records and gradient paths, requested only
 * when opened. Nothing here waits for the slow checks.
 */
async function renderLargeRun(page, idx, query) {
  const run = idx;
  setCrumbs([["Runs", "#/runs"], [fmt(run.name)]]);
  const n = idx.ranks.length;
  const traced = idx.traces.filter((x) => x > 0).length;
  const withGraphs = idx.graphs.filter((x) => x > 0).length;
  // The heatmap is asked first and the checks after it answers: it is the picture the page opens
  // with, and the checks (Python, one interpreter on the server) would slow it down.
  const [heatBox, heatDone] = rankHeatmap(page, run.id, {initial: idx.heatmap});
  const [overviewBox, overviewDone] = runOverview(page, run, {after: heatDone});
  const [liveBox] = liveSection(page, run.id);
  const first = idx.ranks[0];
  const [compileBlock, startCompile] = lazyDetails("details-compile",
    `Compile records — compile health, the compile index; frame metrics and graph breaks of rank ${first}`,
    "compile records", () => lateSection(page, {id: "compile-records", title: "Compile records", what: "compile records",
      missingId: "compile-records-missing",
      request: Promise.all([api(`/api/runs/${run.id}/compile-events?rank=${first}`), api(`/api/runs/${run.id}/graphs?rank=${first}`)]),
      render: ([events, graphs]) => [h("p", {class: "small muted"}, `Frame compile metrics of rank ${first}; each other `
        + "rank's are on its page (click it in the heatmap)."), ...compileRecords(events, graphs, run.id)]}));
  const [gradBlock, startGrads] = lazyDetails("details-grads", "Gradient paths — every parameter on every rank",
    "gradient paths", () => lateSection(page, {id: "grad-section", title: "Gradient paths", what: "gradient-path report",
      request: api(`/api/runs/${run.id}/gradients`), missingId: "grad-report-missing",
      render: (report) => runGradients(report, run)}));
  const lazy = {"details-compile": startCompile, "details-grads": startGrads};
  const rankInput = h("input", {type: "number", min: 0, step: 1, style: "width: 6em", "data-testid": "open-rank-input",
    "aria-label": "rank to open"});
  const openRank = h("form", {class: "inline", "data-testid": "open-rank", onsubmit: (ev) => {
    ev.preventDefault();
    if (rankInput.value !== "") location.hash = `#/runs/${run.id}/rank/${Number(rankInput.value)}`;
  }}, " · open rank ", rankInput, h("button", {type: "submit"}, "go"));
  $app.replaceChildren(h("section", {"data-testid": "large-run", "data-ranks": n},
    h("h1", {}, fmt(run.name)),
    h("p", {class: "summary"}, `world size ${fmt(run.world_size)} · ${plural(n, "rank")} (${withGraphs} with graphs, `
      + `${traced} with a trace) · ${plural(run.num_graphs, "graph")} · ${plural(run.num_traces, "trace")}`
      + ` · created ${fmtDate(run.created_at)}`),
    h("nav", {class: "jump", "aria-label": "sections"}, "Jump to: ",
      joinComma([revealButton("rank heatmap", "rank-heatmap-section"),
        revealButton("compile records", "details-compile"), revealButton("gradient paths", "details-grads"),
        h("a", {href: `#/runs/${run.id}/ranks`, "data-testid": "rank-consistency-link"}, "rank consistency"),
        h("a", {href: `#/runs/${run.id}/map`, "data-testid": "parallel-map-link"}, "parallel map"),
        h("a", {href: `#/runs/${run.id}/cost`, "data-testid": "cost-link"}, "costs"),
        h("a", {href: `#/runs/${run.id}/timeline`}, "timeline"),
        h("a", {href: `#/diff?a=${run.id}`, "data-testid": "diff-link"}, "compare with…"),
        h("a", {href: `#/parity?a=${run.id}`, "data-testid": "parity-link"}, "gradient parity with…")]), openRank),
    liveBox,
    overviewBox,
    h("section", {id: "rank-heatmap-section", "data-testid": "rank-heatmap-section"},
      h("h2", {}, `Ranks — ${plural(n, "rank")}`),
      h("p", {class: "small muted"}, "One row per rank, one column per profiled step (or matched collective). "
        + "Hover a cell for its value, click it to open that rank: its traces, graphs and DDP splits."),
      heatBox),
    h("h2", {class: "details-heading"}, "Details ", h("span", {class: "small muted"}, "(closed: click to open)")),
    compileBlock, gradBlock));
  const apply = (q) => {
    if (q.get("details") === "open") Object.values(lazy).forEach((start) => start());
    if (q.get("details") === "open") setAllDetails(true);
    const target = q.get("section");
    if (!target) return;
    reveal(target);
    const start = lazy[SECTION_BLOCK[target] || target];
    if (start) start().then(() => { if (page.alive()) reveal(target); });
  };
  page.update = (q) => apply(q);
  apply(query);
  await Promise.all([overviewDone, heatDone]);
}
