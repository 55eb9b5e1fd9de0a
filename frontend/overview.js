// graphdeck dashboard: the run page's overview (issue 23 item 2) — every check's verdict with a
// count and a link, worst first, then the slowest steps and ranks. It draws the document of GET
// /api/runs/<id>/summary (NOTE: [Run overview] in graphdeck/analysis/summary.py), the one
// `graphdeck summary RUN` prints, so the page and a CI log say the same — fetched in parts
// (GET /api/runs/<id>/summary/<check>, issue 26 item 2): each check is drawn as it answers, the
// cheap ones at once, so a 1,024-rank run's page never waits for its slowest check; the run's
// verdict line comes once every check has answered.
//
// Verdicts: PASS (green), FAIL (red), INCOMPLETE (amber: evidence missing), WARN (orange: a finding
// no gate covers, exit 0), ERROR (the check
// raised: never green), N/A (grey: nothing to check, e.g. no parallel layout recorded).

import {api, badge, fmt, h, isBlank, plural, table} from "./common.js";

/** Check keys in the order the overview asks for them (analysis/summary.py CHECKS). */
export const CHECKS = ["gradients", "ranks", "compile", "traces", "layout"];
const TITLES = {gradients: "Gradient paths", ranks: "Rank consistency", compile: "Compile health",
  traces: "Trace coverage", layout: "Parallel layout"};
/** The order the parts are asked in (cheap first, as measured at 1,024 ranks) and how many at once. */
const ASK_ORDER = ["layout", "slowest", "compile", "traces", "ranks", "gradients"];
const PARALLEL = 2;
/** Worst first, as RunSummary orders its checks. */
const SEVERITY = ["FAIL", "ERROR", "INCOMPLETE", "WARN", "PASS", "N/A"];

const VERDICT_CLASS = {PASS: "ov-pass", FAIL: "ov-fail", INCOMPLETE: "ov-incomplete", WARN: "ov-warn", ERROR: "ov-error", "N/A": "ov-na"};
const WORDS = {PASS: "pass", FAIL: "fail", INCOMPLETE: "incomplete", WARN: "warn (no gate)", ERROR: "raised an error", "N/A": "not applicable"};
const ms = (ns) => (isBlank(ns) ? "—" : `${(Number(ns) / 1e6).toFixed(1)} ms`);
const verdictBadge = (v, title) => {
  const b = badge(fmt(v), `ov-verdict ${VERDICT_CLASS[v] || "tag"}`);
  if (title) b.title = title;
  return b;
};

/** One check's line: verdict, title, count, headline, its link, then its first reasons. */
function checkItem(c) {
  const count = c.count == null ? null : h("span", {class: "ov-count", "data-testid": "overview-count"},
    `${c.count} ${c.count_label}`);
  const reasons = (c.reasons || []).slice(0, 3);
  const more = (c.reasons || []).length - reasons.length + (c.more || 0);
  // A kept answer (the run unchanged since it was computed: NOTE [Derived-document cache]) says so.
  const timing = `${Number(c.elapsed_s).toFixed(2)} s of a ${Number(c.budget_s).toFixed(0)} s budget`
    + (c.cache && c.cache !== "computed" ? " (computed earlier; the run has not changed since)" : "");
  return h("li", {class: `ov-check ${VERDICT_CLASS[c.verdict] || ""}`, "data-testid": "overview-check",
    "data-check": c.key, "data-verdict": c.verdict},
  h("div", {class: "ov-line"},
    verdictBadge(c.verdict, c.native_verdict && c.native_verdict !== c.verdict ? `the report says ${c.native_verdict}` : null),
    h("strong", {class: "ov-title"}, fmt(c.title)),
    count ? [" · ", count] : null,
    h("span", {class: "ov-headline"}, " — ", fmt(c.headline)),
    c.link ? [" ", h("a", {href: c.link, class: "ov-link", "data-testid": `overview-link-${c.key}`}, "details →")] : null),
  reasons.length || c.over_budget || c.error ? h("ul", {class: "ov-reasons small"},
    reasons.map((r) => h("li", {}, fmt(r))),
    more > 0 ? h("li", {class: "muted"}, `… ${plural(more, "more line")}: see the details`) : null) : null,
  h("div", {class: "ov-meta small muted"}, c.command ? [h("code", {}, fmt(c.command)), " · "] : null,
    h("span", {class: c.over_budget ? "ov-over" : null, "data-testid": "overview-timing"}, timing)));
}

