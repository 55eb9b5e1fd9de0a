"""What a new user hit in one afternoon (issue 24): one test per point, on real inputs."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.store.db import open_engine
from graphdeck.store.schema import Rank, Run
from graphdeck.store.torch_trace import import_torch_trace, torch_version_of
from tests.conftest import shared_path

DETACH = ("data", "torch_trace", "generated_torch2.13_cpu_gloo", "detach")


def test_imported_ranks_carry_the_runs_world_size_and_a_plain_torch_version(tmp_path):
    """Item 3: each rank of an imported 2-rank log said world size 1 and showed the raw JSON of the
    ``torch_version`` artifact (``{"pytorch_version": "2.13.0+cpu", "commit": "cf30…``)."""
    folder = shared_path(*DETACH)
    engine = open_engine(tmp_path / "s.db")
    import_torch_trace(engine, sorted(folder.glob("*.log")), run_name="detach")
    with Session(engine) as s:
        run = s.scalars(select(Run)).one()
        ranks = s.scalars(select(Rank).order_by(Rank.rank)).all()
    assert run.world_size == 2
    assert [(r.rank, r.world_size, r.torch_version) for r in ranks] == [(0, 2, "2.13.0+cpu"), (1, 2, "2.13.0+cpu")]


def test_torch_version_artifact_forms():
    assert torch_version_of('{\n"pytorch_version": "2.9.1+cu128",\n"commit": "abc"\n}') == "2.9.1+cu128"
    assert torch_version_of("2.4.0\n") == "2.4.0"
    assert torch_version_of('"2.5.0"') == "2.5.0"
