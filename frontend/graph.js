// graphdeck dashboard: the graph page. The URL holds the whole view, so a link reproduces it:
//   #/graphs/<id>?node=<name>&depth=<n>&expand=<a/b>&collapse=<a/b>&filter=<regex>&overlay=<kind>
// (expand, collapse and filter repeat). The server draws the visible part (server/render/svg.py
// documents the markup); a click on a collapsed cluster opens it, a click on an open cluster's
// label closes it; selecting a node hidden in a collapsed cluster opens its clusters (the server's
// data-open-clusters tells which) and puts them in the URL. Pan (drag), zoom (wheel, buttons),
// search by name, op, target or module path, node details with inputs, users and the
// forward/backward counterparts (same seq_nr), overlays, filter, exports.

import {
  $app, api, badge, code, cssToken, defList, errorBox, fmt, fmtBytes, fmtSeconds, graphLink, h, isBlank,
  joinComma, kindBadge, objectTable, setCrumbs,
} from "./common.js";
import {importSvg, makeViewer} from "./viewer.js";

// ---------------------------------------------------------------- graph page

/** The view state in a graph URL's query. */
function viewState(q) {
  const depth = q.get("depth");
  return {depth: depth === null || depth === "" ? null : depth, expand: q.getAll("expand"), collapse: q.getAll("collapse"),
    filter: q.getAll("filter").filter((f) => f !== ""), overlay: q.get("overlay") || null};
}

function stateQuery(st, node) {
  const q = new URLSearchParams();
  if (node) q.set("node", node);
  if (st.depth !== null) q.set("depth", st.depth);
  for (const p of [...new Set(st.expand)].sort()) q.append("expand", p);
  for (const p of [...new Set(st.collapse)].sort()) q.append("collapse", p);
  for (const f of st.filter) q.append("filter", f);
  if (st.overlay) q.set("overlay", st.overlay);
  return q.toString();
}

const graphHash = (id, name, st) => {
  const q = st ? stateQuery(st, name) : name ? `node=${encodeURIComponent(name)}` : "";
  return `#/graphs/${id}${q ? `?${q}` : ""}`;
};

/** The /svg URL of a view state (the API's parameter names), optionally with a focus node. */
export function svgUrl(id, st, focus, extra = {}) {
  const q = new URLSearchParams();
  if (st.depth !== null) q.set("max_depth", st.depth);
  for (const p of st.expand) q.append("expand", p);
  for (const p of st.collapse) q.append("collapse", p);
  for (const f of st.filter) q.append("filter_by_op", f);
  if (st.overlay) q.set("overlay", st.overlay);
  if (focus) q.set("node", focus);
  for (const [k, v] of Object.entries(extra)) q.set(k, v);
  const text = q.toString();
  return `/api/graphs/${id}/svg${text ? `?${text}` : ""}`;
}

const sameState = (a, b) => stateQuery(a) === stateQuery(b);

/**
 * The related-graphs list: the parent, its other children (an AOT forward's backward and vice
 * versa, a DDP bucket's other buckets), then this graph's children. The siblings come from
 * GET /api/graphs/<parent id> and are put in place when it answers.
 */
function relatedGraphs(page, graph) {
  const asGraph = (g) => (typeof g === "object" && g !== null ? g : {id: g});
  const item = (relation, g) => h("li", {"data-relation": relation, "data-graph-id": g.id},
    h("span", {class: "muted"}, `${relation} `), g.kind ? [kindBadge(g.kind), " "] : null,
    graphLink(g.id, g.name ? `${g.name} (#${g.id})` : undefined),
    g.partition_index != null ? h("span", {class: "muted"}, ` bucket ${g.partition_index}`) : null);
  const order = (a, b) => (a.partition_index ?? 0) - (b.partition_index ?? 0) || (a.ordinal ?? 0) - (b.ordinal ?? 0) || a.id - b.id;
  const parent = graph.parent ? asGraph(graph.parent) : graph.parent_id != null ? {id: graph.parent_id} : null;
  const children = (graph.children || []).map(asGraph).sort(order);
  const list = h("ul", {class: "related", id: "related-graphs", "data-testid": "related-graphs"},
    parent ? item("parent", parent) : null, children.map((c) => item("child", c)));
  if (!parent && !children.length) list.append(h("li", {class: "muted"}, "none"));
  if (parent) {
    const pending = h("li", {class: "loading", id: "related-siblings-loading"}, "Loading the other graphs of this parent…");
    list.firstChild.after(pending);
    api(`/api/graphs/${parent.id}`).then((p) => {
      if (!page.alive()) return;
      const siblings = (p.children || []).map(asGraph).filter((c) => c.id !== graph.id).sort(order);
      pending.replaceWith(...siblings.map((c) => {
        const li = item("sibling", c);
        li.append(" ", h("a", {href: `#/compare/${graph.id}/${c.id}`, class: "compare-link"}, "side by side"));
        return li;
      }));
    }, (err) => {
      if (page.alive()) pending.replaceWith(h("li", {class: "muted"}, `other graphs of the parent unavailable: ${err.message}`));
    });
  }
  return list;
}

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

