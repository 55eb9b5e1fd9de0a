"""The run page of a large run in Chromium (issue 26 item 2: "the run page of a 1,024-rank run opens
in under 1 s").

Per repeat a fresh page (new browser context) of ``#/runs/<run>`` on the real app (``LiveServer``,
uvicorn in this process), timed three ways:

* the page's own clock (``performance.now()`` from navigation start): the app's modules loaded
  (DOMContentLoaded); the page drawn (header, overview with its pending checks, heatmap box; a
  MutationObserver installed before the page's scripts forces layout and stamps it); the rank
  heatmap drawn (heatmap.js's ``heatmap-drawn`` performance mark); each overview check answered,
  every check answered; and "answer → drawn": from the last byte of ``/rank-index`` to the drawn
  page, and of ``/heatmap`` to the drawn heatmap;
* the renderer's main-thread task time (CDP ``Performance.getMetrics`` ``TaskDuration``, s) once the
  heatmap is drawn, and once every check has answered;
* the server's CPU time (``time.process_time`` of this process, which runs the server) from
  navigation to the drawn heatmap, and to every check answered.

Each invocation is a fresh server process: its first page ("cold") finds the server's memory
empty, so it answers from the derived documents kept in the store (NOTE: [Derived-document cache]
in graphdeck/server/derived.py) or, with ``--forget`` (those rows deleted first), computes every
check, the matching and the heatmap as a store never served before would. The operating system's
page cache is not dropped (no root on the shared host): "cold" never means a cold disk. Chromium
opens one throwaway ``about:blank`` context first (``--cold-browser``: not), so the first page
measures the server's cold start, not the browser's. Repeats
wait for every check to answer before the next page opens, so one page's slow checks do not run
under the next page's timing. Medians and min–max over repeats.

    python bench/bench_run_page.py --store STORE --run RUN [--repeats 3] [--timeout 600] [--frontend DIR] [--forget]

Stores: ``bench/bench_layout.py``'s capture generalised to 1,024 ranks (no traces), and
``bench/scale_harness.py``'s N-rank runs with traces.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: Run before the page's own scripts: stamps (page clock, ms) when each part is drawn, layout forced.
_OBSERVER = """
window.__t = {checks: {}};
new MutationObserver(() => {
  const t = window.__t, now = () => { document.body.offsetHeight; return performance.now(); };
  if (!t.page && document.querySelector('#run-overview')) t.page = now();
  if (!t.heatmap && document.querySelector('[data-testid="rank-heatmap"][data-state="done"]')) t.heatmap = now();
  if (!t.heatmap && document.querySelector('[data-testid="rank-heatmap"][data-state="error"]')) t.heatmap_error = now();
  for (const li of document.querySelectorAll('[data-testid="overview-check"]:not([data-verdict="pending"])')) {
    if (!t.checks[li.dataset.check]) t.checks[li.dataset.check] = now();
  }
  if (!t.overview && document.querySelector('#run-overview[data-state="done"], #run-overview[data-state="error"]')) t.overview = now();
}).observe(document, {childList: true, subtree: true, attributes: true});
"""


def stat(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}–{max(xs):.3f})" if xs else "—"


def _serve_frontend(server, frontend: Path) -> None:
    """Serve the dashboard's files from ``frontend`` (e.g. an older commit's ``frontend/``, from
    ``git archive``) instead of the package's, the API unchanged: the page before and after."""
    from fastapi.staticfiles import StaticFiles

    app = server.server.config.app
    for i, route in enumerate(app.router.routes):
        if getattr(route, "name", None) == "static":
            route.app = StaticFiles(directory=str(frontend))
            return
    raise RuntimeError("no /static mount to replace")