/** The slowest steps (longest first) and ranks (slowest median step first), with the straggler. */
function slowestPart(s, runId) {
  const head = h("h3", {}, "Slowest steps and ranks");
  if (!s || !s.available) {
    return [head, h("p", {class: "muted", "data-testid": "overview-slowest-none"},
      `No step times: ${fmt(s && s.reason)}.`)];
  }
  const stepRows = s.steps.map((x) => h("tr", {"data-rank": x.rank},
    h("td", {class: "num"}, fmt(x.rank)), h("td", {class: "num"}, fmt(x.step)), h("td", {class: "num"}, ms(x.dur_ns)),
    h("td", {class: "muted"}, x.source === "cpu" ? "ProfilerStep range" : "GPU span of its kernels"),
    h("td", {}, h("a", {href: x.link}, "replay →"))));
  const rankRows = s.ranks.map((x) => h("tr", {"data-rank": x.rank},
    h("td", {class: "num"}, fmt(x.rank)), h("td", {class: "num"}, fmt(x.steps)), h("td", {class: "num"}, ms(x.median_ns)),
    h("td", {class: "num"}, ms(x.max_ns)), h("td", {class: "num"}, ms(x.total_ns)),
    h("td", {}, h("a", {href: x.link}, "trace →"))));
  return [head,
    s.straggler_message ? h("p", {class: "small", "data-testid": "overview-straggler"}, fmt(s.straggler_message)) : null,
    h("div", {class: "ov-tables"},
      table("overview-slowest-steps", ["Rank", "Step", "Duration", "Measured as", ""], stepRows, "compact"),
      table("overview-slowest-ranks", ["Rank", "Steps", "Median step", "Longest", "Total", ""], rankRows, "compact",
        {caption: (s.ranks_total || 0) > s.ranks.length
          ? `the ${s.ranks.length} slowest of ${s.ranks_total} ranks: the rank heatmap shows them all` : null})),
    h("p", {class: "small"}, h("a", {href: s.link || `#/runs/${runId}/timeline`, "data-testid": "overview-timeline-link"},
      "all ranks on one timeline →"))];
}

/** The run's verdict from its checks' verdicts (RunSummary.verdict): FAIL, else INCOMPLETE when any
 *  is INCOMPLETE or ERROR, else WARN when any warns (exit 0), else PASS; N/A counts for nothing.
 *  → [verdict, exit code] */
export function runVerdict(verdicts) {
  if (verdicts.includes("FAIL")) return ["FAIL", 1];
  if (verdicts.some((v) => v === "INCOMPLETE" || v === "ERROR")) return ["INCOMPLETE", 3];
  return verdicts.includes("WARN") ? ["WARN", 0] : ["PASS", 0];
}

/** The verdict line once every check has answered. */
function verdictLine(run, checks, elapsed) {
  const [verdict, exit] = runVerdict(checks.map((c) => c.verdict));
  const counts = SEVERITY.map((v) => [v, checks.filter((c) => c.verdict === v).length]).filter(([, n]) => n)
    .map(([v, n]) => `${n} ${WORDS[v] || v}`).join(", ");
  return h("p", {class: "ov-verdict-line", "data-testid": "overview-verdict", "data-verdict": verdict},
    verdictBadge(verdict), " ", h("span", {}, `${plural(checks.length, "check")}: ${counts}`),
    h("span", {class: "muted small"}, ` · \`graphdeck summary ${run.name} --store STORE\` exits ${exit}`
      + ` · checks took ${elapsed.toFixed(1)} s`));
}

/** A check not answered yet: its title and a pending mark (never a verdict colour). */
function pendingItem(key) {
  return h("li", {class: "ov-check ov-pending", "data-testid": "overview-check", "data-check": key, "data-verdict": "pending"},
    h("div", {class: "ov-line"}, badge("…", "ov-verdict ov-pending-badge"), h("strong", {class: "ov-title"}, TITLES[key]),
      h("span", {class: "ov-headline muted"}, " — running…")));
}

/** A part whose request failed: ERROR (never a pass), with the server's message. */
function failedCheck(key, run, err) {
  return {key, title: TITLES[key], verdict: "ERROR", count: null, count_label: "", headline:
    `the check could not be computed: ${err.message}`, link: null, command: `graphdeck summary ${run.name} --store STORE`,
  reasons: [], more: 0, elapsed_s: 0, budget_s: 0, over_budget: false, error: err.message, requestFailed: true};
}