/** The forward/backward nodes sharing this node's seq_nr: links to them in the sibling graph. */
function counterpartsView(cp) {
  if (!cp) return "…";
  if (!cp.graphs || !cp.graphs.length) return cp.seq_nr == null ? "no seq_nr" : "none";
  return h("span", {class: "names", id: "node-counterparts"}, cp.graphs.map((g) => [
    h("span", {class: "muted"}, `${g.kind === "aot_backward" ? "backward" : "forward"} #${g.id}: `),
    g.nodes.map((n) => h("a", {href: `#/graphs/${g.id}?node=${encodeURIComponent(n)}`, class: "counterpart", "data-graph-id": g.id}, n)),
  ]));
}

function nodeDetails(node, full, selectNode, counterparts) {
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
      ["seq_nr", f.seq_nr], ["fwd/bwd", f.seq_nr == null ? null : counterpartsView(counterparts)],
      ["partitioner tag", f.partitioner_tag],
      ["AOT descriptor", isBlank(f.desc) ? null : code(f.desc)],
      ["param fqn", isBlank(f.param_fqn) ? null : code(f.param_fqn)],
      ["args", args], ["inputs", nameButtons(f.inputs)], ["users", nameButtons(f.users)],
    ], {"data-testid": "node-fields"}),
    h("h3", {}, "Stack trace"),
    isBlank(f.stack_trace) ? h("p", {class: "muted"}, full ? "no stack trace recorded" : "…")
      : h("pre", {class: "code stack", id: "node-stack"}, f.stack_trace),
  ];
}

/** node name → <g>, and node name → edge <g>s touching it (edges name their ends in data-src/dst). */
function readSvg(svg, byName) {
  const gByName = new Map(), fx = [], edgesByEnd = new Map();
  for (const g of svg.querySelectorAll("g.node[data-name]")) {
    const m = /^node-(\d+)$/.exec(g.id);
    if (!m || !byName.has(g.dataset.name)) continue;
    gByName.set(g.dataset.name, g);
    fx.push([Number(m[1]), g]);
  }
  for (const e of svg.querySelectorAll("g.edge")) {
    for (const end of [e.dataset.src, e.dataset.dst]) {
      if (!edgesByEnd.has(end)) edgesByEnd.set(end, []);
      edgesByEnd.get(end).push(e);
    }
  }
  fx.sort((a, b) => a[0] - b[0]);
  return {gByName, fxNodes: fx.map(([, g]) => g), edgesByEnd};
}

/**
 * Move the render's legend (op colours, edge bytes, the overlay's line: "no values: …") out of
 * the graph's SVG into `into`, a part of the page that stays in view whatever the pan and zoom;
 * the fallback note too. Returns the SVG units the legend took at the top of the drawing.
 */
function moveLegend(svg, into) {
  into.replaceChildren();
  const legend = svg.querySelector("#legend");
  const notes = [...svg.querySelectorAll(".overlay-legend, .fallback-note")].map((t) => {
    t.remove();
    return h("p", {class: t.classList.contains("fallback-note") ? "overlay-note fallback" : "overlay-note",
      "data-testid": "overlay-note"}, t.textContent);
  });
  if (!legend) { into.append(...notes); return 0; }
  const height = Number(svg.dataset.legendH) || 34;
  legend.remove();
  const box = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  box.setAttribute("class", "legend-svg");
  box.setAttribute("height", "34");
  box.setAttribute("width", "100%");
  box.setAttribute("font-family", "Helvetica,Arial,sans-serif");
  box.append(legend);
  into.append(box, ...notes);
  return height + 12;
}

