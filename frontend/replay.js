// graphdeck dashboard: trace replay (#/traces/<id>/replay?step=&step_interval_ms=&highlight=) and
// the multi-rank timeline of a run (#/runs/<id>/timeline).
//
// Replay: frame i is the i-th GPU kernel of the step (GET /api/traces/<id>/replay) — in a CPU trace
// (rp.source "cpu") the i-th ATen op / C++ kernel of a compiled region; a cursor line
// moves over the step's timeline (GET /api/traces/<id>/window) and the graph of the kernel's node
// is drawn from GET /api/graphs/<gid>/svg, where `<g id="node-<idx>">` gets the class
// `replay-active`. Playback advances one frame per step_interval_ms (requestAnimationFrame,
// so a short interval skips drawing frames rather than falling behind). Every user string
// (kernel, op, node names) goes through textContent (common.js h()).

import {$app, api, errorBox, fmt, h, setCrumbs, table} from "./common.js";
import {SMALL_RUN, rankHeatmap} from "./heatmap.js";
import {loadPlotly} from "./trace.js";
import {importSvg, makeViewer} from "./viewer.js";

const CURSOR = {type: "line", xref: "x", yref: "paper", y0: 0, y1: 1, x0: 0, x1: 0,
  line: {color: "#e4572e", width: 2}};

const tr = (cells) => h("tr", {}, cells.map((c) => h("td", {}, c)));

/** ms between two int64 ns given as decimal strings (exact: BigInt). */
const msBetween = (a, b) => Number(BigInt(String(a)) - BigInt(String(b))) / 1e6;

