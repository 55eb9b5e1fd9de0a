// graphdeck dashboard: a run's cross-rank consistency page (#/runs/<id or name>/ranks), from
// GET /api/runs/<id>/rank-consistency.
//
// Sections: the verdict; the rank groups (ranks with identical compile sequences); each
// divergence (first differing compile / graph / node, with source line, module path, recompile
// reason, and links to both graphs and to their diff); the collective schedule of every rank side
// by side, the first mismatching position marked as the predicted hang; each rank's compile
// sequence. All text from the store goes through h() (textContent), never markup.

import {badge, code, fmt, fmtBytes, graphLink, h, num, setCrumbs, table, api} from "./common.js";
import {SMALL_RUN, rankHeatmap, rankRanges} from "./heatmap.js";

/** A schedule entry without what differs per rank by construction (its graph's id, its group's
 *  name): ranks whose entries are equal but for those run the same collectives. */
const sameWork = ({graph_id, group, ...rest}) => rest; // eslint-disable-line no-unused-vars

/** Ranks whose schedules run the same collectives, in order of their first rank: [[ranks],
 *  schedule of the first, groups differ?]. A large run's schedule table gets a column per group. */
function sameSchedules(report) {
  const groups = new Map();
  for (const r of report.ranks) {
    const sched = report.schedules[String(r)] || [];
    const key = JSON.stringify(sched.map(sameWork));
    if (!groups.has(key)) groups.set(key, [[], sched, new Set()]);
    const g = groups.get(key);
    g[0].push(r);
    g[2].add(JSON.stringify(sched.map((c) => c.group)));
  }
  return [...groups.values()].map(([rs, sched, pgs]) => [rs, sched, pgs.size > 1]);
}

function verdict(report) {
  const groups = report.ranks.length > SMALL_RUN ? report.groups.map((g) => `[${rankRanges(g, 3)}]`).join(" ")
    : report.groups.map((g) => `[${g.join(", ")}]`).join(" ");
  return h("p", {class: "verdict", "data-testid": "rank-verdict"},
    h("strong", {class: report.ok ? "verdict-ok" : "verdict-bad"},
      report.ok ? (report.divergences.some((d) => d.harmless) ? "collective schedules agree (warnings below)"
        : "all ranks agree") : report.verdict === "INCOMPLETE" ? "incomplete: evidence missing"
        : report.verdict === "WARN" ? "ranks agree, but a wait nears the collective timeout"
        : Object.keys(report.diverged_ranks || {}).length || (report.flight?.mismatches || []).length ? "ranks diverge"
        : "a wait reaches the collective timeout"),
    `   ${report.ranks.length} ranks; groups by compile sequence: ${groups}`);
}

// Waits judged against the collective timeout (NOTE: [Time verdicts]): WARN / FAIL ones, each with
// its step, the late rank and the cause; those under the WARN share are among the notes above.
function timeSection(report) {
  const shown = (report.time_findings || []).filter((f) => f.verdict !== "NOTE");
  if (!shown.length) return null;
  return [h("h2", {}, "Waits against the collective timeout"),
    h("ul", {class: "time-findings"}, shown.map((f) => h("li", {"data-testid": "time-finding"},
      badge(f.verdict, `status status-${f.verdict === "FAIL" ? "NO_GRAD" : "partial"}`), " ", f.message)))];
}

function nodeLine(label, node) {
  if (!node) return null;
  return h("div", {class: "node-ref"}, h("span", {class: "muted"}, `${label}: `),
    h("a", {href: `#/graphs/${node.graph_id}?node=${encodeURIComponent(node.name)}`}, node.name),
    " = ", code(node.args != null ? `${node.target}(${node.args})` : node.target), node.shape ? ` ${node.shape}` : "", node.dtype ? ` ${node.dtype}` : "",
    node.module_path ? h("span", {class: "muted"}, ` [${node.module_path}]`) : null,
    node.source ? h("div", {class: "small source"}, node.source) : null);
}

