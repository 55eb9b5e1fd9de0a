"""The N-way rank diff at scale (issue 42; NOTE: [N-way rank diff] in analysis/ranks/nway.py): does
one graph across 64 … 1,024 ranks cost about the number of *distinct* graphs, not ranks?

Stores are made as bench/bench_ranks.py makes them: real FX graphs (a deep MLP with a functional
``all_reduce`` every 16 layers) recorded by the capture's ``record_graph`` and written by its
``StoreWriter`` for rank 0 and the odd rank (whose last graph has ``aten.gelu`` where the others
have ``aten.relu``), the other ranks' identical rows copied in SQL (what a real capture writes).

Printed per rank count: CPU seconds of ``nway_report`` on the differing graph (median of
``--repeat``, min–max), and the anchor in the same process: the two-graph diff of the same pair
(``graph_view`` of both + ``diff_views``), which is what the N-way view must at least do. The
ratio nway / anchor staying flat from 64 to 1,024 ranks is the claim.

    python bench/bench_nway.py [--ranks 64 256 1024] [--layers 100] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_ranks import _replicate, build_graph  # noqa: E402


def generated_store(path: Path, ranks: int, odd: int, graphs: int = 2, layers: int = 20) -> Path:
    """``ranks`` ranks of run ``bench`` holding ``graphs`` identical ``aot_forward`` graphs
    (compile ids ``g/0``) each, but rank ``odd``'s last graph (relu → gelu at layer 4/5)."""
    from graphdeck.capture.fxrecord import record_graph
    from graphdeck.capture.writer import StoreWriter

    base = record_graph(build_graph(layers))
    changed = record_graph(build_graph(layers, changed_at=layers * 4 // 5))
    w = StoreWriter(path, "bench", 0, ranks, backend="gloo")
    for g in range(graphs):
        w.write_graph(base, kind="aot_forward", name=f"graph {g}", compile_id=f"{g}/0")
    w.engine.dispose()
    w = StoreWriter(path, "bench", odd, ranks, backend="gloo")
    w.write_graph(changed, kind="aot_forward", name=f"graph {graphs - 1}", compile_id=f"{graphs - 1}/0")
    w.engine.dispose()
    _replicate(path, ranks, graphs, changed_rank=odd, changed_graph=graphs - 1)
    return path


def _cpu(fn, repeat: int) -> tuple[float, float, float, object]:
    times, out = [], None
    for _ in range(repeat):
        t0 = time.process_time()
        out = fn()
        times.append(time.process_time() - t0)
    return statistics.median(times), min(times), max(times), out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--layers", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from graphdeck.analysis.graphs.diff import diff_views
    from graphdeck.analysis.graphs.view import graph_view
    from graphdeck.analysis.ranks.nway import nway_report
    from graphdeck.store.db import open_engine
    from graphdeck.store.schema import Run

    with tempfile.TemporaryDirectory() as tmp:
        for n in args.ranks:
            odd = n - 3
            t0 = time.perf_counter()
            store = generated_store(Path(tmp) / f"r{n}.db", n, odd, layers=args.layers)
            made = time.perf_counter() - t0
            engine = open_engine(store, read_only=True)
            with Session(engine) as s:
                run = s.scalars(select(Run).where(Run.name == "bench")).one()

                def nway():
                    s.expire_all()
                    return nway_report(s, run, "1/0:aot_forward", times=False)

                med, lo, hi, rep = _cpu(nway, args.repeat)
                assert [c.ranks for c in rep.classes][1] == [odd] and rep.verdict == "FAIL", rep.to_text()
                a, b = rep.classes[0].graph_id, rep.classes[1].graph_id

                def pair():
                    s.expire_all()
                    return diff_views(graph_view(s, a), graph_view(s, b))

                amed, alo, ahi, _d = _cpu(pair, args.repeat)
            engine.dispose()
            print(f"{n:5d} ranks ({rep.classes[0].fingerprints and len(rep.classes)} classes, "
                  f"{len(rep.nodes)} differing node(s); store made in {made:.1f} s): nway_report CPU {med:.3f} s "
                  f"({lo:.3f}-{hi:.3f}); anchor two-graph diff CPU {amed:.3f} s ({alo:.3f}-{ahi:.3f}); "
                  f"ratio {med / amed:.2f}x", flush=True)


if __name__ == "__main__":
    main()
