"""``flashprobe study`` end to end on a tiny budget, and ``flashprobe report`` from its files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from flashprobe.app.study import PRECISIONS, main, run_study, study_plan
from flashprobe.formats.study_file import read_study
from flashprobe.report.cli import report_main
from flashprobe.report.study_verdict import EXIT_CODES, verdict
from tests.app._study import TINY

RUNS = ["flash", "baseline", "identical", "seed1", "fp32"]
#: three replicates (seeds 0, 2, 4): a median distinct from both ends of the interval
STUDY = [*TINY, "study.replicates=3"]
REPLICATES = {0: "", 2: "_seed2", 4: "_seed4"}  # seed → what replicate's names end with
#: every run the fixture trains: replicate 0's five, then flash, baseline, seed pair, fp32 at seeds 2, 4
TRAINED = [*RUNS] + [
    n for s in (2, 4) for n in (f"flash_seed{s}", f"baseline_seed{s}", f"seed{s + 1}", f"fp32_seed{s}")
]


#: one xdist worker runs the whole module (.ci/run: --dist loadgroup), so its module fixture runs once
pytestmark = pytest.mark.xdist_group("app/test_study")


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("study")
    run_study(out, RUNS, STUDY)
    return out


def test_study_trains_like_for_like_compares_and_reports(study: Path) -> None:
    doc = json.loads((study / "study.json").read_text())
    pairs, meta = doc["pairs"], doc["study"]
    groups = {"flash_vs_baseline", "seed1_vs_seed0", "bf16_vs_fp32"}
    expected = {"identical"} | {g + sfx for g in groups - {"seed1_vs_seed0"} for sfx in REPLICATES.values()}
    expected |= {f"seed{s + 1}_vs_seed{s}" for s in REPLICATES}
    assert set(pairs) == expected and sorted(meta["runs"]) == sorted(TRAINED)
    assert meta["replicates"] == 3 and meta["seeds"] == [0, 2, 4]
    runs = meta["runs"]
    assert runs["flash"] == {
        "name": "flash",
        "attention": "flash",
        "precision": "bf16-mixed",
        "seed": 0,
        "role": "flash",
        "replicate": 0,
    }
    assert runs["flash_seed4"]["seed"] == 4 and runs["seed5"]["seed"] == 5 and runs["fp32_seed2"]["seed"] == 2
    # every pair differs in exactly one thing — as planned, and as the runs' own config.yaml, manifest and
    # run.json record it (read back by compare, independently of the plan)
    thing = {"kernel": ["attention"], "noise": [], "seed": ["seed"], "precision": ["precision"]}
    for name, c in meta["comparisons"].items():
        a, b = runs[c["run_a"]], runs[c["run_b"]]
        assert [k for k in ("attention", "precision", "seed") if a[k] != b[k]] == thing[c["kind"]], name
        assert sorted(pairs[name]["differs"]) == thing[c["kind"]], (name, pairs[name]["differs"])
        assert pairs[name]["unrecorded"] == [] and b["seed"] == c["seed"] and a["replicate"] == c["replicate"]
    # the runs really trained at the precision and seed their plan says
    for name, run in runs.items():
        manifest = json.loads((study / "runs" / name / "snapshots" / "manifest.json").read_text())
        assert (manifest["precision"], manifest["seed"]) == (run["precision"], run["seed"]), name
    assert pairs["flash_vs_baseline"]["steps"] == [0, 2, 4]
    assert pairs["identical"]["model"]["wasserstein"] == [0.0, 0.0, 0.0]  # deterministic CPU
    for sfx in REPLICATES.values():
        flash = pairs["flash_vs_baseline" + sfx]["model"]["wasserstein"]
        assert flash[0] == 0.0 and flash[-1] > 0.0
    assert (
        len({pairs["flash_vs_baseline" + sfx]["model"]["wasserstein"][-1] for sfx in REPLICATES.values()})
        == 3
    )
    assert meta["machine"]["torch_threads"] == 1 and meta["machine"]["torch"] == torch.__version__
    text = (study / "report.md").read_text()
    assert text.startswith(
        "# flashprobe study: weight deviation of sdpa_flash attention, like for like (paper §V)"
    )
    assert (
        "Noise floor: 0" in text and "| identical | nothing: the same configuration trained twice |" in text
    )
    assert "inf" not in text
    assert "[probe.png](runs/flash/probe.png)" in text and "| flash | pass | 1 |" in text  # logged at step 4
    assert "[probe.png](runs/flash_seed4/probe.png)" in text
    assert (study / "fig8_wasserstein.png").is_file() and (study / "fig7_flash_vs_baseline.png").is_file()
    # `flashprobe report` regenerates the same report from the files alone
    (study / "report.md").unlink()
    assert report_main([str(study)]) == 0
    assert (study / "report.md").read_text() == text


def _by_hand(pairs: dict, numerator: str, context: str, step: int) -> list[float]:
    """flash / context at ``step`` in each replicate (seed 0, 2, 4), from study.json's numbers."""
    out = []
    for seed, sfx in REPLICATES.items():
        ctx = f"seed{seed + 1}_vs_seed{seed}" if context == "seed" else context + sfx
        flash = pairs[numerator + sfx]
        i, j = flash["steps"].index(step), pairs[ctx]["steps"].index(step)
        out.append(flash["model"]["wasserstein"][i] / pairs[ctx]["model"]["wasserstein"][j])
    return out


