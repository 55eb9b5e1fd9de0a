// graphdeck dashboard: the run page's compile records, per rank, from
// GET /api/runs/<id>/compile-events (torch's structured compile records, as TORCH_TRACE logs them).
//
// NOTE: [Frames without a graph]
// Dynamo writes one `compilation_metrics` record per frame it compiles, including frames that
// produce no graph: under DDP, Dynamo first enters DDP's own forward wrapper and helpers
// (external_utils.inner, contextlib helpers), breaks the graph there with 0 ops, and only a later
// frame (the model's forward) yields the captured graph. Those 0-op frames are drawn muted with a
// "no graph" badge; frames with ops are drawn as the graph they produced and link to it.

import {api, badge, code, errorBox, fmt, fmtSeconds, graphLink, h, isBlank, kindBadge, num, plural, table}
  from "./common.js";
import {kernelBadge, outputCodePanel, recordsPanel} from "./inductor.js";
import {rankRanges} from "./heatmap.js";

const METRICS = "compilation_metrics";
const BREAK = "dynamo_graph_break_reason";

const basename = (path) => String(path ?? "").split(/[\\/]/).pop();
const hasOps = (f) => Number(f.graph_op_count) > 0;

/** The frame cell: co_name, then file basename:line; the full path in the tooltip. */
function frameCell(f) {
  const where = isBlank(f.co_filename) ? null
    : `${basename(f.co_filename)}${isBlank(f.co_firstlineno) ? "" : `:${f.co_firstlineno}`}`;
  return [h("code", {class: "co-name"}, fmt(f.co_name)),
    where ? h("span", {class: "muted small", title: `${f.co_filename}:${fmt(f.co_firstlineno)}`}, ` ${where}`) : null];
}

/** "FX 1 · AOT 0" from the local cache hit counters; "—" when neither was recorded. */
function cacheHits(f) {
  const parts = [["FX", f.inductor_fx_local_cache_hit_count], ["AOT", f.aotautograd_local_cache_hit_count]]
    .filter(([, n]) => !isBlank(n)).map(([label, n]) => `${label} ${n}`);
  return h("td", {class: "num", title: "local cache hits: Inductor FX graph cache, AOTAutograd cache"},
    parts.length ? parts.join(" · ") : "—");
}

function reasonCell(f) {
  const fail = [f.fail_type, f.fail_reason].filter((x) => !isBlank(x)).join(": ");
  return h("td", {class: "reason"},
    fail ? h("div", {}, badge("failed", "status-NO_GRAD"), " ", fail) : null,
    isBlank(f.recompile_reason) ? null : h("div", {}, badge("recompile", "tag"), " ", fmt(f.recompile_reason)));
}

/** One `compilation_metrics` row; `graphs` are this rank's graphs of the same compile id. */
function metricsRow(event, graphs, breakRecord) {
  const f = event.fields || {};
  const captured = hasOps(f);
  const shown = graphs.filter((g) => g.parent_id == null);
  const outcome = captured
    ? [badge("graph", "kind kind-dynamo"), shown.map((g) => [" ", graphLink(g.id, `${fmt(g.name)} #${g.id}`)])]
    : badge("no graph", "tag");
  const brokeHere = breakRecord ? h("button", {type: "button", class: "link small", title: "show the break reason",
    onclick: () => { breakRecord.open = true; breakRecord.scrollIntoView({behavior: "smooth", block: "center"}); }},
  "graph break ↓") : null;
  return h("tr", {class: captured ? "frame-graph" : "frame-empty", "data-compile-id": event.compile_id,
    "data-ops": isBlank(f.graph_op_count) ? null : f.graph_op_count},
  h("td", {}, code(event.compile_id)),
  h("td", {class: "frame"}, frameCell(f), h("div", {class: "outcome"}, outcome, brokeHere ? [" ", brokeHere] : null)),
  num(f.graph_op_count), h("td", {class: "num"}, fmtSeconds(f.entire_frame_compile_time_s)),
  cacheHits(f), reasonCell(f));
}

