"""`phloem bench plan-scaling`: the table and JSON of the data-parallel scaling model, and a
clear exit 2 on bad arguments."""

from __future__ import annotations

import json

from phloem.entrypoints import cli


def test_plan_scaling_cli_table_and_json(tmp_path, capsys) -> None:
    out = tmp_path / "scaling.json"
    argv = ["bench", "plan-scaling", "--workload", "shared-prefix", "--num-groups", "8",
            "--replicas", "1,4", "--json", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    table = capsys.readouterr().out
    assert "prefix_aware" in table and "contiguous" in table and "random" in table
    result = json.loads(out.read_text())
    points = {(p["replicas"], p["strategy"]): p for p in result["points"]}
    assert len(points) == 6 and result["workload"]["num_requests"] == 8 * 16
    assert points[4, "prefix_aware"]["reuse_ratio"] == points[1, "prefix_aware"]["reuse_ratio"]
    assert points[4, "random"]["reuse_ratio"] < points[1, "random"]["reuse_ratio"]
    assert points[4, "prefix_aware"]["planned_imbalance"] == 1.0  # 8 equal groups over 4


def test_plan_scaling_cli_bad_arguments(capsys) -> None:
    assert cli.main(["bench", "plan-scaling", "--replicas", "4,x"]) == 2
    assert "--replicas must be comma-separated integers >= 1" in capsys.readouterr().err
    assert cli.main(["bench", "plan-scaling", "--model", "/no/such/dir"]) == 2
    assert "neither a shipped config" in capsys.readouterr().err
