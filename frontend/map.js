// graphdeck dashboard: a run's parallel map (#/runs/<id or name>/map), from
// GET /api/runs/<id>/parallel-map (server/routes/parallel_map.py, NOTE: [Parallel map]).
//
// One block per pipeline stage; in a block a grid whose columns are the coordinates on the
// sharding mesh dimensions (tp, cp, ...) and whose rows are the data-parallel replicas (dp,
// dp_shard, ...). Each cell is a rank (or, on large maps, a run of replicas with identical states,
// merged by the server) with a badge per check whose state is not "ok": diverged, missing
// gradient, straggler, hang / waiting, no layout record; "?" where that rank could not be
// checked. A check that could not run at all is said once, in the legend. Hover text (title)
// gives the rank's coordinates, host, device and the reason for each badge. All text from the
// store goes through h() (textContent), never markup.

import {api, badge, h, plural, setCrumbs} from "./common.js";

// Badge text and severity per (check, state); states not listed are "ok".
const SHORT = {diverged: "diverged", grad: "no grad", straggler: "straggler", hang: "hang", layout: "no layout"};
const SEVERITY = {diverged: "bad", missing: "bad", hang: "bad", straggler: "warn", waiting: "warn", unknown: "unknown"};
const RANK_ORDER = ["bad", "warn", "unknown", "ok"];

function badgeText(check, state) {
  if (state === "unknown") return `${SHORT[check] || check} ?`;
  if (state === "waiting") return "waiting";
  return SHORT[check] || state;
}

/** Ranks as short text: "0-3, 8" (first `max` pieces, then "…"); a stride as "0, 8, … 120". */
function rankRanges(ranks, max = 6) {
  const step = ranks.length > 3 ? ranks[1] - ranks[0] : 0;
  if (step > 1 && ranks.every((r, i) => r === ranks[0] + i * step)) return `${ranks[0]}, ${ranks[1]}, … ${ranks.at(-1)}`;
  const parts = [];
  for (let i = 0; i < ranks.length; i++) {
    let j = i;
    while (j + 1 < ranks.length && ranks[j + 1] === ranks[j] + 1) j++;
    parts.push(i === j ? String(ranks[i]) : `${ranks[i]}-${ranks[j]}`);
    i = j;
  }
  return parts.length > max ? `${parts.slice(0, max).join(", ")}, …` : parts.join(", ");
}

function legend(map) {
  const items = map.checks.map((c) => {
    const counts = c.pending ? "" : Object.entries(c.counts).map(([state, n]) => `${n} ${state}`).join(", ");
    const status = c.pending ? badge("checking…", "status status-partial")
      : !c.ran ? badge("unknown", "status status-FROZEN")
      // Green only when the check's own verdict is PASS (or it has none): INCOMPLETE is not "checked · ok".
      : c.verdict == null || c.verdict === "PASS" ? badge("checked", "status status-ok")
      : badge(`checked · ${c.verdict}`, `status status-${c.verdict === "FAIL" ? "NO_GRAD" : "partial"}`);
    return h("li", {"data-testid": "map-check", "data-check": c.key},
      h("strong", {}, c.label), " ", status, " ", h("span", {class: "muted"}, counts),
      c.link ? [" · ", h("a", {href: c.link}, "details")] : null,
      c.pending ? null : h("div", {class: "small"}, c.message));
  });
  return h("ul", {class: "map-checks", "data-testid": "map-checks"}, items);
}

function cellTitle(map, stage, rowLabel, colLabel, ranks, kind, why) {
  const r0 = ranks[0];
  const where = [stage.stage !== null && map.dims.stage ? `stage ${stage.stage}` : null, rowLabel, colLabel]
    .filter(Boolean).join(" · ");
  const host = map.ranks.host[r0] != null ? map.hosts[map.ranks.host[r0]] : null;
  const device = map.ranks.device[r0] != null ? map.devices[map.ranks.device[r0]] : null;
  const lines = [ranks.length === 1 ? `rank ${r0}` : `${ranks.length} ranks: ${rankRanges(ranks, 12)}`];
  if (where) lines.push(where);
  if (host || device) lines.push([host && `host ${host}`, device && `device ${device}`].filter(Boolean).join(" · "));
  for (const c of map.checks) {
    const state = map.kinds[kind][c.key];
    const text = (why.get(r0) || {})[c.key];
    lines.push(`${c.label}: ${state}${text ? ` — ${text}` : ""}`);
  }
  return lines.join("\n");
}

function cell(map, stage, row, colLabel, c, why) {
  if (!c) return h("td", {class: "map-hole"}, "");
  const kind = map.kinds[c.kind];
  const marks = map.checks
    .filter((x) => kind[x.key] !== "ok" && x.ran)
    .map((x) => h("span", {class: `mbadge sev-${SEVERITY[kind[x.key]] || "ok"}`, "data-check": x.key},
      badgeText(x.key, kind[x.key])));
  // The colour never says "ok" for a rank some check could not look at: bad, warn, unknown, then ok.
  const worst = RANK_ORDER.find((s) => map.checks.some((x) => (SEVERITY[kind[x.key]] || "ok") === s)) || "ok";
  const label = c.ranks.length === 1 ? `rank ${c.ranks[0]}` : `${c.ranks.length} ranks`;
  return h("td", {class: `map-cell sev-${worst}`, "data-testid": "map-cell", "data-ranks": c.ranks.join(","),
    title: cellTitle(map, stage, row.label, colLabel, c.ranks, c.kind, why)},
    h("div", {class: "map-rank"}, label),
    c.ranks.length > 1 ? h("div", {class: "small muted"}, rankRanges(c.ranks, 3)) : null,
    marks.length ? h("div", {class: "map-marks"}, marks) : null);
}