/** A graph break as a collapsed <details>: the payload's first line as its summary. */
function breakDetails(event) {
  const text = String(event.payload ?? "");
  const first = text.split("\n", 1)[0].trim() || "graph break (no reason recorded)";
  return h("details", {class: "break-record", "data-compile-id": event.compile_id},
    h("summary", {}, code(event.compile_id), " ", first),
    h("pre", {class: "code stack"}, text));
}

function rankRecords(rank, events, graphs) {
  const metrics = events.filter((e) => e.name === METRICS);
  const breaks = events.filter((e) => e.name === BREAK);
  const others = new Map();
  for (const e of events) if (e.name !== METRICS && e.name !== BREAK) others.set(e.name, (others.get(e.name) || 0) + 1);

  const breakByCompileId = new Map();
  const breakItems = breaks.map((e) => {
    const el = breakDetails(e);
    if (!breakByCompileId.has(e.compile_id)) breakByCompileId.set(e.compile_id, el);
    return el;
  });
  const rows = metrics.map((e) => metricsRow(e, graphs.filter((g) => g.compile_id === e.compile_id),
    breakByCompileId.get(e.compile_id)));

  const captured = metrics.filter((e) => hasOps(e.fields || {}));
  const ops = captured.reduce((n, e) => n + Number(e.fields.graph_op_count), 0);
  const total_s = metrics.reduce((s, e) => s + (Number(e.fields?.entire_frame_compile_time_s) || 0), 0);
  const summary = [plural(metrics.length, "frame") + " compiled",
    `${captured.length} with a graph (${plural(ops, "op")})`,
    metrics.length - captured.length ? `${metrics.length - captured.length} without ops` : null,
    breaks.length ? plural(breaks.length, "graph break") : "no graph breaks",
    metrics.length ? `${fmtSeconds(total_s)} compiling frames (entire_frame_compile_time_s; `
      + "backward graphs not counted: see Compile time per rank)" : null].filter(Boolean).join(" · ");

  return h("div", {class: "compile-rank", "data-testid": `compile-rank-${rank}`},
    h("h3", {}, `Rank ${rank}`), h("p", {class: "summary"}, summary),
    metrics.length
      ? table(`compile-metrics-rank-${rank}`, ["Compile id", "Frame", "Ops", "Compile time", "Cache hits",
        "Fail / recompile reason"], rows, "compile-table")
      : h("p", {class: "empty"}, "No compilation_metrics records on this rank."),
    breakItems.length ? h("div", {class: "breaks", "data-testid": `graph-breaks-rank-${rank}`},
      h("h4", {}, plural(breakItems.length, "graph break") + " (dynamo_graph_break_reason)"), breakItems) : null,
    others.size ? h("p", {class: "muted small"}, "Also recorded: ",
      [...others].map(([name, n]) => `${n} × ${name}`).join(", "), ".") : null);
}

/**
 * The compile-records section's content: one block per rank.
 * `events`: the compile-events answer, [{rank, name, compile_id, fields, payload?}] in arrival order;
 * `graphs`: the run's graphs (to link a frame to the graph it produced).
 */
export function compileRecords(events, graphs, runId) {
  const index = runId == null ? [] : [compileHealth(runId), compileIndex(runId)];
  if (!events.length) return [...index, h("p", {class: "empty"}, "No compile records in this run.")];
  const ranks = [...new Set(events.map((e) => e.rank))].sort((a, b) => a - b);
  return [...index, h("h3", {}, "Frame compile metrics"),
    ...ranks.map((r) => rankRecords(r, events.filter((e) => e.rank === r), graphs.filter((g) => g.rank === r)))];
}

// ---------------------------------------------------------------- the compile index (tlparse-like)
// One table per rank from GET /api/runs/<id>/compile-index: every compile id with its frame,
// status, compile time, graph breaks (reason, user source line), recompile reasons, failure or
// restarts, the graphs it produced (each opens in the graph view) and Inductor's output code.