export async function renderReplay(page, m, query) {
  const id = Number(m[1]);
  const intervalMs = Math.max(1, Number(query.get("step_interval_ms")) || 10);
  const highlight = query.getAll("highlight").filter(Boolean);
  const qs = new URLSearchParams();
  if (query.get("step")) qs.set("step", query.get("step"));
  highlight.forEach((x) => qs.append("highlight", x));
  const [trace, rp] = await Promise.all([api(`/api/traces/${id}`, {exactInts: true}), api(`/api/traces/${id}/replay?${qs}`)]);
  if (!page.alive()) return;
  setCrumbs([["Runs", "#/runs"], [fmt(trace.run_name ?? trace.run_id), `#/runs/${trace.run_id}`],
    [`rank ${fmt(trace.rank)} · ${fmt(trace.name)}`, `#/traces/${id}`], ["replay"]]);
  const frames = rp.frames;
  const offMs = msBetween(rp.origin_ns, trace.start_ns);
  const status = h("div", {id: "replay-status", class: "replay-status", "data-frame": "-1"}, "Loading…");
  const timeline = h("div", {id: "replay-timeline", class: "timeline", "data-testid": "replay-timeline"});
  const graphHost = h("div", {id: "replay-graph", class: "svg-host replay-graph", "data-testid": "replay-graph"},
    h("p", {class: "muted"}, "The graph of the running kernel's node shows here."));
  const playBtn = h("button", {type: "button", id: "replay-play"}, "Play");
  const slider = h("input", {type: "range", id: "replay-slider", min: "0", max: String(Math.max(0, frames.length - 1)), value: "0"});
  const stopAt = h("input", {type: "checkbox", id: "replay-stop-at-highlight"});
  const stepSel = h("select", {id: "replay-step"}, rp.steps.map((s) => h("option", {value: String(s), selected: s === rp.step}, `step ${s}`)));
  const nHigh = frames.filter((f) => f.highlight).length;
  const unit = rp.source === "cpu" ? "CPU ops/kernels of compiled regions" : "kernels";
  const howHigh = (rp.highlights || []).filter((x) => x.frames).map((x) => `${x.pattern} by ${x.how}`).join("; ");
  const warnings = (rp.warnings || []).map((w) => h("p", {class: "warning replay-warning", role: "alert", style: "color:#9a3412"}, w));
  $app.replaceChildren(h("section", {class: "replay-page"},
    h("h1", {}, "Replay · ", fmt(trace.name)),
    h("p", {class: "muted", id: "replay-summary"}, `${frames.length} ${unit} in step ${fmt(rp.step)}; one frame every ${intervalMs} ms`,
      highlight.length ? ` · ${nHigh} match ${highlight.join(", ")}` : "", howHigh ? ` (${howHigh})` : "",
      rp.truncated ? " · cut to the first frames" : ""),
    ...warnings,
    h("div", {class: "replay-controls"}, playBtn, " ", slider, " ", stepSel, " ",
      h("label", {}, stopAt, " stop at highlighted")),
    status, timeline, graphHost));
  stepSel.addEventListener("change", () => {
    const q = new URLSearchParams(query); q.set("step", stepSel.value);
    location.hash = `#/traces/${id}/replay?${q}`;
  });
  if (!frames.length) {
    status.textContent = rp.source === "cpu" ? "This step ran no op inside a compiled region."
      : "This step launched no GPU kernel, and no op of a compiled region was found on the CPU.";
    return;
  }

  let Plotly;
  try {
    const [P, fig] = await Promise.all([loadPlotly(),
      api(`/api/traces/${id}/window?t0_ms=${offMs}&t1_ms=${offMs + rp.end_ms}&max_shapes=2000`)]);
    if (!page.alive()) return;
    Plotly = P;
    const layout = {autosize: true, ...(fig.layout || {})};
    layout.shapes = [...(layout.shapes || []), {...CURSOR, x0: offMs, x1: offMs}];
    await Plotly.newPlot(timeline, fig.data || [], layout, {responsive: true, displaylogo: false});
  } catch (err) {
    timeline.replaceChildren(errorBox(err));
  }
  const cursorIndex = () => (timeline.layout?.shapes?.length ?? 1) - 1;

  const svgs = new Map(); // graph id -> Promise<svg element>
  let shownGraph = null, viewer = null, activeEl = null, current = -1, lastCenter = 0;
  async function showGraph(gid) {
    if (gid === shownGraph) return;
    shownGraph = gid;
    if (!svgs.has(gid)) svgs.set(gid, api(`/api/graphs/${gid}/svg?max_depth=99`, {text: true}).then(importSvg));
    try {
      const svg = await svgs.get(gid);
      if (!page.alive() || shownGraph !== gid) return;
      graphHost.replaceChildren(h("p", {class: "small"}, h("a", {href: `#/graphs/${gid}`}, `graph ${gid}`)), svg);
      graphHost.dataset.graph = String(gid);
      viewer = makeViewer(svg, graphHost, []);
      viewer.zoom?.(8); // whole-graph scale is unreadable: start near node size, then follow the node
      activeEl = null;
      lastCenter = 0;
      markNode(frames[current]);
    } catch (err) {
      graphHost.replaceChildren(errorBox(err));
    }
  }
  function markNode(f) {
    if (activeEl) activeEl.classList.remove("replay-active");
    activeEl = null;
    const svg = graphHost.querySelector("svg");
    if (!f || f.node_idx == null || !svg || String(f.graph_id) !== graphHost.dataset.graph) return;
    activeEl = svg.querySelector(`#node-${f.node_idx}`);
    if (activeEl) {
      activeEl.classList.add("replay-active");
      graphHost.dataset.activeNode = String(f.node_idx);
      const now = performance.now();
      if (!playing || now - lastCenter > 250) { viewer?.centerOn?.(activeEl); lastCenter = now; }
    }
  }
  function show(i) {
    i = Math.max(0, Math.min(frames.length - 1, i));
    if (i === current) return;
    const prev = frames[current];
    current = i;
    const f = frames[i];
    slider.value = String(i);
    status.dataset.frame = String(i);
    status.dataset.nodeIdx = f.node_idx == null ? "" : String(f.node_idx);
    status.dataset.graph = f.graph_id == null ? "" : String(f.graph_id);
    status.classList.toggle("highlight", !!f.highlight);
    status.replaceChildren(...[
      h("strong", {}, `frame ${i + 1}/${frames.length}`), ` · ${f.t_ms.toFixed(3)} ms · `,
      h("code", {}, f.kernel), f.op ? " ← " : null, f.op ? h("code", {}, f.op) : null,
      " · node ", f.node ? h("code", {id: "replay-node"}, f.node) : h("span", {class: "muted"}, "not mapped"),
      f.node && f.how ? h("span", {class: "muted small"}, ` (${f.how})`) : null,
      f.highlight ? h("span", {class: "badge"}, "highlighted") : null].filter((x) => x != null));
    if (Plotly && timeline.layout) {
      const k = cursorIndex(), x = offMs + f.t_ms;
      Plotly.relayout(timeline, {[`shapes[${k}].x0`]: x, [`shapes[${k}].x1`]: x});
    }
    if (f.graph_id != null && f.graph_id !== shownGraph) showGraph(f.graph_id);
    else if (!prev || prev.node_idx !== f.node_idx || prev.graph_id !== f.graph_id) markNode(f);
  }

  let playing = false, startT = 0, startFrame = 0;
  function tick(now) {
    if (!playing || !page.alive()) return;
    let target = startFrame + Math.floor((now - startT) / intervalMs);
    if (stopAt.checked) {
      const hit = frames.findIndex((f, j) => j > current && j <= target && f.highlight);
      if (hit >= 0) { target = hit; setPlaying(false); }
    }
    if (target >= frames.length - 1) { show(frames.length - 1); setPlaying(false); return; }
    show(target);
    requestAnimationFrame(tick);
  }
  function setPlaying(on) {
    playing = on;
    playBtn.textContent = on ? "Pause" : "Play";
    // While playing, centring is throttled (every 250 ms): on pause, bring the lit node into view.
    if (!on && activeEl) viewer?.centerOn?.(activeEl);
    if (on) {
      if (current >= frames.length - 1) show(0);
      startT = performance.now(); startFrame = current;
      requestAnimationFrame(tick);
    }
  }
  playBtn.addEventListener("click", () => setPlaying(!playing));
  slider.addEventListener("input", () => { setPlaying(false); show(Number(slider.value)); });
  show(0);
  // Playback is paced by the wall clock: start it once the first graph is drawn, or the seconds
  // its SVG takes to load would be skipped as frames.
  const firstGraph = frames.find((f) => f.graph_id != null)?.graph_id;
  if (firstGraph != null && svgs.has(firstGraph)) await svgs.get(firstGraph).catch(() => null);
  // Opens paused on the first frame (a page that starts moving by itself loses the reader);
  // ?autoplay=1 starts playing once the first graph is drawn.
  if (page.alive() && query.get("autoplay") === "1") setPlaying(true);
}

