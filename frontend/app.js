// graphdeck dashboard: a hash-routed page over the JSON API served by graphdeck.server.
//
// Pages: #/runs, #/runs/<id>, #/graphs/<id>[?node=<fx node name>], #/traces/<id>.
//
// NOTE: [Untrusted text]
// Node names, module paths, stack traces, file names and trace event names come from user code.
// They enter the page only as text: through h() below (createElement + text nodes) or
// textContent, never innerHTML. The only markup parsed is the server's own SVG render, which
// must have an <svg> root and has any <script>, <foreignObject> and on* attributes removed.

const SVG_NS = "http://www.w3.org/2000/svg";
const PLOTLY_SRC = "/static/vendor/plotly.min.js";
const GRAD_STATUSES = ["OK", "NO_GRAD", "NOT_IN_GRAPH", "FROZEN"];

const $app = document.getElementById("app");
const $crumbs = document.getElementById("crumbs");

// ---------------------------------------------------------------- DOM and formatting helpers

/** h("a", {href: "#/runs", class: "x", onclick: fn}, "text", child) → Element; strings become text. */
function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else if (key === "class") el.className = value;
    else el.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : String(child));
  }
  return el;
}

const cssToken = (text) => String(text ?? "none").replace(/[^A-Za-z0-9_-]/g, "_");
const isBlank = (v) => v === null || v === undefined || v === "";
const fmt = (v) => (isBlank(v) ? "—" : typeof v === "object" ? JSON.stringify(v) : String(v));

function fmtBytes(n) {
  if (isBlank(n)) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = Number(n), i = 0;
  while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  return i === 0 ? `${v} B` : `${v.toFixed(1)} ${units[i]}`;
}

function fmtSeconds(s) {
  if (isBlank(s)) return "—";
  return s < 1 ? `${(s * 1000).toFixed(1)} ms` : `${Number(s).toFixed(2)} s`;
}

function fmtDate(text) {
  if (isBlank(text)) return "—";
  const d = new Date(text);
  return Number.isNaN(d.getTime()) ? String(text) : d.toLocaleString();
}

const plural = (n, word) => `${n} ${word}${n === 1 ? "" : "s"}`;
const badge = (text, kindClass) => h("span", {class: `badge ${kindClass}`}, text);
const kindBadge = (kind) => badge(fmt(kind), `kind kind-${cssToken(kind)}`);
const statusBadge = (status) => badge(fmt(status), `status status-${cssToken(status)}`);
const code = (text) => h("code", {}, fmt(text));
const num = (v) => h("td", {class: "num"}, fmt(v));
const graphLink = (id, label) => h("a", {href: `#/graphs/${id}`}, label ?? `#${id}`);

/** A <table id=... data-testid=...> with a header row; `rows` are <tr> elements. */
function table(id, headers, rows, cls = "") {
  const numeric = rows.length ? [...rows[0].children].map((td) => td.classList.contains("num")) : [];
  return h("table", {id, "data-testid": id, class: `data ${cls}`},
    h("thead", {}, h("tr", {}, headers.map((x, i) => h("th", {class: numeric[i] ? "num" : null}, x)))),
    h("tbody", {}, rows));
}

/** Key/value pairs as a <dl>; rows with blank values are left out unless `keepBlank`. */
function defList(pairs, attrs = {}, keepBlank = false) {
  const items = pairs.filter(([, v]) => keepBlank || !isBlank(v));
  return h("dl", {class: "kv", ...attrs}, items.map(([k, v]) => [
    h("dt", {}, k), h("dd", {}, v instanceof Node ? v : fmt(v))]));
}

/** An array of flat objects as a table whose columns are the union of their keys. */
function objectTable(id, rows) {
  const keys = [...new Set(rows.flatMap((r) => (r && typeof r === "object" ? Object.keys(r) : [])))];
  if (!keys.length) return h("ul", {id}, rows.map((r) => h("li", {}, fmt(r))));
  return table(id, keys, rows.map((r) => h("tr", {}, keys.map((k) => h("td", {}, fmt(r[k]))))));
}

function setCrumbs(items) {
  $crumbs.replaceChildren(...items.flatMap(([label, href], i) => [
    i ? h("span", {class: "sep"}, "›") : null,
    href ? h("a", {href}, label) : h("span", {class: "here"}, label)]).filter(Boolean));
  document.title = ["graphdeck", ...items.map(([label]) => label)].join(" · ");
}

function errorBox(err) {
  const status = err.status ? ` (HTTP ${err.status})` : "";
  return h("div", {class: "error", role: "alert", "data-testid": "error"}, `Error${status}: ${err.message}`);
}

// ---------------------------------------------------------------- API

class ApiError extends Error {
  constructor(message, status) { super(message); this.status = status; }
}

