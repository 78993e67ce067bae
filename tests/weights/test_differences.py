"""What two runs differ in, read from their records, and ``flashprobe compare`` saying so: a pair that
differs in two things is named, and the report claims "like for like" only when none does."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from flashprobe.cli import main as cli_main
from flashprobe.formats.study_file import read_study
from flashprobe.report.study_verdict import needs_line
from flashprobe.weights import SnapshotStore
from flashprobe.weights.differences import describe_differences, run_differences

from ._helpers import write_run


def _run(root: Path, name: str, *, value: float = 0.0, config: str | None = None, **facts) -> Path:
    """A two-step run with the manifest facts given (``attention``, ``precision``, ``seed``)."""
    run = write_run(root / name, {s: {"w": torch.full((4,), value + s)} for s in (0, 1)}, **facts)
    if config is not None:
        (run / "config.yaml").write_text(config.replace("RUN", str(run)))
    return run


FACTS = {"attention": "math", "precision": "bf16-mixed", "seed": 0}


def _differences(a: Path, b: Path) -> dict:
    return run_differences(SnapshotStore(a), SnapshotStore(b))


def test_the_manifest_facts_that_differ_are_named_with_both_values(tmp_path: Path) -> None:
    base = _run(tmp_path, "base", **FACTS)
    flash = _run(tmp_path, "flash", **{**FACTS, "attention": "sdpa_flash"})
    flash_seed1 = _run(tmp_path, "flash_seed1", **{**FACTS, "attention": "sdpa_flash", "seed": 1})
    unknown = _run(tmp_path, "unknown", attention="math", precision="bf16-mixed")  # no seed recorded
    assert _differences(flash, base) == {"differs": {"attention": ["sdpa_flash", "math"]}, "unrecorded": []}
    assert _differences(base, _run(tmp_path, "same", **FACTS)) == {"differs": {}, "unrecorded": []}
    both = _differences(flash_seed1, base)
    assert both["differs"] == {"attention": ["sdpa_flash", "math"], "seed": [1, 0]}
    assert describe_differences(both) == "attention (sdpa_flash vs math), seed (1 vs 0)"
    assert _differences(unknown, base) == {"differs": {}, "unrecorded": ["seed"]}


CONFIG = """\
seed: 0
run_name: NAME
run_dir: RUN
attention:
  name: math
  kernel: math
  probe: {enabled: PROBE}
trainer: {precision: bf16-mixed, max_steps: STEPS}
model: {depth: 2}
module: {attention: math, model: {depth: 2}, noise_seed: 0}
logger: {csv: {save_dir: RUN}}
callbacks:
  weight_snapshot: {dirpath: RUN, run_id: NAME, seed: 0}
  checkpoint: {dirpath: RUN/checkpoints, every_n_train_steps: EVERY}
"""


def _config(name: str, *, probe: bool = False, steps: int = 4, every: int = 2) -> str:
    text = CONFIG.replace("NAME", name).replace("PROBE", str(probe).lower())
    return text.replace("STEPS", str(steps)).replace("EVERY", str(every))


def test_config_yaml_settings_count_as_one_thing_each_and_places_and_the_probe_as_none(
    tmp_path: Path,
) -> None:
    base = _run(tmp_path, "base", config=_config("base"), **FACTS)
    # another name and directory, the probe on, checkpoints at other steps: none changes training
    same = _run(tmp_path, "same", config=_config("same", probe=True, every=1), **FACTS)
    assert _differences(same, base)["differs"] == {}
    longer = _run(tmp_path, "longer", config=_config("longer", steps=8), **FACTS)
    assert _differences(longer, base)["differs"] == {"trainer.max_steps": [8, 4]}
    deeper = _config("deeper").replace("depth: 2", "depth: 3")  # model.depth and module.model.depth: one
    assert _differences(_run(tmp_path, "deeper", config=deeper, **FACTS), base)["differs"] == {
        "model.depth": [3, 2]
    }


def test_a_path_counts_as_a_place_only_inside_its_own_run_directory(tmp_path: Path) -> None:
    """Each run's data under its own directory is no difference; a run reading data from elsewhere is,
    even where the other run's directory name is a prefix of that path (``base`` of ``base2/...``)."""
    own = _config("base") + "data: {root: RUN/data}\n"
    base = _run(tmp_path, "base", config=own, **FACTS)
    assert _differences(_run(tmp_path, "other", config=own, **FACTS), base)["differs"] == {}
    shared = _config("base2") + f"data: {{root: {tmp_path}/shared/data}}\n"
    base2 = _run(tmp_path, "base2", config=shared, **FACTS)
    assert _differences(base2, base)["differs"] == {"data.root": [f"{tmp_path}/shared/data", f"{base}/data"]}
    # a path under the *other* run's directory is not this run's own place either
    into_base = _config("base3") + f"data: {{root: {base}2/data}}\n"
    base3 = _run(tmp_path, "base3", config=into_base, **FACTS)
    assert _differences(base3, base)["differs"] == {"data.root": [f"{base}2/data", f"{base}/data"]}


