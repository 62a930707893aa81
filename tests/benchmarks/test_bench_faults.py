"""The fault and load suite, small (``--quick``), as CI runs it: every case meets its
expectations and no case serves a wrong byte. (Its /healthz latencies are timings: they
are recorded by the benchmark, not asserted here.)"""

from __future__ import annotations

import json

import pytest

from kvtier.cli.main import main

pytestmark = pytest.mark.timeout(600)


def test_every_fault_case_holds_and_serves_no_wrong_byte(tmp_path, capsys):
    out = tmp_path / "faults.json"
    rc = main(["bench", "faults", "--quick", "--out", str(out)])
    doc = json.loads(out.read_text())
    rows = {r["case"]: r for r in doc["rows"]}
    assert len(rows) == 7
    for case, row in rows.items():
        assert row["ok"], (case, row["outcome"])
        assert row["wrong_bytes"] == 0 and row["failed_requests"] == 0, case
        assert row["healthz_failures"] == 0, case  # the service answered throughout
    assert rc == 0
    assert "kill -9" in capsys.readouterr().out