def _g(x: float) -> str:
    return f"{x:.3g}"


def test_the_verdict_prints_every_ratio_with_its_interval_computed_by_hand_from_study_json(
    study: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pairs = json.loads((study / "study.json").read_text())["pairs"]
    # the same command with --compare-only: the verdict printed as a user sees it, and its exit code
    code = main(["--out", str(study), "--runs", ",".join(RUNS), "--compare-only", *STUDY])
    printed = capsys.readouterr().out
    report = (study / "report.md").read_text()
    verdicts = {}
    kernel = verdict(read_study(study)).attention[0]  # the label: the kernel run's recorded attention
    assert kernel == "sdpa_flash"
    for label, context in (("seed-to-seed", "seed"), ("bf16_vs_fp32", "bf16_vs_fp32")):
        last = _by_hand(pairs, "flash_vs_baseline", context, 4)
        ordered = sorted(last)
        median, low, high = ordered[1], ordered[0], ordered[2]  # three replicates: the middle one
        over = _by_hand(pairs, "flash_vs_baseline", context, 2) + last  # steps after the (0-step) warm-up
        line = next(x for x in printed.splitlines() if f"{kernel} / {label} = " in x)
        assert f"{kernel} / {label} = {_g(median)}× ({_g(low)}–{_g(high)}) at step 4; " in line, line
        assert f"; {_g(min(over))}–{_g(max(over))} over steps 2–4: " in line, line
        assert f"{_g(median)}× | {_g(low)}–{_g(high)} | {', '.join(map(_g, last))} |" in report
        v = verdict(read_study(study)).context["seed" if context == "seed" else context]
        assert v.ratio.values == pytest.approx(last) and v.ratio.median == pytest.approx(median)
        verdicts[context] = [_by_hand(pairs, "flash_vs_baseline", context, s) for s in (2, 4)]
    # the rule, by hand: PASS iff flash / seed is below 1 in every replicate at steps 2 and 4, and
    # flash / bf16_vs_fp32 is not above 1 in every replicate at either step
    seed_ok = all(max(r) < 1 for r in verdicts["seed"])
    low_ok = not any(min(r) > 1 for r in verdicts["bf16_vs_fp32"])
    answer = "PASS" if seed_ok and low_ok else "LOOK CLOSER"
    assert answer == "PASS"  # torch's own CPU flash kernel passes (a buggy one does not: test below)
    assert code == EXIT_CODES[answer]
    first = printed.strip().splitlines()[0]
    assert first.startswith(
        "PASS: the kernel's weight deviation is within the seed bound and not above low "
    ), first
    assert (
        "(bf16_vs_fp32) — at every snapshot step from 2 to 4, in each of the 3 replicates (seeds 0, 2, 4)"
        in first
    )


@pytest.fixture
def wrong_scale_kernel():
    """Math attention with a softmax scale 1.5× too large: a silent kernel bug."""
    from flashprobe.kernels import math_attention, register_kernel, unregister_kernel

    def wrong_scale(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
        scale = (q.shape[-1] ** -0.5 if scale is None else scale) * 1.5
        return math_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)

    register_kernel("study_wrong_scale", wrong_scale, overwrite=True)
    yield "study_wrong_scale"
    unregister_kernel("study_wrong_scale")


def test_a_buggy_kernel_is_told_to_look_closer_with_exit_code_3(
    tmp_path: Path, wrong_scale_kernel: str, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = "flash,baseline,seed1,fp32"
    code = main(["--out", str(tmp_path), "--runs", runs, *TINY, f"study.kernel={wrong_scale_kernel}"])
    printed = capsys.readouterr().out
    first = printed.split("\n\n")[-2].splitlines()[0]  # the verdict's first line
    assert code == 3, first
    # the probe failed the kernel in the flash run: that run's line says so, its per-site table follows
    lines = printed.splitlines()
    [done] = [i for i, line in enumerate(lines) if re.match(r"\[1/4\] flash +done in .* · probe FAIL", line)]
    assert lines[done + 1].startswith("flash: probe: verdict FAIL")
    assert any(line.split()[:3] == ["site", "dir", "verdict"] for line in lines[done + 1 : done + 6])
    assert re.search(r"\[2/4\] baseline +done in \d+ s · elapsed", printed)  # no probe: its line alone
    assert first.startswith(
        "LOOK CLOSER: study_wrong_scale / bf16_vs_fp32 is above 1 in every replicate at steps 2, 4"
    )
    ratio = verdict(read_study(tmp_path)).context["bf16_vs_fp32"].ratio
    assert ratio.median > 2  # far above what training at bf16 does (torch's kernel: below 1)


def test_a_study_invoked_again_skips_its_finished_runs(study: Path) -> None:
    before = {r: (study / "runs" / r / "run.json").read_text() for r in TRAINED}
    numbers = json.loads((study / "study.json").read_text())["pairs"]
    run_study(study, RUNS, STUDY)
    assert {r: (study / "runs" / r / "run.json").read_text() for r in TRAINED} == before  # nothing retrained
    assert json.loads((study / "study.json").read_text())["pairs"] == numbers
    # another number of replicates is no other setting: replicate r's runs do not depend on how many
    # there are, so a fourth replicate trains only its own runs (seeds 6 and 7)
    run_study(study, RUNS, [*TINY, "study.replicates=4"])
    assert {r: (study / "runs" / r / "run.json").read_text() for r in TRAINED} == before
    more = json.loads((study / "study.json").read_text())["pairs"]
    assert {n: p for n, p in more.items() if n in numbers} == numbers
    assert sorted(set(more) - set(numbers)) == [
        "bf16_vs_fp32_seed6",
        "flash_vs_baseline_seed6",
        "seed7_vs_seed6",
    ]
    run_study(study, RUNS, STUDY, train=False)  # back to the fixture's three, for the tests after this one
    assert json.loads((study / "study.json").read_text())["pairs"] == numbers


def test_two_invocations_give_identical_numbers(study: Path, tmp_path: Path) -> None:
    run_study(tmp_path, ["flash", "baseline"], TINY)
    again = json.loads((tmp_path / "study.json").read_text())["pairs"]["flash_vs_baseline"]
    first = json.loads((study / "study.json").read_text())["pairs"]["flash_vs_baseline"]
    assert again["model"] == first["model"] and again["tensors"] == first["tensors"]


@pytest.mark.parametrize(
    ("runs", "overrides", "message"),
    [
        (
            ["nope"],
            [],
            "unknown study run 'nope' at study.precision=bf16-mixed; choose from: flash, baseline",
        ),
        (["flash", "bf16"], [], "unknown study run 'bf16'"),  # at bf16, the baseline is the bf16 run
        (["flash", "seed1"], [], "form no like-for-like flash_vs_baseline pair"),
        (None, ["study.precision=fp8"], "study.precision='fp8' is not a study precision; use one of 32-true"),
        (None, ["study.replicates=0"], "study.replicates=0 must be a positive integer"),
        (None, ["study.replicates=two"], "study.replicates='two' must be a positive integer"),
        (None, ["seed=3"], "seed= is set by the study for each run (replicate r trains from seed 2r"),
        # a key under the study's own replicate setting would give every replicate one seed
        (None, ["study.replicate.seed=5"], "study.replicate= is set by the study for each run"),
        (["seed2"], [], "unknown study run 'seed2'"),  # seed 2 is replicate 1's: baseline_seed2
    ],
)
def test_bad_studies_fail_before_any_training(tmp_path: Path, runs, overrides, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        run_study(tmp_path / "out", runs, overrides)
    assert not (tmp_path / "out").exists()


def test_the_plan_at_each_precision_pairs_runs_that_differ_in_one_thing() -> None:
    for precision in PRECISIONS:
        plan = study_plan(precision, replicates=3)
        for c in plan.comparisons.values():
            a, b = plan.runs[c.run_a], plan.runs[c.run_b]
            assert sum(getattr(a, k) != getattr(b, k) for k in ("attention", "precision", "seed")) == (
                c.kind != "noise"
            ), (precision, c.name)
            # a pair never crosses replicates: both runs from the replicate's seed (a seed pair: 2r + 1)
            assert a.replicate == b.replicate == c.replicate and b.seed == c.seed == 2 * c.replicate
            assert a.seed == c.seed + (c.kind == "seed"), (precision, c.name)
        groups = {c.group for c in plan.comparisons.values()}
        for group in groups - {"identical", "flash_vs_baseline_fp32"}:  # trained at replicate 0 only
            assert sorted(c.replicate for c in plan.comparisons.values() if c.group == group) == [0, 1, 2]
    assert "flash_fp32" not in study_plan("32-true").runs
    assert study_plan("16-mixed").comparisons["fp16_vs_fp32"].run_a == "baseline"
    plan = study_plan("bf16-mixed", ["flash", "baseline", "seed1"], replicates=2)
    assert list(plan.runs) == ["flash", "baseline", "seed1", "flash_seed2", "baseline_seed2", "seed3"]
    assert list(plan.comparisons) == [
        "flash_vs_baseline",
        "seed1_vs_seed0",
        "flash_vs_baseline_seed2",
        "seed3_vs_seed2",
    ]


def test_report_without_study_json_says_what_to_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert report_main([str(tmp_path)]) == 2
    assert "flashprobe study --out" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"pairs": ', r"study.json: not valid JSON at line 1"),
        ('{"format": "other/1", "pairs": {}}', r"format 'other/1', expected 'flashprobe.compare/1'"),
        ('{"format": "flashprobe.compare/1", "pairs": {}}', r"no comparison under 'pairs'"),
        (
            '{"format": "flashprobe.compare/1", "pairs": {"../../../x": {"steps": [0], "model": '
            '{"wasserstein": [0.0], "max_abs": [0.0]}}}}',
            r"pair name '\.\./\.\./\.\./x' cannot be used in a file name",
        ),
        (
            '{"format": "flashprobe.compare/1", "pairs": {"x": {"steps": [0, 1], "model": '
            '{"wasserstein": [0.0], "max_abs": [0.0, 0.0]}}}}',
            r"pair 'x' column model.wasserstein does not align with its 2 steps",
        ),
    ],
)
def test_report_on_a_malformed_study_json_names_the_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, message: str
) -> None:
    (tmp_path / "study.json").write_text(content)
    for argv in ([str(tmp_path)], [str(tmp_path), "--figures"]):
        assert report_main(argv) == 2
        err = capsys.readouterr().err
        assert re.search(message, err), err
    assert not list(tmp_path.glob("*.png")) and not (tmp_path / "report.md").exists()