@pytest.fixture
def runs(tmp_path: Path) -> dict[str, Path]:
    root = tmp_path / "runs"
    return {
        "base": _run(root, "base", **FACTS),
        "flash": _run(root, "flash", value=0.1, **{**FACTS, "attention": "sdpa_flash"}),
        "seed1": _run(root, "seed1", value=1.0, **{**FACTS, "seed": 1}),
    }


def test_compare_warns_about_a_pair_that_differs_in_two_things_and_the_report_claims_no_like_for_like(
    runs: dict[str, Path], tmp_path: Path, capsys
) -> None:
    out = tmp_path / "mixed"
    pairs = [f"flash_vs_baseline={runs['flash']},{runs['seed1']}", f"seed={runs['seed1']},{runs['base']}"]
    assert (  # the mixed pair is no kernel pair, so there is no verdict: UNDETERMINED
        cli_main(["compare", *(a for p in pairs for a in ("--pair", p)), "--out", str(out), "--no-figures"])
        == 4
    )
    printed = capsys.readouterr().out.splitlines()
    assert any(
        line.startswith("flash_vs_baseline")
        and line.endswith("attention (sdpa_flash vs math), seed (0 vs 1)")
        for line in printed
    )
    assert any(line.startswith("seed ") and line.endswith("seed (1 vs 0)") for line in printed)
    [warning] = [line for line in printed if line.startswith("warning:")]
    assert (
        "not like for like: flash_vs_baseline differs in attention (sdpa_flash vs math), seed (0 vs 1)"
        in warning
    )
    assert "seed differs" not in warning
    doc = json.loads((out / "study.json").read_text())["pairs"]
    assert doc["flash_vs_baseline"]["differs"] == {"attention": ["sdpa_flash", "math"], "seed": [0, 1]}
    assert cli_main(["report", str(out)]) == 4
    text = (out / "report.md").read_text()
    title = text.splitlines()[0]
    assert "like for like" not in title
    assert "**Not shown to be like for like**: `flash_vs_baseline` differs in attention" in text
    assert "No pair here differs in the attention alone" in text  # no verdict from a mixed pair


def test_compare_of_pairs_that_each_differ_in_one_thing_is_like_for_like_and_gets_the_verdict(
    runs: dict[str, Path], tmp_path: Path, capsys
) -> None:
    out = tmp_path / "clean"
    pairs = [f"flash_vs_baseline={runs['flash']},{runs['base']}", f"seed={runs['seed1']},{runs['base']}"]
    assert (  # no low-precision pair: UNDETERMINED
        cli_main(["compare", *(a for p in pairs for a in ("--pair", p)), "--out", str(out), "--no-figures"])
        == 4
    )
    assert not any(line.startswith("warning:") for line in capsys.readouterr().out.splitlines())
    assert cli_main(["report", str(out)]) == 4
    text = (out / "report.md").read_text()
    assert (
        text.splitlines()[0]
        == "# flashprobe study: weight deviation of sdpa_flash attention, like for like (paper §V)"
    )
    # the kinds come from what the runs differ in: a seed pair, and no low-precision pair
    assert "- **UNDETERMINED**: no low-precision pair" in text
    assert "Seed: sdpa_flash / seed-to-seed = " in text  # labelled with what the kernel run recorded


