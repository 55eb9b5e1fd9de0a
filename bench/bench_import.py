"""TORCH_TRACE import: time and peak memory of ``graphdeck import`` vs the anchor, tlparse, on
the same logs, run in the same command.

Both run as child processes under GNU ``/usr/bin/time -f "%e %U %S %M"`` (wall seconds, user and
system CPU seconds, peak RSS in KiB), each into a fresh output (a new SQLite store / a new tlparse
folder), interleaved (graphdeck, tlparse, graphdeck, ...); the median (min–max) of ``--repeat``
runs is reported with the ratio graphdeck / tlparse of the medians, for CPU time (user + system:
on a shared host wall time is mostly other users' load) and for wall time. tlparse gets
``--all-ranks-html`` on rank folders (as the issue's reference numbers) and its defaults on single
logs. ``--commands`` also times the read commands a user types next (``check-ranks``,
``check-grads``, ``check-compile``, ``summary``) on the 2-rank store.

Inputs: the multi-rank logs of ``../shared/data/torch_trace`` and one large single log, made by
``--make-big`` (a 20-block MLP-transformer stack compiled with Inductor under ``TORCH_TRACE``,
compiled again after ``torch._dynamo.reset()`` until the log passes ``--big-mb``; cached under
``/tmp/graphdeck-bench/big``, never in git). Prefixes of the big log (25 %, 50 %, cut at a record
boundary) show whether memory grows with file size.

Usage::

    python bench/bench_import.py --make-big            # once: writes the ≥100 MB log (minutes)
    python bench/bench_import.py [--repeat 5] [--small-only] [--no-prefixes] [--commands]
    python bench/bench_import.py --singles --repeat 5   # each single-file log of tlparse's tests
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "torch_trace"
CACHE = Path("/tmp/graphdeck-bench")
MULTI = {
    "multi_rank_runtime (7 ranks)": DATA / "tlparse_tests" / "inputs" / "multi_rank_runtime",
    "multi_rank_logs (4 ranks)": DATA / "tlparse_tests" / "inputs" / "multi_rank_logs",
    "generated ddp (2 ranks)": DATA / "generated_torch2.13_cpu_gloo" / "ddp",
}
#: Single-file logs (``--singles``): every single TORCH_TRACE log of tlparse's own test inputs.
SINGLES = sorted(p for p in (DATA / "tlparse_tests" / "inputs").iterdir() if p.is_file()) \
    if (DATA / "tlparse_tests" / "inputs").is_dir() else []
GEN = r"""
import sys, torch, torch.nn as nn
target = int(sys.argv[1]) * 1024 * 1024
class Block(nn.Module):
    def __init__(s, d=64):
        super().__init__(); s.ln = nn.LayerNorm(d); s.fc1 = nn.Linear(d, 4 * d); s.fc2 = nn.Linear(4 * d, d)
    def forward(s, x):
        return x + s.fc2(torch.nn.functional.gelu(s.fc1(s.ln(x))))
model = nn.Sequential(*[Block() for _ in range(20)])
x = torch.randn(8, 64)
import glob, os
def size():
    return sum(os.path.getsize(f) for f in glob.glob(os.path.join(os.environ["TORCH_TRACE"], "*.log")))
while size() < target:
    torch._dynamo.reset()
    torch.compile(model)(x).sum().backward()
