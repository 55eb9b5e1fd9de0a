// graphdeck dashboard: the trace page (#/traces/<id>): a Plotly timeline of one rank's Kineto
// trace, its metadata and the ingest stats. Plotly (about 4 MB) loads only when this page opens.

import {$app, api, code, defList, errorBox, fmt, h, plural, setCrumbs, statusBadge, table} from "./common.js";

const PLOTLY_SRC = "/static/vendor/plotly.min.js";

let plotlyLoading = null;
export function loadPlotly() {
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

const META_LABEL = {start_ns: "start", end_ns: "end", duration_ms: "duration", num_events: "events stored"};

/** A trace field as a reader wants it: times as UTC dates, durations in ms, counts grouped. */
function metaValue(k, v) {
  if (v === null || v === undefined) return "—";
  if ((k === "start_ns" || k === "end_ns") && /^-?\d+$/.test(String(v))) {
    const ns = BigInt(String(v));
    const date = new Date(Number(ns / 1000000n));
    // a trace without a Unix time base counts from its own origin: show the raw ns then
    return ns > 10n ** 17n ? h("span", {title: `${v} ns`}, date.toISOString().replace("T", " ").replace("Z", " UTC"))
      : `${Number(ns).toLocaleString("en-US")} ns`;
  }
  if (k === "duration_ms" && typeof v === "number") return `${v.toFixed(3)} ms`;
  if (typeof v === "number") return v.toLocaleString("en-US");
  return typeof v === "object" ? code(JSON.stringify(v)) : v;
}

/** The ingest's counters: the non-zero ones (what was kept and what went wrong), all on demand. */
function ingestStats(stats) {
  const st = stats || {};
  const shown = Object.entries(st).filter(([, v]) => typeof v === "object" ? v && Object.keys(v).length
    : !(v === 0 || v === null || v === "" || v === false));
  return h("div", {}, shown.length ? defList(shown.map(([k, v]) => [k, statValue(v)]), {id: "trace-stats", class: "kv panel"}, true)
    : h("p", {class: "muted", id: "trace-stats"}, "none"),
  h("details", {class: "fold"}, h("summary", {}, `all ${Object.keys(st).length} counters (zeros included)`),
    statsView(st, "trace-stats-all")));
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
  const analysis = h("div", {id: "trace-analysis", "data-testid": "trace-analysis"}, h("p", {class: "loading"}, "Analysing…"));
  const bandwidth = h("div", {id: "trace-bandwidth", "data-testid": "trace-bandwidth"});
  const backward = h("div", {id: "trace-backward", "data-testid": "trace-backward"}, h("p", {class: "loading"}, "Analysing…"));
  const skip = new Set(["stats", "meta", "id", "name", "run_id", "run_name"]);
  $app.replaceChildren(h("section", {class: "trace-page"},
    h("h1", {}, fmt(trace.name), " ", statusBadge(trace.status)),
    trace.status === "truncated" ? truncatedBanner(trace) : null,
    defList(Object.entries(trace).filter(([k]) => !skip.has(k))
      .map(([k, v]) => [META_LABEL[k] || k, metaValue(k, v)]), {id: "trace-meta"}),
    h("p", {class: "trace-links"}, h("a", {href: `#/traces/${id}/replay`, id: "replay-link"}, "Replay a step"), " · ",
      h("a", {href: `#/runs/${encodeURIComponent(trace.run_name ?? trace.run_id)}/timeline`, id: "run-timeline-link"},
        "All ranks on one time axis")),
    h("h2", {}, "Timeline"), timeline,
    h("h2", {}, "Analysis"), analysis, bandwidth,
    h("h2", {}, "Backward time by forward module"), backward,
    h("h2", {}, "Ingest stats"), ingestStats(trace.stats),
    h("details", {class: "fold"}, h("summary", {}, "Trace metadata"), statsView(trace.meta, "trace-info"))));
  api(`/api/traces/${id}/backward`).then((b) => { if (page.alive()) backward.replaceChildren(...backwardView(b)); },
    (err) => { if (page.alive()) backward.replaceChildren(errorBox(err)); });
  api(`/api/traces/${id}/analysis`).then((a) => { if (page.alive()) analysis.replaceChildren(...analysisView(a)); },
    (err) => { if (page.alive()) analysis.replaceChildren(errorBox(err)); });
  api(`/api/traces/${id}/bandwidth`).then((b) => { if (page.alive()) bandwidth.replaceChildren(...bandwidthView(b)); },
    (err) => { if (page.alive()) bandwidth.replaceChildren(errorBox(err)); });
  try {
    const [Plotly, figure] = await Promise.all([loadPlotly(), api(`/api/traces/${id}/window`)]);
    if (!page.alive()) return;
    timeline.replaceChildren();
    timeline.classList.add("plotted");
    await Plotly.newPlot(timeline, figure.data || [], {autosize: true, ...(figure.layout || {})},
      {responsive: true, displaylogo: false});
    // Level of detail: a zoom asks the server for that window (at most 2000 bars, longest first).
    let pending = 0;
    timeline.on("plotly_relayout", async (ev) => {
      const t0 = ev["xaxis.range[0]"], t1 = ev["xaxis.range[1]"], auto = ev["xaxis.autorange"];
      if (t0 === undefined && !auto) return;
      const mine = ++pending;
      const next = await api(auto ? `/api/traces/${id}/window` : `/api/traces/${id}/window?t0_ms=${t0}&t1_ms=${t1}`);
      if (mine !== pending || !page.alive()) return;
      await Plotly.react(timeline, next.data || [], {autosize: true, ...(next.layout || {})}, {responsive: true, displaylogo: false});
      timeline.dataset.window = JSON.stringify(next.layout.meta.window_ms);
    });
  } catch (err) {
    if (page.alive()) timeline.replaceChildren(errorBox(err));
  }
}

const gbps = (x) => (x == null ? "—" : Number(x).toFixed(2));
const mib = (b) => (b == null ? "—" : (Number(b) / 1048576).toFixed(2));
const BW_ROWS = 300; // collectives listed one per row; the per-step table covers every one

/** GET /api/traces/<id>/bandwidth: algbw / busbw per collective (NOTE: [Bus bandwidth]). */
function bandwidthView(b) {
  const f = b.formulas;
  const peak = b.link_gbps ? `share of a ${gbps(b.link_gbps)} GB/s link` : "no link peak set (graphdeck serve --link-gbps, or ?link_gbps=)";
  const shown = b.collectives.slice(0, BW_ROWS);
  return [
    h("h3", {}, "Collective bandwidth"),
    h("p", {class: "small muted", "data-testid": "bandwidth-summary"},
      `algbw = bytes / kernel time; busbw = algbw × ${f.all_reduce} for all_reduce, × ${f.all_gather} for all_gather, `
      + `reduce_scatter and all_to_all, × 1 for broadcast, reduce, send and recv (n = ranks in the group; nccl-tests' PERFORMANCE.md). `
      + `GB/s = 1e9 bytes/s. Device: ${b.device || "unknown"}; ${peak}.`),
    table("bandwidth-steps", ["group", "step", "collectives", "MiB", "ms", "slowest", "slowest ms", "slowest busbw GB/s", "busbw GB/s min–max"],
      b.by_group_step.map((g) => row([fmt(g.group), fmt(g.step), fmt(g.count), mib(g.bytes), ms(g.dur_ns),
        `#${g.slowest} ${g.slowest_type}`, ms(g.slowest_dur_ns), gbps(g.slowest_busbw_gbps),
        g.min_busbw_gbps == null ? "—" : `${gbps(g.min_busbw_gbps)}–${gbps(g.max_busbw_gbps)}`])), "",
      {caption: "Per process group and ProfilerStep: the slowest collective is its longest kernel", empty: b.reason || "no collective"}),
    table("bandwidth-table", ["#", "step", "group", "collective", "ranks", "dtype", "MiB", "ms", "algbw GB/s", "busbw GB/s", "of link peak", "note"],
      shown.map((c) => {
        const tr = row([fmt(c.index), fmt(c.step), fmt(c.group), fmt(c.type), fmt(c.group_size), fmt(c.dtype), mib(c.bytes),
          ms(c.dur_ns), gbps(c.algbw_gbps), gbps(c.busbw_gbps), pct(c.link_share),
          [c.slowest ? "slowest of its step · " : "", c.reason || ""].join("")]);
        tr.dataset.index = c.index;
        if (c.slowest) tr.dataset.slowest = "true";
        return tr;
      }), "",
      {caption: b.collectives.length > BW_ROWS ? `The first ${BW_ROWS} of ${b.collectives.length} collectives` : "Each collective (communication kernel)",
       empty: b.reason || "no collective"}),
  ];
}

const ms = (ns) => (ns == null ? "—" : (Number(ns) / 1e6).toFixed(3));
const pct = (x) => (x == null ? "—" : `${(100 * x).toFixed(1)}%`);
const row = (cells) => h("tr", {}, cells.map((c) => h("td", {}, c)));

/** Backward time by forward module (GET /api/traces/<id>/backward): the autograd engine's
 * backward ranges put on the forward module (or op) each came from; figures in ms. */
function backwardView(b) {
  const share = b.backward_ns ? b.attributed_ns / b.backward_ns : null;
  const top = (o) => Object.entries(o || {}).sort((x, y) => y[1] - x[1]).slice(0, 3).map(([k]) => k).join(", ");
  return [
    h("p", {id: "backward-summary"}, `${ms(b.backward_ns)} ms in ${fmt(b.backward_ranges)} backward ranges; `
      + `${pct(share)} put on a forward ${b.by} through ${fmt(b.flows)} forward→backward flows`
      + (b.gpu_ns ? `; GPU kernels launched from them ${ms(b.gpu_ns)} ms, ${pct(b.attributed_gpu_ns / b.gpu_ns)} on a forward ${b.by}` : "")
      + (Object.keys(b.unattributed || {}).length ? `; not linked: ${top(b.unattributed)}` : "")),
    b.note ? h("p", {class: "muted", id: "backward-note"}, b.note) : "",
    table("backward-table", [b.by === "module" ? "forward module" : "forward op", "backward CPU ms", "GPU ms", "ranges", "backward ops", "forward ops"],
      b.rows.slice(0, 50).map((r) => row([code(r.module), ms(r.backward_ns), b.gpu_ns ? ms(r.gpu_ns) : "—", fmt(r.backward_ops),
        top(r.ops), top(r.forward_ops)])), "",
      {caption: "Own time of each backward range (nested backward ranges go to theirs), by the forward module whose op created its autograd node",
       empty: "no backward range linked to a forward op in this trace"}),
  ];
}

/** Idle time by cause (the analysis' "idle"; NOTE: [Idle time by cause] in graphdeck/analysis/traces/idle.py):
 * GPU stream idle per step and stream as host wait / kernel wait / other (HTA's rule), and each
 * step's host time by cause on the step's thread. Every figure is the API's; nothing is computed here. */
function idleView(idle) {
  if (!idle) return [];
  const g = idle.gpu, c = idle.cpu;
  const gpuRow = (label, r) => row([label, fmt(r.gaps), ms(r.idle_ns), ms(r.host_wait_ns), ms(r.host_wait_sync_ns),
    ms(r.kernel_wait_ns), ms(r.other_ns), ms(r.other_cross_stream_ns)]);
  const gpuCols = ["gaps", "idle ms", "host wait ms", "of which in a CUDA sync", "kernel wait ms", "other ms",
    "of which another stream ran"];
  const out = [h("h3", {}, "Idle time by cause")];
  if (g.total) {
    out.push(table("idle-gpu-table", ["step", ...gpuCols],
      [...g.steps.map((r) => gpuRow(fmt(r.step), r)), ...(g.outside_steps.gaps ? [gpuRow("outside steps", g.outside_steps)] : []),
        gpuRow("all", g.total)], "",
      {caption: `GPU stream idle by cause (HTA's rule): host wait = the launch came after the stream went idle; `
        + `kernel wait = a queued kernel started under ${ms(g.kernel_wait_threshold_ns)} ms later; other = it waited longer on something else. `
        + "Summed over streams, per step of the launch"}));
    out.push(table("idle-stream-table", ["stream", ...gpuCols],
      g.streams.map((r) => gpuRow(`${fmt(r.device)}/${fmt(r.stream)}`, r)), "", {caption: "The same per GPU stream"}));
  } else {
    out.push(h("p", {class: "muted", id: "idle-gpu-none"}, fmt(g.reason)));
  }
  out.push(table("idle-cpu-table", ["step", "wall ms", "compiled", "outside compiled", "data loader", "collectives", "optimizer",
    "eager ops", "Python / other", "of which a collective ran elsewhere", "collectives on other threads"],
    (c.total ? [...c.steps, {step: "all", ...c.total}] : []).map((r) => row([fmt(r.step), ms(r.wall_ns), ms(r.compiled_ns),
      ms(r.outside_compiled_ns), ms(r.data_loader_ns), ms(r.collectives_ns), ms(r.optimizer_ns), ms(r.eager_ops_ns),
      ms(r.python_other_ns), ms(r.python_other_in_collective_ns), ms(r.background_collectives_ns)])), "",
    {caption: "Each ProfilerStep's host time (ms) on its thread by the innermost range's cause (the ops' own time); "
      + "the causes add up to the wall time", empty: c.reason || "no step"}));
  return out;
}

/** The trace's analyses (GET /api/traces/<id>/analysis) as tables; figures in ms. */
function analysisView(a) {
  const ov = a.overlap.trace;
  return [
    h("h3", {}, "Steps"),
    table("steps-table", ["step", "CPU ms", "GPU span ms", "kernels", "kernel ms"],
      a.steps.map((s) => row([fmt(s.step), ms(s.cpu_dur_ns), ms(s.gpu_span_ns), fmt(s.kernels), ms(s.kernel_ns)])), "",
      {caption: "Each ProfilerStep: its CPU time, the span and sum of the GPU kernels it launched",
       empty: "the trace has no ProfilerStep#N events (profile with a schedule and call prof.step())"}),
    h("h3", {}, "GPU busy / idle"),
    table("gpu-table", ["device", "window ms", "busy ms", "idle ms", "busy", "kernel ms (sum)", "streams"],
      a.gpu.map((g) => row([fmt(g.device), ms(g.window_ns), ms(g.busy_ns), ms(g.idle_ns), pct(g.busy_fraction),
        ms(g.kernel_ns), fmt(g.streams)])), "",
      {caption: "Per GPU: the time some kernel ran vs. the profiled window",
       empty: "no GPU kernel in this trace (a CPU-only profile): busy/idle is measured on GPU streams"}),
    h("h3", {}, "Communication / computation overlap"),
    h("p", {id: "overlap-summary"}, ov.ratio == null ? fmt(ov.reason) : `overlap ${pct(ov.ratio)} of ${ms(ov.comm_busy_ns)} ms communication`,
      ov.unclassified?.length ? ` · largest kernels not counted as communication: ${ov.unclassified.slice(0, 3).map((u) => u.kernel.slice(0, 60)).join("; ")}` : ""),
    // CPU-side collectives (gloo…): the same overlap, with the compiled regions' ops as compute
    a.overlap.cpu ? h("p", {id: "overlap-cpu", "data-testid": "overlap-cpu"},
      a.overlap.cpu.trace.ratio == null ? "CPU collectives: none in a step"
        : `CPU collectives (${fmt(a.overlap.cpu.trace.comm_ops)} ops, e.g. gloo:all_reduce on their own threads): `
          + `overlap ${pct(a.overlap.cpu.trace.ratio)} of ${ms(a.overlap.cpu.trace.comm_busy_ns)} ms communication with `
          + `${ms(a.overlap.cpu.trace.compute_busy_ns)} ms of compute`) : "",
    a.overlap.cpu?.steps?.length ? table("overlap-cpu-table", ["step", "CPU collectives", "comm ms", "overlap ms", "overlap"],
      a.overlap.cpu.steps.map((st) => row([fmt(st.step), fmt(st.comm_ops), ms(st.comm_busy_ns), ms(st.overlap_ns),
        st.ratio == null ? "—" : pct(st.ratio)])), "", {caption: "Per ProfilerStep: CPU-side collectives against compute"}) : "",
    ...idleView(a.idle),
    h("h3", {}, "Largest gaps on a stream"),
    table("gaps-table", ["gap ms", "stream", "after", "before"],
      a.hotspots.gaps.map((g) => row([ms(g.gap_ns), fmt(g.stream), fmt(g.after), fmt(g.before)])), "",
      {caption: a.hotspots.device === "cpu" ? "The longest gaps between consecutive ops of one compiled region (CPU thread)"
        : "The longest idle gaps between consecutive kernels of one GPU stream",
       empty: "no GPU stream with two or more kernels in this trace (gaps are measured between kernels)"}),
    h("h3", {}, "Longest launch delays"),
    table("delays-table", ["delay ms", "kernel / node"], a.hotspots.launch_delays.map((d) => row([ms(d.delay_ns), fmt(d.node)])), "",
      {caption: "Kernels that started longest after their CPU-side launch",
       empty: a.hotspots.launch_delays_reason || "no kernel launch linked to its kernel in this trace (needs GPU kernels and their cudaLaunchKernel events)"}),
    h("p", {id: "mapping-summary", class: "muted"},
      a.mapping.device === "cpu"
        ? `CPU time of compiled regions mapped to graph nodes: ${pct(a.mapping.mapped_fraction)} (${ms(a.mapping.mapped_ns)} of ${ms(a.mapping.kernel_ns)} ms; `
          + Object.entries(a.mapping.directions || {}).map(([d, x]) => `${d} ${pct(x.region_ns ? x.mapped_ns / x.region_ns : null)}`).join(", ")
          + `; ops' own time ${pct(a.mapping.kernel_ns ? Object.values(a.mapping.directions || {}).reduce((s, x) => s + (x.mapped_units_ns || 0) - (x.wrapper_ops_ns || 0), 0) / a.mapping.kernel_ns : null)}, `
          + "the rest dispatch / wrapper code given to the node whose op follows and the runtime wrapper's epilogue to the output node)."
        : `Kernel time mapped to graph nodes: ${pct(a.mapping.mapped_fraction)} (${ms(a.mapping.mapped_ns)} of ${ms(a.mapping.kernel_ns)} ms`
          + (a.mapping.optimizer || []).map((o) => `; optimizer step ${o.step}: ${ms(o.kernel_ns)} ms`).join("") + ")."),
    // Below 90% mapped: the warning ingest-trace prints, with the largest unmapped kernels.
    ...(a.mapping.warning ? [h("div", {class: "warn-banner", role: "note", id: "mapping-warning", "data-testid": "mapping-warning"},
      h("strong", {}, "Low kernel → node coverage: "), a.mapping.warning)] : []),
  ];
}

