// graphdeck dashboard: a graph's memory page (#/graphs/<id>/memory[?scope=step|graph]), from
// GET /api/graphs/<id>/memory (graph-derived liveness) and, when a trace of the same run and rank
// has [memory] events, GET /api/traces/<tid>/memory (measured).
//
// A Plotly curve of live bytes over the node order with the peak marked; a click on the curve
// opens that node in the graph view. Beside it: the top holders at the peak (by module path and
// kind), saved activations per module, a what-if form (checkpoint a module / another dtype), and
// the measured curve with the gap between the two peaks: from a CUDA memory snapshot record (GET
// /api/graphs/<id>/memory/measured; its absence said as INCOMPLETE) and from a trace's [memory]
// events. Store text only through h(); Plotly gets only fixed trace names.

import {api, badge, code, errorBox, fmtBytes, h, num, setCrumbs, table} from "./common.js";
import {loadPlotly} from "./trace.js";

const linkOf = (gid, node) => `#/graphs/${gid}?node=${encodeURIComponent(node)}`;

function nodeTarget(curve, index) {
  // Step curves name nodes "f:<name>" (forward graph) / "b:<name>" (backward graph).
  const name = curve.nodes[index];
  if (curve.graph_ids.length === 2 && /^[fb]:/.test(name)) {
    return {gid: curve.graph_ids[name[0] === "f" ? 0 : 1], node: name.slice(2)};
  }
  return {gid: curve.graph_ids[0], node: name};
}

function holdersTable(curve) {
  return table("memory-holders", ["Module path", "Bytes at peak", "Tensors", "By kind"],
    curve.holders.map((x) => h("tr", {},
      h("td", {}, code(x.module_path)), h("td", {class: "num"}, fmtBytes(x.size_bytes)), num(x.tensors),
      h("td", {class: "small"}, Object.entries(x.by_kind).map(([k, v]) => `${k} ${fmtBytes(v)}`).join(", ")))));
}

// Activation checkpointing's recomputations live at the peak, by checkpointed region, and the
// graph-break advice when one module is recomputed for several traversals (analysis/memory/recompute.py).
function recomputeBox(curve) {
  const rec = curve.recomputation;
  if (!rec || !rec.bytes) return h("span", {});
  return h("section", {"data-testid": "memory-recomputed"},
    h("h2", {}, "Recomputed at the peak"),
    h("p", {}, `${fmtBytes(rec.bytes)} live at the peak are activation checkpointing's recomputations:`),
    table("memory-recomputed-regions", ["Checkpointed module", "Region", "Traversals", "Bytes at peak", "Tensors"],
      rec.regions.map((r) => h("tr", {}, h("td", {}, code(r.module || "(no module)")), h("td", {}, r.ac_graph_id || ""),
        num(r.traversals), h("td", {class: "num"}, fmtBytes(r.bytes)), h("td", {class: "small"}, r.tensors.join(", "))))),
    rec.advice ? h("p", {"data-testid": "memory-recompute-advice"}, h("strong", {}, "Advice: "), rec.advice) : h("span", {}));
}

function savedTable(curve) {
  const rows = Object.entries(curve.saved_bytes_by_module || {});
  if (!rows.length) return h("p", {class: "muted"}, "No saved activations (not an AOTAutograd forward/step).");
  const byModule = h("div", {}, table("memory-saved", ["Module path", "Saved bytes"],
    rows.map(([m, b]) => h("tr", {}, h("td", {}, code(m)), h("td", {class: "num"}, fmtBytes(b))))));
  // Each saved activation and the backward node that frees it (step scope only: a forward graph
  // alone does not know its backward).
  const saved = (curve.saved || []).filter((s) => s.freed_by).sort((a, b) => b.size_bytes - a.size_bytes);
  if (!saved.length) return byModule;
  const link = (name) => {
    const t = nodeTarget(curve, curve.nodes.indexOf(name));
    return h("a", {href: linkOf(t.gid, t.node)}, name);
  };
  return h("div", {}, byModule, h("h3", {}, "Which backward node frees each"),
    table("memory-saved-freed", ["Saved tensor", "Module path", "Bytes", "Freed by"],
      saved.slice(0, 50).map((s) => h("tr", {}, h("td", {}, code(s.name)), h("td", {}, code(s.module_path || "")),
        h("td", {class: "num"}, fmtBytes(s.size_bytes)), h("td", {}, link(s.freed_by))))));
}

