// graphdeck dashboard: the rank heatmap (issue 26 item 2) — where a page would list a row per
// rank, a large run gets one picture: ranks × steps or ranks × collectives, coloured by step
// time, lateness, wait or finding (GET /api/runs/<id>/heatmap; NOTE: [Rank heatmap] in
// graphdeck/analysis/ranks/heatmap.py). Drawn on one <canvas> (a pixel block per cell, not a DOM
// element per rank); hovering names rank, column and value; clicking opens that rank's page
// (#/runs/<id>/rank/<r>?step=<s>), which this module also renders.
//
// Missing evidence is never a healthy colour: a rank without a trace is a striped grey row
// ("no trace"), a traced rank without a value in a column is flat grey ("no value"), each in the
// legend. Past the server's row limit (max_rows) a row is a bin of ranks, each cell the worst of
// them; a bin with some ranks untraced ("partial") keeps a striped mark at its left edge. Column labels (process group names, op kinds) come from traces: they reach the page as
// text only (textContent, canvas fillText), never markup (NOTE: [Untrusted text] in common.js).

import {$app, api, badge, fmt, h, plural, setCrumbs, statusBadge} from "./common.js";

/** More ranks than this: pages draw the rank heatmap, or group ranks, instead of a row or a
 *  column per rank (small runs keep their tables). */
export const SMALL_RUN = 8;

/** Sorted ranks as compact text: "0-127", "0, 8, 16-19", cut after `limit` pieces ("… (N ranks)"). */
export function rankRanges(ranks, limit = 6) {
  const rs = [...ranks].map(Number).sort((a, b) => a - b), parts = [];
  for (let i = 0; i < rs.length;) {
    let j = i;
    while (j + 1 < rs.length && rs[j + 1] === rs[j] + 1) j++;
    parts.push(j > i ? `${rs[i]}-${rs[j]}` : String(rs[i]));
    i = j + 1;
  }
  const shown = parts.slice(0, limit).join(", ");
  return parts.length > limit ? `${shown}, … (${rs.length} ranks)` : shown;
}

/** Long rank lists inside a message ("[0, 1, 2, …, 1023]") written as ranges ("[0-1023]"). */
export function compactRanks(text) {
  return String(text ?? "").replace(/\[(\d+(?:, \d+){8,})\]/g, (_, list) => `[${rankRanges(list.split(", "), 8)}]`);
}

/** Messages that differ only by a leading "rank N: " merged: "ranks 0-1023: …" (order of first). */
export function mergeRankLines(lines) {
  const groups = new Map();
  for (const line of lines) {
    const m = /^rank (\d+): ([\s\S]*)$/.exec(String(line));
    const key = m ? m[2] : String(line);
    if (!groups.has(key)) groups.set(key, []);
    if (m) groups.get(key).push(m[1]);
  }
  return [...groups].map(([text, ranks]) => (ranks.length > 1 ? `ranks ${rankRanges(ranks)}: ${text}`
    : ranks.length ? `rank ${ranks[0]}: ${text}` : text));
}

export const METRICS = {
  step_time: {label: "step time", axes: ["steps"]},
  lateness: {label: "lateness (arrival after the first rank)", axes: ["steps", "collectives"]},
  wait: {label: "wait for peers", axes: ["steps", "collectives"]},
  finding: {label: "finding", axes: ["steps", "collectives"]},
};
// Sequential scale, low → high (light yellow → dark red): a late or slow cell is the dark one.
const STOPS = [[255, 255, 204], [254, 217, 118], [253, 141, 60], [227, 26, 28], [128, 0, 38]];
const FINDING_RGB = {ok: [161, 217, 155], late: [253, 141, 60], suspect: [158, 154, 200], diverged: [215, 25, 28],
  absent: [84, 39, 143]};
const NO_VALUE = [208, 208, 208];
const NO_TRACE = [[90, 90, 90], [150, 150, 150]]; // stripes
const rgb = (c) => `rgb(${c[0]},${c[1]},${c[2]})`;
const GUTTER = 48, TOP = 6, AXIS = 20, MAX_HEIGHT = 560;

/** Nanoseconds as "12.3 ms" (µs below 0.1 ms, s from 1 s). */
export function fmtNs(ns) {
  if (ns === null || ns === undefined) return "—";
  const v = Number(ns);
  if (Math.abs(v) >= 1e9) return `${(v / 1e9).toFixed(2)} s`;
  if (Math.abs(v) >= 1e5) return `${(v / 1e6).toFixed(1)} ms`;
  return `${(v / 1e3).toFixed(1)} µs`;
}