def test_machine_facts_of_run_json_that_change_the_numbers_are_a_difference(tmp_path: Path) -> None:
    from flashprobe.formats.run_record import start_session

    machine = {"torch": "2.13.0+cpu", "cpu": "AMD EPYC", "cpu_capability": "AVX512", "torch_threads": 2}
    machine |= {"cuda": None, "deterministic_algorithms": True, "float32_matmul_precision": "highest"}
    runs = []
    for name, changed in (("a", {}), ("b", {"platform": "another kernel"}), ("c", {"torch_threads": 1})):
        run = _run(tmp_path, name, **FACTS)
        start_session(run, from_step=0, max_steps=1, machine={**machine, **changed})
        runs.append(run)
    assert _differences(runs[1], runs[0])["differs"] == {}  # the OS build does not change a run's numbers
    assert _differences(runs[2], runs[0])["differs"] == {"machine": ["torch_threads 1", "torch_threads 2"]}


def test_a_kernel_pair_named_anything_gets_the_verdict_labelled_from_the_records(
    tmp_path: Path, capsys
) -> None:
    """A pair that differs in the attention alone is the kernel pair whatever its name; the report names
    its kernels as the runs recorded them (no fixed 'math'), and what else a verdict needs, by what the
    pairs must differ in."""
    facts = {**FACTS, "attention": "sdpa_flash"}
    base = _run(tmp_path, "base", **facts)
    tiled = _run(tmp_path, "tiled", value=0.001, **{**facts, "attention": "tiled"})
    seed1 = _run(tmp_path, "seed1", value=1.0, **{**facts, "seed": 1})
    fp32 = _run(tmp_path, "fp32", value=0.01, **{**facts, "precision": "32-true"})

    def report(out: Path, *pairs: str, code: int) -> str:
        """compare, then report: each prints the verdict (its first line: the answer) and exits with its
        ``code``, as ``flashprobe study`` does."""
        argv = ["compare", *(a for p in pairs for a in ("--pair", p)), "--out", str(out), "--no-figures"]
        assert cli_main(argv) == code
        printed = capsys.readouterr().out
        assert needs_line({"pairs": read_study(out)["pairs"]}) in printed  # compare says it, once
        assert printed.lower().count("a verdict needs three pairs") == 1, printed
        [first] = [line for line in printed.splitlines() if line.startswith(("PASS", "LOOK", "UNDET"))]
        assert cli_main(["report", str(out)]) == code
        assert capsys.readouterr().out.startswith(f"{first}\n")  # the same answer, first
        answer = {0: "- **PASS**", 3: "- **LOOK CLOSER**", 4: "- **UNDETERMINED**"}[code]
        text = (out / "report.md").read_text()
        assert answer + first.partition(":")[1] + first.partition(":")[2] in text
        assert text.lower().count("a verdict needs three pairs") == 1, text
        return text

    text = report(tmp_path / "two", f"mine={tiled},{base}", f"other_seed={seed1},{base}", code=4)
    verdict = text[text.index("## Verdict") : text.index("## Ratios")]
    assert "- **UNDETERMINED**: no low-precision pair at bf16-mixed" in verdict
    assert "runs that differ in the precision alone" in verdict  # what is missing, by what it differs in
    assert "a kernel pair (runs that differ in the attention alone)" in verdict
    assert "mine (tiled vs sdpa_flash attention, both at bf16-mixed, same seed)" in verdict
    assert "math" not in verdict and "flash_vs_baseline" not in verdict  # no fixed names
    assert (
        "A verdict needs three pairs, named anything — a kernel pair (runs that differ in the attention "
        "alone): mine; a seed pair (in the seed alone): other_seed; a low-precision pair (in the precision "
        "alone, the kernel's precision vs fp32): MISSING. To get one, add a low-precision pair."
    ) in verdict

    text = report(tmp_path / "three", f"mine={tiled},{base}", f"s={seed1},{base}", f"p={base},{fp32}", code=0)
    assert "- **PASS**" in text  # 0.001 against a seed distance of 1 and a precision distance of 0.01

    # the kernel's distance above the seed pair's: 0.5 against 0.001 (a seed run 0.001 away)
    far = _run(tmp_path, "far", value=0.5, **{**facts, "attention": "tiled"})
    near = _run(tmp_path, "near", value=0.001, **{**facts, "seed": 1})
    text = report(tmp_path / "look", f"mine={far},{base}", f"s={near},{base}", f"p={base},{fp32}", code=3)
    assert "tiled / seed is above 1 in every replicate at step" in text

    text = report(tmp_path / "none", f"s={seed1},{base}", code=4)
    assert "no pair's runs differ in the attention (compared: s)" in text
    assert "a kernel pair (runs that differ in the attention alone)" in text


