// graphdeck dashboard: the gradient-path report — its own page (#/runs/<id>/grads[?status=S&rank=R])
// and the section of the run page. Both render GET /api/runs/<id>/gradients.
//
// One row per parameter storage per rank: status, gradient paths, DDP bucket, the cut (op,
// file:line, module path, the no_grad line) with a link to the graph page selecting the cut node
// (`#/graphs/<graph>?node=<cut>&path=<nodes from the parameter to the cut>`), and the graphs that
// read it. Run-level findings (predicted DDP error or hang, collectives, …) are listed above.
// The verdict is PASS, FAIL or INCOMPLETE (the run-time evidence does not cover the run; never
// green); the coverage box says which ranks and steps were seen; each row's step strip shows, per
// step, what arrived on its rank (JSON twin: GET /api/runs/<id>/gradients/steps).
// Every string from the report is user text and goes through h() (NOTE: [Untrusted text]).

import {$app, api, code, fmt, graphLink, h, isBlank, num, setCrumbs, statusBadge, table} from "./common.js";
import {SMALL_RUN, compactRanks, mergeRankLines, rankRanges, statusHeatmap} from "./heatmap.js";

export const GRAD_STATUSES = ["OK", "NO_GRAD", "NOT_IN_GRAPH", "DEAD_END", "FROZEN", "BUFFER", "UNKNOWN"];
const FAILING = new Set(["NO_GRAD", "NOT_IN_GRAPH", "DEAD_END"]);
/** Step states of the run-time evidence (analysis/gradients/evidence.py); anything else draws as "other". */
const STEP_STATES = new Set(["ok", "none", "zero", "multi", "frozen", "unobserved"]);
const VERDICTS = {
  PASS: ["verdict-ok", "PASS · all gradient paths OK"],
  FAIL: ["verdict-bad", "FAIL · problems found"],
  INCOMPLETE: ["verdict-incomplete", "INCOMPLETE · the run-time evidence does not cover the run"],
};
const stepText = (a, b) => `${a}–${b}`;
/** Status colours of the large-run heatmap (failing: reds and purple; never a green for missing). */
const STATUS_RGB = {OK: [161, 217, 155], NO_GRAD: [215, 25, 28], NOT_IN_GRAPH: [165, 0, 38], DEAD_END: [84, 39, 143],
  FROZEN: [158, 202, 225], BUFFER: [189, 189, 189], UNKNOWN: [253, 174, 97]};
/** A large run's table lists at most this many rows at once (pick a rank or a status for others). */
const LARGE_ROWS = 300;

/** Ranks × parameters coloured by status, for a run of more than SMALL_RUN ranks; a rank without
 *  rows is "no records" (missing evidence); a click filters the table to that rank. */
function statusPicture(params, runId, ranks) {
  const fqns = [...new Set(params.map((p) => p.fqn))].sort();
  const col = new Map(fqns.map((f, i) => [f, i]));
  const row = new Map(ranks.map((r, i) => [r, i]));
  const code = new Map(GRAD_STATUSES.map((st, i) => [st, i]));
  const values = ranks.map(() => fqns.map(() => null));
  for (const p of params) {
    const i = row.get(p.rank), j = col.get(p.fqn), v = code.get(p.status) ?? code.get("UNKNOWN");
    values[i][j] = values[i][j] === null ? v : Math.max(values[i][j], v); // several storages: the later status kept
  }
  const seen = new Set(params.map((p) => p.rank));
  return statusHeatmap({run_id: runId, ranks, row_state: ranks.map((r) => (seen.has(r) ? "trace" : "no_trace")),
    columns: fqns.map((f) => ({label: f})), values,
    findings: GRAD_STATUSES.map((st) => ({key: st, label: st.toLowerCase().replace(/_/g, " "), rgb: STATUS_RGB[st]}))},
  (r) => `#/runs/${runId}/grads?rank=${ranks[r]}`, {missing: "no parameter records", testid: "grad-heatmap"});
}

