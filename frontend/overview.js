// graphdeck dashboard: the run page's overview (issue 23 item 2) — every check's verdict with a
// count and a link, worst first, then the slowest steps and ranks. It draws GET
// /api/runs/<id>/summary as is (NOTE: [Run overview] in graphdeck/analysis/summary.py), the
// document `graphdeck summary RUN` prints, so the page and a CI log say the same.
//
// Verdicts: PASS (green), FAIL (red), INCOMPLETE (amber: evidence missing), ERROR (the check
// raised: never green), N/A (grey: nothing to check, e.g. no parallel layout recorded).

import {api, badge, fmt, h, isBlank, plural, table} from "./common.js";

const VERDICT_CLASS = {PASS: "ov-pass", FAIL: "ov-fail", INCOMPLETE: "ov-incomplete", ERROR: "ov-error", "N/A": "ov-na"};
const WORDS = {PASS: "pass", FAIL: "fail", INCOMPLETE: "incomplete", ERROR: "raised an error", "N/A": "not applicable"};
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
  const timing = `${Number(c.elapsed_s).toFixed(2)} s of a ${Number(c.budget_s).toFixed(0)} s budget`;
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
      table("overview-slowest-ranks", ["Rank", "Steps", "Median step", "Longest", "Total", ""], rankRows, "compact")),
    h("p", {class: "small"}, h("a", {href: s.link || `#/runs/${runId}/timeline`, "data-testid": "overview-timeline-link"},
      "all ranks on one timeline →"))];
}

/** The overview's content for a summary document. */
export function overviewContent(sum) {
  const checks = sum.checks || [];
  const counts = Object.entries(sum.counts || {}).filter(([, n]) => n)
    .map(([v, n]) => `${n} ${WORDS[v] || v}`).join(", ");
  return [
    h("p", {class: "ov-verdict-line", "data-testid": "overview-verdict", "data-verdict": sum.verdict},
      verdictBadge(sum.verdict), " ",
      h("span", {}, `${plural(checks.length, "check")}: ${counts}`),
      h("span", {class: "muted small"}, ` · \`graphdeck summary ${sum.run}\` exits ${sum.exit_code}`
        + ` · computed in ${Number(sum.elapsed_s).toFixed(1)} s`)),
    h("ol", {class: "ov-checks", "data-testid": "overview-checks"}, checks.map(checkItem)),
    slowestPart(sum.slowest, sum.run_id),
  ];
}

/**
 * The overview section, drawn now with a loading line and filled when the summary answers;
 * a failed request says so in the section (never an empty, healthy-looking overview).
 * → [section element, promise settled once drawn]
 */
export function runOverview(page, run) {
  const title = h("h2", {}, "Overview");
  const box = h("section", {id: "run-overview", "data-testid": "run-overview", class: "run-overview", "data-state": "loading"},
    title, h("p", {class: "loading"}, "Running the checks (gradients, ranks, compile health, trace coverage, layout)…"));
  const done = api(`/api/runs/${run.id}/summary`).then(
    (sum) => {
      if (!page.alive()) return;
      box.replaceChildren(title, ...overviewContent(sum).flat().filter(Boolean));
      box.dataset.state = "done";
      box.dataset.verdict = sum.verdict;
    },
    (err) => {
      if (!page.alive()) return;
      box.replaceChildren(title, h("p", {class: "error", role: "alert", "data-testid": "overview-error"},
        `The overview could not be computed: ${err.message}`));
      box.dataset.state = "error";
    });
  return [box, done];
}
