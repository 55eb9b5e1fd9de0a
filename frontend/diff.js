// graphdeck dashboard: run B against run A (#/diff?a=<run>&b=<run>), from GET /api/diff (issue 21
// item 2; NOTE: [Run diff] in graphdeck/analysis/diff/runs.py).
//
// Without both runs it shows two run pickers. With them: the verdict and the gates that failed;
// each section's status (compared / INCOMPLETE and why: no trace in one run means no timing claim);
// the root findings, then the findings that follow from them (each names which); every finding
// links the graph view of both runs (and their side-by-side diff when both exist); the slowest
// nodes per rank (ns per step, noise floor) and the memory per rank. All store text goes through
// h() (text nodes), never markup (NOTE: [Untrusted text] in common.js).

import {$app, api, badge, code, fmt, fmtBytes, h, num, setCrumbs, table} from "./common.js";

const KIND_LABEL = {
  new_graph_break: "new graph break", new_recompiles: "new recompiles", structure_changed: "structure changed",
  new_graph: "new graph", removed_graph: "removed graph", node_regression: "slower node(s)",
  module_regression: "slower module", peak_memory: "peak memory", saved_activations: "saved activations",
  new_rank_divergence: "new rank divergence", new_grad_finding: "new gradient finding",
};

function graphRef(side, id, node) {
  if (id === null || id === undefined) return h("span", {class: "muted"}, `run ${side}: —`);
  const href = `#/graphs/${id}` + (node ? `?node=${encodeURIComponent(node)}` : "");
  return h("a", {href, "data-testid": `link-${side.toLowerCase()}`}, `run ${side}: graph #${id}` + (node ? ` ${node}` : ""));
}

function links(f) {
  return h("ul", {class: "small links"}, f.links.slice(0, 6).map((l) => h("li", {},
    graphRef("A", l.a, l.node_a), " · ", graphRef("B", l.b, l.node_b),
    l.a != null && l.b != null ? [" · ", h("a", {href: `#/compare/${l.a}/${l.b}`, class: "diff-link"}, "side by side")] : null)),
  f.links.length > 6 ? h("li", {class: "muted"}, `${f.links.length - 6} more`) : null);
}

function finding(f, byId) {
  const follows = f.follows_from.map((i) => byId.get(i)).filter(Boolean);
  return h("li", {class: "finding", "data-testid": "diff-finding", "data-kind": f.kind, "data-id": f.id,
    "data-root": f.follows_from.length ? "false" : "true"},
  badge(KIND_LABEL[f.kind] || f.kind, f.follows_from.length ? "tag" : "status status-NO_GRAD"), " ",
  h("span", {class: "message"}, f.message),
  f.ranks.length ? h("span", {class: "muted"}, ` (rank${f.ranks.length > 1 ? "s" : ""} ${f.ranks.join(", ")})`) : null,
  follows.length ? h("div", {class: "small", "data-testid": "follows-from"}, "follows from: ",
    follows.map((x, i) => [i ? ", " : "", `[${x.id}] ${KIND_LABEL[x.kind] || x.kind}`])) : null,
  f.detail && f.detail.hint ? h("div", {class: "small muted"}, "hint: ", f.detail.hint) : null,
  f.links.length ? links(f) : null);
}

function sections(report) {
  const rows = Object.entries(report.sections).filter(([name]) => name !== "gates").map(([name, s]) =>
    h("tr", {"data-section": name}, h("td", {}, name),
      h("td", {}, badge(s.status, s.status === "INCOMPLETE" ? "status status-partial" : "status status-OK")),
      h("td", {class: "why"}, s.why)));
  return table("diff-sections", ["Section", "Status", "What was compared / what is missing"], rows);
}

function timing(report) {
  const out = [];
  for (const [rank, t] of Object.entries(report.timing || {})) {
    const rows = t.nodes.slice(0, 15).map((n) => h("tr", {class: n.regression ? "regression" : null},
      h("td", {}, n.phase), h("td", {}, code(n.module || "(top)")), h("td", {}, code(n.target)),
      h("td", {}, graphRef("A", n.a_graph, n.a_node)), h("td", {}, graphRef("B", n.b_graph, n.b_node)),
      num(n.a_ns), num(n.b_ns), num(n.delta_ns), num(n.pct), num(n.floor_ns),
      h("td", {}, n.regression ? badge("regression", "status status-NO_GRAD") : n.regression === null ? "no spread" : "")));
    out.push(h("h3", {}, `rank ${rank}: ${t.steps_a} / ${t.steps_b} profiled steps (${fmt(t.source_b)})`),
      table(`diff-timing-${rank}`, ["Phase", "Module", "Op", "Run A", "Run B", "A ns/step", "B ns/step", "Δ ns",
        "Δ %", "floor ns", ""], rows, "", {empty: "no node ran in both runs"}));
  }
  return out;
}

