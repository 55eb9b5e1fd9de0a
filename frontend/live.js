// graphdeck dashboard: the run page's live section — a running captured job as its heartbeats
// give it (per rank the training step, per process group the last collective enqueued and
// completed, the heartbeat's age) and the live hang report the agents write while the job still
// hangs (its step, the group and collective, each rank's frame). Polls GET /api/runs/<id>/live
// (analysis/ranks/live.py live_state) every heartbeat interval while the page is open and the job
// goes on, redrawing in place: no reload. A run without heartbeats (imported, or captured without
// the live watch) shows nothing. Strings from the job (group descriptions, source lines) are text.

import {api, badge, fmt, h, isBlank, plural, table} from "./common.js";

const WORDS = {
  running: "running", stalled: "stalled: a collective is past the threshold, evidence being gathered",
  hang: "HANG — the job is still running", ended: "ended: every rank closed",
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

function rankRow(r) {
  return h("tr", {"data-testid": "live-rank", "data-rank": r.rank},
    h("td", {class: "num"}, String(r.rank)),
    h("td", {class: "num", "data-testid": "live-step"}, fmt(r.step)),
    h("td", {}, r.groups.length ? r.groups.map((g) => h("div", {"data-testid": "live-group", "data-group": g.group},
      groupText(g))) : h("span", {class: "muted"}, "no process group")),
    h("td", {class: "num", "data-testid": "live-beat-age"}, secs(r.beat_age_s)),
    h("td", {"data-testid": "live-rank-state"}, r.ended ? `ended (${r.ended})`
      : r.stalled ? `stalled in #${fmt(r.stalled.seq)} of group ${fmt(r.stalled.group)} for ${secs(r.stalled.for_s)}`
        : "beating"));
}

/** The live hang report: each group's and rank's line as `graphdeck watch` prints it (`text`,
 *  computed by the server), the rank's frame and source line also as code. */
function reportBlock(rep) {
  const groups = (rep.groups || []).map((g) => h("li", {"data-testid": "live-report-group", "data-group": g.group},
    fmt(g.text ?? `group ${g.group}: collective #${g.seq}`)));
  const ranks = Object.values(rep.ranks || {}).sort((a, b) => a.rank - b.rank).map((r) => h("li",
    {"data-testid": "live-report-rank", "data-rank": r.rank}, fmt(r.text ?? `rank ${r.rank}`),
    h("div", {class: "small muted"}, "frame ", h("code", {"data-testid": "live-frame"}, fmt(r.frame ?? r.innermost)))));
  const when = rep.written_at ? new Date(rep.written_at * 1000).toLocaleTimeString() : "—";
  return h("div", {class: "live-report", "data-testid": "live-report"},
    h("h3", {}, "Hang report ", h("span", {class: "small muted"}, `written ${when} while the job still ran`
      + `${rep.by ? ` by ${rep.by}` : " by the agents"}; graphdeck does not stop the job`)),
    h("p", {"data-testid": "live-report-step"}, fmt((rep.lines || [])[0])),
    groups.length ? h("ul", {}, groups) : h("p", {class: "muted"}, "no mismatched collective yet"),
    h("ul", {}, ranks));
}

function draw(box, st) {
  box.hidden = st.state === "none";
  box.dataset.state = st.state;
  const head = h("p", {class: "summary"}, badge(WORDS[st.state] || st.state, `status ${CLASS[st.state] || ""}`),
    ` · ${plural(st.ranks.length, "rank")} beating`,
    st.timeout_s ? ` · collective timeout ${st.timeout_s} s` : "",
    st.threshold_s ? ` · hang threshold ${st.threshold_s} s` : "",
    st.final ? "" : ` · updated every ${secs(st.poll_s || 2)}`);
  box.replaceChildren(h("h2", {}, "Live"), head,
    st.report ? reportBlock(st.report) : null,
    table("live-ranks", ["Rank", "Step", "Collectives per group (last enqueued / completed)", "Heartbeat age", "State"],
      st.ranks.map(rankRow), "compact", {empty: "no heartbeat yet"}));
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