function scaleColour(t) {
  const x = Math.min(1, Math.max(0, t)) * (STOPS.length - 1);
  const i = Math.min(STOPS.length - 2, Math.floor(x)), f = x - i;
  return STOPS[i].map((v, k) => Math.round(v + (STOPS[i + 1][k] - v) * f));
}

/** "rank 7", or "ranks 0-31" for a binned row. */
export function rowLabel(doc, r) {
  const last = doc.rank_last?.[r];
  return last !== undefined && last !== doc.ranks[r] ? `ranks ${doc.ranks[r]}-${last}` : `rank ${doc.ranks[r]}`;
}

/** The rank a click on row `r` opens: the rank itself, or a bin's worst rank. */
const rowRank = (doc, r) => doc.rank_worst?.[r] ?? doc.ranks[r];
const PARTIAL_MARK = 4; // px of stripes at the left of a bin with some ranks untraced

/** The colour of one cell: [r, g, b], or null for a no-trace row (drawn striped). */
function cellColour(doc, row, value, lo, hi) {
  if (doc.row_state[row] === "no_trace") return null;
  if (value === null || value === undefined) return NO_VALUE;
  if (doc.unit === "finding") return doc.findings[value]?.rgb || FINDING_RGB[doc.findings[value]?.key] || NO_VALUE;
  return scaleColour(hi > lo ? (Number(value) - lo) / (hi - lo) : 0);
}

function legend(doc) {
  const items = [];
  if (doc.unit === "finding") {
    for (const f of doc.findings) {
      items.push(h("li", {"data-testid": `heatmap-legend-${f.key}`},
        h("span", {class: "hm-swatch", style: `background:${rgb(f.rgb || FINDING_RGB[f.key])}`}), ` ${f.key}: ${f.label}`));
    }
  } else {
    const s = doc.scale || {};
    if (s.min !== null && s.min !== undefined) items.push(h("li", {"data-testid": "heatmap-legend-scale"}, fmtNs(s.min), " ",
      h("span", {class: "hm-ramp", style: `background:linear-gradient(to right,${STOPS.map(rgb).join(",")})`}),
      " ", fmtNs(s.p99 ?? s.max), s.max !== s.p99 ? h("span", {class: "muted"}, ` (max ${fmtNs(s.max)})`) : null));
  }
  items.push(h("li", {"data-testid": "heatmap-legend-no-value"},
    h("span", {class: "hm-swatch", style: `background:${rgb(NO_VALUE)}`}), " no value (not in this column)"));
  items.push(h("li", {"data-testid": "heatmap-legend-no-trace"},
    h("span", {class: "hm-swatch hm-no-trace"}),
    ` ${doc.missing || "no trace"}: missing evidence (${plural(doc.counts.no_trace, "rank")})`));
  return h("ul", {class: "hm-legend small", "data-testid": "heatmap-legend"}, items);
}

/** Draw `doc` on a new canvas sized for `width` CSS px. → {canvas, geometry} */
function draw(doc, width) {
  const rows = doc.ranks.length, cols = doc.columns.length;
  const rh = Math.max(1, Math.min(18, Math.floor(MAX_HEIGHT / Math.max(1, rows))));
  const shown = Math.max(cols, 1);
  const cw = Math.max(1, Math.min(40, Math.floor((width - GUTTER) / shown)));
  const w = GUTTER + cw * shown, hgt = TOP + rows * rh + AXIS;
  const canvas = h("canvas", {width: w, height: hgt, class: "hm-canvas", "data-testid": "heatmap-canvas",
    "data-left": GUTTER, "data-top": TOP, "data-cw": cw, "data-rh": rh, role: "img",
    "aria-label": `${plural(rows, "rank")} × ${plural(cols, "column")}, ${fmt(METRICS[doc.metric]?.label)}`});
  const ctx = canvas.getContext("2d");
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, w, hgt);
  {
    // No column (no trace, no step): one blank column, so a no-trace row still shows as missing.
    const lo = Number(doc.scale?.min ?? 0), hi = Number(doc.scale?.p99 ?? doc.scale?.max ?? 0);
    const img = ctx.createImageData(cw * shown, Math.max(1, rows * rh));
    const px = img.data, stride = cw * shown * 4;
    for (let r = 0; r < rows; r++) {
      const vals = doc.values[r] || [];
      for (let c = 0; c < shown; c++) {
        const col = cellColour(doc, r, vals[c], lo, hi);
        const partial = doc.row_state[r] === "partial";
        for (let y = r * rh; y < (r + 1) * rh; y++) {
          let o = y * stride + c * cw * 4;
          for (let x = c * cw; x < (c + 1) * cw; x++, o += 4) {
            const k = col && !(partial && x < PARTIAL_MARK) ? col : NO_TRACE[((x + y) >> 2) & 1];
            px[o] = k[0]; px[o + 1] = k[1]; px[o + 2] = k[2]; px[o + 3] = 255;
          }
        }
      }
    }
    ctx.putImageData(img, GUTTER, TOP);
  }
  // Rank labels (numbers) every few rows; column ticks below (canvas text: never markup).
  ctx.fillStyle = "#333";
  ctx.font = "10px sans-serif";
  ctx.textBaseline = "middle";
  const every = Math.max(1, Math.ceil(12 / rh));
  for (let r = 0; r < rows; r += every) ctx.fillText(String(doc.ranks[r]), 2, TOP + r * rh + rh / 2);
  const tickEvery = Math.max(1, Math.ceil(90 / cw));
  ctx.textBaseline = "top";
  for (let c = 0; c < cols; c += tickEvery) {
    ctx.fillText(String(doc.columns[c].label).slice(0, 16), GUTTER + c * cw, TOP + rows * rh + 4);
  }
  return {canvas, rh, cw};
}