const STATUS_CLASS = {ok: "status-OK", failed: "status-NO_GRAD", error: "status-NO_GRAD", restarted: "tag",
  empty: "tag"};

/** The first informative line (a break's "Graph break in user code at …" is already its source line). */
function firstLine(text) {
  const lines = String(text ?? "").split("\n").map((x) => x.trim()).filter(Boolean);
  return lines.find((x) => !x.startsWith("Graph break in user code")) || lines[0] || "";
}

/** A reason as <details>: first line as the summary, the whole text inside. */
function reasonDetails(label, text, extra) {
  return h("details", {class: "reason-details"},
    h("summary", {}, badge(label, "tag"), " ", extra ? [code(extra), " "] : null, firstLine(text)),
    h("pre", {class: "code stack"}, String(text ?? "")));
}

function indexRow(e) {
  const graphs = e.graphs.map((g) => h("div", {class: "index-graph"}, kindBadge(g.kind), " ",
    graphLink(g.id, `${fmt(g.name)} #${g.id}`), h("span", {class: "muted small"}, ` ${g.num_nodes} nodes `),
    kernelBadge(g.kernel_links)));
  const reasons = [
    e.failure ? reasonDetails(`failed: ${fmt(e.failure.type)}`, e.failure.reason, e.failure.user_frame) : null,
    e.error ? reasonDetails("error", e.error) : null,
    e.graph_breaks.map((b) => reasonDetails("graph break", b.reason, b.source_line && basename(b.source_line))),
    e.recompile_reasons.length ? reasonDetails(
      e.recompile_reasons.length > 1 ? `recompile (${e.recompile_reasons.length} guard failures)` : "recompile",
      e.recompile_reasons.join("\n")) : null,
    e.restarts.map((r) => reasonDetails("restart", r))];
  return h("tr", {"data-compile-id": e.compile_id, class: `index-${e.status}`},
    h("td", {}, code(e.compile_id)), h("td", {class: "frame"}, code(e.frame)),
    h("td", {}, badge(e.status, STATUS_CLASS[e.status] || "tag")),
    h("td", {class: "num"}, fmtSeconds(e.compile_time_s)),
    h("td", {class: "reason"}, reasons),
    h("td", {class: "graphs"}, graphs, e.output_code.map((o) => outputCodePanel(o, e.graphs.find((g) => g.id === o.graph_id))),
      recordsPanel(e.records)));
}

/** "from <file>", and a warning when the file name and the envelopes disagree on the rank. */
function rankSource(src) {
  if (!src) return null;
  const dropped = Object.entries(src.dropped || {});
  return h("p", {class: "small muted", "data-testid": "rank-source"}, "imported from ", code(src.file),
    src.records != null ? ` (${plural(src.records, "record")})` : null,
    dropped.length ? [" ", badge(`${dropped.reduce((n, [, c]) => n + c, 0)} dropped`, "tag"), " ",
      dropped.map(([k, c]) => `${k} ${c}`).join(", ")] : null,
    src.unverified ? [" ", badge(`${src.unverified} unverified`, "tag"),
      ` kept and read though their md5 failed (md5_mismatch ${src.unverified})`] : null,
    src.rank_mismatch ? [" ", badge("rank mismatch", "status-NO_GRAD"),
      ` the file name says this rank, its records say rank ${fmt(src.envelope_rank)}`] : null);
}