function memory(report) {
  const rows = Object.entries(report.memory || {}).map(([rank, m]) => h("tr", {}, num(rank),
    h("td", {class: "num"}, fmtBytes(m.a.peak_bytes)), h("td", {class: "num"}, fmtBytes(m.b.peak_bytes)),
    h("td", {class: "num"}, fmtBytes(m.a.saved_bytes)), h("td", {class: "num"}, fmtBytes(m.b.saved_bytes)),
    h("td", {}, h("a", {href: `#/graphs/${m.a.forward}/memory`}, `A #${m.a.forward}`), " · ",
      h("a", {href: `#/graphs/${m.b.forward}/memory`}, `B #${m.b.forward}`))));
  return table("diff-memory", ["Rank", "Peak A", "Peak B", "Saved A", "Saved B", "Memory pages"], rows, "",
    {empty: "no forward/backward graph pair in both runs"});
}

async function pickers(page, query) {
  const runs = await api("/api/runs");
  if (!page.alive()) return;
  const select = (name, value) => h("select", {name, "data-testid": `pick-${name}`},
    runs.map((r) => h("option", {value: r.id, selected: String(r.id) === value || r.name === value}, `${r.name} (#${r.id})`)));
  const a = select("a", query.get("a")), b = select("b", query.get("b"));
  const go = (e) => { e.preventDefault(); location.hash = `#/diff?a=${encodeURIComponent(a.value)}&b=${encodeURIComponent(b.value)}`; };
  return h("form", {class: "diff-pick", onsubmit: go}, "Run A (baseline) ", a, " run B ", b, " ",
    h("button", {type: "submit"}, "compare"));
}

export async function renderDiff(page, _match, query) {
  setCrumbs([["Runs", "#/runs"], ["diff"]]);
  const a = query.get("a"), b = query.get("b");
  if (!a || !b) {
    const form = await pickers(page, query);
    if (page.alive()) $app.replaceChildren(h("section", {}, h("h1", {}, "Compare two runs"), form));
    return;
  }
  const report = await api(`/api/diff?run_a=${encodeURIComponent(a)}&run_b=${encodeURIComponent(b)}`);
  if (!page.alive()) return;
  setCrumbs([["Runs", "#/runs"], [report.run_a, `#/runs/${report.run_a_id}`], [report.run_b, `#/runs/${report.run_b_id}`],
    ["diff"]]);
  const byId = new Map(report.findings.map((f) => [f.id, f]));
  const roots = report.findings.filter((f) => !f.follows_from.length);
  const rest = report.findings.filter((f) => f.follows_from.length);
  $app.replaceChildren(h("section", {},
    h("h1", {}, "Run ", code(report.run_a), " → ", code(report.run_b)),
    h("p", {class: "verdict", "data-testid": "diff-verdict"},
      h("strong", {class: report.verdict === "PASS" ? "verdict-ok" : report.verdict === "WARN" ? "verdict-warn" : "verdict-bad"}, report.verdict),
      `  ${roots.length} finding(s), ${rest.length} following from them, ${report.improvements.length} improvement(s)`),
    report.failures.length ? h("ul", {"data-testid": "diff-failures"}, report.failures.map((x) => h("li", {}, x))) : null,
    sections(report),
    h("h2", {}, "Findings"),
    roots.length ? h("ol", {"data-testid": "diff-roots"}, roots.map((f) => finding(f, byId)))
      : h("p", {class: "muted", "data-testid": "diff-none"}, "Nothing changed beyond the noise floor in the sections compared."),
    rest.length ? [h("h3", {}, "Following from them"), h("ol", {"data-testid": "diff-consequences"},
      rest.map((f) => finding(f, byId)))] : null,
    report.improvements.length ? [h("h3", {}, "Improvements"), h("ul", {"data-testid": "diff-improvements"},
      report.improvements.map((f) => finding(f, byId)))] : null,
    h("h2", {}, "Node times"), timing(report),
    h("h2", {}, "Graph-derived memory"), memory(report)));
}
