// graphdeck dashboard: the graph page (#/graphs/<id>[?node=<name>]): the server's SVG render with
// pan (drag) and zoom (wheel, buttons), node search, and the selected node's details. The selected
// node lives in the URL, so a node link or the back button selects it again.

import {
  $app, api, badge, code, cssToken, defList, errorBox, fmt, fmtBytes, fmtSeconds, graphLink, h, isBlank,
  joinComma, kindBadge, objectTable, setCrumbs,
} from "./common.js";
import {importSvg, makeViewer} from "./viewer.js";

// ---------------------------------------------------------------- graph page

const graphHash = (id, name) => `#/graphs/${id}${name ? `?node=${encodeURIComponent(name)}` : ""}`;

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
      pending.replaceWith(...siblings.map((c) => item("sibling", c)));
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

const XLINK_NS = "http://www.w3.org/1999/xlink";

/**
 * Read the SVG's nodes (server/render/svg.py documents the markup). Only `g.node` elements with
 * id `node-<idx>` are FX nodes; `stub-in-<idx>` / `stub-out-<idx>` (Graphviz names "s<idx>i",
 * "s<idx>o") stand for long edges cut into stubs (NOTE: [Long edges] there) and name their far
 * ends in their tooltip. → {gByName, fxNodes (FX <g>s in idx order), stubs: Map(<g> → stub)}
 * where a stub is {dir: "in" | "out", owner: FX name, far: [FX names of the far ends], title}.
 */
function readSvgNodes(svg, byName, byIdx) {
  const gByName = new Map(), fx = [], stubs = new Map();
  for (const g of svg.querySelectorAll("g.node")) {
    const m = /^node-(\d+)$/.exec(g.id);
    const stub = /^stub-(in|out)-(\d+)$/.exec(g.id);
    if (m && byIdx.has(Number(m[1]))) {
      const node = byIdx.get(Number(m[1]));
      gByName.set(node.name, g);
      g.dataset.name = node.name;
      fx.push([node.idx, g]);
    } else if (stub || g.classList.contains("stub")) {
      const a = g.querySelector("a");
      const tip = a?.getAttributeNS(XLINK_NS, "title") || a?.getAttribute("title") || "";
      const far = [...new Set(tip.split(/,\s*/).map((t) => t.trim()).filter((t) => byName.has(t)))];
      const title = g.querySelector("title")?.textContent.trim();
      stubs.set(g, {dir: stub ? stub[1] : "", owner: stub ? byIdx.get(Number(stub[2]))?.name : undefined, far, title});
    }
  }
  fx.sort((a, b) => a[0] - b[0]);
  return {gByName, fxNodes: fx.map(([, g]) => g), stubs};
}

