// graphdeck dashboard: the run page's live section — a running captured job as its heartbeats
// give it (per rank the training step, per process group the last collective enqueued and
// completed, the heartbeat's age) and the live hang report the agents write while the job still
// hangs (its step, the group and collective, each rank's frame). Polls GET /api/runs/<id>/live
// (analysis/ranks/live.py live_state) every heartbeat interval while the page is open and the job
// goes on, redrawing in place: no reload. A run without heartbeats (imported, or captured without
// the live watch) shows nothing. Strings from the job (group descriptions, source lines) are text.

import {api, badge, fmt, h, isBlank, plural, table} from "./common.js";
import {SMALL_RUN, rankRanges} from "./heatmap.js";

const WORDS = {
  running: "running", stalled: "stalled: a collective is past the threshold, evidence being gathered",
  hang: "HANG — the job is still running", hangGone: "HANG — the ranks have stopped beating since",
  ended: "ended: every rank closed",
  silent: "silent: no heartbeat for a while and no rank ended (the job died, or froze holding the GIL)",
};
const CLASS = {running: "status-ok", stalled: "status-partial", hang: "status-NO_GRAD", ended: "status-FROZEN",
  silent: "status-partial"};
/** A run without heartbeats is asked this many more times (its job may be starting), then left. */
const NONE_TRIES = 5;
const secs = (s) => (isBlank(s) ? "—" : `${Number(s).toFixed(1)} s`);

function groupText(g) {
  const name = `group ${g.group}${g.desc ? ` (${g.desc})` : ""}`;
  const pending = (g.enqueued ?? -1) > (g.completed ?? -1);
  return [h("span", {"data-testid": "live-group-name"}, name), ": enqueued ",
    h("span", {"data-testid": "live-enqueued"}, `#${fmt(g.enqueued)}`), ", completed ",
    h("span", {"data-testid": "live-completed"}, `#${fmt(g.completed)}`),
    pending ? h("span", {class: g.in_flight ? "verdict-bad" : "muted"},
      ` (#${fmt(g.enqueued)} pending ${secs(g.pending_s)}${g.in_flight ? ", in flight" : ""})`) : null];
}

function rankState(r) {
  if (r.ended) return `ended (${r.ended})`;
  if (r.stalled) return `stalled in #${fmt(r.stalled.seq)} of group ${fmt(r.stalled.group)} for ${secs(r.stalled.for_s)}`;
  return r.beating ? "beating" : "no heartbeat lately";
}

/** One row for `rs` (ranks whose step, collectives and state are the same): heartbeat ages as a range. */
function rankRow(rs) {
  const r = rs[0];
  const ages = rs.map((x) => x.beat_age_s).filter((a) => !isBlank(a));
  const lo = Math.min(...ages), hi = Math.max(...ages);
  return h("tr", {"data-testid": "live-rank", "data-rank": rs.length === 1 ? r.rank : null,
    "data-ranks": rs.length > 1 ? rankRanges(rs.map((x) => x.rank)) : null},
    h("td", {class: "num"}, rs.length === 1 ? String(r.rank) : rankRanges(rs.map((x) => x.rank))),
    h("td", {class: "num", "data-testid": "live-step"}, fmt(r.step)),
    h("td", {}, r.groups.length ? r.groups.map((g) => h("div", {"data-testid": "live-group", "data-group": g.group},
      groupText(g))) : h("span", {class: "muted"}, "no process group")),
    h("td", {class: "num", "data-testid": "live-beat-age"}, !ages.length ? "—"
      : lo === hi || rs.length === 1 ? secs(lo) : `${secs(lo)} – ${secs(hi)}`),
    h("td", {"data-testid": "live-rank-state"}, rankState(r)));
}

/** Ranks alike (step, each group's counts, state) in one row past SMALL_RUN ranks, else one row a rank. */
function rankRows(ranks) {
  if (ranks.length <= SMALL_RUN) return ranks.map((r) => rankRow([r]));
  const alike = new Map();
  for (const r of ranks) {
    const key = JSON.stringify([r.step, r.groups.map((g) => [g.group, g.desc, g.enqueued, g.completed, g.in_flight]),
      rankState(r)]);
    if (!alike.has(key)) alike.set(key, []);
    alike.get(key).push(r);
  }
  return [...alike.values()].map(rankRow);
}

/** The live hang report as `graphdeck watch` prints it: its lines (ranks alike merged by the
 *  server), each group's line with its group. */
function reportBlock(rep) {
  const groups = rep.groups || [];
  const lines = rep.lines || [];
  const when = rep.written_at ? new Date(rep.written_at * 1000).toLocaleTimeString() : "—";
  return h("div", {class: "live-report", "data-testid": "live-report"},
    h("h3", {}, "Hang report ", h("span", {class: "small muted"}, `written ${when} while the job still ran`
      + `${rep.by ? ` by ${rep.by}` : " by the agents"}; graphdeck does not stop the job`)),
    h("p", {"data-testid": "live-report-step"}, fmt(lines[0])),
    groups.length ? h("ul", {}, groups.map((g) => h("li", {"data-testid": "live-report-group", "data-group": g.group},
      fmt(g.text ?? `group ${g.group}: collective #${g.seq}`))))
      : h("p", {class: "muted"}, "no mismatched collective yet"),
    h("ul", {}, lines.slice(1 + groups.length).map((line) => h("li", {"data-testid": "live-report-rank"},
      line.trim()))));
}

function draw(box, st) {
  // nothing live to tell: no heartbeat, or every rank closed with no hang report (a finished
  // healthy run opens on its overview, not on a live box)
  box.hidden = st.state === "none" || (st.state === "ended" && !st.report);
  box.dataset.state = st.state;
  const words = st.state === "hang" && st.final ? WORDS.hangGone : WORDS[st.state] || st.state;
  const beating = st.ranks.filter((r) => r.beating).length;
  const head = h("p", {class: "summary"}, badge(words, `status ${CLASS[st.state] || ""}`),
    ` · ${beating} of ${plural(st.ranks.length, "rank")} beating`,
    st.timeout_s ? ` · collective timeout ${st.timeout_s} s` : "",
    st.threshold_s ? ` · hang threshold ${st.threshold_s} s` : "",
    st.final ? "" : ` · updated every ${secs(st.poll_s || 2)}`);
  box.replaceChildren(h("h2", {}, "Live"), head,
    st.report ? reportBlock(st.report) : null,
    table("live-ranks", ["Rank", "Step", "Collectives per group (last enqueued / completed)", "Heartbeat age", "State"],
      rankRows(st.ranks), "compact", {empty: "no heartbeat yet"}));
}

/**
 * The live section of run `runId`: [element (hidden until a heartbeat is seen), promise settled
 * after the first answer]. Keeps polling while `page.alive()` and the answer is not `final`.
 */
export function liveSection(page, runId) {
  const box = h("section", {id: "live", "data-testid": "live", hidden: true});
  let tries = 0;
  const poll = async () => {
    let st;
    try {
      st = await api(`/api/runs/${runId}/live`);
    } catch (err) {
      if (page.alive()) box.dataset.error = err.message;
      return null;
    }
    if (!page.alive()) return null;
    draw(box, st);
    // `final`: nothing will change any more (every rank ended, or stopped beating)
    if (!st.final && (st.state !== "none" || ++tries <= NONE_TRIES)) {
      setTimeout(() => { if (page.alive()) poll(); }, Math.max(500, 1000 * Math.min(st.poll_s || 3, 5)));
    }
    return st;
  };
  return [box, poll()];
}