"""


def timed(cmd: list[str], env: dict | None = None, ok: tuple = (0,)) -> tuple[float, float, float]:
    """(wall seconds, peak RSS MiB, CPU seconds = user + system) of ``cmd`` as GNU time reports them;
    an exit status outside ``ok`` raises."""
    out = subprocess.run(["/usr/bin/time", "-f", "%e %U %S %M", *cmd], capture_output=True, text=True, env=env)
    if out.returncode not in ok:
        raise RuntimeError(f"{cmd[0]} failed: {out.stderr[-2000:]}")
    wall, user, system, rss_kib = out.stderr.strip().splitlines()[-1].split()
    return float(wall), int(rss_kib) / 1024, float(user) + float(system)


def run_graphdeck(path: Path, tmp: Path) -> tuple[float, float, float]:
    store = tmp / "bench.db"
    for suffix in ("", "-wal", "-shm"):
        Path(f"{store}{suffix}").unlink(missing_ok=True)
    return timed([sys.executable, "-m", "graphdeck.cli", "import", str(path), "--store", str(store), "--run", "b",
                  "--no-progress"])


def run_tlparse(path: Path, tmp: Path) -> tuple[float, float, float]:
    out = tmp / "tl_out"
    shutil.rmtree(out, ignore_errors=True)
    extra = ["--all-ranks-html"] if path.is_dir() else []
    return timed(["tlparse", str(path), "-o", str(out), "--overwrite", "--no-browser", *extra])


def prefix_copy(src: Path, fraction: float, dst: Path) -> Path:
    """The first ``fraction`` of ``src``, cut before a glog line (a record boundary)."""
    limit = int(src.stat().st_size * fraction)
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        written = 0
        for line in fin:
            if written >= limit and line[:1] == b"V":
                break
            fout.write(line)
            written += len(line)
    return dst


def make_big(mb: int) -> None:
    folder = CACHE / "big"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    env = {**os.environ, "TORCH_TRACE": str(folder), "TORCHINDUCTOR_COMPILE_THREADS": "1", "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", GEN, str(mb)], env=env, check=True)


def big_log() -> Path | None:
    logs = sorted((CACHE / "big").glob("*.log"), key=lambda p: p.stat().st_size)
    return logs[-1] if logs else None


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}–{max(xs):.2f})"


def run_command(args: list[str]) -> tuple[float, float, float]:
    """A read command; exit 1 (the check found something) or 3 (INCOMPLETE) is an answer too."""
    return timed([sys.executable, "-m", "graphdeck.cli", *args], ok=(0, 1, 3))


def time_commands(store_folder: Path, tmp: Path, repeat: int) -> None:
    """CPU s of the read commands on a store of ``store_folder`` (imported once)."""
    store = tmp / "cmds.db"
    run_graphdeck(store_folder, tmp)
    shutil.copy(tmp / "bench.db", store)
    cmds = {"check-ranks": ["check-ranks", str(store), "--run", "b"],
            "check-grads": ["check-grads", str(store), "--run", "b"],
            "check-compile": ["check-compile", str(store), "--run", "b"],
            "summary": ["summary", "b", "--store", str(store)],
            "--help": ["--help"]}
    print(f"\n{'command (2-rank store)':34s} {'CPU s median (min-max)':>24s} {'MiB':>6s}")
    for name, args in cmds.items():
        runs = [run_command(args) for _ in range(repeat)]
        print(f"{name:34s} {_spread([r[2] for r in runs]):>24s} {statistics.median(r[1] for r in runs):6.0f}",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5, help="runs per input (median reported)")
    ap.add_argument("--no-prefixes", action="store_true", help="the large log whole, without its 25%% / 50%% prefixes")
    ap.add_argument("--commands", action="store_true", help="also time check-ranks/-grads/-compile and summary")
    ap.add_argument("--make-big", action="store_true", help="generate the large single log first")
    ap.add_argument("--big-mb", type=int, default=100, help="size of the large log to generate, MiB")
    ap.add_argument("--big", type=Path, default=None, help="use this large log instead of the cached one")
    ap.add_argument("--small-only", action="store_true", help="only the multi-rank logs (no large log)")
    ap.add_argument("--singles", action="store_true",
                    help="only tlparse's single-file test logs, one row each (issue 41 goal 4: <= 0.1 CPU s)")
    args = ap.parse_args()
    if shutil.which("tlparse") is None:
        sys.exit("tlparse is not installed (pip install tlparse)")
    if args.make_big:
        make_big(args.big_mb)
    inputs = {p.name: p for p in SINGLES} if args.singles else dict(MULTI)
    big = None if args.small_only or args.singles else args.big or big_log()
    tmp = Path(tempfile.mkdtemp(prefix="gd-bench-import-"))
    if big is not None and not args.no_prefixes:
        inputs[f"big 25% ({big.stat().st_size * 0.25 / 2**20:.0f} MiB)"] = prefix_copy(big, 0.25, tmp / "b25.log")
        inputs[f"big 50% ({big.stat().st_size * 0.5 / 2**20:.0f} MiB)"] = prefix_copy(big, 0.5, tmp / "b50.log")
    if big is not None:
        inputs[f"big single log ({big.stat().st_size / 2**20:.0f} MiB)"] = big
    elif not args.singles:
        print("no large log: run with --make-big first", file=sys.stderr)
    print(f"{'input':34s} {'graphdeck CPU s':>20s} {'tlparse CPU s':>20s} {'CPU x':>6s} "
          f"{'gd wall s':>9s} {'tl wall s':>9s} {'wall x':>6s} "
          f"{'graphdeck MiB':>13s} {'tlparse MiB':>11s} {'mem x':>6s}")
    try:
        for label, path in inputs.items():
            g, t = [], []
            for _ in range(args.repeat):  # interleaved: both see the same host load
                g.append(run_graphdeck(path, tmp))
                t.append(run_tlparse(path, tmp))
            gw, gm = statistics.median(x[0] for x in g), statistics.median(x[1] for x in g)
            tw, tm = statistics.median(x[0] for x in t), statistics.median(x[1] for x in t)
            gc, tc = statistics.median(x[2] for x in g), statistics.median(x[2] for x in t)
            print(f"{label:34s} {_spread([x[2] for x in g]):>20s} {_spread([x[2] for x in t]):>20s} {gc / tc:6.2f} "
                  f"{gw:9.2f} {tw:9.2f} {gw / tw:6.2f} {gm:13.0f} {tm:11.0f} {gm / tm:6.2f}", flush=True)
        if args.commands:
            time_commands(MULTI["generated ddp (2 ranks)"], tmp, args.repeat)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