function whatIf(graphId) {
  const out = h("div", {id: "whatif-result", "data-testid": "whatif-result"});
  const input = h("input", {type: "text", placeholder: "module path, e.g. transformer/h/0", "aria-label": "module"});
  const dtype = h("select", {"aria-label": "dtype"}, ["", "bfloat16", "float16", "float8_e4m3fn"].map(
    (d) => h("option", {value: d}, d || "(dtype)")));
  const run = async () => {
    const q = input.value ? `checkpoint=${encodeURIComponent(input.value)}` : `dtype=${encodeURIComponent(dtype.value)}`;
    try {
      const e = await api(`/api/graphs/${graphId}/memory/whatif?${q}`);
      const parts = [h("p", {}, badge(e.what, "tag"), ` peak ${fmtBytes(e.baseline_peak_bytes)} → `,
        h("strong", {}, fmtBytes(e.estimated_peak_bytes)), ` (saves ${fmtBytes(e.saving_bytes)})`,
        e.note ? h("span", {class: "muted"}, ` — ${e.note}`) : null)];
      if (e.peak_phase) {
        parts.push(h("p", {class: "muted", "data-testid": "whatif-peak"},
          `estimated peak at ${e.estimated_peak_node} (${e.peak_phase}); removed from the saved set: `
          + fmtBytes(e.saved_bytes_removed)));
      }
      out.replaceChildren(...parts);  // never a null child: replaceChildren would print "null"
    } catch (err) { out.replaceChildren(errorBox(err)); }
  };
  return h("div", {class: "whatif"}, h("h2", {}, "What if"),
    h("form", {onsubmit: (ev) => { ev.preventDefault(); run(); }}, input, " or ", dtype, " ",
      h("button", {type: "submit"}, "estimate")), out);
}

async function measured(graph, curve, host) {
  const run = await api(`/api/runs/${graph.run_id}`);
  const traces = (run.traces || []).filter((t) => t.rank === graph.rank);
  for (const t of traces) {
    let series;
    // if_any: a trace without [memory] events answers {} rather than a 404 in the console
    try { series = await api(`/api/traces/${t.id}/memory?if_any=true`); } catch { continue; }
    if (!series || !Object.keys(series).length) continue;
    const [dev, s] = Object.entries(series).sort((a, b) => b[1].peak_bytes - a[1].peak_bytes)[0];
    const Plotly = await loadPlotly();
    const div = h("div", {id: "memory-measured", class: "plot"});
    const ours = curve.peak_bytes - (curve.by_kind_at_peak.parameter || 0);
    const measuredPeak = s.peak_bytes - s.min_bytes;
    const gap = measuredPeak ? ((ours - measuredPeak) / measuredPeak) * 100 : null;
    host.replaceChildren(h("h2", {}, `Measured (trace #${t.id}, device ${dev})`),
      h("p", {"data-testid": "memory-gap"}, `graph-derived peak without parameters ${fmtBytes(ours)}; measured rise `,
        `${fmtBytes(measuredPeak)}`, gap === null ? "" : ` — ${gap >= 0 ? "+" : ""}${gap.toFixed(1)}% apart`), div);
    const t0 = s.ts_ns[0];
    await Plotly.newPlot(div, [{x: s.ts_ns.map((x) => (x - t0) / 1e6), y: s.total_allocated_bytes, mode: "lines",
      name: "Total Allocated"}], {height: 280, margin: {t: 10}, xaxis: {title: {text: "ms since first event"}},
      yaxis: {title: {text: "bytes"}}}, {displaylogo: false, responsive: true});
    return;
  }
  host.replaceChildren(h("p", {class: "muted"}, "No trace of this rank has [memory] events (profile_memory=True)."));
}

// ---- Measured (CUDA memory snapshot) beside the graph-derived models: GET /api/graphs/<id>/memory/measured
// (NOTE: [Measured beside derived]). A run without a snapshot record says so rather than nothing.
const mib = (n) => (n === null || n === undefined ? "—"
  : `${(n / 2 ** 20).toLocaleString("en-US", {minimumFractionDigits: 1, maximumFractionDigits: 1})} MiB`);
const signedMib = (n) => (n === null || n === undefined ? "—" : `${n >= 0 ? "+" : "−"}${mib(Math.abs(n))}`);
const pct = (p) => (p === null || p === undefined ? "—" : `${p >= 0 ? "+" : "−"}${Math.abs(p).toFixed(1)}%`);