def test_the_report_tables_name_the_snapshot_steps_they_leave_out(tmp_path: Path) -> None:
    steps = range(0, 100, 10)  # 10 snapshot steps; the tables show 8
    runs = [
        write_run(tmp_path / name, {s: {"w": torch.full((4,), v * s)} for s in steps}, **facts)
        for name, v, facts in (("a", 1e-3, FACTS), ("b", 0.0, {**FACTS, "seed": 1}))
    ]
    out = tmp_path / "cmp"
    assert cli_main(["compare", *map(str, runs), "--out", str(out), "--no-figures"]) == 4  # no kernel pair
    assert cli_main(["report", str(out)]) == 4
    text = (out / "report.md").read_text()
    table = text[text.index("## Wasserstein distance over training") : text.index("## Max |W_a")]
    rows = [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ")]
    shown = [int(cell) for cell in rows if cell.isdigit()]
    assert shown == [0, 10, 30, 40, 50, 60, 80, 90]
    note = "8 of the 10 snapshot steps, evenly spaced, to keep the table short; left out: steps 20, 70"
    assert note in table


def test_a_comparisons_report_names_its_one_seed_and_each_runs_recorded_facts(tmp_path: Path) -> None:
    """Runs at seed 7 (the seed pair: 7 vs 8, listed last): the verdict's replicate is seed 7 wherever
    the report names it (it said "seed 8" in one line and "seed 0" in the next), and each run of a pair
    is labelled with the attention, precision and seed it recorded."""
    facts = {**FACTS, "seed": 7}
    base = _run(tmp_path, "base", **facts)
    tiled = _run(tmp_path, "tiled", value=0.001, **{**facts, "attention": "tiled"})
    fp32 = _run(tmp_path, "fp32", value=0.01, **{**facts, "precision": "32-true"})
    seed8 = _run(tmp_path, "seed8", value=1.0, **{**facts, "seed": 8})
    out = tmp_path / "cmp"
    pairs = [f"mine={tiled},{base}", f"p={base},{fp32}", f"s={base},{seed8}"]
    argv = ["compare", *(a for p in pairs for a in ("--pair", p)), "--out", str(out), "--no-figures"]
    assert cli_main(argv) == 0  # PASS: 0.001 against a seed distance of 1 and a precision distance of 0.01
    assert cli_main(["report", str(out)]) == 0
    text = (out / "report.md").read_text()
    verdict = text[text.index("## Verdict") : text.index("## What each comparison isolates")]
    named = re.findall(r"\bseeds? (\d+)", verdict)
    assert named and set(named) == {"7"}, named
    assert "in its one replicate (seed 7)" in verdict and "(1 replicate, seed 7;" in verdict
    table = text[text.index("## What each comparison isolates") :]
    row = next(line for line in table.splitlines() if line.startswith("| s |"))
    cells = [c.strip() for c in row.split("|")]
    assert cells[3:5] == ["base (math, bf16-mixed, seed 7)", "seed8 (math, bf16-mixed, seed 8)"]
    row = next(line for line in table.splitlines() if line.startswith("| mine |"))
    assert [c.strip() for c in row.split("|")][3:5] == [
        "tiled (tiled, bf16-mixed, seed 7)",
        "base (math, bf16-mixed, seed 7)",
    ]