def test_report_on_a_missing_directory_or_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert report_main([str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    (tmp_path / "f").write_text("x")
    assert report_main([str(tmp_path / "f")]) == 2


def _pair(values: list[float]) -> dict:
    return {"run_a": "a", "run_b": "b", "steps": [0, 10], "model": {"wasserstein": values, "max_abs": values}}


def _comparison(name: str, kind: str, replicate: int = 0, group: str | None = None) -> dict:
    return {
        "name": name,
        "run_a": "a",
        "run_b": "b",
        "kind": kind,
        "isolates": f"what {name} isolates",
        "group": group or name,
        "replicate": replicate,
        "seed": 2 * replicate,
    }


@pytest.mark.parametrize(
    ("precision", "flash", "finding", "answer"),
    [
        # flash trains at fp16: fp16_vs_fp32 is the rule's low-precision pair
        ("16-mixed", 2e-7, "0.01× (1 replicate: no interval) at step 10: below fp16_vs_fp32", "UNDETERMINED"),
        ("16-mixed", 4e-5, "2× (1 replicate: no interval) at step 10: above fp16_vs_fp32", "LOOK CLOSER"),
        # flash trains at bf16: fp16_vs_fp32 is reported, not judged; bf16_vs_fp32 is missing
        ("bf16-mixed", 4e-5, "2× (1 replicate: no interval) at step 10: above fp16_vs_fp32", "UNDETERMINED"),
    ],
)
def test_report_verdict_against_low_precision(
    tmp_path: Path, precision: str, flash: float, finding: str, answer: str
) -> None:
    pairs = {"flash_vs_baseline": _pair([0.0, flash]), "fp16_vs_fp32": _pair([0.0, 2e-5])}
    meta = {
        "precision": precision,
        "comparisons": {
            "flash_vs_baseline": _comparison("flash_vs_baseline", "kernel"),
            "fp16_vs_fp32": _comparison("fp16_vs_fp32", "precision"),
        },
    }
    (tmp_path / "study.json").write_text(
        json.dumps({"format": "flashprobe.compare/1", "pairs": pairs, "study": meta})
    )
    v = verdict(read_study(tmp_path))
    assert v.context["fp16_vs_fp32"].ratio.median == pytest.approx(flash / 2e-5)
    assert v.answer == answer  # no seed pair: below low precision alone cannot pass
    assert report_main([str(tmp_path)]) == EXIT_CODES[answer]  # the answer's code, as study's
    text = (tmp_path / "report.md").read_text()
    assert f"flash_vs_baseline / fp16_vs_fp32 = {finding}" in text  # no run recorded: the pair's name
    assert f"- **{answer}**: " in text
    if precision == "bf16-mixed":
        assert "no low-precision pair at bf16-mixed, the precision flash_vs_baseline trains at" in text
        assert "reported, not in the rule" in text


def _replicated(curves: dict[str, list[list[float]]], warmup: int) -> dict:
    """study.json of a study at len(values) replicates: pair group → one curve (steps 0, 20, 40, 60) each."""
    kinds = {"flash_vs_baseline": "kernel", "seed1_vs_seed0": "seed", "bf16_vs_fp32": "precision"}
    pairs, comparisons = {}, {}
    for group, per_replicate in curves.items():
        for r, values in enumerate(per_replicate):
            name = group + ("" if r == 0 else f"_seed{2 * r}")
            pairs[name] = {
                "run_a": "a",
                "run_b": "b",
                "steps": [0, 20, 40, 60],
                "model": {"wasserstein": values, "max_abs": values},
            }
            comparisons[name] = _comparison(name, kinds[group], r, group)
    meta = {"precision": "bf16-mixed", "warmup_steps": warmup, "comparisons": comparisons}
    return {"format": "flashprobe.compare/1", "pairs": pairs, "study": meta}


@pytest.mark.parametrize(
    ("flash", "scale", "answer", "why"),
    [
        # below the seed pair and below fp16 in all three replicates, at every step after warm-up
        ([0, 1, 2, 3], (1.0, 0.9, 1.1), "PASS", "from 40 to 60, in each of the 3 replicates (seeds 0, 2, 4)"),
        # above bf16 in every replicate at step 40 only (after warm-up), below at the last step
        (
            [0, 9, 6, 3],
            (1.0, 0.9, 1.1),
            "LOOK CLOSER",
            "bf16_vs_fp32 is above 1 in every replicate at step 40",
        ),
        # the same bump at step 20, before the 30-step warm-up: not read
        ([0, 6, 2, 3], (1.0, 0.9, 1.1), "PASS", "from 40 to 60, in each of the 3 replicates"),
        # flash / seed at the last step is 0.5, 1 and 1.5: it straddles 1, not distinguishable from the bound
        (
            [0, 1, 2, 10],
            (1.0, 0.5, 1.5),
            "LOOK CLOSER",
            "flash_vs_baseline / seed is not below 1 in every replicate at step 60",
        ),
    ],
)
def test_the_answer_reads_every_step_after_warm_up_and_every_replicate(
    tmp_path: Path, flash: list[float], scale: tuple[float, ...], answer: str, why: str
) -> None:
    """Three replicates: flash's curve scaled per replicate; seed pairs at 10, bf16 vs fp32 at 5 (50 when
    the seed bound is the question), steps 0, 20, 40, 60 after a 30-step warm-up."""
    low = 50 if "seed" in why else 5
    curves = {
        "flash_vs_baseline": [[x * k for x in flash] for k in scale],
        "seed1_vs_seed0": [[0, 10, 10, 10]] * 3,
        "bf16_vs_fp32": [[0, low, low, low]] * 3,
    }
    (tmp_path / "study.json").write_text(json.dumps(_replicated(curves, warmup=30)))
    v = verdict(read_study(tmp_path))
    assert v.steps == [40, 60] and v.seeds == [0, 2, 4]
    assert v.answer == answer and why in " ".join(v.reasons) + report_line(tmp_path)
    ratio = v.context["seed"].ratio
    assert (ratio.low, ratio.median, ratio.high) == pytest.approx(sorted(flash[-1] * k / 10 for k in scale))


def test_the_verdict_as_plain_data_holds_every_ratio_computed_by_hand(tmp_path: Path) -> None:
    """Two replicates (seeds 0, 2), steps 0, 20, 40, 60, a 30-step warm-up: flash 1, 2 / 2, 4 at steps 40 /
    60, the seed pair 10 throughout, bf16 vs fp32 5 throughout: every ratio below is flash / context."""
    curves = {
        "flash_vs_baseline": [[0, 9, 1, 2], [0, 9, 2, 4]],
        "seed1_vs_seed0": [[0, 10, 10, 10]] * 2,
        "bf16_vs_fp32": [[0, 5, 5, 5]] * 2,
    }
    (tmp_path / "study.json").write_text(json.dumps(_replicated(curves, warmup=30)))

    def interval(values: list[float], seeds: list[int]) -> dict:
        return {
            "median": sum(values) / 2,
            "low": min(values),
            "high": max(values),
            "values": values,
            "seeds": seeds,
        }

    def context(kind: str, pairs: list[str], isolates: str, distance: float, ratios: dict[int, list[float]]):
        return {
            "kind": kind,
            "replicate_seeds": [0, 2],
            "pairs": pairs,
            "isolates": isolates,
            "distance": interval([distance, distance], [0, 2]),
            "ratio": interval(ratios[60], [0, 2]),
            "by_step": {s: interval(r, [0, 2]) for s, r in ratios.items()},
            "over_training": [min(min(r) for r in ratios.values()), max(max(r) for r in ratios.values())],
            "in_rule": True,
        }

    got = verdict(read_study(tmp_path)).to_dict()
    assert got == {
        "kernel_pair": "flash_vs_baseline",
        "attention": ["not recorded", "not recorded"],
        "step": 60,
        "steps": [40, 60],
        "warmup_steps": 30,
        "seeds": [0, 2],
        "flash": interval([2.0, 4.0], [0, 2]),
        "context": {
            "seed": context(
                "seed",
                ["seed1_vs_seed0", "seed1_vs_seed0_seed2"],
                "the random seed",
                10.0,
                {40: [0.1, 0.2], 60: [0.2, 0.4]},
            ),
            "bf16_vs_fp32": context(
                "precision",
                ["bf16_vs_fp32", "bf16_vs_fp32_seed2"],
                "what bf16_vs_fp32 isolates",
                5.0,
                {40: [0.2, 0.4], 60: [0.4, 0.8]},
            ),
        },
        "extra": {},
        "noise_floor": None,
        "left_out": {},
        "precision": "bf16-mixed",
        "answer": "PASS",
        "reasons": [],
    }
    assert json.loads(json.dumps(got)) == json.loads(json.dumps(got, sort_keys=True))  # plain JSON data


def report_line(study_dir: Path) -> str:
    """The verdict's first line in report.md; ``report`` exits with that answer's code, as study does."""
    found = verdict(read_study(study_dir))
    assert report_main([str(study_dir)]) == EXIT_CODES[found.answer if found else "UNDETERMINED"]
    return (study_dir / "report.md").read_text().split("\n## Verdict\n\n- ", 1)[1].split("\n", 1)[0]


def test_other_settings_into_the_same_out_are_refused_before_any_training(study: Path, capsys) -> None:
    from flashprobe.app.study import SETTINGS_FILE

    assert (study / SETTINGS_FILE).is_file()
    before = {p: p.stat().st_mtime_ns for p in study.rglob("*") if p.is_file()}
    for changed in ("trainer.max_steps=6", "study.precision=16-mixed"):
        assert main(["--out", str(study), "--runs", ",".join(RUNS), *STUDY, changed]) == 2
        err = capsys.readouterr().err
        assert "holds a study trained with other settings" in err and changed.split("=")[0] in err
    assert {p: p.stat().st_mtime_ns for p in study.rglob("*") if p.is_file()} == before  # nothing written
    # the same settings are accepted (compare-only here: no retraining), exiting with the answer's code
    code = main(["--out", str(study), "--runs", ",".join(RUNS), "--compare-only", *STUDY])
    assert code == 0  # PASS, as the rule applied by hand finds above


def test_a_replicate_whose_ratio_is_undefined_leaves_the_answer_undetermined(tmp_path: Path) -> None:
    """Replicate seed 2's seed pair never moved (distance 0): its flash / seed is undefined, so "below 1 in
    every replicate" cannot be said from the other two, although both are far below 1."""
    curves = {
        "flash_vs_baseline": [[0, 1, 1, 1], [0, 50, 50, 50], [0, 1, 1, 1]],
        "seed1_vs_seed0": [[0, 10, 10, 10], [0, 0, 0, 0], [0, 10, 10, 10]],
        "bf16_vs_fp32": [[0, 5, 5, 5]] * 3,
    }
    (tmp_path / "study.json").write_text(json.dumps(_replicated(curves, warmup=30)))
    v = verdict(read_study(tmp_path))
    assert v.answer == "UNDETERMINED", v.reasons
    assert "flash_vs_baseline / seed is undefined in replicate seed 2 at steps 40, 60" in v.reasons
    assert report_line(tmp_path).startswith(
        "**UNDETERMINED**: flash_vs_baseline / seed is undefined in replicate seed 2"
    )
    # the table keeps each value under its own replicate's seed: "–" where it is undefined
    rows = (tmp_path / "report.md").read_text().splitlines()
    row = next(x for x in rows if x.startswith("| flash_vs_baseline / seed |"))
    assert "| 0.1, –, 0.1 |" in row, row


def test_a_planned_pair_whose_runs_differ_in_more_carries_no_verdict(tmp_path: Path) -> None:
    """The plan says flash_vs_baseline isolates the attention; its runs recorded a second difference (the
    number of threads): the study's answer is UNDETERMINED, not PASS, and says why."""
    curves = {
        "flash_vs_baseline": [[0, 1, 1, 1]] * 3,
        "seed1_vs_seed0": [[0, 10, 10, 10]] * 3,
        "bf16_vs_fp32": [[0, 5, 5, 5]] * 3,
    }
    doc = _replicated(curves, warmup=30)
    for name, pair in doc["pairs"].items():
        thing = {"flash": "attention", "seed1": "seed", "bf16_": "precision"}[name[:5]]
        pair["differs"], pair["unrecorded"] = {thing: ["x", "y"]}, []
    (tmp_path / "study.json").write_text(json.dumps(doc))
    assert verdict(read_study(tmp_path)).answer == "PASS"  # as planned: one difference each
    doc["pairs"]["flash_vs_baseline_seed2"]["differs"]["machine"] = ["torch_threads 2", "torch_threads 4"]
    (tmp_path / "study.json").write_text(json.dumps(doc))
    v = verdict(read_study(tmp_path))
    assert v.answer == "UNDETERMINED" and v.reasons[0] == (
        "flash_vs_baseline_seed2 is left out: its runs differ in attention (x vs y), "
        "machine (torch_threads 2 vs torch_threads 4)"
    )
    assert v.seeds == [0, 4]  # the pair that differs in two things is left out, not averaged in
    text = (tmp_path / "report.md").read_text() if report_main([str(tmp_path)]) == 4 else ""  # UNDETERMINED
    assert "`flash_vs_baseline_seed2` differs in attention (x vs y), machine" in text
    # replicate 0's own pair differing in two things leaves no flash_vs_baseline at all
    doc["pairs"]["flash_vs_baseline"]["differs"]["seed"] = [0, 1]
    (tmp_path / "study.json").write_text(json.dumps(doc))
    assert verdict(read_study(tmp_path)) is None
    assert report_line(tmp_path) == (
        "**UNDETERMINED**: no pair's runs differ in the attention alone: those of flash_vs_baseline differ "
        "in attention (x vs y), seed (0 vs 1), so no distance here measures the kernel."
    )