/** The verdict from `report.verdict` (older reports: from `ok`); INCOMPLETE is never green. */
function verdictOf(report) {
  const v = report.verdict || (report.ok === undefined ? null : report.ok ? "PASS" : "FAIL");
  if (!v) return null;
  const [cls, text] = VERDICTS[v] || ["verdict-incomplete", fmt(v)];
  return h("strong", {class: `verdict ${cls}`, id: "grad-verdict", "data-verdict": fmt(v)}, text, "   ");
}

/** What the evidence covers: ranks and steps seen, the parameter list's source, notes, and why it is incomplete. */
/** Ranks whose coverage reads the same, one entry each (1,024 ranks: not 1,024 list items):
 *  [[ranks], steps of the first, capture unfinished]. */
function sameSteps(steps, finished) {
  const groups = new Map();
  for (const [rank, s] of steps) {
    const key = [s.first, s.last, s.backward_passes, s.numbered_by, finished[rank] === false].join("|");
    if (!groups.has(key)) groups.set(key, [[], s, finished[rank] === false]);
    groups.get(key)[0].push(rank);
  }
  return [...groups.values()];
}

function coverageBox(report) {
  const cov = report.coverage || {}, gaps = report.incomplete || [];
  if (!Object.keys(cov).length && !gaps.length) return null;
  const steps = Object.entries(cov.steps || {}).sort(([a], [b]) => Number(a) - Number(b));
  const finished = cov.finished || {};
  return h("div", {class: "grad-coverage", id: "grad-coverage"},
    h("div", {}, h("strong", {}, "coverage "),
      h("span", {class: "muted"}, `world size ${fmt(cov.world_size)} · ranks with run-time evidence: `),
      (cov.ranks_with_evidence || []).length ? rankRanges(cov.ranks_with_evidence, 8) : "none"),
    steps.length ? h("ul", {class: "coverage-ranks"}, sameSteps(steps, finished).map(([ranks, s, unfinished]) =>
      h("li", {"data-rank": ranks.join(",")},
        `${ranks.length > 1 ? "ranks" : "rank"} ${rankRanges(ranks, 8)}: steps ${stepText(s.first, s.last)}`,
        h("span", {class: "muted"}, ` (${fmt(s.backward_passes)} backward passes, numbered by ${fmt(s.numbered_by)}`,
          unfinished ? "; the capture did not finish" : "", ")")))) : null,
    h("div", {}, h("span", {class: "muted"}, "parameter list: "), fmt(cov.parameter_list)),
    steps.length ? h("div", {class: "step-legend muted small"}, "steps: ", [...STEP_STATES].map((st) =>
      [h("span", {class: `seg seg-${st}`}), ` ${st} `])) : null,
    (cov.notes || []).length ? h("ul", {class: "notes muted"}, mergeRankLines(cov.notes).map((n) => h("li", {}, fmt(compactRanks(n))))) : null,
    gaps.length ? h("div", {}, h("strong", {class: "verdict-incomplete"},
      report.allow_incomplete ? "not seen (allowed):" : "incomplete:"),
    h("ul", {id: "grad-incomplete"}, mergeRankLines(gaps).map((g) => h("li", {}, fmt(compactRanks(g)))))) : null);
}

/** One rank's steps as a bar, a block per [first, last, state] segment, placed on the run's steps `range`. */
export function stepStrip(segs, range) {
  const lo = range ? range.first : segs[0][0], hi = range ? range.last : segs[segs.length - 1][1];
  const span = Math.max(1, hi - lo + 1);
  const pct = (x) => `${((100 * x) / span).toFixed(3)}%`;
  return h("span", {class: "step-strip", role: "img",
    "aria-label": segs.map(([a, b, st]) => `steps ${stepText(a, b)}: ${st}`).join("; ")},
  segs.map(([a, b, st]) => h("span", {
    class: `seg seg-${STEP_STATES.has(st) ? st : "other"}`, "data-state": fmt(st), "data-first": a, "data-last": b,
    title: `steps ${stepText(a, b)}: ${fmt(st)}`,
    style: `left:${pct(Number(a) - lo)};width:${pct(Number(b) - Number(a) + 1)}`})));
}