export async function renderGraph(page, m, query) {
  const id = Number(m[1]);
  const [graph, nodes, svgText] = await Promise.all([
    api(`/api/graphs/${id}`), api(`/api/graphs/${id}/nodes`), api(`/api/graphs/${id}/svg`, {text: true})]);
  if (!page.alive()) return;
  const svg = importSvg(svgText);
  setCrumbs([["Runs", "#/runs"],
    graph.run_id != null ? [isBlank(graph.run_name) ? `run ${graph.run_id}` : fmt(graph.run_name), `#/runs/${graph.run_id}`] : null,
    [`rank ${fmt(graph.rank)} · ${fmt(graph.name)}`]].filter(Boolean));

  const byName = new Map(nodes.map((n) => [n.name, n]));
  const byIdx = new Map(nodes.map((n) => [n.idx, n]));
  const {gByName, fxNodes, stubs} = readSvgNodes(svg, byName, byIdx);
  // node name → edge <g>s that touch it; Graphviz titles an edge "n<src idx>->n<dst idx>", and the
  // dashed edge to a stub "s<idx>i->n<idx>" or "n<idx>->s<idx>o" (counted as the node's own).
  const endName = (t) => (/^[ns]\d+[io]?$/.test(t) ? byIdx.get(Number(t.replace(/\D/g, "")))?.name : undefined) ?? t;
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
  const results = h("ul", {id: "search-results", "data-testid": "search-results", class: "results", hidden: true});
  const viewer = {zoom: () => {}, fit: () => {}, centerOn: () => {}, justDragged: () => false};
  const button = (bid, label, title, fn) => h("button", {type: "button", id: bid, title, onclick: fn}, label);

  const closeResults = () => { results.hidden = true; };
  const showResults = (items) => { results.replaceChildren(...items); results.hidden = !items.length; };
  const pick = (name, extra) => h("li", {},
    h("button", {type: "button", class: "link", onclick: () => selectNode(name)}, name), extra ? h("span", {class: "muted"}, extra) : null);

  let selected = null, selectToken = 0;
  const selectNode = (name) => { closeResults(); location.hash = graphHash(id, name); };
  async function select(name, {center = true} = {}) {
    closeResults();
    const stub = name && !byName.has(name) ? [...stubs.values()].find((st) => st.title === name) : null;
    const stubTarget = stub && (stub.far.length === 1 ? stub.far[0] : stub.owner);
    if (stubTarget) { location.replace(graphHash(id, stubTarget)); return; } // an old link to a stub ("s12o")
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
    for (const [sg, stub] of stubs) if (stub.owner === selected || stub.far.includes(selected)) sg.classList.add("related");
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

  /** A click on a stub selects the one node it names, or lists them when there are several. */
  function followStub(stub) {
    if (stub.far.length === 1) { selectNode(stub.far[0]); return; }
    if (!stub.far.length) { closeResults(); return; }
    const head = stub.dir === "in" ? `inputs of ${stub.owner ?? "this node"} drawn far away:`
      : stub.dir === "out" ? `users of ${stub.owner ?? "this node"} drawn far away:` : "nodes at the far end:";
    showResults([h("li", {class: "muted", id: "stub-targets"}, head), ...stub.far.map((n) => pick(n, ` ${fmt(byName.get(n)?.op)}`))]);
  }

  function runSearch() {
    const q = search.value.trim().toLowerCase();
    svg.classList.toggle("searching", Boolean(q));
    const hits = q ? nodes.filter((n) => [n.name, n.op, n.target].some((v) => v && String(v).toLowerCase().includes(q))) : [];
    const hitNames = new Set(hits.map((n) => n.name));
    for (const [name, g] of gByName) g.classList.toggle("match", hitNames.has(name));
    showResults(!q ? [] : [
      ...hits.slice(0, 40).map((n) => pick(n.name, ` ${fmt(n.op)} ${isBlank(n.target) ? "" : n.target}`)),
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
  // A click anywhere but the list, the search box and the graph (which handles its own) closes the list.
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
  host.addEventListener("click", (e) => {
    if (viewer.justDragged()) return;
    const g = e.target.closest("g.node");
    if (g && g.dataset.name) selectNode(g.dataset.name);
    else if (g && stubs.has(g)) followStub(stubs.get(g));
    else closeResults(); // a cluster box, an edge or the background: nothing to select
  });

  const io = Array.isArray(graph.io) && graph.io.length ? objectTable("graph-io", graph.io) : h("p", {class: "muted"}, "none recorded");
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
        h("div", {class: "toolbar"}, search,
          button("zoom-in", "+", "zoom in", () => viewer.zoom(1.25)),
          button("zoom-out", "−", "zoom out", () => viewer.zoom(0.8)),
          button("zoom-fit", "fit", "fit the whole graph", () => viewer.fit()),
          h("span", {class: "muted hint"}, "drag to pan · wheel to zoom")),
        results, host),
      details),
    h("h2", {}, "Related graphs"), relatedGraphs(page, graph),
    h("details", {class: "fold"}, h("summary", {}, "Inputs and outputs"), io),
    graph.code ? h("details", {class: "fold"}, h("summary", {}, "Graph code"), h("pre", {class: "code", id: "graph-code"}, graph.code)) : null));
  Object.assign(viewer, makeViewer(svg, host, fxNodes));
  page.update = (q) => select(q.get("node"));
  select(query.get("node"));
}
