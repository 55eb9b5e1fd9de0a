"""Issue 40 item 3 (newcomer report): kernels of a plain CPU Inductor TORCH_TRACE log (no
``INDUCTOR_PROVENANCE``) are linked to the post-grad nodes each call computes, by the wrapper's
dataflow (NOTE: [C++ kernels by wrapper dataflow]): every linked name is a node of the graph it is
linked to, and extern calls stay one key per call site on ``/api/graphs/<id>/kernels``.

Before the fix a plain log got 0 kernel links, and a provenance log linked
``cpp_fused_threshold_backward_*`` to GELU-backward nodes, ``aten::addmm`` to ``gelu, mul_5``, and
all ``mm`` calls under one key, some to names (``scalar_tensor``, ``(unnamed)``) not in the graph.

Input: a real job made here — a tiny MLP (Linear→ReLU→Linear→GELU→Linear), torch.compile with the
default backend (Inductor, C++ on CPU), forward + backward, ``TORCH_TRACE`` set (one g++ compile,
20–60 s).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import defaultdict

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.store.db import open_engine
from graphdeck.store.schema import Graph, KernelNode, Node
from tests.conftest import LiveServer, shared_path

JOB = r"""
import torch, torch.nn as nn
torch.manual_seed(0)
class MLP(nn.Module):
    def __init__(s):
        super().__init__(); s.fc1 = nn.Linear(16, 32); s.fc2 = nn.Linear(32, 32); s.out = nn.Linear(32, 4)
    def forward(s, x):
        h = torch.relu(s.fc1(x))
        h = torch.nn.functional.gelu(s.fc2(h))
        return s.out(h)
m = torch.compile(MLP())
x = torch.randn(8, 16)
m(x).sum().backward()
print("ok")
"""


@pytest.fixture(scope="module")
def plain_log(tmp_path_factory):
    d = tmp_path_factory.mktemp("cpplog")
    env = {k: v for k, v in os.environ.items() if k not in ("INDUCTOR_PROVENANCE", "TORCH_LOGS")}
    env.update(TORCH_TRACE=str(d / "trace"), TORCHINDUCTOR_CACHE_DIR=str(d / "cache"),
               TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_COMPILE_THREADS="1")
    (d / "job.py").write_text(JOB)
    proc = subprocess.run([sys.executable, str(d / "job.py")], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
    text = next((d / "trace").glob("*.log")).read_text()
    assert "cpp_pybinding" in text and "inductor_provenance_tracking_node_mappings" not in text, \
        "a plain C++ Inductor log (no provenance artifacts)"
    store = d / "s.db"
    imp = subprocess.run([sys.executable, "-m", "graphdeck.cli", "import", str(d / "trace"), "--store", str(store),
                          "--run", "cpp", "--no-progress"], capture_output=True, text=True, timeout=300)
    assert imp.returncode == 0, imp.stderr
    assert " 0 kernel links" not in imp.stdout and "INDUCTOR_PROVENANCE" not in imp.stderr, imp.stdout + imp.stderr
    return store


def _links(store):
    """graph name → "<kernel>#<call>" → node names, and graph name → its node names."""
    links: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    names: dict[str, set[str]] = defaultdict(set)
    engine = open_engine(store)
    with Session(engine) as s:
        for g, k, ci, n in s.execute(select(Graph.name, KernelNode.kernel_name, KernelNode.call_index,
                                            KernelNode.node_name).join(Graph, Graph.id == KernelNode.graph_id)):
            links[g][f"{k}#{ci}"].add(n)
        for g, n in s.execute(select(Graph.name, Node.name).join(Graph, Graph.id == Node.graph_id)):
            names[g].add(n)
    return links, names


def _one(kernels: dict, part: str) -> set[str]:
    """The nodes of the one C++ kernel call whose name has ``part`` (``cpp_fused_sum_threshold_backward_1``)."""
    got = [v for k, v in kernels.items() if k.startswith("cpp_fused_") and part in k]
    assert len(got) == 1, (part, sorted(kernels))
    return got[0]


def test_plain_cpu_log_links_each_call_to_the_nodes_it_computes(plain_log):
    links, names = _links(plain_log)
    fwd = next(v for g, v in links.items() if "forward" in g and "post-grad" in g)
    bwd = next(v for g, v in links.items() if "backward" in g and "post-grad" in g)
    for g, kernels in links.items():
        missing = {n for ns in kernels.values() for n in ns} - names[g]
        assert not missing, f"{g}: linked names not in the graph: {missing}"
    # forward: relu alone; the GELU kernel computes gelu's decomposition (erf) and nothing of relu
    assert _one(fwd, "_relu_") == {"relu"}
    assert "erf" in _one(fwd, "_gelu_") and "relu" not in _one(fwd, "_gelu_")
    # backward: ReLU's backward (le/where) is the threshold kernel's, not an mm's; GELU's backward
    # (erf, exp) is the gelu_backward kernel's, not the threshold kernel's
    thr = _one(bwd, "_threshold_backward_")
    assert {"le", "where"} <= thr and not thr & {"erf", "exp", "exp_1", "add", "mm"}, thr
    gb = _one(bwd, "_gelu_backward_")
    assert {"erf", "exp"} <= gb and not gb & {"le", "where"}, gb
    mms = {k: v for k, v in bwd.items() if k.startswith("aten::mm#")}
    assert len(mms) >= 4, f"each extern mm call is its own call site: {sorted(mms)}"
    matmuls = sorted(n for v in mms.values() for n in v if n.startswith("mm"))
    assert len(matmuls) == len(set(matmuls)) == len(mms), f"one mm node per mm call: {mms}"
    assert not any({"le", "where", "full_default"} & v for v in mms.values()), mms


def test_kernels_api_keys_extern_calls_per_call_site(plain_log):
    engine = open_engine(plain_log)
    with Session(engine) as s:
        gid = s.scalar(select(Graph.id).where(Graph.name.like("%backward · post-grad%")))
    with LiveServer(plain_log) as srv:
        body = httpx.get(f"{srv.url}/api/graphs/{gid}/kernels").json()
    mm_keys = [k for k in body["kernels"] if k.startswith("aten::mm")]
    assert len(mm_keys) >= 4 and all(" #" in k for k in mm_keys), mm_keys
    # node → kernel tells the mm calls apart
    per_node = {n: ks for n, ks in body["nodes"].items() if n.startswith("mm")}
    assert len({ks[0] for ks in per_node.values()}) == len(per_node), per_node


def test_import_says_why_a_triton_log_has_no_kernel_links(tmp_path):
    """A GPU (Triton) log without provenance records: the import names the reason for 0 links."""
    src = shared_path("data", "torch_trace", "tlparse_tests", "inputs", "multi_rank_messy_input",
                      "dedicated_log_torch_trace_rank_0.log")
    (tmp_path / "logs").mkdir()
    shutil.copy(src, tmp_path / "logs" / src.name)
    imp = subprocess.run([sys.executable, "-m", "graphdeck.cli", "import", str(tmp_path / "logs"), "--store",
                          str(tmp_path / "t.db"), "--run", "t", "--no-progress"], capture_output=True, text=True,
                         timeout=300)
    assert imp.returncode == 0, imp.stderr
    assert "0 kernel links" in imp.stdout and "INDUCTOR_PROVENANCE=1" in imp.stderr, imp.stderr
