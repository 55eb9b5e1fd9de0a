"""Issue 40 item 5 (newcomer report): missing evidence has one wording in check-ranks and summary
(``INCOMPLETE: ...``, was ``MISSING EVIDENCE:`` in check-ranks); recompile reasons reach check-ranks' and summary's text as
the guard failure only — not the raw ``recompile_reasons`` payload (a JSON list printed over
lines: ``___check_obj_id(fn, …)   "`` then ``]``) nor its padding spaces.

Input: ``../shared/data/torch_trace/tlparse_tests/inputs/multi_rank_runtime`` (tlparse's 7-rank
log: ranks 5 and 6 stop recompiling an ``___check_obj_id`` guard the others fail; SOURCES.md there).
"""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import shared_path


def test_recompile_reasons_are_clean_text(tmp_path):
    logs = shared_path("data", "torch_trace", "tlparse_tests", "inputs", "multi_rank_runtime")
    store = tmp_path / "s.db"
    cli = [sys.executable, "-m", "graphdeck.cli"]
    imp = subprocess.run([*cli, "import", str(logs), "--store", str(store), "--run", "mrr", "--no-progress"],
                         capture_output=True, text=True, timeout=600)
    assert imp.returncode == 0, imp.stderr
    texts = {}
    for cmd in ("check-ranks", "summary"):
        out = subprocess.run([*cli, cmd, str(store), "--run", "mrr"], capture_output=True, text=True, timeout=600)
        lines = out.stdout.splitlines()
        hits = [ln for ln in lines if "___check_obj_id(fn, " in ln]
        assert hits, out.stdout
        assert not any(ln.strip() in ("]", "[", '"') for ln in lines), out.stdout
        for ln in hits:
            assert '"' not in ln and "   )" not in ln and "   ;" not in ln, ln
        texts[cmd] = out.stdout
    # one wording for missing evidence: check-ranks says it as summary does ("INCOMPLETE: ...")
    assert "MISSING EVIDENCE" not in texts["check-ranks"]
    gap = next(ln for ln in texts["check-ranks"].splitlines() if ln.startswith("INCOMPLETE: rank 0 "))
    assert gap in texts["summary"], (gap, texts["summary"])