/** The row's step cell: its strip, "from step N" at the first step without a real gradient. */
function stepsCell(p, range) {
  if (!Array.isArray(p.steps) || !p.steps.length) return h("td", {class: "steps muted small"}, "no run-time evidence");
  return h("td", {class: "steps"}, stepStrip(p.steps, range),
    p.first_bad_step != null ? h("span", {class: "first-bad"}, ` from step ${fmt(p.first_bad_step)}`) : null,
    p.zero_filled ? h("div", {class: "muted small"}, "zero-filled by a compiled backward") : null);
}

/** The run's step range from coverage.steps (null without evidence). */
function stepRange(report) {
  const all = Object.values((report.coverage || {}).steps || {});
  if (!all.length) return null;
  return {first: Math.min(...all.map((s) => s.first)), last: Math.max(...all.map((s) => s.last))};
}

/** 'File "/long/path/modeling_gpt2.py", line 569, in forward' → <code title=full>modeling_gpt2.py:569 in forward</code> */
function sourceLine(label, text) {
  const m = /File "(?:.*[\\/])?([^\\/"]+)", line (\d+)(?:, in (\S+))?/.exec(text || "");
  const short = m ? `${m[1]}:${m[2]}${m[3] ? ` in ${m[3]}` : ""}` : text;
  return h("div", {class: "first-use"}, `${label} `, h("code", {title: text}, short));
}

/** Link to the graph page with the cut node selected and the path from the parameter highlighted. */
export function cutLink(cut) {
  if (!cut || cut.graph_id == null || isBlank(cut.node)) return null;
  const q = new URLSearchParams({node: cut.node});
  if (cut.path && cut.path.length) q.set("path", cut.path.join(","));
  return h("a", {href: `#/graphs/${cut.graph_id}?${q}`, class: "cut-link", "data-testid": "cut-link"},
    `show the cut in graph #${cut.graph_id}`);
}

/** Whether a cut's op only repeats its kind ("detach" / "aten.detach.default" under kind "detach"):
 * then the chip says it once, not "cut: detach detach at …" (issue 24.14). */
function sameAsKind(op, kind) {
  const short = String(op).replace(/^(aten|torch|prims)\./, "").replace(/\.(default|Tensor)$/, "");
  return short === String(kind) || String(op) === String(kind);
}

function cutCell(p) {
  const c = p.cut;
  return h("td", {class: "reason"},
    isBlank(p.reason) ? "" : fmt(p.reason),
    c && c.kind && c.kind !== "not_read" ? h("div", {class: "cut"}, h("span", {class: "muted"}, "cut: "),
      h("code", {class: "chip"}, fmt(c.kind)), " ", c.op && !sameAsKind(c.op, c.kind) ? code(c.op) : null,
      c.source ? [" at ", h("code", {title: c.code || ""}, fmt(c.source))] : null,
      c.module_path ? [" in ", h("code", {}, fmt(c.module_path))] : null) : null,
    c && c.code ? h("pre", {class: "cut-code"}, c.code) : null,
    c && c.region ? h("div", {class: "muted"}, "no_grad region opened at ", code(c.region)) : null,
    p.fix && FAILING.has(p.status) ? h("div", {class: "fix"}, h("strong", {}, "fix: "), fmt(p.fix)) : null,
    p.first_use && !c ? sourceLine("first use", p.first_use) : null,
    (p.notes || []).map((n) => h("div", {class: "muted"}, fmt(n))),
    cutLink(c));
}

/** {rank: status} → [[ranks], status] per status, in order of first appearance. */
function sameStatus(byRank) {
  const groups = new Map();
  for (const [r, st] of Object.entries(byRank)) {
    if (!groups.has(st)) groups.set(st, []);
    groups.get(st).push(r);
  }
  return [...groups].map(([st, rs]) => [rs, st]);
}

