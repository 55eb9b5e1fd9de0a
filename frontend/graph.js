// graphdeck dashboard: the graph page (#/graphs/<id>[?node=<name>]): the server's SVG render with
// pan (drag) and zoom (wheel, buttons), node search, and the selected node's details. The selected
// node lives in the URL, so a node link or the back button selects it again.

import {
  $app, api, badge, code, cssToken, defList, errorBox, fmt, fmtBytes, fmtSeconds, graphLink, h, isBlank,
  joinComma, kindBadge, objectTable, setCrumbs,
} from "./common.js";

const SVG_NS = "http://www.w3.org/2000/svg";

// ---------------------------------------------------------------- SVG viewer

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