function valueText(doc, r, c) {
  if (doc.row_state[r] === "no_trace") return `${doc.missing || "no trace"}: missing evidence`;
  const partial = doc.row_state[r] === "partial" ? ` (${plural(doc.row_no_trace[r], "rank")} of the bin without a trace)` : "";
  const worst = doc.rank_worst ? `; the worst: the largest of the bin (opens rank ${rowRank(doc, r)})` : "";
  const v = doc.values[r]?.[c];
  if (v === null || v === undefined) return `no value${partial}`;
  if (doc.unit !== "finding") return `${fmtNs(v)}${worst}${partial}`;
  const f = doc.findings[v] || {};
  const d = f.key === "diverged" ? (doc.divergent || []).find((x) => x.rank === rowRank(doc, r)) : null;
  const what = (kind, n) => `${fmt(kind)}${n !== null && n !== undefined ? ` of ${n} elements` : ""}`;
  return `${f.key}: ${f.label}${worst}${partial}` + (!d ? "" : d.count !== null && d.count !== undefined
    ? ` (issued ${d.count} collectives of group ${fmt(d.group)}, most ranks ${d.expected_count})`
    : ` (#${d.seq} of group ${fmt(d.group)}: ${what(d.kind, d.nelems)} where ${d.agreeing_ranks} ranks run `
      + `${what(d.expected_kind, d.expected_nelems)})`);
}

/** Where a click on (rank row, column) leads: the rank's page, at the column's step. */
export function drillHref(doc, r, c) {
  const col = doc.columns[c] || {};
  const q = new URLSearchParams();
  if (col.step !== null && col.step !== undefined) q.set("step", col.step);
  if (col.index !== undefined) q.set("collective", col.index);
  const qs = q.toString();
  return `#/runs/${encodeURIComponent(doc.run_id)}/rank/${rowRank(doc, r)}${qs ? `?${qs}` : ""}`;
}

/** Hover (the tip names rank, column and value) and click (`hrefOf(row, col)`, or `pick(row, col)`
 *  instead of following a link) on a drawn canvas. */
function interactive(canvas, doc, rh, cw, tip, hrefOf, pick = null) {
  const at = (ev) => {
    const b = canvas.getBoundingClientRect();
    const col = Math.floor((ev.clientX - b.left - GUTTER) / cw), row = Math.floor((ev.clientY - b.top - TOP) / rh);
    return row >= 0 && row < doc.ranks.length && col >= 0 && col < doc.columns.length ? [row, col] : null;
  };
  canvas.addEventListener("mousemove", (ev) => {
    const hit = at(ev);
    if (!hit) { tip.hidden = true; return; }
    const [r, col] = hit;
    tip.textContent = `${rowLabel(doc, r)} · ${doc.columns[col].label} · ${valueText(doc, r, col)}`;
    tip.dataset.rank = rowRank(doc, r);
    tip.dataset.column = col;
    const box = canvas.parentElement.getBoundingClientRect();
    tip.style.left = `${ev.clientX - box.left + 12}px`;
    tip.style.top = `${ev.clientY - box.top + 12}px`;
    tip.hidden = false;
  });
  canvas.addEventListener("mouseleave", () => { tip.hidden = true; });
  canvas.addEventListener("click", (ev) => {
    const hit = at(ev);
    if (hit && pick) pick(hit[0], hit[1]);
    else if (hit) location.hash = hrefOf(hit[0], hit[1]);
  });
}

