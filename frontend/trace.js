// graphdeck dashboard: the trace page (#/traces/<id>): a Plotly timeline of one rank's Kineto
// trace, its metadata and the ingest stats. Plotly (about 4 MB) loads only when this page opens.

import {$app, api, code, defList, errorBox, fmt, h, plural, setCrumbs, statusBadge} from "./common.js";

const PLOTLY_SRC = "/static/vendor/plotly.min.js";

let plotlyLoading = null;
function loadPlotly() {
  if (window.Plotly) return Promise.resolve(window.Plotly);
  plotlyLoading ??= new Promise((resolve, reject) => {
    const s = h("script", {src: PLOTLY_SRC});
    s.addEventListener("load", () => resolve(window.Plotly));
    s.addEventListener("error", () => { plotlyLoading = null; reject(new Error(`could not load ${PLOTLY_SRC}`)); });
    document.head.append(s);
  });
  return plotlyLoading;
}

/** A stats value: scalars as text, a flat object as `key: value` chips, anything deeper as JSON. */
function statValue(v) {
  if (typeof v !== "object" || v === null) return fmt(v);
  const entries = Object.entries(v);
  if (!Array.isArray(v) && entries.every(([, x]) => typeof x !== "object" || x === null)) {
    return h("span", {}, entries.map(([k, x]) => h("code", {class: "chip"}, `${k}: ${fmt(x)}`)));
  }
  return h("pre", {class: "code small"}, JSON.stringify(v, null, 1));
}

function statsView(stats, id) {
  const entries = Object.entries(stats || {});
  if (!entries.length) return h("p", {class: "muted", id}, "none");
  return defList(entries.map(([k, v]) => [k, statValue(v)]), {id, class: "kv panel"}, true);
}

/**
 * Why a trace with status "truncated" is short: the file ended (or turned invalid) part-way and
 * the events parsed before the cut were kept (store/traces.py). Names the counters that say so.
 */
function truncatedBanner(trace) {
  const st = trace.stats || {};
  const kept = st.stored ?? trace.num_events;
  const counters = ["truncated", "corrupt", "trailing_garbage"].filter((k) => Number(st[k]) > 0)
    .map((k) => `stats.${k} = ${st[k]}`);
  const read = st.bytes_json != null ? ` after ${fmt(st.bytes_json)} bytes of JSON` : "";
  return h("div", {class: "warn-banner", role: "note", id: "trace-truncated", "data-testid": "trace-truncated"},
    h("strong", {}, "This trace file ended early"), `${read}. `,
    `The ${plural(Number(kept) || 0, "event")} parsed before the cut ${Number(kept) === 1 ? "was" : "were"} kept `,
    `(stats.stored = ${fmt(st.stored)}, `,
    `num_events = ${fmt(trace.num_events)}, of stats.events_total = ${fmt(st.events_total)} items read); `,
    "the event the cut went through and everything after it are missing, so the timeline ends early.",
    st.corrupt ? " The JSON turned invalid there (stats.corrupt) rather than just stopping." : "",
    counters.length ? h("div", {class: "small"}, "Counters: ", counters.map((c) => [code(c), " "])) : null);
}

export async function renderTrace(page, m) {
  const id = Number(m[1]);
  // exactInts: start_ns / end_ns are int64 nanoseconds, past what a JS number holds exactly.
  const trace = await api(`/api/traces/${id}`, {exactInts: true});
  if (!page.alive()) return;
  const crumbs = [["Runs", "#/runs"]];
  if (trace.run_id != null) crumbs.push([trace.run_name ? fmt(trace.run_name) : `run ${trace.run_id}`, `#/runs/${trace.run_id}`]);
  setCrumbs([...crumbs, [`rank ${fmt(trace.rank)} · ${fmt(trace.name)}`]]);
  const timeline = h("div", {id: "timeline", "data-testid": "timeline", class: "timeline"},
    h("p", {class: "loading"}, "Loading the timeline…"));
  const skip = new Set(["stats", "meta", "id", "name", "run_id", "run_name"]);
  $app.replaceChildren(h("section", {class: "trace-page"},
    h("h1", {}, fmt(trace.name), " ", statusBadge(trace.status)),
    trace.status === "truncated" ? truncatedBanner(trace) : null,
    defList(Object.entries(trace).filter(([k]) => !skip.has(k))
      .map(([k, v]) => [k, typeof v === "object" && v !== null ? code(JSON.stringify(v)) : v]), {id: "trace-meta"}),
    h("h2", {}, "Timeline"), timeline,
    h("h2", {}, "Ingest stats"), statsView(trace.stats, "trace-stats"),
    h("details", {class: "fold"}, h("summary", {}, "Trace metadata"), statsView(trace.meta, "trace-info"))));
  try {
    const [Plotly, figure] = await Promise.all([loadPlotly(), api(`/api/traces/${id}/timeline`)]);
    if (!page.alive()) return;
    timeline.replaceChildren();
    timeline.classList.add("plotted");
    await Plotly.newPlot(timeline, figure.data || [], {autosize: true, ...(figure.layout || {})},
      {responsive: true, displaylogo: false});
  } catch (err) {
    if (page.alive()) timeline.replaceChildren(errorBox(err));
  }
}

