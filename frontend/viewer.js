// graphdeck dashboard: the graph page's SVG viewer: the server's render parsed safely, then pan
// (drag) and zoom (wheel, buttons) by editing its viewBox.
//
// NOTE: [Initial view]
// A graph whose whole drawing is readable (labels are 10 units tall, so at ≥ 0.7× they stay about
// 7 px or more) opens fitted. A larger one (GPT-2 AOT backward graphs are ~4,600 units wide) opens
// at 1× on the graph's top (where an FX graph starts: its inputs, the first ops), horizontally on
// the host-sized window holding the most nodes of that top band (the leftmost on a tie). So the
// first view shows real nodes from the start of the graph, and the "fit" button still shows
// everything. The legend and overlay notes are not in the SVG's view: graph.js moves them into
// the page above it.

const SVG_NS = "http://www.w3.org/2000/svg";
/** Fit the whole graph when that draws it at least this large (screen px per SVG unit). */
const READABLE_FIT_SCALE = 0.7;
/** Otherwise open at this scale, on the graph's first nodes. */
const HOME_SCALE = 1;
/** Selecting a node zooms in to at least this scale (screen px per SVG unit). */
const SELECT_SCALE = 1;

/** Parse the server's SVG render and import it into this document; throws unless the root is <svg>. */
export function importSvg(text) {
  const doc = new DOMParser().parseFromString(text, "image/svg+xml");
  const root = doc.documentElement;
  if (doc.querySelector("parsererror") || root.localName !== "svg" || root.namespaceURI !== SVG_NS) {
    throw new Error("the graph render is not an SVG document");
  }
  doc.querySelectorAll("script, foreignObject").forEach((el) => el.remove());
  for (const el of doc.querySelectorAll("*")) {
    for (const attr of [...el.attributes]) if (/^on/i.test(attr.name)) el.removeAttribute(attr.name);
  }
  return document.importNode(root, true);
}

/** `lo + (span - size) / 2` when the window is larger than the drawing, else `v` kept inside it. */
function clampInto(v, size, lo, span) {
  if (size >= span) return lo + (span - size) / 2;
  return Math.min(Math.max(v, lo), lo + span - size);
}

/**
 * Pan (drag) and zoom (wheel, buttons) `svg` inside `host` by editing its viewBox.
 * `firstNodes`: the FX nodes' <g> elements in FX graph order (see NOTE: [Initial view]);
 * `options.trimTop`: SVG units at the top of the viewBox left out of every view (a legend moved out).
 * → {zoom(factor, clientX?, clientY?), fit(), centerOn(el), zoomTo(el), justDragged()}
 */