function divergenceItem(d) {
  const diff = d.reference_graph_id && d.graph_id
    ? h("a", {href: `#/compare/${d.reference_graph_id}/${d.graph_id}`, class: "diff-link"}, "side-by-side diff") : null;
  return h("li", {class: "divergence", "data-testid": "divergence"},
    d.harmless ? badge(`${d.what} (no hang)`, "status status-partial") : badge(d.what, "status status-NO_GRAD"), " ",
    h("span", {}, `ranks [${d.ranks.join(", ")}] vs [${d.reference_ranks.join(", ")}]: ${d.message}`),
    h("div", {class: "small"},
      d.reference_graph_id ? ["graphs ", graphLink(d.reference_graph_id), " vs ", graphLink(d.graph_id)] : null,
      diff ? [" · ", diff] : null),
    nodeLine(`ranks [${d.reference_ranks.join(", ")}]`, d.reference_node),
    nodeLine(`ranks [${d.ranks.join(", ")}]`, d.node),
    d.recompile_reason ? h("div", {class: "small"}, badge("recompile", "tag"), " ", d.recompile_reason) : null,
    d.harmless ? h("div", {class: "small", "data-testid": "harmless"}, d.harmless) : null);
}

// FSDP's uneven shards (a graph equal on every rank but for dim 0 of its shard shapes): a note,
// not a divergence; each rank group's shape links to that group's graph.
function shardItem(x) {
  return h("li", {class: "shard-shapes", "data-testid": "shard-shapes"},
    badge("shard shapes", "tag"), " ", code(x.param || x.node), ` in compile ${x.compile_id} ${x.kind}: `,
    x.variants.map((v, i) => [i ? ", " : "", graphLink(v.graph_id, v.shape),
      ` on rank${v.ranks.length > 1 ? "s" : ""} ${v.ranks.join(",")}`]),
    h("div", {class: "small muted"}, x.message));
}

// The recorded half (Flight Recorder dumps): per process group the first mismatched collective
// (group, sequence id, op), the ranks that reached it and those that did not — each with what it
// did instead and why (the compile records joined, the branch that sent it another way). The
// headline and each rank's account are check-ranks' own lines (the report's `headline`, `accounts`).
function frRef(e) {
  return e ? `${e.op} #${e.seq} of group ${e.group}${e.line ? ` at ${e.line}` : ""}` : "nothing";
}

function frMismatch(m) {
  const issued = Object.entries(m.issued || {})[0];
  return h("div", {class: "hang-note", "data-testid": "recorded-hang", "data-group": m.group},
    badge(m.primary ? "hang" : "consequence", "status status-NO_GRAD"), " ",
    h("span", {"data-testid": "fr-group"}, `group ${m.group}${m.desc ? ` (${m.desc})` : ""}`), ": first mismatch at ",
    h("span", {"data-testid": "fr-seq"}, `collective #${m.seq}`), ` ${m.op || ""} `,
    h("span", {"data-testid": "fr-reached"}, `reached by ranks [${m.reached.join(", ")}]`), ", ",
    h("span", {"data-testid": "fr-not-reached"}, `not by ranks [${m.not_reached.join(", ")}]`),
    m.no_dump.length ? h("span", {class: "muted"}, `; no dump from ranks [${m.no_dump.join(", ")}]`) : null,
    m.headline ? h("div", {class: "small", "data-testid": "fr-headline"}, `HANG ${m.headline}`) : null,
    issued ? h("div", {class: "small muted"}, `rank ${issued[0]} issued it`
      + `${issued[1].compiled ? " inside a compiled graph" : ""}${issued[1].line ? ` at ${issued[1].line}` : ""}`) : null,
    h("ul", {}, m.not_reached.map((r) => {
      const key = String(r);
      const waiting = m.cause[key] === "waiting";
      return h("li", {"data-testid": "fr-rank", "data-rank": key},
        h("strong", {}, `rank ${r}`), waiting ? " (waiting in an earlier collective)" : " (skipped it)",
        m.accounts?.[key] != null ? `: ${m.accounts[key]}`
          : `: last completed ${frRef(m.last_completed[key])}; ${waiting ? "waiting in" : "went on to"} ${frRef(m.doing[key])}`,
        (m.why[key] || []).map((w) => h("div", {class: "small", "data-testid": "fr-why"}, w)));
    })));
}

