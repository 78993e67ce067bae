"""The findings ledger (``flashprobe fuzz --ledger``): known failures, unexpected passes, quarantine,
the file's checks, and the shipped ledger that replaces the tests' lists of torch's findings.

Oracles: kernels whose one bug is known by construction (``falsy_scale``: ``scale or default``;
``crashes``: raises) against the correct ``sdpa_math``; exit codes and printed lines of the real
command on a real YAML file; the docs' headings, read from docs/fuzz.md, for the shipped links.
"""

from __future__ import annotations

import json
import re
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from flashprobe import check_kernel
from flashprobe.fuzz.cli import main
from flashprobe.fuzz.ledger import SHIPPED, LedgerError, load_ledger

from ._helpers import crashes, falsy_scale

REPO = Path(__file__).resolve().parents[2]
#: one small case each: ``scale_zero`` (falsy_scale fails it), ``single_key`` (everyone passes)
TINY = ["--case", "scale_zero", "--case", "single_key", "--dtype", "fp32", "--no-backward", "-q"]


def _ledger(tmp_path: Path, text: str, name: str = "ledger.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


FALSY = """\
    entries:
      - kernel: user_falsy
        case: scale_zero
        dtype: fp32
        failure: values
        reason: scale=0.0 is taken for "not given" (fixed upstream in 2.1)
        link: https://example.org/issues/1
"""


@pytest.fixture
def kernels(register):
    register("user_falsy", falsy_scale)
    register("user_crashes", crashes)


def _run(tmp_path: Path, *argv: str) -> tuple[int, dict]:
    code = main([*argv, *TINY, "--out", str(tmp_path / "out")])
    return code, json.loads((tmp_path / "out" / "fuzz.json").read_text())


def test_a_failure_the_ledger_accepts_is_known_and_does_not_fail_the_run(kernels, tmp_path, capsys):
    code, _ = _run(tmp_path, "--kernel", "user_falsy")
    assert code == 1  # without the ledger: the bug fails the gate
    capsys.readouterr()
    code, payload = _run(tmp_path, "--kernel", "user_falsy", "--ledger", str(_ledger(tmp_path, FALSY)))
    assert code == 0
    (row,) = [r for r in payload["rows"] if r["case"] == "scale_zero"]
    assert row["verdict"] == "fail" and row["known"].startswith(f"{tmp_path / 'ledger.yaml'}:2 (entry 1)")
    assert payload["summary"]["fail"] == 0 and payload["summary"]["known"] == 1
    printed = capsys.readouterr().out
    assert "known ×1 user_falsy | scale_zero | fp32" in printed and "https://example.org/issues/1" in printed
    assert "FAIL  user_falsy" not in printed  # not listed as a failure


def test_a_toml_ledger_reads_as_the_same_entries(kernels, tmp_path):
    toml = _ledger(
        tmp_path,
        """\
        # the same finding as FALSY, in TOML
        [[entries]]
        kernel = "user_falsy"
        case = "scale_zero"
        dtype = "fp32"
        failure = "values"
        reason = 'scale=0.0 is taken for "not given" (fixed upstream in 2.1)'
        link = "https://example.org/issues/1"
        """,
        "ledger.toml",
    )
    (entry,) = load_ledger(toml).entries
    (same,) = load_ledger(_ledger(tmp_path, FALSY)).entries
    assert entry.where == f"{toml}:2 (entry 1)" and replace(entry, where="") == replace(same, where="")
    code, payload = _run(tmp_path, "--kernel", "user_falsy", "--ledger", str(toml))
    assert code == 0 and payload["summary"]["known"] == 1
    bad = _ledger(tmp_path, "[[entries]]\nkernel = \n", "bad.toml")
    with pytest.raises(LedgerError, match=r"bad.toml: not valid TOML"):
        load_ledger(bad)


def test_an_entry_that_passes_fails_the_run_with_fixed_remove_the_entry(kernels, tmp_path, capsys):
    ledger = _ledger(tmp_path, FALSY.replace("user_falsy", "sdpa_math"))  # sdpa_math is right there
    code, payload = _run(tmp_path, "--kernel", "sdpa_math", "--ledger", str(ledger))
    assert code == 1 and payload["summary"]["fail"] == 0
    assert payload["ledger"]["unexpected"] == [
        {
            "entry": f"{ledger}:2 (entry 1)",
            "kernel": "sdpa_math",
            "case": "scale_zero",
            "dtype": "fp32",
            "runs": 1,
        }
    ]
    assert (
        "sdpa_math | scale_zero | fp32 passed in its run: fixed? remove the entry" in capsys.readouterr().out
    )
    relaxed = _ledger(
        tmp_path, FALSY.replace("user_falsy", "sdpa_math") + "        strict: false\n", "relaxed.yaml"
    )
    assert _run(tmp_path, "--kernel", "sdpa_math", "--ledger", str(relaxed))[0] == 0  # a flaky finding


def test_an_entry_accepts_only_its_failure_kinds(kernels, tmp_path):
    other = _ledger(tmp_path, FALSY.replace("failure: values", "failure: [nonfinite, 'd?:nonfinite']"))
    code, payload = _run(tmp_path, "--kernel", "user_falsy", "--ledger", str(other))
    assert code == 1 and payload["summary"]["fail"] == 1 and payload["summary"]["known"] == 0


def test_a_quarantined_kernel_is_not_called_on_its_cases(register, tmp_path, capsys):
    calls = []

    def counted(q, k, v, **kwargs):
        calls.append(q.shape)
        return crashes(q, k, v, **kwargs)

    register("user_crashes", counted)
    assert _run(tmp_path, "--kernel", "user_crashes")[0] == 1 and len(calls) == 2  # raises on both cases
    ledger = _ledger(
        tmp_path,
        """\
        entries:
          - kernel: user_crashes
            property: [scale zero, single key]
            quarantine: true
            reason: segfaults on any call (tracked upstream)
            link: docs/fuzz.md#as-a-ci-gate
        """,
    )
    calls.clear()
    code, payload = _run(tmp_path, "--kernel", "user_crashes", "--ledger", str(ledger))
    assert code == 0 and calls == []
    assert {r["verdict"] for r in payload["rows"]} == {"skip"}
    assert all(r["reason"].startswith("quarantined by the ledger") for r in payload["rows"])
    assert "quarantined ×2 user_crashes | scale_zero, single_key | fp32" in capsys.readouterr().out


def test_removing_one_entry_fails_the_run_on_that_entry_alone(kernels, tmp_path, capsys):
    both = FALSY + (
        '      - kernel: user_crashes\n        case: "*"\n        failure: raised\n'
        "        reason: raises on every call\n        link: https://example.org/issues/2\n"
    )
    argv = ("--kernel", "user_falsy", "--kernel", "user_crashes")
    assert _run(tmp_path, *argv, "--ledger", str(_ledger(tmp_path, both)))[0] == 0
    capsys.readouterr()
    code, payload = _run(tmp_path, *argv, "--ledger", str(_ledger(tmp_path, FALSY, "one.yaml")))
    failing = {(r["kernel"], r["case"]) for r in payload["rows"] if r["verdict"] == "fail" and not r["known"]}
    assert code == 1 and failing == {("user_crashes", "scale_zero"), ("user_crashes", "single_key")}
    printed = capsys.readouterr().out
    assert "FAIL  user_crashes | scale_zero" in printed and "FAIL  user_falsy" not in printed


def test_check_kernel_applies_the_ledger(kernels, tmp_path):
    result = check_kernel("user_falsy", dtypes=["fp32"], cases=["scale_zero"], backward=False)
    assert not result.passed
    result = check_kernel(
        "user_falsy", dtypes=["fp32"], cases=["scale_zero"], backward=False, ledger=_ledger(tmp_path, FALSY)
    )
    assert result.passed and result.failures == [] and result.ledger.known[0].case == "scale_zero"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "entries:\n  - kernal: x\n",
            r"ledger.yaml:2 \(entry 1\): unknown key 'kernal'; an entry's keys are kernel",
        ),
        (FALSY.replace("        reason", "        # reason"), r":2 \(entry 1\): missing reason"),
        (
            FALSY.replace("https://example.org/issues/1", "see the wiki"),
            r"link 'see the wiki' must be an issue URL",
        ),
        (FALSY.replace("user_falsy", "no_such"), r"kernel 'no_such'.*register it first \(--import MODULE\)"),
        (FALSY.replace("case: scale_zero", "case: scale_zer0"), r"case 'scale_zer0' matches no case"),
        (FALSY.replace("case: scale_zero", "property: scale 0"), r"unknown property 'scale 0'; properties:"),
        (FALSY.replace("dtype: fp32", "dtype: float8"), r"dtype 'float8': use bf16, fp16, fp32, fp64"),
        (FALSY.replace("        case: scale_zero\n", ""), r"give case or property"),
        (FALSY + "        strict: maybe\n", r"strict must be true or false"),
        ("entries: [\n", r"ledger.yaml:\d+: not valid YAML"),
        ("kernel: x\n", r"a mapping with a list of entries"),
        (FALSY + "    version: 2\n", r"unknown top-level key 'version'"),
    ],
)
def test_an_unusable_ledger_is_refused_in_one_line_naming_the_file_line_and_fix(
    kernels, tmp_path, capsys, text, message
):
    path = _ledger(tmp_path, text)
    with pytest.raises(LedgerError, match=message):
        load_ledger(path)
    assert main(["--kernel", "user_falsy", "--ledger", str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flashprobe fuzz: --ledger: ") and "\n" not in err and str(path) in err
    with pytest.raises(LedgerError, match="no such file; give a YAML ledger's path or a shipped ledger"):
        load_ledger(tmp_path / "missing.yaml")


def _headings(doc: Path) -> set[str]:
    """GitHub's anchors of a Markdown page's headings."""
    titles = re.findall(r"^#+ (.+)$", doc.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", t.lower()).replace(" ", "-") for t in titles}


def test_the_shipped_ledger_is_package_data_and_each_entry_says_why_and_where():
    ledger = load_ledger("builtin")
    assert ledger.path == SHIPPED["builtin"] and ledger.path.is_file()
    assert '"flashprobe.fuzz" = ["ledgers/*.yaml"]' in (REPO / "pyproject.toml").read_text()
    for entry in ledger.entries:
        assert entry.reason and entry.link, entry.where
        doc, _, anchor = entry.link.partition("#")
        if not entry.link.startswith("http"):
            assert anchor in _headings(REPO / doc), f"{entry.where}: {entry.link} names no heading"
    biased = next(e for e in ledger.entries if "bias_repeated_max" in e.cases and "tiled" in e.kernels)
    assert "2510.04212" in biased.link and "max_shift=repeated" in biased.reason


def test_fuzz_help_prints_the_shipped_ledgers_path(capsys):
    assert main(["--help"]) == 0
    assert str(SHIPPED["builtin"]).replace(" ", "") in capsys.readouterr().out.replace("\n", "").replace(
        " ", ""
    )


def test_torchs_documented_findings_are_known_under_the_shipped_ledger_and_one_entry_removed_fails_alone(
    tmp_path, capsys
):
    """The floor of issue 54 at a tiny budget (the 20-seed run is in docs/calibration.md): torch's CPU flash
    kernel fails ``scale_zero_causal`` (NaN), known under ``builtin``; the same ledger without that
    entry fails the run on it alone."""
    argv = [
        "--kernel",
        "sdpa_flash",
        "--kernel",
        "sdpa_math",
        "--case",
        "scale_zero_causal",
        "--case",
        "single_key",
    ]
    argv += ["--dtype", "fp32", "--no-backward", "-q", "--out", str(tmp_path / "o")]
    assert main([*argv, "--ledger", "builtin"]) == 0
    rows = json.loads((tmp_path / "o" / "fuzz.json").read_text())["rows"]
    assert [(r["kernel"], r["case"]) for r in rows if r["verdict"] == "fail"] == [
        ("sdpa_flash", "scale_zero_causal")
    ]
    assert all(r["known"].startswith("builtin:") for r in rows if r["verdict"] == "fail")
    text = SHIPPED["builtin"].read_text()
    first = text.index("  - kernel: sdpa_flash\n    case: scale_zero_causal")
    rest = text[first:].split("\n\n", 1)[1]
    pruned = _ledger(tmp_path, text[:first] + rest, "pruned.yaml")
    capsys.readouterr()
    assert main([*argv, "--ledger", str(pruned)]) == 1
    payload = json.loads((tmp_path / "o" / "fuzz.json").read_text())
    assert payload["summary"]["fail"] == 1 and payload["ledger"]["unexpected"] == []
    assert [r["case"] for r in payload["rows"] if r["verdict"] == "fail" and not r["known"]] == [
        "scale_zero_causal"
    ]


def test_the_biased_failure_names_its_mechanism_and_mitigation_and_is_known_under_builtin():
    """``tiled`` (FlashAttention-2's numerics) at bf16 on repeated row maxima: errors of one sign
    (tests/fuzz/test_bias_cases.py); its reason names arXiv 2510.04212's rounding and ``max_shift``;
    ``tiled:max_shift=repeated`` passes the same case."""
    from flashprobe.fuzz import run_catalogue, select_cases

    cases = select_cases(["bias_repeated_max"])
    rows = run_catalogue(["tiled", "tiled:max_shift=repeated"], ["bf16"], cases=cases, backward=False)
    verdict = {r.kernel: r for r in rows}
    biased = verdict["tiled"]
    assert biased.verdict == "fail" and biased.failure == "biased", biased.reason
    assert "2510.04212" in biased.reason and "max_shift" in biased.reason
    assert verdict["tiled:max_shift=repeated"].verdict == "pass", verdict["tiled:max_shift=repeated"].reason
    report = load_ledger("builtin").apply(rows)
    assert report.failures == [] and report.known[0].known.startswith("builtin:")