function peaksTable(m) {
  return table("memory-peaks", ["Source", "Peak", "+ held outside the graphs", "Compared", "Gap vs measured", "Gap %"],
    m.peaks.map((p) => h("tr", {"data-source": p.source}, h("td", {}, p.label), h("td", {class: "num"}, mib(p.peak_bytes)),
      h("td", {class: "num"}, p.held_outside_bytes === null ? "—" : mib(p.held_outside_bytes)),
      h("td", {class: "num"}, mib(p.compared_bytes)),
      h("td", {class: "num"}, p.source === "measured" ? "" : signedMib(p.gap_bytes)),
      h("td", {class: "num"}, p.source === "measured" ? "" : pct(p.gap_pct)))),
    "", {caption: "Step peaks. Graphs hold the parameters, not what the job held outside them (optimizer state, "
      + "eager buffers): a derived peak is compared with that added (the bytes allocated before the snapshot's "
      + "history, less the parameters).", empty: "no graph-derived model for this graph"});
}

function modulesTable(m) {
  return table("memory-modules", ["Module path", "Measured at its peak", "Graph-derived at its peak", "Gap"],
    m.modules.map((x) => h("tr", {}, h("td", {}, code(x.module)), h("td", {class: "num"}, mib(x.measured_bytes)),
      h("td", {class: "num"}, mib(x.derived_bytes)), h("td", {class: "num"}, signedMib(x.gap_bytes)))),
    "", {caption: `Bytes live at each side's own peak per module (paths cut to ${m.depth} parts), parameters left `
      + "out. Measured: every graph and eager code of the step; derived: this page's forward/backward pair.",
    empty: "no per-module bytes (see the notes)"});
}

async function snapshotSection(id, host, page) {
  const m = await api(`/api/graphs/${id}/memory/measured`);
  if (!page.alive()) return;
  const notes = m.notes.length ? h("ul", {class: "muted small", "data-testid": "memory-snapshot-notes"},
    m.notes.map((n) => h("li", {}, n))) : null;
  const title = h("h2", {}, "Measured (CUDA memory snapshot) beside graph-derived");
  if (m.status !== "ok") {
    host.replaceChildren(title, h("p", {class: "verdict-incomplete", "data-testid": "memory-snapshot-missing"},
      badge("INCOMPLETE", "tag"), " ", m.message), ...[peaksTable(m), notes].filter(Boolean));  // replaceChildren prints null
    return;
  }
  const s = m.snapshot;
  const measuredPeak = m.peaks.find((p) => p.source === "measured");
  const summary = h("p", {"data-testid": "memory-snapshot-summary"},
    h("strong", {}, `measured peak ${mib(s.peak_bytes)}`), ` (snapshot `, code(s.file), `, rank ${s.rank}, device ${s.device}; `,
    `${mib(s.baseline_bytes)} allocated before its history; ${s.attributed} of ${s.allocations} allocations on graph nodes). `,
    m.peaks.filter((p) => p.source !== "measured").map((p) => `${p.source === "graph" ? "graph-derived" : "Inductor model"} `
      + `${mib(p.compared_bytes)} (${pct(p.gap_pct)}). `));
  const div = h("div", {id: "memory-snapshot-curve", class: "plot", "data-testid": "memory-snapshot-curve"});
  host.replaceChildren(...[title, summary, div, peaksTable(m), h("h3", {}, "Per module at the peak"), modulesTable(m),
    notes].filter(Boolean));
  if (!m.curve) { div.replaceChildren(h("p", {class: "muted"}, "No stored curve (see the notes).")); return; }
  const Plotly = await loadPlotly();
  if (!page.alive()) return;
  const x = m.curve.t_us.map((t) => t / 1000);
  const [x0, x1] = [x[0] ?? 0, x[x.length - 1] ?? 0];
  const toMib = (b) => b / 2 ** 20;  // MiB on the axis: Plotly's SI ticks would write bytes as "4B"
  const level = (p, name, dash) => ({x: [x0, x1], y: [toMib(p.compared_bytes), toMib(p.compared_bytes)], mode: "lines",
    name, line: {dash}, hovertemplate: `${name} %{y:,.1f} MiB<extra></extra>`});
  const traces = [{x, y: m.curve.bytes.map(toMib), mode: "lines", name: "measured (allocated)",
    hovertemplate: "%{x:.1f} ms<br>%{y:,.1f} MiB<extra></extra>"}];
  for (const p of m.peaks) {
    if (p.source === "graph") traces.push(level(p, "graph-derived step peak", "dash"));
    if (p.source === "inductor") traces.push(level(p, "Inductor model step peak", "dot"));
  }
  traces.push({x: [x[m.curve.bytes.indexOf(Math.max(...m.curve.bytes))]], y: [toMib(measuredPeak.peak_bytes)],
    mode: "markers", name: "measured peak", marker: {size: 10, color: "#c0392b"},
    hovertemplate: "measured peak %{y:,.1f} MiB<extra></extra>"});
  await Plotly.newPlot(div, traces, {height: 320, margin: {t: 10},
    xaxis: {title: {text: "ms since the snapshot's first event"}}, yaxis: {title: {text: "allocated MiB"}}},
  {displaylogo: false, responsive: true});
}