/**
 * A categorical heatmap of a matrix the page already holds (the gradient report's status per rank
 * and parameter): `doc` = {ranks, row_state ("no_trace" rows: `missing` label), columns: [{label}],
 * values: [[code | null]], findings: [{key, label, rgb}]}; `hrefOf(row, col)` is where a click
 * leads. → element
 */
export function statusHeatmap(doc, hrefOf, {missing = "no evidence", testid = "status-heatmap"} = {}) {
  const full = {unit: "finding", counts: {ranks: doc.ranks.length,
    no_trace: doc.row_state.filter((x) => x === "no_trace").length}, missing, ...doc};
  const box = h("div", {class: "heatmap", "data-testid": testid});
  const plot = h("div", {class: "hm-plot"}), tip = h("div", {class: "hm-tip", "data-testid": "heatmap-tip", hidden: true});
  box.append(h("div", {class: "hm-wrap"}, plot, tip));
  requestAnimationFrame(() => {
    const {canvas, rh, cw} = draw(full, Math.max(320, (box.clientWidth || 1000) - 8));
    plot.replaceChildren(canvas);
    box.append(legend(full));
    interactive(canvas, full, rh, cw, tip, hrefOf);
    Object.assign(box.dataset, {state: "done", rows: full.ranks.length, cols: full.columns.length});
  });
  return box;
}

/**
 * The heatmap panel of run `runId`: metric and axis pickers, the picture, its legend. Drawn now
 * with a loading line and filled when the matrix answers. → [element, promise settled once drawn]
 */
export function rankHeatmap(page, runId, {metric = "step_time", axis = "steps", maxRows = null, onPick = null,
  initial = null} = {}) {
  const box = h("div", {class: "heatmap", "data-testid": "rank-heatmap", "data-state": "loading"});
  const pickMetric = h("select", {"data-testid": "heatmap-metric", "aria-label": "colour by"},
    Object.entries(METRICS).map(([k, m]) => h("option", {value: k, selected: k === metric}, m.label)));
  const pickAxis = h("select", {"data-testid": "heatmap-axis", "aria-label": "columns"},
    ["steps", "collectives"].map((a) => h("option", {value: a, selected: a === axis}, a)));
  const status = h("p", {class: "small muted", "data-testid": "heatmap-status"}, "Loading the rank heatmap…");
  const plot = h("div", {class: "hm-plot"});
  const tip = h("div", {class: "hm-tip", "data-testid": "heatmap-tip", hidden: true});
  const legendBox = h("div", {});
  box.append(h("div", {class: "hm-controls small"}, "colour by ", pickMetric, " per ", pickAxis), status,
    h("div", {class: "hm-wrap"}, plot, tip), legendBox);
  let generation = 0;
  const load = () => {
    const m = pickMetric.value;
    if (!METRICS[m].axes.includes(pickAxis.value)) pickAxis.value = METRICS[m].axes[0];
    const mine = ++generation;
    box.dataset.state = "loading";
    box.dataset.metric = m;
    box.dataset.axis = pickAxis.value;
    status.textContent = "Loading the rank heatmap…";
    // Asked at once (before the overview's checks, which share the server); drawn once it answers.
    const rowsQ = maxRows ? `&max_rows=${Number(maxRows)}` : "";
    // `initial`: the matrix the page already holds (rank-index?heatmap=), drawn without asking again.
    const given = initial && initial.metric === m && initial.axis === pickAxis.value && !maxRows ? initial : null;
    initial = null;
    return (given ? Promise.resolve(given)
      : api(`/api/runs/${encodeURIComponent(runId)}/heatmap?metric=${m}&axis=${pickAxis.value}${rowsQ}`)).then((doc) => {
      if (!page.alive() || mine !== generation) return;
      performance.mark("heatmap-answer"); // bench/bench_run_page.py reads these marks
      const width = Math.max(320, (box.clientWidth || document.body.clientWidth || 1000) - 8);
      const {canvas, rh, cw} = draw(doc, width);
      plot.replaceChildren(canvas);
      legendBox.replaceChildren(legend(doc));
      const c = doc.counts;
      status.replaceChildren(...[`${plural(c.ranks, "rank")} × ${plural(doc.columns.length, doc.axis === "steps" ? "step" : "column")}`,
        doc.binned > 1 ? ` (${doc.binned} collectives per column, the worst kept)` : "",
        doc.binned_rows > 1 ? ` (${doc.binned_rows} ranks per row, the worst kept: ${doc.ranks.length} rows)` : "",
        ` · ${c.traced} with a trace`, c.no_trace ? ` · ${c.no_trace} without (missing evidence)` : "",
        doc.straggler !== null && doc.straggler !== undefined ? [" · straggler: ",
          h("a", {href: `#/runs/${encodeURIComponent(doc.run_id)}/rank/${doc.straggler}`, "data-testid": "heatmap-straggler"},
            `rank ${doc.straggler}`)] : "",
        doc.reason ? h("span", {"data-testid": "heatmap-reason"}, ` · ${doc.reason}`) : "",
        onPick ? " · click a row to add that rank's lane" : " · click a cell to open that rank"].flat());
      interactive(canvas, doc, rh, cw, tip, (r, col) => drillHref(doc, r, col), onPick && ((r) => onPick(rowRank(doc, r))));
      Object.assign(box.dataset, {state: "done", rows: doc.ranks.length, cols: doc.columns.length,
        noTrace: c.no_trace, binnedRows: doc.binned_rows || 1});
      performance.mark("heatmap-drawn");
    }, (err) => {
      if (!page.alive() || mine !== generation) return;
      status.replaceChildren(h("span", {class: "error", role: "alert", "data-testid": "heatmap-error"},
        `The rank heatmap could not be computed: ${err.message}`));
      plot.replaceChildren();
      box.dataset.state = "error";
    });
  };
  pickMetric.addEventListener("change", load);
  pickAxis.addEventListener("change", load);
  const done = load(); // the answer comes after this task, which puts the box in the page
  return [box, done];
}