function findingItem(f) {
  const ranks = f.ranks && typeof f.ranks === "object" && !Array.isArray(f.ranks)
    ? ` (${sameStatus(f.ranks).map(([rs, st]) => `${rs.length > 1 ? "ranks" : "rank"} ${rankRanges(rs, 8)}: ${st}`).join(", ")})` : "";
  return h("li", {"data-kind": f.kind, class: f.severity},
    statusBadge(f.kind), f.allowed ? " (allowed) " : " ", fmt(f.message), ranks,
    f.source ? h("div", {}, h("span", {class: "muted"}, "at "), code(f.source)) : null,
    f.fix ? h("div", {class: "fix"}, h("strong", {}, "fix: "), fmt(f.fix)) : null,
    f.graph_id != null ? h("div", {}, graphLink(f.graph_id, `graph #${f.graph_id}`)) : null);
}

/**
 * The report as DOM: verdict + counts, findings, filters (text, status, rank) and the table.
 * `initial` = {status, rank} preselects the filters; `onFilter(status, rank)` is told of changes.
 */
export function gradientReport(report, {initial = {}, onFilter = null} = {}) {
  const params = report.params || [];
  const summary = {...(report.summary || {})};
  for (const s of GRAD_STATUSES) if (summary[s] === undefined) summary[s] = params.filter((p) => p.status === s).length;
  const verdict = verdictOf(report);
  const range = stepRange(report);
  const summaryLine = h("p", {class: "summary", id: "grad-summary"}, verdict,
    Object.entries(summary).filter(([, n]) => n).flatMap(([s, n]) => [statusBadge(s), ` ${n}   `]),
    report.mode ? h("span", {class: "muted"}, `${report.mode} mode`) : null);
  const findings = report.findings || [];
  const ranks = [...new Set(params.map((p) => p.rank))].sort((a, b) => a - b);
  // A large run: rows are built for what the filters show (failing rows until a rank or status is
  // picked), at most LARGE_ROWS at once; the heatmap above shows every rank and parameter.
  const heatRanks = [...new Set([...(report.ranks || []), ...ranks])].map(Number).sort((a, b) => a - b);
  const large = heatRanks.length > SMALL_RUN;
  const rowFor = (p) => {
    const hay = [p.rank, p.fqn, p.status, p.reason, ...(p.aliases || [])].join(" ").toLowerCase();
    const tensor = [isBlank(p.shape) ? null : fmt(p.shape), p.dtype].filter(Boolean).join(" ");
    const links = (label, ids) => (ids && ids.length ? h("div", {}, h("span", {class: "muted"}, label),
      ids.map((id) => [" ", graphLink(id)])) : null);
    return h("tr", {"data-status": p.status, "data-rank": p.rank, "data-hay": hay, "data-fqn": p.fqn,
      class: p.failing ? "failing" : null},
    num(p.rank),
    h("td", {}, code(p.fqn), (p.aliases || []).filter((a) => a !== p.fqn).map((a) => [" = ", h("code", {class: "chip"}, fmt(a))]),
      tensor ? h("div", {class: "muted small"}, tensor) : null),
    h("td", {}, statusBadge(p.status), p.allowed ? h("div", {class: "muted small"}, "allowed") : null),
    stepsCell(p, range), num(p.paths), num(p.bucket), cutCell(p),
    h("td", {class: "graph-links"}, links("read by", p.graphs), links("grad from", p.grad_graphs)));
  };
  const rows = large ? [] : params.map(rowFor);
  const count = h("span", {class: "muted", id: "grad-count"});
  const text = h("input", {type: "search", id: "grad-filter", placeholder: "filter parameters…",
    "aria-label": "filter the gradient report"});
  const status = h("select", {id: "grad-status", "aria-label": "status"}, h("option", {value: ""}, "all statuses"),
    GRAD_STATUSES.map((s) => h("option", {value: s}, s)));
  const rank = h("select", {id: "grad-rank", "aria-label": "rank"}, h("option", {value: ""}, "all ranks"),
    ranks.map((r) => h("option", {value: String(r)}, `rank ${r}`)));
  if (initial.status) status.value = initial.status;
  if (initial.rank != null && initial.rank !== "") rank.value = String(initial.rank);
  const apply = (notify) => {
    const q = text.value.trim().toLowerCase(), want = status.value, wantRank = rank.value;
    if (large) {
      const picked = want || wantRank || q;
      const match = params.filter((p) => (!want || p.status === want) && (!wantRank || String(p.rank) === wantRank)
        && (!q || [p.rank, p.fqn, p.status, p.reason, ...(p.aliases || [])].join(" ").toLowerCase().includes(q))
        && (picked || p.failing));
      grid.tBodies[0].replaceChildren(...match.slice(0, LARGE_ROWS).map(rowFor));
      if (grid.tFoot) grid.tFoot.hidden = match.length > 0;
      count.textContent = `${Math.min(match.length, LARGE_ROWS)} of ${match.length} ${picked ? "matching" : "failing"} rows`
        + ` (${params.length} in all, ${ranks.length} ranks)${picked ? "" : ": pick a rank (or click it in the heatmap) or a status for the others"}`;
      if (notify && onFilter) onFilter(want, wantRank);
      return;
    }
    let shown = 0;
    for (const tr of rows) {
      tr.hidden = !((!q || tr.dataset.hay.includes(q)) && (!want || tr.dataset.status === want)
        && (!wantRank || tr.dataset.rank === wantRank));
      shown += tr.hidden ? 0 : 1;
    }
    count.textContent = `${shown} of ${rows.length} parameters`;
    if (notify && onFilter) onFilter(want, wantRank);
  };
  text.addEventListener("input", () => apply(false));
  status.addEventListener("change", () => apply(true));
  rank.addEventListener("change", () => apply(true));
  const grid = table("grad-report", ["Rank", "Parameter", "Status", "Steps", "Paths", "Bucket", "Cut / reason", "Graphs"], rows,
    "", large ? {empty: "none of the rows the filters pick (no failing parameter, unless a rank or status is picked)"} : {});
  apply(false);
  const view = [summaryLine, coverageBox(report),
    findings.length ? h("ul", {class: "problems", id: "grad-findings"}, findings.map(findingItem)) : null,
    (report.notes || []).length ? h("ul", {class: "notes muted", id: "grad-notes"},
      (large ? mergeRankLines(report.notes).map(compactRanks) : report.notes).map((n) => h("li", {}, fmt(n)))) : null,
    large && report.run_id != null ? statusPicture(params, report.run_id, heatRanks) : null,
    h("div", {class: "toolbar"}, text, status, rank, count),
    grid];
  view.setFilters = (s, r) => { status.value = s || ""; rank.value = r || ""; apply(false); };
  return view;
}