/** Node labels wider than their box (the font is wider than the layout's estimate) end in "…";
 * the node's <title> keeps the full text (a hover shows it). */
function fitLabels(svg) {
  for (const g of svg.querySelectorAll("g.node")) {
    const rect = g.querySelector("rect");
    if (!rect) continue;
    const room = rect.width.baseVal.value - 6;
    for (const t of g.querySelectorAll(":scope > text")) {
      const full = t.textContent;
      if (!(t.getComputedTextLength() > room)) continue;
      let n = full.length;
      while (n > 1 && t.getComputedTextLength() > room) { n = Math.floor(n * 0.9); t.textContent = `${full.slice(0, n)}\u2026`; }
      const title = g.querySelector(":scope > title");
      if (title && !title.textContent.includes(full.replace(/\u2026$/, ""))) title.textContent = `${full}\n${title.textContent}`;
    }
  }
}

/** A selected node: class `selected` and a halo around its box (visible at any zoom). */
function markSelected(g) {
  g.classList.add("selected");
  const r = g.querySelector("rect");
  if (!r) return;
  const halo = document.createElementNS("http://www.w3.org/2000/svg", "rect");
  const [x, y, w, hh] = ["x", "y", "width", "height"].map((a) => Number(r.getAttribute(a)));
  for (const [k, v] of Object.entries({x: x - 5, y: y - 5, width: w + 10, height: hh + 10, rx: 6, class: "selection-halo",
    fill: "none", stroke: "#e8590c", "stroke-width": 3, "vector-effect": "non-scaling-stroke", "pointer-events": "none"})) {
    halo.setAttribute(k, String(v));
  }
  g.prepend(halo);
}

/** The toolbar's line about what is drawn; with a filter, how many nodes match it. */
function statusText(svg, st, drawnNodes, total) {
  const visible = svg.dataset.visibleNodes ?? drawnNodes;
  const drawn = `${visible} of ${total} nodes drawn`;
  if (!st.filter.length || svg.dataset.matches === undefined) return drawn;
  const matches = Number(svg.dataset.matches), onPath = Number(svg.dataset.onPath || 0);
  const what = st.filter.join("|");
  if (!matches) return `no node matches ${what} · ${drawn}`;
  return `${matches} node${matches === 1 ? "" : "s"} match ${what} (${matches + onPath} with the paths between them) · ${drawn}, the rest faded`;
}

const OVERLAYS = [["", "op category"], ["bytes", "output bytes"], ["time", "time (trace)"], ["comm", "communication (trace)"], ["partition", "partition (DDP, FSDP2, TP, PP)"], ["rank", "rank"],
  ["memory", "live bytes (memory)"], ["stage", "pipeline stage (executor)"]];

