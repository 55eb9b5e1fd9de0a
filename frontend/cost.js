// graphdeck dashboard: one cost view per rank (#/runs/<id>/cost?step=&sort=&desc=), from
// GET /api/runs/<id>/costs (server/routes/cost.py, NOTE: [Rank cost view] in analysis/ranks/cost.py).
//
// One row per rank, one column per metric for the chosen step: step time, the step's collectives
// (count, bytes, time), peak memory (an imported CUDA snapshot), compile time. A header sorts
// (the server sorts, rows without a value last; a second click flips the order); each cell links
// to the page its number comes from. The colour of a cell grows with its value within the column.
// All text from the store goes through h() (textContent), never markup.

import {api, fmt, fmtBytes, fmtSeconds, h, setCrumbs} from "./common.js";

const fmtNs = (ns) => (ns == null ? "—" : Number(ns) >= 1e9 ? `${(ns / 1e9).toFixed(2)} s` : `${(ns / 1e6).toFixed(2)} ms`);
const COLUMNS = [
  ["step_time_ns", "step time", fmtNs],
  ["comm_count", "collectives", fmt],
  ["comm_bytes", "collective bytes", fmtBytes],
  ["comm_ns", "collective time", fmtNs],
  ["peak_memory_bytes", "peak memory", fmtBytes],
  ["compile_s", "compile time", fmtSeconds],
];

function shade(value, total) {
  if (value == null || !total || total.max === total.min) return null;
  const t = (value - total.min) / (total.max - total.min);
  return `background: rgba(214, 96, 77, ${(0.08 + 0.42 * t).toFixed(3)})`;
}

export async function renderCost(page, match, query) {
  const run = decodeURIComponent(match[1]);
  const params = new URLSearchParams();
  for (const k of ["step", "sort", "desc"]) if (query.get(k)) params.set(k, query.get(k));
  const doc = await api(`/api/runs/${encodeURIComponent(run)}/costs?${params}`);
  if (!page.alive()) return;
  setCrumbs([["Runs", "#/runs"], [doc.run, `#/runs/${doc.run_id}`], ["cost per rank", null]]);
  const sort = query.get("sort");
  const desc = query.get("desc") !== "false";
  const href = (changes) => {
    const q = new URLSearchParams(params);
    for (const [k, v] of Object.entries(changes)) (v == null ? q.delete(k) : q.set(k, v));
    return `#/runs/${doc.run_id}/cost${q.toString() ? `?${q}` : ""}`;
  };
  const head = h("tr", {},
    h("th", {}, h("a", {href: href({sort: "rank", desc: sort === "rank" && !desc ? "true" : "false"}), "data-sort": "rank"}, "rank")),
    COLUMNS.map(([key, label]) => h("th", {class: "num", "aria-sort": sort === key ? (desc ? "descending" : "ascending") : null},
      h("a", {href: href({sort: key, desc: sort === key && desc ? "false" : "true"}), "data-sort": key, "data-testid": "cost-sort"},
        label, sort === key ? (desc ? " ▼" : " ▲") : ""))));
  const body = doc.rows.map((row) => h("tr", {"data-rank": row.rank, "data-traced": row.traced ? "true" : "false"},
    h("th", {}, h("a", {href: `#/runs/${doc.run_id}/rank/${row.rank}`}, `rank ${row.rank}`)),
    COLUMNS.map(([key, , show]) => {
      const v = row[key];
      const link = row.links[key];
      const text = show(v);
      const title = key === "compile_s" && row.compile_source ? `from the ${row.compile_source}` : null;
      return h("td", {class: "num", "data-metric": key, style: shade(v, doc.totals[key]), title},
        link ? h("a", {href: link}, text) : text);
    })));
  const steps = doc.steps.map((s) => h("a", {href: href({step: String(s)}), class: s === doc.step ? "current" : null,
    "data-testid": "cost-step"}, String(s)));
  document.getElementById("app").replaceChildren(h("section", {class: "cost-page", "data-testid": "cost-page"},
    h("h1", {}, `Cost per rank — ${doc.run}`),
    h("p", {class: "summary", "data-testid": "cost-summary"},
      `${doc.world_size} ranks · step ${fmt(doc.step)}`, doc.steps.length > 1 ? [" · steps: ", steps.flatMap((a, i) => (i ? [" ", a] : [a]))] : ""),
    h("p", {class: "muted small"}, "Step time and the step's collectives from each rank's trace (the rank page and the trace page's "
      + "bandwidth table), peak memory from an imported CUDA memory snapshot (the memory page), compile time from torch's compile "
      + "records (the run page). Click a header to sort; a cell opens the page its number comes from."),
    doc.notes.map((n) => h("p", {class: "muted", "data-testid": "cost-note"}, n)),
    h("table", {class: "data cost-table", "data-testid": "cost-table"}, h("thead", {}, head), h("tbody", {}, body))));
}