/** #/runs/<id>/timeline: every rank on one aligned axis; zooming fetches the window. */
export async function renderRunTimeline(page, m) {
  const run = decodeURIComponent(m[1]);
  const base = `/api/runs/${encodeURIComponent(run)}`;
  setCrumbs([["Runs", "#/runs"], [run, `#/runs/${encodeURIComponent(run)}`], ["timeline"]]);
  const plot = h("div", {id: "run-timeline", class: "timeline", "data-testid": "run-timeline"}, h("p", {class: "loading"}, "Loading…"));
  const offsets = h("div", {id: "rank-offsets"});
  const colls = h("div", {id: "collectives"});
  $app.replaceChildren(h("section", {}, h("h1", {}, `${run}: ranks on one time axis`), offsets, plot,
    h("h2", {}, "Collectives and stragglers"), colls));
  // Download for Perfetto: GET /api/runs/{id}/export-trace?ranks= (server/routes/export.py).
  const exportRanks = h("input", {id: "export-ranks", placeholder: "all, or 0,2-5", size: 14, "aria-label": "ranks to export"});
  const exportLink = h("a", {id: "export-trace", class: "button", href: `${base}/export-trace`, download: "",
    title: "One Chrome-trace file of the chosen ranks, clocks aligned, collectives linked: open it in ui.perfetto.dev"},
  "Download for Perfetto");
  exportRanks.addEventListener("input", () => {
    const v = exportRanks.value.trim();
    exportLink.href = `${base}/export-trace${v ? `?ranks=${encodeURIComponent(v)}` : ""}`;
  });
  offsets.before(h("p", {id: "export-trace-bar"}, exportLink, " ranks: ", exportRanks));
  // A large run (issue 26 item 2): stragglers, waits and step times as rank heatmaps drawn at once,
  // not tables with a column per rank (the full /collectives answer is not fetched).
  const index = await api(`${base}/rank-index`);
  if (!page.alive()) return;
  // Large: more traced ranks than SMALL_RUN (the tables below have a column per traced rank).
  const large = index.traces.filter((n) => n > 0).length > SMALL_RUN;
  // Lanes (a large run): the server draws the 8 worst ranks (the straggler first) unless asked for
  // others (?ranks=); the user types ranks or clicks a row of the lateness heatmap above the plot.
  let lanes = null; // null: the server's choice
  const lanesQ = () => (lanes ? `ranks=${encodeURIComponent(lanes)}` : "");
  const timelineUrl = (win) => {
    const q = [win, lanesQ()].filter(Boolean).join("&");
    return `${base}/timeline${q ? `?${q}` : ""}`;
  };
  const lanesInput = h("input", {id: "timeline-lanes", "data-testid": "timeline-lanes-input", size: 24,
    placeholder: "0,2-5 or all", "aria-label": "ranks drawn as lanes"});
  const lanesNote = h("span", {class: "small muted", "data-testid": "timeline-lanes-note"});
  let redraw = null;
  if (large) {
    const maps = [["lateness", "collectives", "Lateness at each matched collective (arrival after the first rank)"],
      ["wait", "collectives", "Time each rank waited for its peers inside each collective"],
      ["step_time", "steps", "Step time per rank"]];
    colls.replaceChildren(...maps.flatMap(([metric, axis, what]) => [h("h3", {}, what),
      rankHeatmap(page, index.id, {metric, axis})[0]]));
    const addLane = (rank) => {
      const now = (lanesInput.value || "").split(",").map((x) => x.trim()).filter(Boolean);
      if (!now.includes(String(rank))) now.push(String(rank));
      lanesInput.value = now.join(",");
      if (redraw) redraw(lanesInput.value);
    };
    const show = h("button", {type: "button", "data-testid": "timeline-lanes-show"}, "Show lanes");
    show.addEventListener("click", () => redraw && redraw(lanesInput.value.trim()));
    lanesInput.addEventListener("keydown", (ev) => { if (ev.key === "Enter" && redraw) redraw(lanesInput.value.trim()); });
    plot.before(h("h3", {}, "Lateness per step (summed over the step's collectives): the straggler is the dark row"),
      rankHeatmap(page, index.id, {metric: "lateness", axis: "steps", onPick: addLane})[0],
      h("p", {id: "timeline-lanes-bar", "data-testid": "timeline-lanes"}, "Lanes: ", lanesInput, " ", show, " ", lanesNote));
  }
  const [Plotly, fig] = await Promise.all([loadPlotly(), api(timelineUrl(""))]);
  if (!page.alive()) return;
  const meta = fig.layout?.meta || {};
  const noteLanes = (m) => {
    const l = m.lanes;
    if (!l) return;
    lanesInput.value = l.shown.join(",");
    plot.dataset.lanes = l.shown.join(",");
    lanesNote.textContent = `${l.shown.length} of ${l.traced} traced ranks` + (l.chosen === "worst"
      ? ": the worst (the latest to arrive at collectives, the straggler first; then the reference rank). "
        + "Type others, or click a row of the heatmap above to add its lane." : ".");
  };
  noteLanes(meta);
  // A large run's offsets: the largest 20 (by size), the rest counted.
  const allOffsets = Object.entries(meta.offsets || {});
  const shownOffsets = large ? [...allOffsets].sort(([, a], [, b]) => Math.abs(b.offset_ns) - Math.abs(a.offset_ns)).slice(0, 20)
    : allOffsets;
  offsets.replaceChildren(table("offsets-table", ["rank", "trace", "clock offset (µs)", "method", "matched collectives"],
    shownOffsets.map(([r, o]) => tr([r, h("a", {href: `#/traces/${meta.traces[r]}`}, `#${meta.traces[r]}`),
      (o.offset_ns / 1e3).toFixed(3), o.method, fmt(o.matched)])), "",
    {caption: large && allOffsets.length > shownOffsets.length
      ? `The ${shownOffsets.length} largest of ${allOffsets.length} clock offsets against the reference rank's`
      : "How each rank's clock was aligned to rank 0's", empty: "no rank has a stored trace"}));
  plot.replaceChildren();
  await Plotly.newPlot(plot, fig.data, {autosize: true, ...fig.layout}, {responsive: true, displaylogo: false});
  let pending = 0;
  const fetchDraw = async (win) => {
    const mine = ++pending;
    let next;
    try {
      next = await api(timelineUrl(win));
    } catch (err) { // a bad ranks spec: the server's 400 names it
      if (mine === pending && page.alive()) lanesNote.replaceChildren(h("span", {class: "error", role: "alert",
        "data-testid": "timeline-lanes-error"}, err.message));
      return;
    }
    if (mine !== pending || !page.alive()) return;
    await Plotly.react(plot, next.data, {autosize: true, ...next.layout}, {responsive: true, displaylogo: false});
    plot.dataset.window = JSON.stringify(next.layout.meta.window_ms);
    noteLanes(next.layout.meta);
  };
  redraw = (spec) => { lanes = spec || null; return fetchDraw(""); };
  plot.on("plotly_relayout", async (ev) => {
    const t0 = ev["xaxis.range[0]"], t1 = ev["xaxis.range[1]"];
    const auto = ev["xaxis.autorange"];
    if (t0 === undefined && !auto) return;
    await fetchDraw(auto ? "" : `t0_ms=${t0}&t1_ms=${t1}`);
  });
  if (large) return;
  try {
    const c = await api(`${base}/collectives`);
    if (!page.alive()) return;
    const ranks = Object.keys(c.offsets);
    const shown = c.collectives.slice(0, 200);
    colls.replaceChildren(
      h("p", {}, `${c.collectives.length} collectives matched across ranks (process group + sequence)`,
        c.collectives.length > shown.length ? `; the first ${shown.length} are listed` : "", "."),
      table("collectives-table", ["group", "kind", "seq", "step", "arrived last", "spread ms",
        ...ranks.map((r) => `rank ${r} wait / transfer ms`)],
      shown.map((x) => tr([fmt(x.group), fmt(x.kind), fmt(x.seq), fmt(x.step), `rank ${x.last_rank}`,
        (x.spread_ns / 1e6).toFixed(3),
        ...ranks.map((r) => (x.ranks[r] ? `${(x.ranks[r].wait_ns / 1e6).toFixed(3)} / ${(x.ranks[r].transfer_ns / 1e6).toFixed(3)}` : "—"))])), "",
      {caption: "Each collective matched across ranks: who arrived last, and each rank's wait vs. transfer time",
       empty: "no collective matched across ranks: it needs the traces of two or more ranks holding communication "
         + "kernels (NCCL) or CPU-side collective ops (gloo:*) of the same process group"}),
      table("step-times-table", ["rank", ...Object.values(c.step_times)[0]?.map((st) => `step ${fmt(st.step)} CPU / GPU ms`) ?? []],
        Object.entries(c.step_times).map(([r, sts]) => tr([`rank ${r}`, ...sts.map((st) =>
          `${((st.cpu_dur_ns ?? 0) / 1e6).toFixed(3)} / ${((st.gpu_span_ns ?? 0) / 1e6).toFixed(3)}`)])), "",
        {caption: "Each rank's profiled steps: CPU time / GPU span",
         empty: "no rank's trace has ProfilerStep#N events"}),
      table("stragglers-table", ["step", "collectives", "lateness per rank (ms)", "arrived last (count)", "straggler"],
        c.stragglers.map((s) => tr([fmt(s.step), fmt(s.collectives),
          Object.entries(s.lateness_ns).map(([r, ns]) => `r${r}: ${(ns / 1e6).toFixed(3)}`).join(", "),
          Object.entries(s.last_count).map(([r, n]) => `r${r}: ${n}`).join(", "), fmt(s.straggler)])), "",
        {caption: "Per step: how late each rank arrived at its collectives, and the rank that held the others up",
         empty: "no step with collectives matched across ranks, so no rank can be called late"}));
  } catch (err) {
    colls.replaceChildren(errorBox(err));
  }
}
