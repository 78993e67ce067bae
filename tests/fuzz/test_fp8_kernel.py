"""``flashprobe fuzz`` on an FP8 ``tiled`` spec: it runs, judges forward only, and names why it
cannot run a case. (How wide the rule's limits are for FP8 belongs to the rule, not checked here.)"""

from __future__ import annotations

import json

from flashprobe.fuzz import VERDICTS
from flashprobe.fuzz.cli import main

FA3 = "tiled:preset=fa3_fp8"


def test_fuzz_runs_the_fa3_fp8_preset(tmp_path):
    cases = [a for c in ("single_key", "padding_mask", "head_dim_192", "scale_zero") for a in ("--case", c)]
    code = main(["--kernel", FA3, "--dtype", "bf16", *cases, "--out", str(tmp_path)])
    payload = json.loads((tmp_path / "fuzz.json").read_text())
    rows = {r["case"]: r for r in payload["rows"]}
    assert set(rows) == {"single_key", "padding_mask", "head_dim_192", "scale_zero"}
    assert all(r["verdict"] in VERDICTS for r in rows.values())
    assert code == (1 if payload["summary"]["fail"] else 0)
    assert rows["head_dim_192"]["verdict"] == "unsupported"
    assert "the kernel takes head dims 1, 2, 4, 8, 16, 32, 64, 128" in rows["head_dim_192"]["reason"]
    for case in ("single_key", "padding_mask"):  # judged on values, never a crash; no backward to check
        assert rows[case]["verdict"] in ("pass", "fail", "no_backward")
        assert rows[case].get("failure") in (None, "values")
        assert rows[case]["primary_golden_max_abs"] is not None
    # a case that checks gradients: its forward is judged, its backward reported as absent
    assert rows["scale_zero"]["verdict"] in ("no_backward", "fail")
    assert "inputs require grad, but it has no backward" in rows["scale_zero"]["reason"]
    assert rows["scale_zero"]["primary_golden_max_abs"] is not None