def bench(store: Path, run: str, repeats: int, timeout_s: float, frontend: Path | None = None,
          warm_browser: bool = True) -> dict:
    """Time ``repeats`` fresh pages (module docstring). With ``frontend`` (a dashboard without the
    heatmap), a page counts as drawn at the overview box and nothing waits for a heatmap."""
    sys.path.insert(0, str(REPO))
    from playwright.sync_api import sync_playwright

    from tests.conftest import CHROMIUM, CHROMIUM_ARGS, LiveServer

    rows: list[dict] = []
    first_picture = "window.__t.page" if frontend else "window.__t.heatmap || window.__t.heatmap_error"
    with LiveServer(store) as server, sync_playwright() as p:
        if frontend:
            _serve_frontend(server, frontend)
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        if warm_browser:  # a user's browser is running already: its first context is not the server's cold start
            ctx = browser.new_context()
            ctx.new_page().goto("about:blank")
            ctx.close()
        for i in range(repeats):
            ctx = browser.new_context(viewport={"width": 1440, "height": 900})
            page = ctx.new_page()
            page.add_init_script(_OBSERVER)
            cdp = ctx.new_cdp_session(page)
            cdp.send("Performance.enable")
            c0 = time.process_time()
            page.goto(f"{server.url}/#/runs/{run}")
            page.wait_for_function(first_picture, timeout=timeout_s * 1000)
            cpu_first = time.process_time() - c0
            task_first = {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}["TaskDuration"]
            page.wait_for_function("window.__t.overview", timeout=timeout_s * 1000)
            cpu_all = time.process_time() - c0
            task_all = {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}["TaskDuration"]
            t = page.evaluate("""() => {
              const end = (part) => {
                const e = performance.getEntriesByType("resource").filter((x) => x.name.includes(`/api/`) && x.name.includes(part));
                return e.length ? e[0].responseEnd : null;
              };
              const hm = document.querySelector('[data-testid="rank-heatmap"]');
              const mark = (name) => { const m = performance.getEntriesByName(name, "mark"); return m.length ? m[0].startTime : null; };
              return {...window.__t, index_end: end("/rank-index"), heatmap_end: end("/heatmap?"),
                      heatmap_answer: mark("heatmap-answer"), heatmap_drawn: mark("heatmap-drawn"),
                      dcl: performance.getEntriesByType("navigation")[0].domContentLoadedEventEnd,
                      rows: hm ? Number(hm.dataset.rows) : null, cols: hm ? Number(hm.dataset.cols) : null,
                      no_trace: hm ? Number(hm.dataset.noTrace) : null,
                      parts: Object.fromEntries(performance.getEntriesByType("resource").filter((e) => e.name.includes("/summary/"))
                        .map((e) => [e.name.split("/summary/")[1], (e.responseEnd - e.requestStart) / 1e3])),
                      resources: performance.getEntriesByType("resource").map((e) => [e.name.split("/api/")[1] || e.name.split("/").pop(),
                        Math.round(e.responseEnd), e.encodedBodySize])};
            }""")
            ctx.close()
            drawn = t.get("heatmap_drawn") or t.get("heatmap") or t.get("heatmap_error") or t["page"]
            row = {"repeat": i, "page_s": t["page"] / 1e3, "heatmap_s": drawn / 1e3, "scripts_s": t["dcl"] / 1e3,
                   "heatmap_server_s": (t["heatmap_end"] - t["index_end"]) / 1e3 if t["heatmap_end"] and t["index_end"] else None,
                   "overview_s": t["overview"] / 1e3, "checks_s": {k: v / 1e3 for k, v in t["checks"].items()},
                   "index_to_page_s": (t["page"] - t["index_end"]) / 1e3 if t["index_end"] else None,
                   "heatmap_answer_to_drawn_s": (t["heatmap_drawn"] - t["heatmap_end"]) / 1e3
                   if t.get("heatmap_drawn") and t["heatmap_end"] else None,
                   "task_first_s": task_first, "task_all_s": task_all, "server_cpu_first_s": cpu_first,
                   "server_cpu_all_s": cpu_all, "rows": t["rows"], "cols": t["cols"], "no_trace": t["no_trace"],
                   "heatmap_error": bool(t.get("heatmap_error")), "parts_s": t["parts"], "resources": t["resources"]}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "resources"}), flush=True)
        browser.close()
    return {"rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", type=Path, required=True, help="a SQLite store file")
    ap.add_argument("--run", required=True, help="the run's name or id")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600, help="seconds to wait for each page's parts")
    ap.add_argument("--json", type=Path, help="write every repeat's numbers here")
    ap.add_argument("--cold-browser", action="store_true",
                    help="no throwaway about:blank context first: the first page pays Chromium's first context too")
    ap.add_argument("--forget", action="store_true",
                    help="delete the store's derived documents first: the first page computes everything")
    ap.add_argument("--frontend", type=Path,
                    help="serve the dashboard from this folder (e.g. `git archive e9b9e54 frontend | tar -x -C DIR`, "
                         "the page before the heatmap) to compare")
    args = ap.parse_args()
    if args.repeats < 3:
        ap.error("--repeats must be at least 3 (a spread, not one time)")
    if not args.store.exists():
        ap.error(f"no store at {args.store}")
    if args.frontend and not (args.frontend / "app.js").exists():
        ap.error(f"no app.js in {args.frontend}")
    if args.forget:
        import sqlite3

        with sqlite3.connect(args.store) as db:
            gone = db.execute("DELETE FROM store_meta WHERE key LIKE 'derived:%'").rowcount
        print(f"--forget: {gone} derived document(s) deleted from the store", flush=True)
    out = bench(args.store, args.run, args.repeats, args.timeout, args.frontend, not args.cold_browser)
    rows = out["rows"]
    warm = rows[1:]  # the first page fills the server's caches
    print(f"\n{args.run}: {rows[0]['rows']} ranks x {rows[0]['cols']} columns ({rows[0]['no_trace']} without a trace); "
          f"{len(rows)} pages, the first with cold caches")
    for label, key in (("navigation -> app.js and common.js loaded (DOMContentLoaded; the page modules load after)", "scripts_s"),
                       ("navigation -> page drawn (header, overview pending, heatmap box)", "page_s"),
                       ("rank-index answer -> heatmap answer (the heatmap request's round trip)", "heatmap_server_s"),
                       ("navigation -> rank heatmap drawn", "heatmap_s"),
                       ("rank-index answer -> page drawn", "index_to_page_s"),
                       ("heatmap answer -> heatmap drawn", "heatmap_answer_to_drawn_s"),
                       ("renderer main-thread task time at the heatmap drawn", "task_first_s"),
                       ("server CPU, navigation -> heatmap drawn", "server_cpu_first_s"),
                       ("navigation -> every check answered", "overview_s"),
                       ("renderer main-thread task time, every check answered", "task_all_s"),
                       ("server CPU, navigation -> every check answered", "server_cpu_all_s")):
        xs = [r[key] for r in rows if r[key] is not None]
        ws = [r[key] for r in warm if r[key] is not None]
        print(f"  {label}: all {stat(xs)} s; warm {stat(ws)} s; cold {rows[0][key] if rows[0][key] is None else round(rows[0][key], 3)} s")
    keys = sorted({k for r in rows for k in r["checks_s"]})
    print("  each check answered (navigation ->, s): " + "; ".join(
        f"{k} {stat([r['checks_s'][k] for r in rows if k in r['checks_s']])}" for k in keys))
    parts = sorted({k for r in rows for k in r["parts_s"]})
    print("  each part's request (sent -> answered, s), all pages: " + "; ".join(
        f"{k} {stat([r['parts_s'][k] for r in rows if k in r['parts_s']])}" for k in parts))
    print("  ... the first page: " + "; ".join(f"{k} {rows[0]['parts_s'][k]:.3f}" for k in parts if k in rows[0]["parts_s"]))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