/**
 * The overview section, drawn now: a pending line per check, each replaced by its verdict as its
 * part answers (cheap checks first), sorted worst first and given the run's verdict line once all
 * have answered; then the slowest steps and ranks. A failed part is an ERROR line, never a pass.
 * `after` (a promise): ask nothing before it settles (at most 2 s), so a large run's heatmap is
 * not slowed by the checks. → [section element, promise settled once every part is drawn]
 */
export function runOverview(page, run, {after = null} = {}) {
  const title = h("h2", {}, "Overview");
  const line = h("p", {class: "loading", "data-testid": "overview-progress"},
    `Running the checks (gradients, ranks, compile health, trace coverage, layout): 0 of ${CHECKS.length} answered…`);
  const list = h("ol", {class: "ov-checks", "data-testid": "overview-checks"}, CHECKS.map(pendingItem));
  const slow = h("div", {class: "ov-slowest"}, h("h3", {}, "Slowest steps and ranks"),
    h("p", {class: "loading"}, "Reading step times…"));
  const box = h("section", {id: "run-overview", "data-testid": "run-overview", class: "run-overview", "data-state": "loading"},
    title, line, list, slow);
  const t0 = performance.now();
  const got = new Map();
  // At most PARALLEL parts asked at once, in ASK_ORDER (usually cheap first): the server runs
  // Python checks that share one interpreter, so six at once would slow the cheap ones (and the
  // heatmap) to the pace of the slowest.
  const waiting = [];
  let running = 0;
  const next = () => {
    while (running < PARALLEL && waiting.length) {
      waiting.sort((a, b) => ASK_ORDER.indexOf(a.key) - ASK_ORDER.indexOf(b.key));
      const job = waiting.shift();
      running += 1;
      job.start().then(job.resolve, job.reject).finally(() => { running -= 1; next(); });
    }
  };
  // `after`: a promise the first request waits for (a large run's heatmap, the page's picture).
  const gate = after ? Promise.race([after.catch(() => null), new Promise((res) => setTimeout(res, 2000))]) : null;
  const queued = (key, start) => new Promise((resolve, reject) => {
    waiting.push({key, start, resolve, reject});
    if (gate) gate.then(next); else queueMicrotask(next);
  });
  const parts = CHECKS.map((key) => queued(key, () => api(`/api/runs/${run.id}/summary/${key}`))
    .catch((err) => failedCheck(key, run, err))
    .then((c) => {
      if (!page.alive()) return;
      got.set(key, c);
      list.querySelector(`[data-check="${key}"]`)?.replaceWith(checkItem(c));
      if (got.size < CHECKS.length) {
        line.textContent = `Running the checks: ${got.size} of ${CHECKS.length} answered…`;
        return;
      }
      const checks = CHECKS.map((k) => got.get(k))
        .sort((a, b) => SEVERITY.indexOf(a.verdict) - SEVERITY.indexOf(b.verdict) || CHECKS.indexOf(a.key) - CHECKS.indexOf(b.key));
      list.replaceChildren(...checks.map(checkItem));
      const elapsed = checks.reduce((sum, c) => sum + Number(c.elapsed_s || 0), 0);
      line.replaceWith(verdictLine(run, checks, elapsed));
      box.dataset.verdict = runVerdict(checks.map((c) => c.verdict))[0];
    }));
  const slowest = queued("slowest", () => api(`/api/runs/${run.id}/summary/slowest`)).then(
    (s) => { if (page.alive()) slow.replaceChildren(...slowestPart(s, run.id).flat().filter(Boolean)); },
    (err) => {
      if (page.alive()) {
        slow.replaceChildren(h("h3", {}, "Slowest steps and ranks"), h("p", {class: "error", role: "alert",
          "data-testid": "overview-error"}, `The step times could not be read: ${err.message}`));
      }
    });
  const done = Promise.all([...parts, slowest]).then(() => {
    if (!page.alive()) return;
    box.dataset.state = [...got.values()].some((c) => c.requestFailed) ? "error" : "done";
    box.dataset.ms = String(Math.round(performance.now() - t0));
  });
  return [box, done];
}