function flightSection(report) {
  const fr = report.flight;
  const missing = (report.missing_evidence || []).map((x) => h("li", {"data-testid": "missing-evidence"}, x));
  if (!fr) return missing.length ? h("ul", {class: "missing-evidence"}, missing) : null;
  return [h("h2", {}, "Recorded collectives (Flight Recorder)"),
    h("p", {class: "muted", "data-testid": "fr-summary"}, `dumps from ranks [${fr.ranks.join(", ")}], ${fr.entries} entries; `
      + `${fr.groups_agree.length} group(s) agree, `
      + (Object.keys(fr.groups_incomplete || {}).length
        ? `${Object.keys(fr.groups_incomplete).length} incomplete (a member without a dump: cannot be told), ` : "")
      + `${fr.mismatches.length} mismatched`
      + (fr.no_dump.length ? `; no dump from ranks [${fr.no_dump.join(", ")}]` : "")),
    Object.entries(fr.shown || {}).map(([g, text]) => h("p", {class: "small", "data-testid": "fr-shown", "data-group": g},
      `group ${g} (incomplete): ${text}`)),
    fr.mismatches.map(frMismatch),
    missing.length ? h("ul", {class: "missing-evidence"}, missing) : null];
}

function scheduleTable(report) {
  const large = report.ranks.length > SMALL_RUN;
  // A large run: one column per distinct schedule, headed by its ranks.
  const cols = large ? sameSchedules(report) : report.ranks.map((r) => [[r], report.schedules[String(r)] || [], false]);
  const ranks = cols.map(([rs]) => rs);
  const schedules = cols.map(([, s]) => s);
  const perRankGroups = cols.map(([, , differ]) => differ);
  const longest = Math.max(0, ...schedules.map((s) => s.length));
  const hangAt = report.collective_mismatches.length ? report.collective_mismatches[0].index : -1;
  const cell = (c, j) => (c ? h("td", {title: c.line || ""},
    code(c.kind), c.group != null ? ` pg ${c.group}${perRankGroups[j] ? ` (rank ${ranks[j][0]}'s; these ranks are in different groups)` : ""}` : "", c.size_bytes != null ? ` ${fmtBytes(c.size_bytes)}` : "",
    c.node ? h("div", {class: "small muted"}, c.node) : null,
    c.compile_id ? h("div", {class: "small muted"}, `compile ${c.compile_id}`) : null) : h("td", {class: "muted"}, "—"));
  const rows = [];
  for (let i = 0; i < longest; i++) {
    rows.push(h("tr", {class: i === hangAt ? "hang" : "", "data-index": i},
      num(i), ...schedules.map((s, j) => cell(s[i], j))));
  }
  return rows.length
    ? table("collective-schedule", ["#", ...ranks.map((rs) => (large ? `ranks ${rankRanges(rs)}` : `rank ${rs[0]}`))], rows, "",
      {caption: large ? `${report.ranks.length} ranks: one column per distinct schedule (${cols.length})` : null})
    : h("p", {class: "muted"}, "No collectives in the captured graphs, no recorded DDP or FSDP2 collectives and no DDP buckets.");
}

// Predicted vs recorded per process group (analysis/ranks/predicted.py): the schedule the graphs
// predict next to the Flight Recorder's record, and whether the prediction held.
const OUTCOME_CLASS = {"held": "status-OK", "held in part": "status-partial", "did not hold": "status-NO_GRAD",
  "not predicted": "status-NOT_IN_GRAPH", "unchecked": "status-FROZEN", "incomplete": "status-partial"};

function predictionTable(report) {
  const checks = report.predictions || [];
  if (!checks.length) return null;
  const rows = checks.map((p) => h("tr", {"data-testid": "prediction", "data-group": p.group},
    h("td", {}, p.group, p.desc ? h("span", {class: "muted"}, ` (${p.desc})`) : null),
    h("td", {}, p.predicted), h("td", {}, p.recorded),
    h("td", {}, badge(p.outcome, `status ${OUTCOME_CLASS[p.outcome] || ""}`))));
  return [h("h2", {}, "Predicted vs recorded"),
    table("predicted-vs-recorded", ["Process group", "Predicted (graphs)", "Recorded (Flight Recorder)", "Prediction"], rows)];
}

function sequenceTable(report) {
  const rows = [];
  const large = report.ranks.length > SMALL_RUN;
  // A large run: one block per group of identical compile sequences (the report's groups).
  const blocks = large ? report.groups.map((g) => [g, report.sequences[String(g[0])] || []])
    : report.ranks.map((r) => [[r], report.sequences[String(r)] || []]);
  for (const [rs, seq] of blocks) {
    const r = rs[0];
    for (const e of seq) {
      rows.push(h("tr", {"data-rank": r},
        large ? h("td", {"data-ranks": rs.length}, rankRanges(rs)) : num(r), h("td", {}, code(e.compile_id)), h("td", {}, fmt(e.frame)),
        h("td", {}, e.graphs.map(([kind, hash, id], i) => [i ? " " : "", graphLink(id, kind),
          h("span", {class: "muted small"}, ` ${String(hash || "").slice(0, 8)}`)])),
        h("td", {}, e.failed ? badge("failed", "status-NO_GRAD") : "", e.failed ? ` ${e.failed}` : ""),
        h("td", {class: "reason"}, fmt(e.recompile_reason))));
    }
  }
  return table("compile-sequences", ["Rank", "Compile id", "Frame", "Graphs (hash)", "Failure", "Recompile reason"], rows);
}

export async function renderRanks(page, match) {
  const report = await api(`/api/runs/${encodeURIComponent(match[1])}/rank-consistency`);
  if (!page.alive()) return;
  setCrumbs([["Runs", "#/runs"], [report.run, `#/runs/${report.run_id}`], ["rank consistency", null]]);
  // A large run: its traces' collectives as the rank heatmap (finding per collective).
  const large = report.ranks.length > SMALL_RUN;
  const [heatBox] = large ? rankHeatmap(page, report.run_id, {metric: "finding", axis: "collectives"}) : [null];
  document.getElementById("app").replaceChildren(h("section", {class: "ranks-page"},
    h("h1", {}, `Rank consistency — ${report.run}`),
    verdict(report),
    h("p", {}, h("a", {href: `#/runs/${report.run_id}/nway`, "data-testid": "nway-link"},
      "N-way rank diff: one graph across all ranks, the nodes where any rank differs")),
    report.notes.filter((n) => !(report.shard_shapes || []).some((x) => x.message === n))
      .map((n) => h("p", {class: "muted"}, n)),
    (report.shard_shapes || []).length ? h("ul", {class: "shard-notes"}, report.shard_shapes.map(shardItem)) : null,
    timeSection(report),
    h("h2", {}, "Divergences"),
    report.divergences.length ? h("ul", {class: "divergences"}, report.divergences.map(divergenceItem))
      : h("p", {class: "muted"}, "Every rank compiled the same sequence of graphs."),
    h("h2", {}, "Collective schedule"),
    report.collective_mismatches.map((m) => h("p", {class: "hang-note", "data-testid": "predicted-hang"},
      badge("predicted hang", "status status-NO_GRAD"), " ", m.message)),
    scheduleTable(report),
    flightSection(report),
    predictionTable(report),
    large ? [h("h2", {}, "Recorded collectives per rank (traces)"), heatBox] : null,
    h("h2", {}, large ? "Compile sequence per group of ranks" : "Compile sequence per rank"),
    sequenceTable(report)));
}