export function makeViewer(svg, host, firstNodes = [], options = {}) {
  const vbAttr = (svg.getAttribute("viewBox") || "").trim().split(/[\s,]+/).map(Number);
  const base = vbAttr.length === 4 && vbAttr.every(Number.isFinite) && vbAttr[2] > 0
    ? {x: vbAttr[0], y: vbAttr[1], w: vbAttr[2], h: vbAttr[3]}
    : {x: 0, y: 0, w: parseFloat(svg.getAttribute("width")) || 1000, h: parseFloat(svg.getAttribute("height")) || 1000};
  let vb = {...base};
  svg.removeAttribute("width");
  svg.removeAttribute("height");
  svg.setAttribute("preserveAspectRatio", "xMidYMid meet");
  const apply = () => svg.setAttribute("viewBox", `${vb.x} ${vb.y} ${vb.w} ${vb.h}`);
  const toSvg = (clientX, clientY) => new DOMPoint(clientX, clientY).matrixTransform(svg.getScreenCTM().inverse());
  const hostCenter = () => { const r = host.getBoundingClientRect(); return [r.left + r.width / 2, r.top + r.height / 2]; };

  function zoom(factor, clientX, clientY) {
    if (clientX === undefined) [clientX, clientY] = hostCenter();
    const w = Math.min(Math.max(vb.w / factor, Math.min(20, base.w)), base.w * 20); // 20 units … 20× the graph
    const f = vb.w / w;
    const p = toSvg(clientX, clientY);
    vb = {x: p.x - (p.x - vb.x) / f, y: p.y - (p.y - vb.y) / f, w: vb.w / f, h: vb.h / f};
    apply();
  }
  function centerOn(el) {
    const r = el.getBoundingClientRect(), hr = host.getBoundingClientRect();
    if (r.left >= hr.left && r.right <= hr.right && r.top >= hr.top && r.bottom <= hr.bottom) return;
    const p = toSvg(r.left + r.width / 2, r.top + r.height / 2);
    vb = {...vb, x: p.x - vb.w / 2, y: p.y - vb.h / 2};
    apply();
  }
  function fit() { // the whole graph, magnified at most 1.5× so a small graph is not blown up
    const r = host.getBoundingClientRect();
    const scale = Math.min(r.width / base.w, r.height / base.h);
    if (!(scale > 1.5)) { vb = {...base}; apply(); return; }
    const w = r.width / 1.5, hgt = r.height / 1.5;
    vb = {x: base.x + (base.w - w) / 2, y: base.y - Math.min(16, (hgt - base.h) / 2), w, h: hgt};
    apply();
  }

  function home() { // NOTE: [Initial view]
    const r = host.getBoundingClientRect();
    const scale = Math.min(r.width / base.w, r.height / base.h);
    if (!(scale < READABLE_FIT_SCALE) || !firstNodes.length) { fit(); return; }
    const w = r.width / HOME_SCALE, hgt = r.height / HOME_SCALE;
    vb = {...base};
    apply(); // measure node centres in SVG units against the whole drawing
    const centres = firstNodes.map((g) => {
      const b = g.getBoundingClientRect();
      return toSvg(b.left + b.width / 2, b.top + b.height / 2);
    });
    const top = Math.min(...centres.map((p) => p.y));
    const y = hgt >= base.h ? base.y : clampInto(top - 40, hgt, base.y, base.h); // top-aligned when it all fits
    const band = centres.filter((p) => p.y >= y && p.y <= y + hgt).map((p) => p.x).sort((a, b) => a - b);
    let bestX = band.length ? band[0] : base.x, bestCount = -1;
    for (let i = 0, j = 0; i < band.length; i++) { // sliding window over the band's x positions
      while (band[j] < band[i] + w - 40 && j < band.length) j++;
      if (j - i > bestCount) { bestCount = j - i; bestX = band[i]; }
    }
    vb = {x: clampInto(bestX - 40, w, base.x, base.w), y, w, h: hgt};
    apply();
  }
  /** Show `el` readable: zoomed to at least SELECT_SCALE and centred when the view is smaller, else
   * centred only when it is not already in view. */
  function zoomTo(el) {
    const scale = svg.getScreenCTM()?.a || 1;
    if (scale >= SELECT_SCALE) { centerOn(el); return; }
    const r = el.getBoundingClientRect(), hr = host.getBoundingClientRect();
    const p = toSvg(r.left + r.width / 2, r.top + r.height / 2);
    const w = hr.width / SELECT_SCALE, hgt = hr.height / SELECT_SCALE;
    vb = {x: p.x - w / 2, y: p.y - hgt / 2, w, h: hgt};
    apply();
  }
  /** Move the top of the view down by `dy` SVG units and shorten it (the legend moved out of the SVG). */
  function trimTop(dy) {
    if (!(dy > 0) || dy >= base.h) return;
    base.y += dy; base.h -= dy;
  }

  let drag = null; // {x, y, id, moved}
  let dragEnded_ms = -Infinity; // a click right after a drag is the drag's end, not a selection
  host.addEventListener("pointerdown", (e) => {
    if (e.button === 0) drag = {x: e.clientX, y: e.clientY, id: e.pointerId, moved: false};
  });
  host.addEventListener("pointermove", (e) => {
    if (!drag || e.pointerId !== drag.id) return;
    const dx = e.clientX - drag.x, dy = e.clientY - drag.y;
    if (!drag.moved && Math.hypot(dx, dy) < 4) return;
    if (!drag.moved) { drag.moved = true; host.setPointerCapture(e.pointerId); host.classList.add("dragging"); }
    const scale = svg.getScreenCTM().a || 1; // screen px per viewBox unit
    vb = {...vb, x: vb.x - dx / scale, y: vb.y - dy / scale};
    drag.x = e.clientX; drag.y = e.clientY;
    apply();
  });
  const endDrag = (e) => {
    if (!drag || e.pointerId !== drag.id) return;
    host.classList.remove("dragging");
    if (drag.moved) dragEnded_ms = performance.now();
    drag = null;
  };
  host.addEventListener("pointerup", endDrag);
  host.addEventListener("pointercancel", endDrag);
  host.addEventListener("wheel", (e) => {
    e.preventDefault();
    zoom(Math.exp(-e.deltaY * (e.deltaMode === 1 ? 0.05 : 0.0015)), e.clientX, e.clientY);
  }, {passive: false});
  trimTop(options.trimTop || 0);
  home();
  return {zoom, fit, centerOn, zoomTo, justDragged: () => performance.now() - dragEnded_ms < 250};
}
