// graphdeck dashboard: two graphs side by side (#/compare/<a>/<b>[?node=<name in a>]): two ranks'
// graphs, two compiles of one frame, or an AOT forward and its backward. Each side is the server's
// SVG with the other graph's diff marks (diff-added / diff-removed / diff-changed, from
// GET /api/graphs/<a>/diff/<b>, analysis/graphs/diff.py); a click on a node selects it and its
// counterpart on the other side (the diff's pairs, or for a forward/backward pair the nodes with
// the same seq_nr).

import {api, badge, fmt, h, kindBadge, setCrumbs} from "./common.js";
import {svgUrl} from "./graph.js";
import {importSvg, makeViewer} from "./viewer.js";

const ALL_OPEN = {depth: "99", expand: [], collapse: [], filter: [], overlay: null};

function panel(graph, side) {
  const host = h("div", {id: `compare-svg-${side}`, class: "svg-host compare-host", "data-testid": `compare-${side}`});
  return {host, box: h("div", {class: "compare-side"}, h("h2", {}, kindBadge(graph.kind), " ",
    h("a", {href: `#/graphs/${graph.id}`}, `${fmt(graph.name)} (#${graph.id})`), ` rank ${fmt(graph.rank)}`), host)};
}

/** Why the two graphs differ, when the store says: one recompiled the other (the guard /
 * recompile reason of the later compile), or they are one compile on two ranks. */
function whyDifferent(ga, gb, cpA, cpB) {
  for (const [cp, other, later] of [[cpB, ga, gb], [cpA, gb, ga]]) {
    const prev = cp?.previous;
    if (prev && prev.graph_id === other.id) {
      return h("p", {class: "recompile-reason", "data-testid": "recompile-reason"},
        badge("recompile", "tag"), ` ${later.compile_id} recompiled ${prev.compile_id}: `,
        prev.recompile_reason || "no recompile reason recorded");
    }
  }
  if (ga.compile_id === gb.compile_id && ga.rank !== gb.rank) {
    return h("p", {class: "muted", "data-testid": "rank-pair"},
      `compile ${ga.compile_id} on rank ${ga.rank} and rank ${gb.rank}`);
  }
  return null;
}

export async function renderCompare(page, m, query) {
  const a = Number(m[1]), b = Number(m[2]);
  const [ga, gb, nodesA, nodesB] = await Promise.all([
    api(`/api/graphs/${a}`), api(`/api/graphs/${b}`), api(`/api/graphs/${a}/nodes`), api(`/api/graphs/${b}/nodes`)]);
  if (!page.alive()) return;
  // an AOT forward and its backward are not two versions of one graph: no diff marks, seq_nr links
  const fwdBwd = new Set([ga.kind, gb.kind]).size === 2 && [ga.kind, gb.kind].every((k) => k === "aot_forward" || k === "aot_backward");
  const [diff, svgA, svgB, cpA, cpB] = await Promise.all([
    fwdBwd ? null : api(`/api/graphs/${a}/diff/${b}`),
    api(svgUrl(a, ALL_OPEN, null, fwdBwd ? {} : {diff_against: b}), {text: true}),
    api(svgUrl(b, ALL_OPEN, null, fwdBwd ? {} : {diff_against: a}), {text: true}),
    api(`/api/graphs/${a}/counterparts`).catch(() => null), api(`/api/graphs/${b}/counterparts`).catch(() => null)]);
  if (!page.alive()) return;
  setCrumbs([["Runs", "#/runs"], [`compare #${a} · #${b}`]]);
  // counterpart maps: diff pairs, or seq_nr for a forward/backward pair
  const aToB = new Map(), bToA = new Map();
  const add = (map, k, v) => { if (!map.has(k)) map.set(k, []); map.get(k).push(v); };
  if (fwdBwd) {
    const bySeq = new Map();
    for (const n of nodesB) if (n.seq_nr != null) add(bySeq, n.seq_nr, n.name);
    for (const n of nodesA) for (const o of bySeq.get(n.seq_nr) || []) { add(aToB, n.name, o); add(bToA, o, n.name); }
  } else {
    for (const p of diff.pairs) { add(aToB, p.a, p.b); add(bToA, p.b, p.a); }
  }
  const left = panel(ga, "a"), right = panel(gb, "b");
  const info = h("p", {id: "compare-selection", class: "muted"}, "Click a node on either side.");
  const counts = diff?.counts;
  $app().replaceChildren(h("section", {class: "compare-page"},
    h("h1", {}, fwdBwd ? "Forward and backward" : "Graph diff"),
    fwdBwd ? h("p", {class: "summary", id: "link-counts"},
      `${aToB.size} of ${nodesA.length} nodes of #${a} link to #${b} by seq_nr; click one to see its counterparts`)
      : h("p", {class: "summary", id: "diff-counts", "data-testid": "diff-counts"},
        badge(`${counts.same} same`, "diff-same"), " ", badge(`${counts.changed} changed`, "diff-changed"), " ",
        badge(`${counts.removed} only in #${a}`, "diff-removed"), " ", badge(`${counts.added} only in #${b}`, "diff-added")),
    whyDifferent(ga, gb, cpA, cpB),
    info, h("div", {class: "compare-layout"}, left.box, right.box)));
  const sides = [[left, svgA, aToB, "a"], [right, svgB, bToA, "b"]];
  const gMaps = {}, viewers = {};
  for (const [p, text, , side] of sides) {
    const svg = importSvg(text);
    p.host.replaceChildren(svg);
    gMaps[side] = new Map([...svg.querySelectorAll("g.node[data-name]")].map((g) => [g.dataset.name, g]));
    viewers[side] = makeViewer(svg, p.host, [...gMaps[side].values()]);
  }
  function select(side, name) {
    for (const el of document.querySelectorAll(".compare-host .selected, .compare-host .related")) el.classList.remove("selected", "related");
    const other = side === "a" ? "b" : "a";
    const partners = (side === "a" ? aToB : bToA).get(name) || [];
    gMaps[side].get(name)?.classList.add("selected");
    for (const n of partners) gMaps[other].get(n)?.classList.add("related");
    const first = partners.map((n) => gMaps[other].get(n)).find(Boolean);
    if (first) viewers[other].centerOn(first);
    info.replaceChildren(`#${side === "a" ? a : b} ${name} ↔ #${side === "a" ? b : a} `,
      partners.length ? partners.join(", ") : h("span", {class: "muted"}, "no counterpart"));
    info.dataset.partners = partners.join(",");
  }
  for (const [p, , , side] of sides) {
    p.host.addEventListener("click", (e) => {
      const g = e.target.closest("g.node[data-name]");
      if (g) select(side, g.dataset.name);
    });
  }
  if (query.get("node")) select("a", query.get("node"));
}

const $app = () => document.getElementById("app");
