// graphdeck dashboard: Inductor's generated code of a graph and its provenance links
// (kernel ↔ FX node), loaded on demand from
//   GET /api/compile-events/<id>     the inductor_output_code record (payload = the code)
//   GET /api/graphs/<id>/kernels     kernel_nodes rows of the graph the code was generated for
// Code and names come from logs: they enter the page only as text (h(), NOTE: [Untrusted text]).

import {api, code, errorBox, fmt, h, plural} from "./common.js";

/** Links kernel → nodes: each node opens the graph view with that node selected. */
function kernelList(graphId, kernels) {
  const entries = Object.entries(kernels || {});
  if (!entries.length) return h("p", {class: "muted small"}, "No provenance links for this graph.");
  return h("ul", {class: "kernel-links", "data-testid": `kernel-links-${graphId}`},
    entries.map(([kernel, nodes]) => h("li", {},
      h("code", {class: "kernel-name"}, kernel), " → ",
      nodes.map((n, i) => [i ? ", " : "",
        h("a", {href: `#/graphs/${graphId}?node=${encodeURIComponent(n.node)}`, class: "node-link",
          title: n.pre_grad_node ? `pre-grad node ${n.pre_grad_node} (${n.source})` : n.source}, n.node)]))));
}

/** The other direction: each node → the kernels that compute it. */
function nodeList(graphId, nodes) {
  const entries = Object.entries(nodes || {});
  if (!entries.length) return null;
  return h("details", {class: "node-kernels", "data-testid": `node-kernels-${graphId}`},
    h("summary", {}, `by node (${entries.length})`),
    h("ul", {class: "kernel-links"}, entries.map(([node, kernels]) => h("li", {},
      h("a", {href: `#/graphs/${graphId}?node=${encodeURIComponent(node)}`, class: "node-link"}, node), " ← ",
      kernels.map((k, i) => [i ? ", " : "", h("code", {class: "kernel-name"}, k)])))));
}

/**
 * A collapsed <details> "Inductor output code": on first open it fetches the record's code and
 * the kernel → node links of its graph. `out`: {event_id, graph_id, chars} from the compile index.
 */
export function outputCodePanel(out, graph = null) {
  let loaded = false;
  const body = h("div", {class: "output-code-body", "data-testid": `output-code-body-${out.event_id}`},
    h("p", {class: "loading"}, "Loading…"));
  // Named after its graph: a compile id with several graphs has several panels (issue 24.12).
  const label = graph ? `${fmt(graph.name)} #${graph.id}` : out.graph_id != null ? `graph #${out.graph_id}` : null;
  const details = h("details", {class: "output-code", "data-testid": `output-code-${out.event_id}`},
    h("summary", {}, "output code", label ? [" of ", h("code", {}, label)] : null,
      h("span", {class: "muted small"}, ` ${fmt(out.chars)} chars`)));
  let codeRow = null;
  details.addEventListener("toggle", async () => {
    // In a table the code gets a full-width row of its own under the compile's row (a cell is too
    // narrow for it); elsewhere it opens in place.
    const row = details.closest("tr");
    if (row && details.open) {
      codeRow = codeRow || h("tr", {class: "code-row"}, h("td", {colspan: String(row.children.length)}, body));
      row.after(codeRow);
    } else if (row && codeRow) {
      codeRow.remove();
    } else if (!row && body.parentNode !== details) {
      details.append(body);
    }
    if (!details.open || loaded) return;
    loaded = true;
    try {
      const ev = await api(`/api/compile-events/${out.event_id}`);
      const links = ev.graph_id != null ? await api(`/api/graphs/${ev.graph_id}/kernels`) : null;
      const kernels = links ? Object.keys(links.kernels || {}).length : 0;
      body.replaceChildren(
        ev.graph_id != null ? h("p", {class: "small"}, "for ",
          h("a", {href: `#/graphs/${ev.graph_id}`}, fmt(ev.graph_name ?? `graph ${ev.graph_id}`)),
          links ? ` · ${plural(kernels, "kernel")} with provenance links` : "") : null,
        links ? kernelList(ev.graph_id, links.kernels) : null,
        links ? nodeList(ev.graph_id, links.nodes) : null,
        h("pre", {class: "code output-code-text"}, String(ev.payload ?? "")));
    } catch (err) {
      body.replaceChildren(errorBox(err));
    }
  });
  return details;
}

/** A kernel-count badge text for a graph link, e.g. "3 kernels". */
export const kernelBadge = (n) => (n ? h("span", {class: "tag small", title: "provenance links"}, code(`${n} k`)) : null);

/** Every compile record of a compile id (guards, metrics, artifacts), each opening its payload. */
export function recordsPanel(records) {
  if (!records || !records.length) return null;
  const items = records.map((r) => {
    const body = h("div", {});
    const item = h("details", {class: "record"}, h("summary", {}, code(r.name),
      h("span", {class: "muted small"}, r.chars ? ` ${fmt(r.chars)} chars` : "")), body);
    let loaded = false;
    item.addEventListener("toggle", async () => {
      if (!item.open || loaded) return;
      loaded = true;
      try {
        const ev = await api(`/api/compile-events/${r.event_id}`);
        body.replaceChildren(ev.payload != null ? h("pre", {class: "code output-code-text"}, String(ev.payload))
          : h("pre", {class: "code output-code-text"}, JSON.stringify(ev.metadata, null, 1)));
      } catch (err) {
        body.replaceChildren(errorBox(err));
      }
    });
    return h("li", {}, item);
  });
  return h("details", {class: "records", "data-testid": "compile-records-list"},
    h("summary", {}, plural(records.length, "record")), h("ul", {class: "record-list"}, items));
}