// ---------------------------------------------------------------- one rank (the drill-down)

/** #/runs/<id>/rank/<r>[?step=&collective=]: the rank's record, traces (a replay link at the
 *  step), graphs and DDP splits, from GET /api/runs/<id>/ranks/<r>. */
export async function renderRankPage(page, m, query, rankSection) {
  const runKey = decodeURIComponent(m[1]), rank = Number(m[2]);
  const doc = await api(`/api/runs/${encodeURIComponent(runKey)}/ranks/${rank}`);
  if (!page.alive()) return;
  const run = doc.run;
  setCrumbs([["Runs", "#/runs"], [fmt(run.name), `#/runs/${run.id}`], [`rank ${rank}`]]);
  const step = query.get("step"), coll = query.get("collective");
  const traces = doc.traces || [];
  const usable = traces.filter((t) => t.status === "ok" || t.status === "truncated");
  const newest = usable[usable.length - 1];
  const rec = doc.record;
  const compileEvents = api(`/api/runs/${run.id}/compile-events?rank=${rank}`).catch(() => null);
  $app.replaceChildren(h("section", {"data-testid": "rank-page", "data-rank": rank},
    h("h1", {}, `${fmt(run.name)} — rank ${rank}`),
    h("p", {class: "summary"}, `world size ${fmt(run.world_size)}`,
      rec ? ` · host ${fmt(rec.hostname)} · pid ${fmt(rec.pid)} · ${fmt(rec.backend)} · torch ${fmt(rec.torch_version)}`
        : " · no rank record (nothing captured from this rank)"),
    h("p", {"data-testid": "rank-page-trace"}, newest
      ? [statusBadge(newest.status), " ", h("a", {href: `#/traces/${newest.id}`}, `trace #${newest.id} (${fmt(newest.name)})`),
        step !== null ? [" · ", h("a", {href: `#/traces/${newest.id}/replay?step=${encodeURIComponent(step)}`,
          "data-testid": "rank-page-replay"}, `replay step ${step}`)] : null,
        coll !== null ? h("span", {class: "muted"}, ` · collective #${coll} of the heatmap`) : null,
        " · ", h("a", {href: `#/runs/${run.id}/timeline`}, "all ranks on one timeline")]
      : [badge("no trace", "status status-NO_GRAD"), " this rank has no usable trace: its time, lateness and waits are "
        + "missing evidence (ingest it with graphdeck ingest-trace --rank ", String(rank), ")"]),
    h("p", {class: "small"}, h("a", {href: `#/runs/${run.id}`}, "← the run"), " · ",
      rank > 0 ? h("a", {href: `#/runs/${run.id}/rank/${rank - 1}`}, `rank ${rank - 1}`) : null,
      rank > 0 ? " · " : null, h("a", {href: `#/runs/${run.id}/rank/${rank + 1}`}, `rank ${rank + 1}`)),
    rankSection(rank, doc.graphs || [], traces, (doc.partitions || []).sort((a, b) => a.index - b.index),
      compileEvents)));
}

