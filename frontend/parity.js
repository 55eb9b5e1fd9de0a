// graphdeck dashboard: reference parity of a sharded run against its unsharded reference
// (#/parity?a=<sharded run>&b=<reference run>), from GET /api/parity (issue 35 item 3; NOTE and
// format in graphdeck/analysis/gradients/parity.py, docs/parity.md).
//
// Without both runs it shows two run pickers (a run named `X-sharded` proposes `X-reference`).
// With them: the verdict and the step compared, the loss of both runs, one row per parameter
// (MATCH / DIFFER / NOT_COMPARED / MISSING, the largest difference against the largest reference
// entry, its placements), the first backward node that differs with the forward line that made it
// and what its incoming gradient says, what is missing, notes, the fix and the consequence. Every
// sentence is the report's own (the CLI prints the same); store text goes through h() only.

import {$app, api, badge, code, fmt, h, setCrumbs, table} from "./common.js";

const g = (x) => (x === null || x === undefined ? "—" : Number(x).toPrecision(3));
const VERDICT_CLASS = {PASS: "verdict-ok", FAIL: "verdict-bad", INCOMPLETE: "verdict-warn"};
const STATUS_CLASS = {MATCH: "status status-OK", DIFFER: "status status-NO_GRAD"};

async function pickers(page, query) {
  const runs = await api("/api/runs");
  if (!page.alive()) return null;
  const a0 = query.get("a");
  const aRun = runs.find((r) => String(r.id) === a0 || r.name === a0);
  const b0 = query.get("b") || (aRun && aRun.name.endsWith("-sharded") ? aRun.name.replace(/-sharded$/, "-reference") : null);
  const select = (name, value) => h("select", {name, "data-testid": `pick-${name}`},
    runs.map((r) => h("option", {value: r.id, selected: String(r.id) === value || r.name === value}, `${r.name} (#${r.id})`)));
  const a = select("a", a0), b = select("b", b0);
  const go = (e) => {
    e.preventDefault();
    location.hash = `#/parity?a=${encodeURIComponent(a.value)}&b=${encodeURIComponent(b.value)}`;
  };
  return h("form", {class: "diff-pick", onsubmit: go}, "Sharded run ", a, " reference run ", b, " ",
    h("button", {type: "submit"}, "compare gradients"));
}

function params(rep) {
  const rows = rep.params.map((p) => h("tr", {"data-param": p.name, "data-status": p.status},
    h("td", {}, code(p.name)), h("td", {}, badge(p.status, STATUS_CLASS[p.status] || "status status-partial")),
    h("td", {}, p.shape ? `[${p.shape.join(", ")}]` : "—"), h("td", {}, fmt(p.dtype)),
    h("td", {}, p.placements ? p.placements.join(", ") : "—"),
    h("td", {class: "num"}, g(p.diff)), h("td", {class: "num"}, g(p.scale)), h("td", {class: "why"}, p.reason || "")));
  return table("parity-params", ["Parameter", "Status", "Shape", "dtype", "Placements",
    "max |sharded − reference|", "max |reference|", "Why"], rows, "", {empty: "no parameter in either run"});
}

function firstNode(n) {
  if (!n) return null;
  return h("div", {class: "finding", "data-testid": "parity-first-node"},
    h("h2", {}, "First differing backward node"),
    h("p", {}, code(n.name), ` — backward ${n.backward}, node ${n.index + 1} of ${n.of} in the reference's order`,
      n.source ? [", made by ", code(n.source)] : null,
      `: max |sharded − reference| ${g(n.diff)}, max |reference| ${g(n.scale)}`),
    h("p", {"data-testid": "parity-node-meaning"}, n.meaning),
    n.unmatched_before ? h("p", {class: "small muted"},
      `${n.unmatched_before} node(s) before it could not be compared: `, n.unmatched_nodes.join(", ")) : null);
}

export async function renderParity(page, _match, query) {
  setCrumbs([["Runs", "#/runs"], ["parity"]]);
  const a = query.get("a"), b = query.get("b");
  if (!a || !b) {
    const form = await pickers(page, query);
    if (page.alive()) {
      $app.replaceChildren(h("section", {}, h("h1", {}, "Reference parity"),
        h("p", {class: "muted"}, "One optimizer step of a sharded run against the same model without sharding ",
          "(launch both with ", code("graphdeck parity --nproc N --run NAME -- script.py"), ")."), form));
    }
    return;
  }
  const rep = await api(`/api/parity?run_a=${encodeURIComponent(a)}&run_b=${encodeURIComponent(b)}`);
  if (!page.alive()) return;
  setCrumbs([["Runs", "#/runs"], [rep.run_a, `#/runs/${encodeURIComponent(rep.run_a)}`],
    [rep.run_b, `#/runs/${encodeURIComponent(rep.run_b)}`], ["parity"]]);
  const [wa, wb] = rep.worlds;
  const loss = rep.loss;
  const tol = Object.entries(rep.tolerance).map(([k, t]) => `${k} rtol ${t.rtol} atol ${t.atol}`).join(", ");
  $app.replaceChildren(h("section", {},
    h("h1", {}, "Parity: ", code(rep.run_a), " vs reference ", code(rep.run_b)),
    h("p", {class: "verdict", "data-testid": "parity-verdict"},
      h("strong", {class: VERDICT_CLASS[rep.verdict] || "verdict-warn"}, rep.verdict),
      `  ${wa ?? "?"} rank(s) vs ${wb ?? "?"}`, rep.step !== null ? `, optimizer step ${rep.step}` : ""),
    rep.consequence ? h("p", {"data-testid": "parity-consequence"}, h("strong", {}, "Consequence: "), rep.consequence) : null,
    rep.fix ? h("p", {"data-testid": "parity-fix"}, h("strong", {}, "Fix: "), rep.fix) : null,
    rep.incomplete.length ? h("ul", {"data-testid": "parity-incomplete"},
      rep.incomplete.map((x) => h("li", {}, badge("INCOMPLETE", "status status-partial"), " ", x))) : null,
    loss ? h("p", {"data-testid": "parity-loss"}, "Loss: sharded ",
      loss.per_rank ? `per rank ${loss.per_rank.map(g).join(", ")}` : g(loss.sharded), `, reference ${g(loss.reference)} `,
      badge(loss.status, STATUS_CLASS[loss.status] || "status status-partial"), loss.reason ? ` (${loss.reason})` : "") : null,
    h("h2", {}, "Gradients per parameter"),
    params(rep),
    h("p", {class: "small muted"}, `tolerance: max|sharded − reference| ≤ atol + rtol · max|reference| (${tol})`),
    firstNode(rep.first_node),
    rep.notes.length ? [h("h2", {}, "Notes"), h("ul", {"data-testid": "parity-notes"}, rep.notes.map((x) => h("li", {}, x)))] : null));
}