export async function renderMemory(page, match, query) {
  const id = Number(match[1]);
  const scope = query.get("scope") || "step";
  const graph = await api(`/api/graphs/${id}`);
  let curve;
  try {
    curve = await api(`/api/graphs/${id}/memory?scope=${scope}&top=20`);
  } catch (err) {
    if (scope !== "step" || err.status !== 404) throw err;
    curve = await api(`/api/graphs/${id}/memory?scope=graph&top=20`);
  }
  if (!page.alive()) return;
  setCrumbs([["Runs", "#/runs"], [graph.run_name, `#/runs/${graph.run_id}`], [graph.name, `#/graphs/${id}`], ["memory", null]]);
  const plot = h("div", {id: "memory-curve", class: "plot", "data-testid": "memory-curve"});
  const measuredBox = h("section", {id: "memory-measured-box"}, h("p", {class: "loading"}, "Looking for measured memory…"));
  const snapshotBox = h("section", {id: "memory-snapshot-box", "data-testid": "memory-snapshot"},
    h("p", {class: "loading"}, "Looking for a CUDA memory snapshot…"));
  const peak = nodeTarget(curve, curve.peak_index);
  document.getElementById("app").replaceChildren(h("section", {class: "memory-page"},
    h("h1", {}, `Memory — ${graph.name}`),
    h("p", {"data-testid": "memory-peak"}, h("strong", {}, `peak ${fmtBytes(curve.peak_bytes)}`), " at ",
      h("a", {href: linkOf(peak.gid, peak.node)}, curve.peak_node), ` (#${curve.peak_index} of ${curve.nodes.length} nodes; `,
      curve.scope === "step" ? "forward then backward graph" : "this graph alone", "). ",
      Object.entries(curve.by_kind_at_peak).map(([k, v]) => `${k} ${fmtBytes(v)}`).join(", ")),
    plot,
    h("h2", {}, "Top holders at the peak"), holdersTable(curve), recomputeBox(curve),
    h("h2", {}, "Saved activations by module"), savedTable(curve),
    snapshotBox, whatIf(id), measuredBox));
  const Plotly = await loadPlotly();
  if (!page.alive()) return;
  const x = curve.live_bytes.map((_, i) => i);
  await Plotly.newPlot(plot, [
    {x, y: curve.live_bytes, mode: "lines", name: "live bytes", text: curve.nodes,
      customdata: curve.modules.map((m) => m || "(no module)"),
      hovertemplate: "%{text}<br>%{customdata}<br>%{y:,} bytes<extra></extra>"},
    {x: [curve.peak_index], y: [curve.peak_bytes], mode: "markers", name: "peak", marker: {size: 11, color: "#c0392b"},
      text: [curve.peak_node], hovertemplate: "peak %{text}<br>%{y:,} bytes<extra></extra>"},
  ], {height: 360, margin: {t: 10}, xaxis: {title: {text: "node (execution order)"}}, yaxis: {title: {text: "live bytes"}}},
  {displaylogo: false, responsive: true});
  plot.on("plotly_click", (ev) => {
    const p = ev.points && ev.points[0];
    if (!p) return;
    const t = nodeTarget(curve, p.x);  // x is the node index on both traces (the peak marker has one point)
    location.hash = linkOf(t.gid, t.node);
  });
  snapshotSection(id, snapshotBox, page).catch((err) => snapshotBox.replaceChildren(errorBox(err)));
  measured(graph, curve, measuredBox).catch((err) => measuredBox.replaceChildren(errorBox(err)));
}