/** GET `path`; JSON by default, text with {text: true}. Raises ApiError with the server's message. */
async function api(path, {text = false} = {}) {
  const res = await fetch(path, {headers: {Accept: text ? "*/*" : "application/json"}});
  if (!res.ok) {
    let message = `${res.status} ${res.statusText}`;
    try { const body = await res.json(); if (body && body.error) message = body.error; } catch { /* not JSON */ }
    throw new ApiError(message, res.status);
  }
  return text ? res.text() : res.json();
}

// ---------------------------------------------------------------- router

const routes = [
  [/^\/runs\/?$/, renderRuns],
  [/^\/runs\/([^/]+)$/, renderRun], // a run's id or its name
  [/^\/graphs\/(\d+)$/, renderGraph],
  [/^\/traces\/(\d+)$/, renderTrace],
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

// ---------------------------------------------------------------- runs list

async function renderRuns(page) {
  const runs = await api("/api/runs");
  if (!page.alive()) return;
  setCrumbs([["Runs"]]);
  const go = (id) => (e) => { if (!e.target.closest("a")) location.hash = `#/runs/${id}`; };
  const rows = runs.map((r) => h("tr", {class: "clickable", "data-run-id": r.id, onclick: go(r.id)},
    h("td", {}, h("a", {href: `#/runs/${r.id}`}, fmt(r.name))),
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

function graphRow(g, depth, partByGraph) {
  const part = partByGraph.get(g.id);
  const relation = [];
  if (g.kind === "ddp_partition" || g.partition_index != null) {
    relation.push(badge(`bucket ${fmt(g.partition_index ?? part?.index)}`, "tag"));
    if (part) relation.push(` ${fmtBytes(part.size_bytes)} · ${plural((part.params || []).length, "param")}`);
  }
  if (g.parent_id != null) relation.push(h("span", {class: "muted"}, " of "), graphLink(g.parent_id));
  const name = h("td", {class: "name", style: `padding-left: ${0.6 + depth * 1.4}em`},
    depth ? h("span", {class: "tree"}, "└ ") : null, graphLink(g.id, fmt(g.name)), h("span", {class: "gid"}, ` #${g.id}`));
  return h("tr", {class: g.break_reason ? "has-break" : "", "data-graph-id": g.id, "data-kind": g.kind},
    num(g.ordinal), h("td", {}, kindBadge(g.kind)), name, h("td", {}, code(g.compile_id)),
    num(g.num_nodes), h("td", {class: "relation"}, relation), h("td", {class: "num"}, fmtSeconds(g.compile_time_s)),
    h("td", {class: "reason"}, g.break_reason ? [badge("graph break", "break"), " ", g.break_reason] : ""));
}

function rankSection(rank, graphs, traces, parts) {
  const partByGraph = new Map(parts.filter((p) => p.graph_id != null).map((p) => [p.graph_id, p]));
  const dynamo = graphs.filter((g) => g.kind === "dynamo");
  const breaks = graphs.filter((g) => g.break_reason).length;
  const ddp = graphs.filter((g) => g.kind === "ddp_partition").length;
  const summary = [plural(graphs.length, "graph"), `${dynamo.length} Dynamo`,
    breaks ? plural(breaks, "graph break") : "no graph breaks",
    ddp ? plural(ddp, "DDP partition") : null, plural(traces.length, "trace")].filter(Boolean).join(" · ");
  const graphRows = graphTree(graphs).map(([g, depth]) => graphRow(g, depth, partByGraph));
  const bucketRows = parts.map((p) => h("tr", {},
    num(p.index), h("td", {class: "num"}, fmtBytes(p.size_bytes)), num((p.params || []).length),
    h("td", {class: "params"}, (p.params || []).map((fqn) => h("code", {class: "chip"}, fmt(fqn)))),
    h("td", {}, p.graph_id != null ? graphLink(p.graph_id) : "—")));
  const traceRows = traces.map((t) => h("tr", {},
    h("td", {}, h("a", {href: `#/traces/${t.id}`}, fmt(t.name))), h("td", {}, statusBadge(t.status)),
    num(t.num_events), h("td", {}, h("a", {href: `#/traces/${t.id}`}, "timeline →"))));
  return h("section", {class: "rank", "data-testid": `rank-${rank}`},
    h("h2", {}, `Rank ${rank}`), h("p", {class: "summary"}, summary),
    graphs.length
      ? table(`graphs-rank-${rank}`, ["Ord.", "Kind", "Name", "Compile id", "Nodes", "Parent / partition",
        "Compile", "Break reason"], graphRows, "graphs-table")
      : h("p", {class: "empty"}, "No graphs captured on this rank."),
    parts.length ? [h("h3", {}, "DDP buckets"),
      table(`buckets-rank-${rank}`, ["Bucket", "Size", "Params", "Parameters", "Graph"], bucketRows)] : null,
    traces.length ? [h("h3", {}, "Traces"),
      table(`traces-rank-${rank}`, ["Name", "Status", "Events", ""], traceRows)] : null);
}

async function renderRun(page, m) {
  const run = await api(`/api/runs/${encodeURIComponent(decodeURIComponent(m[1]))}`);
  const runId = run.id;
  if (!page.alive()) return;
  setCrumbs([["Runs", "#/runs"], [fmt(run.name)]]);
  const graphs = run.graphs || [], traces = run.traces || [], parts = run.partitions || [];
  const rankInfo = run.ranks || [];
  const ranks = [...new Set([...rankInfo, ...graphs, ...traces, ...parts].map((x) => x.rank))]
    .filter((r) => r != null).sort((a, b) => a - b);
  const rankRows = rankInfo.map((r) => h("tr", {}, num(r.rank), num(r.world_size), h("td", {}, fmt(r.hostname)),
    num(r.pid), h("td", {}, fmt(r.backend)), h("td", {}, code(r.torch_version))));
  const gradBox = h("section", {id: "grad-section", class: "grad"}, h("h2", {}, "Gradient paths"),
    h("p", {class: "loading"}, "Loading the gradient-path report…"));
  const of = (list, r) => list.filter((x) => x.rank === r);
  // In-page jumps are buttons: a #fragment link would be taken by the router.
  const jump = (label, target) => h("button", {type: "button", class: "link",
    onclick: () => document.querySelector(target)?.scrollIntoView({behavior: "smooth"})}, label);
  $app.replaceChildren(h("section", {},
    h("h1", {}, fmt(run.name)),
    h("p", {class: "summary"}, `world size ${fmt(run.world_size)} · ${plural(graphs.length, "graph")} · ${plural(traces.length, "trace")}`
      + ` · created ${fmtDate(run.created_at)}`),
    h("nav", {class: "jump", "aria-label": "sections"}, "Jump to: ",
      joinComma([...ranks.map((r) => jump(`rank ${r}`, `[data-testid="rank-${r}"]`)), jump("gradient paths", "#grad-section")])),
    rankInfo.length ? table("ranks-table", ["Rank", "World size", "Host", "PID", "Backend", "torch"], rankRows) : null,
    ranks.map((r) => rankSection(r, of(graphs, r), of(traces, r), of(parts, r).sort((a, b) => a.index - b.index))),
    gradBox));
  let report;
  try {
    report = await api(`/api/runs/${runId}/gradients`);
  } catch (err) {
    if (page.alive()) gradBox.replaceChildren(h("h2", {}, "Gradient paths"),
      h("p", {class: "muted", id: "grad-report-missing"}, `Gradient-path report unavailable: ${err.message}`));
    return;
  }
  if (page.alive()) gradBox.replaceChildren(h("h2", {}, "Gradient paths"), ...gradientReport(report).filter(Boolean));
}

/** 'File "/long/path/modeling_gpt2.py", line 569, in forward' → <code title=full>modeling_gpt2.py:569 in forward</code> */
function sourceLine(text) {
  const m = /File "(?:.*[\\/])?([^\\/"]+)", line (\d+)(?:, in (\S+))?/.exec(text || "");
  const short = m ? `${m[1]}:${m[2]}${m[3] ? ` in ${m[3]}` : ""}` : text;
  return h("div", {class: "first-use"}, "first use ", h("code", {title: text}, short));
}

function problemItem(p) {
  if (typeof p !== "object" || p === null) return h("li", {}, fmt(p));
  const head = [p.rank != null ? `rank ${p.rank}` : null, p.fqn ?? p.param ?? null].filter(Boolean).join(" · ");
  const text = p.message ?? p.reason ?? p.detail ?? JSON.stringify(p);
  const perRank = p.ranks && typeof p.ranks === "object" && !Array.isArray(p.ranks)
    ? ` (${Object.entries(p.ranks).map(([r, st]) => `rank ${r}: ${st}`).join(", ")})` : "";
  return h("li", {}, p.status ? statusBadge(p.status) : null, head ? [" ", h("code", {}, head), ": "] : " ",
    fmt(text), perRank, p.first_use ? sourceLine(p.first_use) : null);
}

/** The gradient-path report: summary line, problems, a filter, and one row per rank/param. */
function gradientReport(report) {
  const params = report.params || [];
  const summary = report.summary || {};
  for (const s of GRAD_STATUSES) {
    if (summary[s] === undefined) summary[s] = params.filter((p) => p.status === s).length;
  }
  const verdict = report.ok === undefined ? null
    : h("strong", {class: report.ok ? "verdict-ok" : "verdict-bad"}, report.ok ? "all gradient paths OK   " : "problems found   ");
  const summaryLine = h("p", {class: "summary", id: "grad-summary"}, verdict, Object.entries(summary).flatMap(([s, n]) =>
    [statusBadge(s), ` ${n}   `]));
  const problems = report.problems || [];
  const rows = params.map((p) => {
    const hay = [p.rank, p.fqn, p.status, p.reason, ...(p.aliases || [])].join(" ").toLowerCase();
    const tensor = [isBlank(p.shape) ? null : fmt(p.shape), p.dtype].filter(Boolean).join(" ");
    const links = (label, ids) => (ids && ids.length ? h("div", {}, h("span", {class: "muted"}, label),
      ids.map((id) => [" ", graphLink(id)])) : null);
    return h("tr", {"data-status": p.status, "data-hay": hay},
      num(p.rank), h("td", {}, code(p.fqn), tensor ? h("div", {class: "muted small"}, tensor) : null),
      h("td", {}, statusBadge(p.status)),
      h("td", {}, (p.aliases || []).filter((a) => a !== p.fqn).map((a) => h("code", {class: "chip"}, fmt(a)))),
      h("td", {class: "reason"}, isBlank(p.reason) ? "" : fmt(p.reason),
        p.first_use ? sourceLine(p.first_use) : null),
      h("td", {class: "graph-links"}, links("read by", p.graphs), links("grad from", p.grad_graphs)));
  });
  const count = h("span", {class: "muted", id: "grad-count"});
  const text = h("input", {type: "search", id: "grad-filter", placeholder: "filter parameters…",
    "aria-label": "filter the gradient report"});
  const status = h("select", {id: "grad-status", "aria-label": "status"}, h("option", {value: ""}, "all statuses"),
    Object.keys(summary).map((s) => h("option", {value: s}, s)));
  const apply = () => {
    const q = text.value.trim().toLowerCase(), want = status.value;
    let shown = 0;
    for (const tr of rows) {
      tr.hidden = !((!q || tr.dataset.hay.includes(q)) && (!want || tr.dataset.status === want));
      shown += tr.hidden ? 0 : 1;
    }
    count.textContent = `${shown} of ${rows.length} parameters`;
  };
  text.addEventListener("input", apply);
  status.addEventListener("change", apply);
  apply();
  return [summaryLine,
    problems.length ? h("ul", {class: "problems", id: "grad-problems"}, problems.map(problemItem)) : null,
    h("div", {class: "toolbar"}, text, status, count),
    table("grad-report", ["Rank", "Parameter", "Status", "Aliases", "Reason", "Graphs"], rows)];
}

// ---------------------------------------------------------------- graph page: SVG viewer

/** Parse the server's SVG render and import it into this document; throws unless the root is <svg>. */
function importSvg(text) {
  const doc = new DOMParser().parseFromString(text, "image/svg+xml");
  const root = doc.documentElement;
  if (doc.querySelector("parsererror") || root.localName !== "svg" || root.namespaceURI !== SVG_NS) {
    throw new Error("the graph render is not an SVG document");
  }
  doc.querySelectorAll("script, foreignObject").forEach((el) => el.remove());
  for (const el of doc.querySelectorAll("*")) {
    for (const attr of [...el.attributes]) if (/^on/i.test(attr.name)) el.removeAttribute(attr.name);
  }
  return document.importNode(root, true);
}

/** Pan (drag) and zoom (wheel, buttons) by editing the SVG's viewBox. */
function makeViewer(svg, host) {
  const vbAttr = (svg.getAttribute("viewBox") || "").trim().split(/[\s,]+/).map(Number);
  const base = vbAttr.length === 4 && vbAttr.every(Number.isFinite) && vbAttr[2] > 0
    ? {x: vbAttr[0], y: vbAttr[1], w: vbAttr[2], h: vbAttr[3]}
    : {x: 0, y: 0, w: parseFloat(svg.getAttribute("width")) || 1000, h: parseFloat(svg.getAttribute("height")) || 1000};
  let vb = {...base};
  svg.removeAttribute("width");
  svg.removeAttribute("height");
  svg.setAttribute("preserveAspectRatio", "xMidYMid meet");
  const apply = () => svg.setAttribute("viewBox", `${vb.x} ${vb.y} ${vb.w} ${vb.h}`);
  const toSvg = (clientX, clientY) => new DOMPoint(clientX, clientY).matrixTransform(svg.getScreenCTM().inverse());
  const hostCenter = () => { const r = host.getBoundingClientRect(); return [r.left + r.width / 2, r.top + r.height / 2]; };

  function zoom(factor, clientX, clientY) {
    if (clientX === undefined) [clientX, clientY] = hostCenter();
    const w = Math.min(Math.max(vb.w / factor, Math.min(20, base.w)), base.w * 20); // 20 units … 20× the graph
    const f = vb.w / w;
    const p = toSvg(clientX, clientY);
    vb = {x: p.x - (p.x - vb.x) / f, y: p.y - (p.y - vb.y) / f, w: vb.w / f, h: vb.h / f};
    apply();
  }
  function centerOn(el) {
    const r = el.getBoundingClientRect(), hr = host.getBoundingClientRect();
    if (r.left >= hr.left && r.right <= hr.right && r.top >= hr.top && r.bottom <= hr.bottom) return;
    const p = toSvg(r.left + r.width / 2, r.top + r.height / 2);
    vb = {...vb, x: p.x - vb.w / 2, y: p.y - vb.h / 2};
    apply();
  }
  function fit() { // the whole graph, magnified at most 1.5× so a small graph is not blown up
    const r = host.getBoundingClientRect();
    const scale = Math.min(r.width / base.w, r.height / base.h);
    if (!(scale > 1.5)) { vb = {...base}; apply(); return; }
    const w = r.width / 1.5, hgt = r.height / 1.5;
    vb = {x: base.x + (base.w - w) / 2, y: base.y - Math.min(16, (hgt - base.h) / 2), w, h: hgt};
    apply();
  }

  function home() { // the whole graph if it stays readable (≥ 0.6×), else its top at 0.6–1×
    const r = host.getBoundingClientRect();
    const scale = Math.min(r.width / base.w, r.height / base.h);
    if (!(scale < 0.6)) { fit(); return; }
    const s = Math.min(1, Math.max(0.6, r.width / base.w));
    const w = r.width / s, hgt = r.height / s;
    vb = {x: base.x + (base.w - w) / 2, y: base.y, w, h: hgt};
    apply();
  }

  let drag = null; // {x, y, id, moved}
  let dragEnded_ms = -Infinity; // a click right after a drag is the drag's end, not a selection
  host.addEventListener("pointerdown", (e) => {
    if (e.button === 0) drag = {x: e.clientX, y: e.clientY, id: e.pointerId, moved: false};
  });
  host.addEventListener("pointermove", (e) => {
    if (!drag || e.pointerId !== drag.id) return;
    const dx = e.clientX - drag.x, dy = e.clientY - drag.y;
    if (!drag.moved && Math.hypot(dx, dy) < 4) return;
    if (!drag.moved) { drag.moved = true; host.setPointerCapture(e.pointerId); host.classList.add("dragging"); }
    const scale = svg.getScreenCTM().a || 1; // screen px per viewBox unit
    vb = {...vb, x: vb.x - dx / scale, y: vb.y - dy / scale};
    drag.x = e.clientX; drag.y = e.clientY;
    apply();
  });
  const endDrag = (e) => {
    if (!drag || e.pointerId !== drag.id) return;
    host.classList.remove("dragging");
    if (drag.moved) dragEnded_ms = performance.now();
    drag = null;
  };
  host.addEventListener("pointerup", endDrag);
  host.addEventListener("pointercancel", endDrag);
  host.addEventListener("wheel", (e) => {
    e.preventDefault();
    zoom(Math.exp(-e.deltaY * (e.deltaMode === 1 ? 0.05 : 0.0015)), e.clientX, e.clientY);
  }, {passive: false});
  home();
  return {zoom, fit, centerOn, justDragged: () => performance.now() - dragEnded_ms < 250};
}

// ---------------------------------------------------------------- graph page

const graphHash = (id, name) => `#/graphs/${id}${name ? `?node=${encodeURIComponent(name)}` : ""}`;

function relatedGraphs(graph) {
  const asGraph = (g) => (typeof g === "object" && g !== null ? g : {id: g});
  const item = (label, g) => h("li", {}, label ? h("span", {class: "muted"}, label) : null,
    g.kind ? [kindBadge(g.kind), " "] : null, graphLink(g.id, g.name ? `${g.name} (#${g.id})` : undefined),
    g.partition_index != null ? h("span", {class: "muted"}, ` bucket ${g.partition_index}`) : null);
  const items = [];
  if (graph.parent || graph.parent_id != null) items.push(item("parent ", asGraph(graph.parent ?? graph.parent_id)));
  for (const c of graph.children || []) items.push(item("", asGraph(c)));
  return items.length ? h("ul", {class: "related", id: "related-graphs"}, items) : h("p", {class: "muted"}, "none");
}

const joinComma = (parts) => parts.flatMap((p, i) => (i ? [", ", p] : [p]));

/** An FX argument as capture stores it, shown Python-style; {"node": n} becomes a button selecting n. */
function argView(v, selectNode) {
  if (v === null || v === undefined) return "None";
  if (typeof v === "boolean") return v ? "True" : "False";
  if (typeof v !== "object") return typeof v === "string" ? `'${v}'` : String(v);
  if (Array.isArray(v)) return ["[", joinComma(v.map((x) => argView(x, selectNode))), "]"];
  const keys = Object.keys(v);
  if (keys.length === 1 && typeof v.node === "string") {
    return h("button", {type: "button", class: "link", onclick: () => selectNode(v.node)}, v.node);
  }
  if (keys.length === 1 && typeof v.repr === "string") return v.repr;
  return ["{", joinComma(keys.map((k) => [`'${k}': `, argView(v[k], selectNode)])), "}"];
}

function callView(args, kwargs, selectNode) {
  if (typeof args === "string") return h("pre", {class: "code"}, args);
  const positional = Array.isArray(args) ? args.map((a) => argView(a, selectNode)) : [argView(args, selectNode)];
  const named = Object.entries(kwargs || {}).map(([k, v]) => [`${k}=`, argView(v, selectNode)]);
  return h("div", {class: "call", id: "node-args"}, "(", joinComma([...positional, ...named]), ")");
}

function nodeDetails(node, full, selectNode) {
  const f = {...node, ...(full || {})};
  const nameButtons = (names) => (names && names.length
    ? h("span", {class: "names"}, names.map((n) => h("button", {type: "button", class: "link", onclick: () => selectNode(n)}, n)))
    : full ? "none" : "…");
  const moduleStack = Array.isArray(f.module_stack) && f.module_stack.length
    ? h("ol", {class: "module-stack"}, f.module_stack.map((e) => h("li", {},
      Array.isArray(e) ? [h("code", {}, fmt(e[0])), " ", h("span", {class: "muted"}, fmt(e[1]))] : fmt(e))))
    : null;
  const args = f.args === undefined ? null : callView(f.args, f.kwargs, selectNode);
  return [
    h("h2", {class: "node-name", "data-testid": "node-name"}, f.name),
    defList([
      ["op", h("span", {class: "node-op", "data-testid": "node-op"}, badge(fmt(f.op), `op op-${cssToken(f.op)}`))],
      ["target", isBlank(f.target) ? null : code(f.target)],
      ["shape", isBlank(f.shape) ? null : code(fmt(f.shape))],
      ["dtype", f.dtype], ["stride", isBlank(f.stride) ? null : code(fmt(f.stride))], ["device", f.device],
      ["size", isBlank(f.size_bytes) ? null : fmtBytes(f.size_bytes)],
      ["module path", isBlank(f.module_path) ? null : code(f.module_path)], ["module stack", moduleStack],
      ["seq_nr", f.seq_nr], ["partitioner tag", f.partitioner_tag],
      ["AOT descriptor", isBlank(f.desc) ? null : code(f.desc)],
      ["param fqn", isBlank(f.param_fqn) ? null : code(f.param_fqn)],
      ["args", args], ["inputs", nameButtons(f.inputs)], ["users", nameButtons(f.users)],
    ], {"data-testid": "node-fields"}),
    h("h3", {}, "Stack trace"),
    isBlank(f.stack_trace) ? h("p", {class: "muted"}, full ? "no stack trace recorded" : "…")
      : h("pre", {class: "code stack", id: "node-stack"}, f.stack_trace),
  ];
}

async function renderGraph(page, m, query) {
  const id = Number(m[1]);
  const [graph, nodes, svgText] = await Promise.all([
    api(`/api/graphs/${id}`), api(`/api/graphs/${id}/nodes`), api(`/api/graphs/${id}/svg`, {text: true})]);
  if (!page.alive()) return;
  const svg = importSvg(svgText);
  const crumbs = (runName) => setCrumbs([["Runs", "#/runs"],
    graph.run_id != null ? [runName ?? `run ${graph.run_id}`, `#/runs/${graph.run_id}`] : null,
    [`rank ${fmt(graph.rank)} · ${fmt(graph.name)}`]].filter(Boolean));
  crumbs(graph.run_name);
  if (graph.run_name == null && graph.run_id != null) { // the graph JSON names its run only by id
    api("/api/runs").then((runs) => {
      const run = runs.find((r) => r.id === graph.run_id);
      if (run && page.alive()) crumbs(fmt(run.name));
    }).catch(() => {});
  }

  const byName = new Map(nodes.map((n) => [n.name, n]));
  const byIdx = new Map(nodes.map((n) => [n.idx, n]));
  const gByName = new Map();
  for (const g of svg.querySelectorAll("g.node")) {
    const title = g.querySelector("title");
    const node = g.id.startsWith("node-") ? byIdx.get(Number(g.id.slice(5))) : undefined;
    const name = node ? node.name : title && title.textContent.trim();
    if (name) { gByName.set(name, g); g.dataset.name = name; }
  }
  // node name → edge <g>s that touch it; Graphviz titles an edge "n<src idx>->n<dst idx>"
  const endName = (t) => (/^n\d+$/.test(t) ? byIdx.get(Number(t.slice(1)))?.name : undefined) ?? t;
  const edgesByEnd = new Map();
  for (const e of svg.querySelectorAll("g.edge")) {
    const ends = (e.querySelector("title")?.textContent || "").split(/->|--/)
      .map((t) => endName(t.trim().replace(/:.*$/, "")));
    for (const end of ends) { if (!edgesByEnd.has(end)) edgesByEnd.set(end, []); edgesByEnd.get(end).push(e); }
  }

  const host = h("div", {id: "graph-svg", "data-testid": "graph-svg", class: "svg-host"}, svg);
  const details = h("aside", {id: "node-details", "data-testid": "node-details", class: "details"},
    h("p", {class: "muted"}, "Click a node to see its details."));
  const search = h("input", {type: "search", id: "node-search", placeholder: "find node by name, op or target…",
    "aria-label": "find node", autocomplete: "off"});
  const results = h("ul", {id: "search-results", class: "results", hidden: true});
  const viewer = {zoom: () => {}, fit: () => {}, centerOn: () => {}, justDragged: () => false};
  const button = (bid, label, title, fn) => h("button", {type: "button", id: bid, title, onclick: fn}, label);

  let selected = null, selectToken = 0;
  const selectNode = (name) => { location.hash = graphHash(id, name); };
  async function select(name, {center = true} = {}) {
    for (const el of svg.querySelectorAll(".selected, .related")) el.classList.remove("selected", "related");
    selected = name && byName.has(name) ? name : null;
    const token = ++selectToken;
    if (!selected) {
      details.replaceChildren(name ? errorBox(new Error(`no node named "${name}" in this graph`))
        : h("p", {class: "muted"}, "Click a node to see its details."));
      return;
    }
    const g = gByName.get(selected);
    if (g) { g.classList.add("selected"); if (center) viewer.centerOn(g); }
    (edgesByEnd.get(selected) || []).forEach((e) => e.classList.add("related"));
    const node = byName.get(selected);
    details.replaceChildren(...nodeDetails(node, null, selectNode));
    let full;
    try { full = await api(`/api/graphs/${id}/nodes/${encodeURIComponent(selected)}`); } catch (err) {
      if (token === selectToken && page.alive()) details.append(errorBox(err));
      return;
    }
    if (token !== selectToken || !page.alive()) return;
    details.replaceChildren(...nodeDetails(node, full, selectNode));
    for (const other of [...(full.inputs || []), ...(full.users || [])]) gByName.get(other)?.classList.add("related");
  }

  function runSearch() {
    const q = search.value.trim().toLowerCase();
    svg.classList.toggle("searching", Boolean(q));
    const hits = q ? nodes.filter((n) => [n.name, n.op, n.target].some((v) => v && String(v).toLowerCase().includes(q))) : [];
    const hitNames = new Set(hits.map((n) => n.name));
    for (const [name, g] of gByName) g.classList.toggle("match", hitNames.has(name));
    results.hidden = !q;
    results.replaceChildren(...hits.slice(0, 40).map((n) => h("li", {},
      h("button", {type: "button", class: "link", onclick: () => selectNode(n.name)}, n.name),
      h("span", {class: "muted"}, ` ${fmt(n.op)} ${isBlank(n.target) ? "" : n.target}`))),
    q && !hits.length ? h("li", {class: "muted"}, "no match") : "",
    hits.length > 40 ? h("li", {class: "muted"}, `… ${hits.length - 40} more`) : "");
    return hits;
  }
  search.addEventListener("input", runSearch);
  search.addEventListener("keydown", (e) => {
    if (e.key === "Enter") { const hits = runSearch(); if (hits.length) selectNode(hits[0].name); }
    if (e.key === "Escape") { search.value = ""; runSearch(); }
  });
  host.addEventListener("click", (e) => {
    if (viewer.justDragged()) return;
    const g = e.target.closest("g.node");
    if (g && g.dataset.name) selectNode(g.dataset.name);
  });

  const io = Array.isArray(graph.io) && graph.io.length ? objectTable("graph-io", graph.io) : h("p", {class: "muted"}, "none recorded");
  $app.replaceChildren(h("section", {class: "graph-page"},
    h("h1", {}, kindBadge(graph.kind), " ", fmt(graph.name)),
    h("p", {class: "summary"}, [`rank ${fmt(graph.rank)}`, `ordinal ${fmt(graph.ordinal)}`,
      graph.compile_id ? `compile id ${graph.compile_id}` : null, graph.frame_name ? `frame ${graph.frame_name}` : null,
      `${nodes.length} nodes`, graph.compile_time_s != null ? `compiled in ${fmtSeconds(graph.compile_time_s)}` : null,
      graph.partition_index != null ? `DDP bucket ${graph.partition_index}` : null].filter(Boolean).join(" · ")),
    graph.break_reason ? h("p", {class: "break-banner"}, badge("graph break", "break"), " ", graph.break_reason) : null,
    h("div", {class: "graph-layout"},
      h("div", {class: "viewer"},
        h("div", {class: "toolbar"}, search,
          button("zoom-in", "+", "zoom in", () => viewer.zoom(1.25)),
          button("zoom-out", "−", "zoom out", () => viewer.zoom(0.8)),
          button("zoom-fit", "fit", "fit the whole graph", () => viewer.fit()),
          h("span", {class: "muted hint"}, "drag to pan · wheel to zoom")),
        results, host),
      details),
    h("h2", {}, "Related graphs"), relatedGraphs(graph),
    h("details", {class: "fold"}, h("summary", {}, "Inputs and outputs"), io),
    graph.code ? h("details", {class: "fold"}, h("summary", {}, "Graph code"), h("pre", {class: "code", id: "graph-code"}, graph.code)) : null));
  Object.assign(viewer, makeViewer(svg, host));
  page.update = (q) => select(q.get("node"));
  select(query.get("node"));
}

// ---------------------------------------------------------------- trace page

let plotlyLoading = null;
function loadPlotly() {
  if (window.Plotly) return Promise.resolve(window.Plotly);
  plotlyLoading ??= new Promise((resolve, reject) => {
    const s = h("script", {src: PLOTLY_SRC});
    s.addEventListener("load", () => resolve(window.Plotly));
    s.addEventListener("error", () => { plotlyLoading = null; reject(new Error(`could not load ${PLOTLY_SRC}`)); });
    document.head.append(s);
  });
  return plotlyLoading;
}

/** A stats value: scalars as text, a flat object as `key: value` chips, anything deeper as JSON. */
function statValue(v) {
  if (typeof v !== "object" || v === null) return fmt(v);
  const entries = Object.entries(v);
  if (!Array.isArray(v) && entries.every(([, x]) => typeof x !== "object" || x === null)) {
    return h("span", {}, entries.map(([k, x]) => h("code", {class: "chip"}, `${k}: ${fmt(x)}`)));
  }
  return h("pre", {class: "code small"}, JSON.stringify(v, null, 1));
}

function statsView(stats, id) {
  const entries = Object.entries(stats || {});
  if (!entries.length) return h("p", {class: "muted", id}, "none");
  return defList(entries.map(([k, v]) => [k, statValue(v)]), {id, class: "kv panel"}, true);
}

async function renderTrace(page, m) {
  const id = Number(m[1]);
  const trace = await api(`/api/traces/${id}`);
  if (!page.alive()) return;
  const crumbs = [["Runs", "#/runs"]];
  if (trace.run_id != null) crumbs.push([trace.run_name ? fmt(trace.run_name) : `run ${trace.run_id}`, `#/runs/${trace.run_id}`]);
  setCrumbs([...crumbs, [`rank ${fmt(trace.rank)} · ${fmt(trace.name)}`]]);
  const timeline = h("div", {id: "timeline", "data-testid": "timeline", class: "timeline"},
    h("p", {class: "loading"}, "Loading the timeline…"));
  const skip = new Set(["stats", "meta", "id", "name", "run_id", "run_name"]);
  $app.replaceChildren(h("section", {class: "trace-page"},
    h("h1", {}, fmt(trace.name), " ", statusBadge(trace.status)),
    defList(Object.entries(trace).filter(([k]) => !skip.has(k))
      .map(([k, v]) => [k, typeof v === "object" && v !== null ? code(JSON.stringify(v)) : v]), {id: "trace-meta"}),
    h("h2", {}, "Timeline"), timeline,
    h("h2", {}, "Ingest stats"), statsView(trace.stats, "trace-stats"),
    h("details", {class: "fold"}, h("summary", {}, "Trace metadata"), statsView(trace.meta, "trace-info"))));
  try {
    const [Plotly, figure] = await Promise.all([loadPlotly(), api(`/api/traces/${id}/timeline`)]);
    if (!page.alive()) return;
    timeline.replaceChildren();
    timeline.classList.add("plotted");
    await Plotly.newPlot(timeline, figure.data || [], {autosize: true, ...(figure.layout || {})},
      {responsive: true, displaylogo: false});
  } catch (err) {
    if (page.alive()) timeline.replaceChildren(errorBox(err));
  }
}

route();