function indexRank(rank, entries, src) {
  const n = (f) => entries.filter(f).length;
  const summary = [plural(entries.length, "compile id"),
    n((e) => e.graph_breaks.length) ? plural(entries.reduce((k, e) => k + e.graph_breaks.length, 0), "graph break") : "no graph breaks",
    plural(n((e) => e.recompile_reasons.length), "recompile"),
    n((e) => e.status === "failed" || e.status === "error") ? plural(n((e) => e.status === "failed" || e.status === "error"), "failure") : null,
    `${fmtSeconds(entries.reduce((t, e) => t + (Number(e.compile_time_s) || 0), 0))} compiling frames `
    + "(backward graphs not counted: see Compile time per rank)"].filter(Boolean).join(" · ");
  return h("div", {class: "compile-index-rank", "data-testid": `compile-index-rank-${rank}`},
    h("h4", {}, `Rank ${rank}`), rankSource(src), h("p", {class: "summary"}, summary),
    table(`compile-index-${rank}`, ["Compile id", "Frame", "Status", "Compile time", "Breaks / recompiles / failures",
      "Graphs and output code"], entries.map(indexRow), "compile-table compile-index"));
}

/** The compile-index block: filled when its request answers; an error stays inside the block. */
function compileIndex(runId) {
  const box = h("div", {class: "compile-index", id: "compile-index", "data-testid": "compile-index"},
    h("h3", {}, "Compile index (per rank)"), h("p", {class: "loading"}, "Loading…"));
  api(`/api/runs/${encodeURIComponent(runId)}/compile-index`).then((idx) => {
    const ranks = Object.keys(idx.ranks || {}).map(Number).sort((a, b) => a - b);
    box.replaceChildren(h("h3", {}, "Compile index (per rank)"),
      ...(ranks.length ? ranks.map((r) => indexRank(r, idx.ranks[String(r)], (idx.rank_sources || {})[String(r)])) : [h("p", {class: "empty"}, "No compiles.")]));
  }).catch((err) => box.replaceChildren(h("h3", {}, "Compile index (per rank)"), errorBox(err)));
  return box;
}

// ---------------------------------------------------------------- compile health (issue 21)
// The check-compile report from GET /api/runs/<id>/compile-health (NOTE: [Compile health] in
// graphdeck/analysis/compilation/health.py): verdict, graph breaks by reason and source line with a
// hint, recompile budgets per frame, eager fallbacks, compile time and caches per rank. Every
// text here (reasons, guards, file names) comes from the user's program: it goes in through h().

const VERDICT_CLASS = {PASS: "status-OK", FAIL: "status-NO_GRAD", INCOMPLETE: "tag", WARN: "ov-incomplete"};
const CACHE_LABELS = [["fx_graph", "FX graph cache"], ["aot_autograd", "AOTAutograd cache"],
  ["fx_graph_remote", "FX graph (remote)"], ["aot_autograd_remote", "AOTAutograd (remote)"]];
const pct = (v) => (isBlank(v) ? "—" : `${Math.round(v * 100)}%`);

function breakRow(b) {
  return h("tr", {class: b.library ? "muted" : null, "data-source-line": b.source_line},
    h("td", {}, code(b.source_line), b.library ? [" ", badge("torch/stdlib", "tag")]
      : b.framework ? [" ", badge(`framework: ${b.framework}`, "tag")] : null),
    h("td", {}, badge(b.reason_class, "tag"), " ", b.headline),
    num(b.count), h("td", {"data-ranks": (b.ranks || []).length}, rankRanges(b.ranks || [], 8)),
    h("td", {}, h("div", {}, "user frame ", code(b.user_frame)),
      h("div", {class: "muted small"}, "compiled in ", (b.frames || []).join(", ")),
      b.eager_fallback ? h("div", {}, badge("frame skipped → eager", "status-NO_GRAD")) : null),
    h("td", {class: "hint"}, b.library ? "DDP/torch-internal break: not counted" : b.hint));
}

function budgetCell(f) {
  const state = f.limit_hit ? badge("limit hit → eager", "status-NO_GRAD")
    : f.will_hit_limit ? badge("will hit the limit", "tag") : null;
  return h("td", {}, h("meter", {min: 0, max: f.limit, value: Math.min(f.used, f.limit), title: f.limit_source}),
    ` ${f.used} of ${f.limit} `, state, h("div", {class: "muted small"}, `limit ${f.limit_source}`));
}