export async function renderGraph(page, m, query) {
  const id = Number(m[1]);
  let st = viewState(query);
  const [graph, nodes, svgText] = await Promise.all([
    api(`/api/graphs/${id}`), api(`/api/graphs/${id}/nodes`), api(svgUrl(id, st), {text: true})]);
  if (!page.alive()) return;
  setCrumbs([["Runs", "#/runs"],
    graph.run_id != null ? [isBlank(graph.run_name) ? `run ${graph.run_id}` : fmt(graph.run_name), `#/runs/${graph.run_id}`] : null,
    [`rank ${fmt(graph.rank)} · ${fmt(graph.name)}`]].filter(Boolean));
  const byName = new Map(nodes.map((n) => [n.name, n]));

  let svg = null, gByName = new Map(), edgesByEnd = new Map();
  const host = h("div", {id: "graph-svg", "data-testid": "graph-svg", class: "svg-host"});
  const details = h("aside", {id: "node-details", "data-testid": "node-details", class: "details"},
    h("p", {class: "muted"}, "Click a node to see its details."));
  const search = h("input", {type: "search", id: "node-search", placeholder: "find node by name, op, target or module…",
    "aria-label": "find node", autocomplete: "off"});
  const filter = h("input", {type: "search", id: "op-filter", placeholder: "filter ops (regex), Enter", "aria-label": "filter by op",
    value: st.filter.join("|"), autocomplete: "off"});
  const overlaySel = h("select", {id: "overlay", "aria-label": "overlay"},
    OVERLAYS.map(([v, label]) => h("option", {value: v, selected: (st.overlay || "") === v}, label)));
  const depthSel = h("select", {id: "depth", "aria-label": "cluster depth"},
    [["", "depth: auto"], ...[0, 1, 2, 3, 4, 5, 99].map((d) => [String(d), d === 99 ? "depth: all" : `depth: ${d}`])]
      .map(([v, label]) => h("option", {value: v, selected: (st.depth ?? "") === v}, label)));
  const results = h("ul", {id: "search-results", "data-testid": "search-results", class: "results", hidden: true});
  const status = h("span", {id: "view-status", "data-testid": "view-status", class: "muted hint"});
  const legendHost = h("div", {id: "graph-legend", "data-testid": "graph-legend", class: "graph-legend"});
  const exportSvg = h("a", {id: "export-svg", href: svgUrl(id, st, null, {download: "1"}), download: `graph-${id}.svg`}, "SVG");
  const viewer = {zoom: () => {}, fit: () => {}, centerOn: () => {}, justDragged: () => false};
  const button = (bid, label, title, fn) => h("button", {type: "button", id: bid, title, onclick: fn}, label);

  const closeResults = () => { results.hidden = true; };
  const showResults = (items) => { results.replaceChildren(...items); results.hidden = !items.length; };
  const pick = (name, extra) => h("li", {},
    h("button", {type: "button", class: "link", onclick: () => selectNode(name)}, name), extra ? h("span", {class: "muted"}, extra) : null);
  const go = (newState, name, {replace = false} = {}) => {
    const target = graphHash(id, name, newState);
    if (replace) location.replace(target); else location.hash = target;
  };

  function draw(text) {
    svg = importSvg(text);
    ({gByName, edgesByEnd} = readSvg(svg, byName));
    const fxNodes = [...gByName.values()];
    const legendH = moveLegend(svg, legendHost);
    host.replaceChildren(svg);
    fitLabels(svg);
    Object.assign(viewer, makeViewer(svg, host, fxNodes, {trimTop: legendH}));
    status.textContent = statusText(svg, st, gByName.size, nodes.length);
    exportSvg.href = svgUrl(id, st, null, {download: "1"});
  }

  let selected = null, selectToken = 0;
  const selectNode = (name) => { closeResults(); go(st, name); };

  /** A node not drawn (in a collapsed cluster): ask the server to open its clusters, keep them in the URL. */
  async function reveal(name) {
    // a cluster closed by hand that holds the node opens again (collapse wins over the focus);
    // region boxes (paths with a ⟨label⟩ segment, server/render/regions.py) are not module paths:
    // any closed one may hold the node, so they open too
    const path = byName.get(name)?.module_path || "";
    const kept = st.collapse.filter((p) => !(path === p || path.startsWith(`${p}/`)) && !p.includes("\u27e8"));
    const text = await api(svgUrl(id, {...st, collapse: kept}, name), {text: true});
    if (!page.alive()) return false;
    const doc = new DOMParser().parseFromString(text, "image/svg+xml");
    const opened = (doc.documentElement.getAttribute("data-open-clusters") || "").split("|").filter(Boolean);
    const collapse = kept.filter((p) => !opened.includes(p));
    const expand = [...new Set([...st.expand, ...opened.filter((p) => !st.expand.includes(p))])];
    // keep only the deepest opened paths that the default depth would not open anyway
    const minimal = expand.filter((p) => !expand.some((q) => q !== p && q.startsWith(`${p}/`)));
    go({...st, expand: minimal, collapse}, name, {replace: true});
    return true;
  }

  /** ?path=a,b,c (e.g. from the gradient report: parameter → cut): mark those nodes and the edges
   * between consecutive ones with the class `on-path`. */
  function markPath(q) {
    for (const el of host.querySelectorAll(".on-path")) el.classList.remove("on-path");
    const names = (q.get("path") || "").split(",").filter(Boolean);
    names.forEach((n) => gByName.get(n)?.classList.add("on-path"));
    for (let i = 1; i < names.length; i++) {
      const into = new Set(edgesByEnd.get(names[i]) || []);
      (edgesByEnd.get(names[i - 1]) || []).filter((e) => into.has(e)).forEach((e) => e.classList.add("on-path"));
    }
    host.dataset.pathNodes = String(host.querySelectorAll("g.node.on-path").length);
  }

  async function select(name, {center = true} = {}) {
    closeResults();
    for (const el of host.querySelectorAll(".selected, .related")) el.classList.remove("selected", "related");
    host.querySelectorAll(".selection-halo").forEach((el) => el.remove());
    selected = name && byName.has(name) ? name : null;
    const token = ++selectToken;
    if (!selected) {
      details.replaceChildren(name ? errorBox(new Error(`no node named "${name}" in this graph`))
        : h("p", {class: "muted"}, "Click a node to see its details."));
      return;
    }
    const g = gByName.get(selected);
    if (!g) { if (await reveal(selected)) return; }
    if (g) { markSelected(g); if (center) viewer.zoomTo(g); }
    (edgesByEnd.get(selected) || []).forEach((e) => e.classList.add("related"));
    const node = byName.get(selected);
    details.replaceChildren(...nodeDetails(node, null, selectNode));
    let full, cp = null;
    try {
      [full, cp] = await Promise.all([api(`/api/graphs/${id}/nodes/${encodeURIComponent(selected)}`),
        node.seq_nr == null ? null : api(`/api/graphs/${id}/nodes/${encodeURIComponent(selected)}/counterparts`)]);
    } catch (err) {
      if (token === selectToken && page.alive()) details.append(errorBox(err));
      return;
    }
    if (token !== selectToken || !page.alive()) return;
    details.replaceChildren(...nodeDetails(node, full, selectNode, cp));
    for (const other of [...(full.inputs || []), ...(full.users || [])]) gByName.get(other)?.classList.add("related");
  }

  function runSearch() {
    const q = search.value.trim().toLowerCase();
    svg?.classList.toggle("searching", Boolean(q));
    const hits = q ? nodes.filter((n) => [n.name, n.op, n.target, n.module_path].some((v) => v && String(v).toLowerCase().includes(q))) : [];
    const hitNames = new Set(hits.map((n) => n.name));
    for (const [name, g] of gByName) g.classList.toggle("match", hitNames.has(name));
    showResults(!q ? [] : [
      ...hits.slice(0, 40).map((n) => pick(n.name, ` ${fmt(n.op)} ${isBlank(n.target) ? "" : n.target}${gByName.has(n.name) ? "" : " (in a collapsed cluster)"}`)),
      hits.length ? null : h("li", {class: "muted"}, "no match"),
      hits.length > 40 ? h("li", {class: "muted"}, `… ${hits.length - 40} more`) : null].filter(Boolean));
    return hits;
  }
  search.addEventListener("input", runSearch);
  search.addEventListener("focus", () => { if (search.value.trim()) runSearch(); });
  search.addEventListener("keydown", (e) => {
    if (e.key === "Enter") { const hits = runSearch(); closeResults(); if (hits.length) selectNode(hits[0].name); }
    if (e.key === "Escape") { search.value = ""; runSearch(); closeResults(); }
  });
  filter.addEventListener("keydown", (e) => {
    if (e.key !== "Enter") return;
    const value = filter.value.trim();
    go({...st, filter: value ? [value] : []}, selected);
  });
  overlaySel.addEventListener("change", () => go({...st, overlay: overlaySel.value || null}, selected));
  depthSel.addEventListener("change", () => go({...st, depth: depthSel.value || null, expand: [], collapse: []}, selected));
  const onDocClick = (e) => {
    if (!page.alive()) { document.removeEventListener("click", onDocClick); return; }
    if (!(results.contains(e.target) || search.contains(e.target) || host.contains(e.target))) closeResults();
  };
  document.addEventListener("click", onDocClick);
  const onDocKey = (e) => {
    if (!page.alive()) { document.removeEventListener("keydown", onDocKey); return; }
    if (e.key === "Escape") closeResults();
  };
  document.addEventListener("keydown", onDocKey);

  /** Open (collapsed) or close (open, by its label) one module cluster; the URL records it. */
  function toggleCluster(cluster, target) {
    const path = cluster.dataset.path;
    if (cluster.classList.contains("collapsed")) {
      go({...st, expand: [...st.expand.filter((p) => p !== path), path], collapse: st.collapse.filter((p) => p !== path)}, selected);
    } else if (target.closest("text")) {
      go({...st, expand: st.expand.filter((p) => p !== path && !p.startsWith(`${path}/`)), collapse: [...st.collapse, path]}, selected);
    }
  }
  host.addEventListener("click", (e) => {
    if (viewer.justDragged()) return;
    const g = e.target.closest("g.node");
    const cluster = e.target.closest("g.cluster");
    if (g && g.dataset.name && byName.has(g.dataset.name)) selectNode(g.dataset.name);
    else if (cluster) toggleCluster(cluster, e.target);
    else closeResults(); // an edge, the legend or the background: nothing to select
  });

  const io = Array.isArray(graph.io) && graph.io.length ? objectTable("graph-io", graph.io) : h("p", {class: "muted"}, "none recorded");
  const compare = h("input", {type: "number", id: "compare-with", placeholder: "graph id", "aria-label": "compare with graph id", min: 1});
  compare.addEventListener("keydown", (e) => { if (e.key === "Enter" && compare.value) location.hash = `#/compare/${id}/${compare.value}`; });
  $app.replaceChildren(h("section", {class: "graph-page"},
    h("h1", {}, kindBadge(graph.kind), " ", fmt(graph.name)),
    h("p", {class: "summary"}, [`rank ${fmt(graph.rank)}`, `ordinal ${fmt(graph.ordinal)}`,
      graph.compile_id ? `compile id ${graph.compile_id}` : null, graph.frame_name ? `frame ${graph.frame_name}` : null,
      `${nodes.length} nodes`, graph.compile_time_s != null ? `compiled in ${fmtSeconds(graph.compile_time_s)}` : null,
      graph.partition_index != null ? `DDP bucket ${graph.partition_index}` : null].filter(Boolean).join(" · ")),
    graph.break_reason ? h("p", {class: "break-banner"}, /DDPOptimizer/.test(graph.break_reason)
      ? badge("DDP split", "tag") : badge("graph break", "break"), " ", graph.break_reason) : null,
    h("div", {class: "graph-layout"},
      h("div", {class: "viewer"},
        h("div", {class: "toolbar"}, search, filter, overlaySel, depthSel,
          button("zoom-in", "+", "zoom in", () => viewer.zoom(1.25)),
          button("zoom-out", "−", "zoom out", () => viewer.zoom(0.8)),
          button("zoom-fit", "fit", "fit the whole graph", () => viewer.fit()),
          h("span", {class: "muted hint"}, "export: ", exportSvg, " · ",
            h("a", {href: `/api/graphs/${id}/model-explorer`, id: "export-me"}, "Model Explorer JSON"), " + ",
            h("a", {href: `/api/graphs/${id}/model-explorer/node-data/bytes`, id: "export-me-data"}, "node data"),
            " · compare with #", compare, " · ",
            h("a", {href: `#/graphs/${id}/memory`, id: "memory-link"}, "memory")),
          status),
        legendHost, results, host),
      details),
    h("h2", {}, "Related graphs"), relatedGraphs(page, graph),
    h("details", {class: "fold"}, h("summary", {}, "Inputs and outputs"), io),
    graph.code ? h("details", {class: "fold"}, h("summary", {}, "Graph code"), h("pre", {class: "code", id: "graph-code"}, graph.code)) : null));
  draw(svgText);
  // the graph's place in the parallel layout (pipeline stage), from the partition overlay
  api(`/api/graphs/${id}/overlays/partition`).then((ov) => {
    const summary = $app.querySelector(".graph-page .summary");
    if (ov && ov.label && summary && page.alive()) summary.append(" · ", h("span", {id: "graph-stage", class: "tag"}, ov.label));
  }, () => {});
  page.update = async (q) => {
    const next = viewState(q);
    if (!sameState(next, st)) {
      st = next;
      filter.value = st.filter.join("|");
      overlaySel.value = st.overlay || "";
      depthSel.value = st.depth ?? "";
      let text;
      try { text = await api(svgUrl(id, st), {text: true}); } catch (err) {
        if (page.alive()) { host.replaceChildren(errorBox(err)); status.textContent = ""; }
        return;
      }
      if (!page.alive()) return;
      draw(text);
    }
    markPath(q);
    await select(q.get("node"));
  };
  markPath(query);
  await select(query.get("node"));
}