function stageBlock(map, stage, why) {
  const corner = [map.dims.rows.join(" · "), map.dims.cols.join(" · ")].filter(Boolean).join(" \\ ");
  const head = h("tr", {}, h("th", {class: "map-corner"}, corner),
    stage.cols.map((label) => h("th", {class: "map-col", "data-testid": "map-col"}, label || "")));
  const rows = stage.rows.map((row) => h("tr", {"data-count": row.count},
    h("th", {class: "map-row", "data-testid": "map-row"}, row.label || ""),
    row.cells.map((c, i) => cell(map, stage, row, stage.cols[i], c, why))));
  return h("section", {class: "map-stage", "data-testid": "map-stage", "data-stage": stage.stage ?? "unknown"},
    h("h2", {}, stage.label, h("span", {class: "muted"}, ` — ${plural(stage.ranks, "rank")}`)),
    h("table", {class: "map-grid", "data-testid": "map-grid"}, h("thead", {}, head), h("tbody", {}, rows)));
}

// A run without a device mesh (DDP, or a plain torch.distributed job): its replica group as one row
// (NOTE: [Replica row] in analysis/parallel/replicas.py).
function replicaLine(rep) {
  if (!rep) return null;
  const d = rep.ddp;
  return h("p", {class: "summary", "data-testid": "map-replica", "data-kind": rep.kind}, rep.text,
    d && d.bucket_bytes.length ? h("span", {class: "muted small", "data-testid": "map-replica-buckets"},
      ` — bucket sizes ${d.bucket_bytes.map((b) => `${(b / 1048576).toFixed(2)} MiB`).join(", ")}`) : null);
}

function meshLine(map) {
  const meshes = map.meshes.map((m) => `${m.dim_names.join("×")} (${m.shape.join("×")})${m.device_type ? ` on ${m.device_type}` : ""}`);
  return h("p", {class: "summary", "data-testid": "map-summary"},
    `world size ${map.world_size}`,
    meshes.length ? ` · mesh ${meshes.join(", ")}` : " · no device mesh recorded",
    map.dims.stage ? ` · ${plural(map.stages.length, "pipeline stage")}` : "");
}

// The check answered at once; the others (check-ranks, check-grads, Flight Recorder, traces) can take seconds
// on a large run, so the map is drawn with these first and redrawn when every check has answered.
const FAST_CHECKS = "layout";

export async function renderMap(page, match, query) {
  const expand = query && query.get("expand") === "1"; // every replica row, none merged
  const base = `/api/runs/${encodeURIComponent(decodeURIComponent(match[1]))}/parallel-map?expand=${expand}`;
  const first = await api(`${base}&checks=${FAST_CHECKS}`);
  if (!page.alive()) return;
  setCrumbs([["Runs", "#/runs"], [first.run, `#/runs/${first.run_id}`], ["parallel map", null]]);
  const app = document.getElementById("app");
  if (!first.has_layout) {
    app.replaceChildren(h("section", {class: "map-page"},
      h("h1", {}, `Parallel map — ${first.run}`),
      h("div", {class: "empty", "data-testid": "map-empty"},
        h("p", {}, first.message), h("p", {}, first.hint))));
    return;
  }
  app.replaceChildren(mapPage(first, expand, false));
  let full;
  try {
    full = await api(base);
  } catch (err) {
    if (page.alive()) app.querySelector(".map-checks")?.after(h("p", {class: "error", "data-testid": "map-checks-failed"},
      `The other checks could not be answered: ${err.message}`));
    return;
  }
  if (page.alive()) app.replaceChildren(mapPage(full, expand, true));
}

function mapPage(map, expand, complete) {
  const why = new Map(); // rank -> {check: text}
  for (const d of map.details) {
    for (const r of d.ranks) {
      if (!why.has(r)) why.set(r, {});
      why.get(r)[d.check] = d.text;
    }
  }
  return h("section", {class: "map-page", "data-complete": complete ? "true" : null},
    h("h1", {}, `Parallel map — ${map.run}`),
    meshLine(map),
    replicaLine(map.replica),
    map.replica && !map.meshes.length ? h("p", {class: "muted small"}, "One row: the replica group; a column per rank (each runs the same program on its own data). Hover a rank for the reason for each badge.")
    : h("p", {class: "muted small"}, "Rows: ", map.dims.stage ? "pipeline stages, then " : "",
      map.dims.rows.length ? `data-parallel replicas (${map.dims.rows.join(", ")})` : "one row per stage",
      "; columns: ", map.dims.cols.length ? `position on ${map.dims.cols.join(", ")}` : "one column",
      ". Hover a rank for its coordinates and the reason for each badge. ",
      map.stages.some((s) => s.rows.some((r) => r.count > 1)) || expand
        ? h("a", {href: `#/runs/${map.run_id}/map${expand ? "" : "?expand=1"}`, "data-testid": "map-expand"},
          expand ? "merge identical replica rows" : "show every replica row") : null),
    legend(map),
    (map.replica && !map.meshes.length ? map.notes.slice(1) : map.notes).map((n) => h("p", {class: "muted"}, n)),
    h("div", {class: "map-stages", "data-testid": "parallel-map"}, map.stages.map((s) => stageBlock(map, s, why))),
    map.unplaced.length ? h("p", {class: "muted", "data-testid": "map-unplaced"},
      `Not placed by any mesh or stage: ranks ${rankRanges(map.unplaced, 20)}`) : null);
}