// Each rank with its own numbers (the merged frame's fields are the worst rank's: per_rank has the
// others), as check-compile's text says it (analysis/compilation/text.py _frame_ranks).
function frameRanks(f) {
  const per = Object.entries(f.per_rank || {});
  const other = per.filter(([, v]) => v.used !== f.used || v.recompiles !== f.recompiles);
  if (!other.length) return `ranks ${f.ranks.join(", ")}`;
  return [`rank ${f.worst_rank} (the most of ranks ${f.ranks.join(", ")}); `,
    other.map(([r, v]) => `rank ${r}: ${v.used} of ${f.limit} compiles used, ${v.recompiles} recompile(s)`).join("; ")];
}

function frameRow(f) {
  const guards = (f.guards || []).slice(0, 4).map((g) => h("div", {class: "guard"},
    g.storm ? [badge(`storm ×${g.count}`, "status-NO_GRAD"), " "] : `×${g.count} `, badge(g.class, "tag"), " ",
    code(g.example)));
  return h("tr", {"data-frame": f.frame, class: f.limit_hit ? "index-failed" : null},
    h("td", {}, code(f.frame), (f.ranks || []).length > 1 ? h("div", {class: "muted small", "data-testid": "frame-ranks"},
      frameRanks(f)) : null),
    budgetCell(f), num(f.recompiles),
    h("td", {}, Object.entries(f.classes || {}).map(([k, n]) => [badge(`${k} ×${n}`, "tag"), " "])),
    h("td", {class: "reason"}, guards, (f.steps || []).length ? h("details", {class: "reason-details"},
      h("summary", {}, `the guard that failed at each of ${plural(f.steps.length, "recompile")}`),
      h("ol", {class: "small"}, f.steps.map((st) => h("li", {}, code(st.compile_id), " ", st.failed_guard,
        st.source_line ? h("span", {class: "muted"}, ` (${st.source_line})`) : null)))) : null),
    h("td", {class: "hint"}, fmt(f.hint)));
}

function rankStatsRow(r) {
  const st = r.stats || {};
  const caches = CACHE_LABELS.map(([k]) => {
    const c = (st.cache || {})[k] || {};
    return h("td", {class: "num"}, c.hit || c.miss || c.bypass ? `${c.hit} / ${c.miss}` : "—");
  });
  return h("tr", {}, num(r.rank), num(st.compiles), h("td", {class: "num"}, fmtSeconds(st.compile_s)),
    h("td", {class: "num"}, fmtSeconds(st.frame_compile_s)), h("td", {class: "num"}, fmtSeconds(st.bwd_compile_s)),
    caches, h("td", {class: "muted small"}, fmt(st.cache_source)));
}

/** PASS only when a gate was checked; with none (the page asks for none) the report is a report. */
function verdictBadge(rep) {
  const th = rep.thresholds || {};
  const gated = !isBlank(th.max_graph_breaks) || !isBlank(th.max_recompiles_per_frame) || th.fail_on_eager_fallback
    || th.fail_on_ddp_no_overlap;
  return rep.verdict === "PASS" && !gated
    ? h("span", {title: "no threshold given: see check-compile's --max-* flags"}, badge("report · no gates", "tag"))
    : badge(rep.verdict, VERDICT_CLASS[rep.verdict] || "tag");
}

