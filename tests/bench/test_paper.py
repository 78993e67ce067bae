"""``flashprobe bench paper`` at a tiny budget (``--tiny``): files, schema, verdicts, an FP64 oracle.

The verdicts at this size mean little; what is checked is that every verdict is the one its
criterion gives on the measured numbers, and that the numbers are right (F4's error ratio is
recomputed by hand from the documented input recipe).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import torch

from flashprobe.bench import paper
from flashprobe.bench.claims import CLAIM_IDS, CRITERIA, PAPER, VERDICTS, judge_f4
from flashprobe.bench.paper_runs import PaperSettings, build_claims
from flashprobe.cli import main as cli_main
from flashprobe.kernels import get_kernel

FIGURES = ("paper_length.png", "paper_precision.png", "paper_tiles.png")


#: one xdist worker runs the whole module (.ci/run: --dist loadgroup), so its module fixture runs once
pytestmark = pytest.mark.xdist_group("bench/test_paper")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("paper")
    threads = torch.get_num_threads()
    assert cli_main(["bench", "paper", "--tiny", "--out", str(out)]) == 0
    assert torch.get_num_threads() == threads  # --threads applies while measuring only
    return out, json.loads((out / "paper.json").read_text())


def test_files_and_schema(tiny_run: tuple[Path, dict]) -> None:
    out, doc = tiny_run
    for name in FIGURES:
        assert (out / name).read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert [c["id"] for c in doc["claims"]] == list(CLAIM_IDS)
    for claim in doc["claims"]:
        assert claim["verdict"] in VERDICTS and claim["why"]
        assert claim["paper"] == PAPER[claim["id"]] and claim["criterion"] == CRITERIA[claim["id"]]
        assert {"measured", "unit", "display", "setting", "real", "spread", "details"} <= claim.keys()
        for real in claim["real"].values():
            assert real["verdict"] in VERDICTS and "measured" in real
    by = {c["id"]: c for c in doc["claims"]}
    for claim_id in ("F3", "F4", "F5"):
        assert set(by[claim_id]["real"]) == {"tiled:preset=fa2,block_k=8", "sdpa_flash"}
    assert set(doc["sweeps"]) == {"length", "precision", "tiles"}
    assert doc["command"] == f"flashprobe bench paper --tiny --out {out}"
    assert doc["settings"] == json.loads(json.dumps(PaperSettings.tiny().as_dict())) and doc["threads"] == 1
    text = (out / "paper.md").read_text()
    assert "| claim | the paper |" in text and all(f"**{i}**" in text for i in CLAIM_IDS)


def test_verdicts_follow_from_the_stored_numbers(tiny_run: tuple[Path, dict]) -> None:
    """Recomputing the claims from the stored sweep rows gives the stored verdicts, and F4's
    verdict is its criterion applied to its measured median and spread."""
    _, doc = tiny_run
    again = [c.as_dict() for c in build_claims(doc["sweeps"], PaperSettings.tiny())]
    assert [(c["id"], c["verdict"], c["why"]) for c in again] == [
        (c["id"], c["verdict"], c["why"]) for c in doc["claims"]
    ]
    f4 = next(c for c in doc["claims"] if c["id"] == "F4")
    assert f4["verdict"] == judge_f4(f4["measured"], f4["spread"]["min"], f4["spread"]["max"]).verdict


def test_f4_ratio_against_a_hand_computation(tiny_run: tuple[Path, dict]) -> None:
    """Oracle: q, k, v drawn as documented (one generator, randn q, k, v in float64, cast to
    bf16), golden = softmax attention in float64, baseline written out in bf16."""
    _, doc = tiny_run
    f4 = next(c for c in doc["claims"] if c["id"] == "F4")
    setting = f4["setting"]
    kernel = get_kernel(setting["kernel"])
    ratios = []
    for seed in setting["seeds"]:
        gen = torch.Generator().manual_seed(seed)
        shape = (1, setting["heads"], setting["seq_len"], setting["head_dim"])
        drawn = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(3)]
        q, k, v = (t.to(torch.bfloat16) for t in drawn)
        scale = 1 / math.sqrt(shape[-1])
        golden = torch.softmax(q.double() @ k.double().transpose(-2, -1) * scale, dim=-1) @ v.double()
        baseline = torch.softmax((q @ k.transpose(-2, -1)) * scale, dim=-1) @ v
        p = (kernel(q, k, v).double() - golden).abs().max().item()
        b = (baseline.double() - golden).abs().max().item()
        ratios.append(p / b)
    assert setting["key_tiles"] == math.ceil(setting["seq_len"] / setting["block_k"])
    assert f4["measured"] == pytest.approx(statistics.median(ratios), rel=1e-9)
    assert (f4["spread"]["min"], f4["spread"]["max"]) == pytest.approx((min(ratios), max(ratios)), rel=1e-9)


def test_tiles_sweep_rows(tiny_run: tuple[Path, dict]) -> None:
    _, doc = tiny_run
    rows = doc["sweeps"]["tiles"]
    variants = {(r["role"], r["variant"]) for r in rows}
    expected = {("paper", v) for v in ("default", "swapped", "reverse", "shuffle", "square", "narrow")}
    assert expected | {("fa2", "forward"), ("fa2", "shuffle"), ("fa2", "default")} <= variants
    square = next(r for r in rows if r["variant"] == "square" and r["role"] == "paper")
    narrow = next(r for r in rows if r["variant"] == "narrow" and r["role"] == "paper")
    assert (square["block_q"], square["block_k"], narrow["block_q"], narrow["block_k"]) == (16, 16, 4, 16)
    # the swapped tile exists only where Br = d < Bc, and then its Bc is d
    assert {r["block_k"] for r in rows if r["variant"] == "swapped"} == {16}
    assert all(r["dtype"] == "bf16" for r in rows)


def test_replot_redraws_without_measuring(tiny_run: tuple[Path, dict], tmp_path: Path) -> None:
    out, _ = tiny_run
    copy = tmp_path / "copy"
    copy.mkdir()
    text = (out / "paper.json").read_text()
    (copy / "paper.json").write_text(text)
    assert paper.main(["--replot", "--out", str(copy)]) == 0
    for name in (*FIGURES, "paper.md"):
        assert (copy / name).exists()
    assert (copy / "paper.md").read_text() == (out / "paper.md").read_text()
    assert (copy / "paper.json").read_text() == text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--threads", "0"], "--threads must be at least 1"),
        (["--seed", "-1"], "--seed must be ≥ 0"),
        (["--replot"], "run `flashprobe bench paper --out"),
        (["--device", "cuda:0"] if not torch.cuda.is_available() else ["--device", "tpu"], "--device"),
    ],
)
def test_bad_arguments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert paper.main(["--tiny", *args, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flashprobe bench paper: error:") and message in err, err
    assert not (tmp_path / "paper.json").exists()
