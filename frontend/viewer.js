// graphdeck dashboard: the graph page's SVG viewer: the server's render parsed safely, then pan
// (drag) and zoom (wheel, buttons) by editing its viewBox.
//
// NOTE: [Initial view]
// A graph whose whole drawing is readable (labels are 10 units tall, so at ≥ 0.7× they stay about
// 7 px or more) opens fitted. A larger one (GPT-2 AOT backward graphs are ~4,600 units wide, mostly
// cluster boxes at the top) opens at 1× on the region where the graph starts: each of the first few
// FX nodes (by idx, which is FX graph order) is tried as the centre of a host-sized window clamped
// to the drawing, and the window holding the most FX nodes wins (the earliest on a tie). So the
// first view always shows real nodes, and the "fit" button still shows everything.

const SVG_NS = "http://www.w3.org/2000/svg";
/** Fit the whole graph when that draws it at least this large (screen px per SVG unit). */
const READABLE_FIT_SCALE = 0.7;
/** Otherwise open at this scale, on the graph's first nodes. */
const HOME_SCALE = 1;
/** How many of the first FX nodes are tried as the centre of the first view. */
const HOME_CANDIDATES = 12;

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
 * `firstNodes`: the FX nodes' <g> elements in FX graph order (see NOTE: [Initial view]).
 * → {zoom(factor, clientX?, clientY?), fit(), centerOn(el), justDragged()}
 */
export function makeViewer(svg, host, firstNodes = []) {
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
    const frame = (cx, cy) => ({x: clampInto(cx - w / 2, w, base.x, base.w), y: clampInto(cy - hgt / 2, hgt, base.y, base.h), w, h: hgt});
    vb = {...base};
    apply(); // measure node centres in SVG units against the whole drawing
    const centres = firstNodes.map((g) => {
      const b = g.getBoundingClientRect();
      return toSvg(b.left + b.width / 2, b.top + b.height / 2);
    });
    const inside = (p, box) => p.x >= box.x && p.x <= box.x + box.w && p.y >= box.y && p.y <= box.y + box.h;
    let best = frame(base.x + base.w / 2, base.y), bestCount = -1;
    for (const c of centres.slice(0, HOME_CANDIDATES)) {
      const box = frame(c.x, c.y);
      const count = centres.reduce((n, p) => n + (inside(p, box) ? 1 : 0), 0);
      if (count > bestCount) { best = box; bestCount = count; }
    }
    vb = best;
    apply();
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
  home();
  return {zoom, fit, centerOn, justDragged: () => performance.now() - dragEnded_ms < 250};
}