function healthBody(rep) {
  const s = rep.summary || {};
  const frames = (rep.frames || []).filter((f) => f.recompiles || f.limit_hit);
  const ranks = Object.values(rep.ranks || {}).sort((a, b) => a.rank - b.rank);
  const spread = rep.spread || {};
  const ct = spread.compile_s;
  return [
    h("p", {class: "summary"}, verdictBadge(rep), " ",
      [plural(s.graph_breaks || 0, "distinct graph break") + " in user code",
        plural(s.recompiles || 0, "recompile") + ` over ${plural(s.frames || 0, "frame")}`,
        (s.limit_hit || []).length ? `recompile limit hit in ${(s.limit_hit || []).join(", ")}` : null,
        plural(s.eager_fallbacks || 0, "eager fallback"), plural(s.restarts || 0, "restart")]
        .filter(Boolean).join(" · ")),
    (rep.findings || []).length ? h("ul", {class: "findings", "data-testid": "compile-health-findings"},
      rep.findings.map((x) => h("li", {}, badge("FAIL", "status-NO_GRAD"), " ", x))) : null,
    // What no gate covers but a user must see (check-compile's WARN lines, the same text): a hit
    // recompile limit, eager fallbacks, compiled DDP that cannot overlap its all-reduces.
    (rep.warnings || []).length ? h("ul", {class: "findings", "data-testid": "compile-health-warnings"},
      rep.warnings.map((x) => h("li", {}, badge("WARN", "ov-warn"), " ", x))) : null,
    (rep.missing_evidence || []).length ? h("ul", {class: "missing", "data-testid": "compile-health-missing"},
      rep.missing_evidence.map((x) => h("li", {}, badge("INCOMPLETE", "tag"), " ", x))) : null,
    table("compile-health-breaks", ["Source line", "Reason", "Count", "Ranks", "Frames", "Hint"],
      (rep.breaks || []).map(breakRow), "compile-health-table",
      {caption: "Graph breaks, grouped by reason class and source line", empty: "no graph break was recorded"}),
    table("compile-health-frames", ["Frame", "Compiles used / recompile limit", "Recompiles", "Budget spent on",
      "Failed guards", "Hint"], frames.map(frameRow), "compile-health-table",
    {caption: "Recompiles per frame (code object)", empty: "no frame recompiled"}),
    table("compile-health-fallbacks", ["Rank", "Compile id", "Frame", "Why", "Reason"],
      (rep.fallbacks || []).map((x) => h("tr", {}, num(x.rank), h("td", {}, code(x.compile_id)),
        h("td", {}, code(x.frame)), h("td", {}, badge(x.kind, "status-NO_GRAD")),
        h("td", {class: "reason"}, reasonDetails(fmt(x.fail_type), x.reason)))), "compile-health-table",
      {caption: "Frames that fell back to eager and failed compiles", empty: "every compile succeeded"}),
    table("compile-health-ranks", ["Rank", "Compiles", "Compile time (all)", "Frames (forward)",
      "Backward graphs", ...CACHE_LABELS.map(([, l]) => `${l} hit / miss`),
      "Cache counts from"], ranks.map(rankStatsRow), "compile-health-table",
    {caption: "Compile time and caches per rank: all = the frames' compiles (compilation_metrics, what the "
      + "compile index and the frame metrics below add up) + backward graphs compiled at their first run "
      + "(bwd_compilation_metrics)", empty: "no rank has compile records"}),
    ct && ct.spread != null ? h("p", {class: "small", "data-testid": "compile-health-spread"},
      `Spread across ranks: compile time ${fmtSeconds(ct.spread)} (rank ${ct.min_rank} ${fmtSeconds(ct.min)} … `
      + `rank ${ct.max_rank} ${fmtSeconds(ct.max)})`,
      CACHE_LABELS.filter(([k]) => spread[`${k}_hit_rate`]?.spread != null).map(([k, l]) =>
        `; ${l} hit rate ${pct(spread[`${k}_hit_rate`].min)} … ${pct(spread[`${k}_hit_rate`].max)}`)) : null];
}

/** The compile-health block: filled when its request answers; an error stays inside the block. */
function compileHealth(runId) {
  const title = () => h("h3", {}, "Compile health");
  const box = h("div", {class: "compile-health", id: "compile-health", "data-testid": "compile-health"},
    title(), h("p", {class: "loading"}, "Loading…"));
  api(`/api/runs/${encodeURIComponent(runId)}/compile-health`)
    .then((rep) => box.replaceChildren(title(), ...healthBody(rep).filter(Boolean)))
    .catch((err) => box.replaceChildren(title(), errorBox(err)));
  return box;
}