/** #/runs/<id or name>/grads[?status=S&rank=R] */
export async function renderGrads(page, m, query) {
  const runKey = decodeURIComponent(m[1]);
  const run = await api(`/api/runs/${encodeURIComponent(runKey)}`);
  const report = await api(`/api/runs/${run.id}/gradients`);
  if (!page.alive()) return;
  setCrumbs([["Runs", "#/runs"], [fmt(run.name), `#/runs/${run.id}`], ["Gradient paths"]]);
  const base = `#/runs/${encodeURIComponent(runKey)}/grads`;
  const view = gradientReport(report, {
    initial: {status: query.get("status") || "", rank: query.get("rank") || ""},
    onFilter: (s, r) => {
      const q = new URLSearchParams();
      if (s) q.set("status", s);
      if (r) q.set("rank", r);
      const next = q.toString() ? `${base}?${q}` : base;
      if (location.hash !== next) history.replaceState(null, "", next);
    },
  });
  page.update = (q) => view.setFilters(q.get("status"), q.get("rank"));
  $app.replaceChildren(h("section", {id: "grads-page"},
    h("h1", {}, "Gradient paths · ", fmt(run.name)),
    h("p", {class: "muted"}, "Every trainable parameter on every rank: does a gradient reach it, and if not, where the ",
      "forward path is cut. JSON: ", h("a", {href: `/api/runs/${run.id}/gradients`}, "gradients"), " · per step: ",
      h("a", {href: `/api/runs/${run.id}/gradients/steps`}, "gradients/steps"), " · JUnit: ",
      h("a", {href: `/api/runs/${run.id}/gradients.junit`}, "gradients.junit")),
    h("div", {id: "grad-section"}, view)));
}
