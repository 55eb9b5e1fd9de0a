// graphdeck dashboard: shared helpers of every page (DOM building, formatting, the JSON API, crumbs).
//
// NOTE: [Untrusted text]
// Node names, module paths, stack traces, file names and trace event names come from user code.
// They enter the page only as text: through h() below (createElement + text nodes) or
// textContent, never innerHTML. The only markup parsed is the server's own SVG render (graph.js),
// which must have an <svg> root and has any <script>, <foreignObject> and on* attributes removed.

export const $app = document.getElementById("app");
const $crumbs = document.getElementById("crumbs");

// ---------------------------------------------------------------- DOM and formatting helpers

/** h("a", {href: "#/runs", class: "x", onclick: fn}, "text", child) → Element; strings become text. */
function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else if (key === "class") el.className = value;
    else el.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : String(child));
  }
  return el;
}

const cssToken = (text) => String(text ?? "none").replace(/[^A-Za-z0-9_-]/g, "_");
const isBlank = (v) => v === null || v === undefined || v === "";
const fmt = (v) => (isBlank(v) ? "—" : typeof v === "object" ? JSON.stringify(v) : String(v));

function fmtBytes(n) {
  if (isBlank(n)) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = Number(n), i = 0;
  while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  return i === 0 ? `${v} B` : `${v.toFixed(1)} ${units[i]}`;
}

function fmtSeconds(s) {
  if (isBlank(s)) return "—";
  return s < 1 ? `${(s * 1000).toFixed(1)} ms` : `${Number(s).toFixed(2)} s`;
}

function fmtDate(text) {
  if (isBlank(text)) return "—";
  const d = new Date(text);
  return Number.isNaN(d.getTime()) ? String(text) : d.toLocaleString();
}

const plural = (n, word) => `${n} ${word}${n === 1 ? "" : "s"}`;
const badge = (text, kindClass) => h("span", {class: `badge ${kindClass}`}, text);
const kindBadge = (kind) => badge(fmt(kind), `kind kind-${cssToken(kind)}`);
const statusBadge = (status) => badge(fmt(status), `status status-${cssToken(status)}`);
const code = (text) => h("code", {}, fmt(text));
const num = (v) => h("td", {class: "num"}, fmt(v));
const graphLink = (id, label) => h("a", {href: `#/graphs/${id}`}, label ?? `#${id}`);

/** A <table id=... data-testid=...> with a header row; `rows` are <tr> elements.
 * `opts.caption`: what the table shows (a <caption>); `opts.empty`: why it can be empty — a table
 * without rows says so in its footer ("No rows: <why>") instead of standing as bare headers. */
function table(id, headers, rows, cls = "", opts = {}) {
  const numeric = rows.length ? [...rows[0].children].map((td) => td.classList.contains("num")) : [];
  return h("table", {id, "data-testid": id, class: `data ${cls}${rows.length ? "" : " empty"}`},
    opts.caption ? h("caption", {}, opts.caption) : null,
    h("thead", {}, h("tr", {}, headers.map((x, i) => h("th", {class: numeric[i] ? "num" : null}, x)))),
    h("tbody", {}, rows),
    rows.length ? null : h("tfoot", {}, h("tr", {}, h("td", {colspan: headers.length, class: "muted",
      "data-testid": `${id}-empty`}, `No rows: ${opts.empty || "nothing to show"}`))));
}

/** Key/value pairs as a <dl>; rows with blank values are left out unless `keepBlank`. */
function defList(pairs, attrs = {}, keepBlank = false) {
  const items = pairs.filter(([, v]) => keepBlank || !isBlank(v));
  return h("dl", {class: "kv", ...attrs}, items.map(([k, v]) => [
    h("dt", {}, k), h("dd", {}, v instanceof Node ? v : fmt(v))]));
}

/** An array of flat objects as a table whose columns are the union of their keys. */
function objectTable(id, rows) {
  const keys = [...new Set(rows.flatMap((r) => (r && typeof r === "object" ? Object.keys(r) : [])))];
  if (!keys.length) return h("ul", {id}, rows.map((r) => h("li", {}, fmt(r))));
  return table(id, keys, rows.map((r) => h("tr", {}, keys.map((k) => h("td", {}, fmt(r[k]))))));
}

function setCrumbs(items) {
  $crumbs.replaceChildren(...items.flatMap(([label, href], i) => [
    i ? h("span", {class: "sep"}, "›") : null,
    href ? h("a", {href}, label) : h("span", {class: "here"}, label)]).filter(Boolean));
  document.title = ["graphdeck", ...items.map(([label]) => label)].join(" · ");
}

function errorBox(err) {
  const status = err.status ? ` (HTTP ${err.status})` : "";
  return h("div", {class: "error", role: "alert", "data-testid": "error"}, `Error${status}: ${err.message}`);
}

const joinComma = (parts) => parts.flatMap((p, i) => (i ? [", ", p] : [p]));

/** In-page jump: a button, since a #fragment link would be taken by the router. */
const jumpButton = (label, selector) => h("button", {type: "button", class: "link",
  onclick: () => document.querySelector(selector)?.scrollIntoView({behavior: "smooth"})}, label);

// ---------------------------------------------------------------- API

class ApiError extends Error {
  constructor(message, status) { super(message); this.status = status; }
}

/**
 * JSON.parse, except that integers outside ±(2^53 − 1) come back as their exact decimal strings:
 * a JS number would round them (int64 nanosecond timestamps such as 1795948293425319112 would
 * print as 1795948293425319200). Numbers are only looked for outside JSON strings.
 */
function parseJsonExact(text) {
  return JSON.parse(text.replace(/"(?:[^"\\]|\\.)*"|-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?/g, (tok) =>
    (/^-?\d{16,}$/.test(tok) && !Number.isSafeInteger(Number(tok)) ? `"${tok}"` : tok)));
}

/**
 * GET `path`; JSON by default, text with {text: true}, JSON with big integers kept exact (as
 * strings, see parseJsonExact) with {exactInts: true}. Raises ApiError with the server's message.
 */
async function api(path, {text = false, exactInts = false} = {}) {
  const res = await fetch(path, {headers: {Accept: text ? "*/*" : "application/json"}});
  if (!res.ok) {
    let message = `${res.status} ${res.statusText}`;
    try { const body = await res.json(); if (body && body.error) message = body.error; } catch { /* not JSON */ }
    throw new ApiError(message, res.status);
  }
  if (exactInts) return parseJsonExact(await res.text());
  return text ? res.text() : res.json();
}

export {
  h, cssToken, isBlank, fmt, fmtBytes, fmtSeconds, fmtDate, plural, joinComma,
  badge, kindBadge, statusBadge, code, num, graphLink, table, defList, objectTable, jumpButton,
  setCrumbs, errorBox, ApiError, api, parseJsonExact,
};
