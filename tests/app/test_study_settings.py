"""A study whose first run refused a setting when it built its objects (a callback's or the Trainer's
argument, which only its constructor checks) has trained nothing: the corrected command continues in
the same ``--out`` instead of being refused for "other settings"; once a run has started training, the
settings are the study's and other settings are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from flashprobe.app.study import SETTINGS_FILE, check_settings, main, study_config
from flashprobe.formats.run_record import RUN_RECORD
from tests.app._study import TINY


def test_a_study_refused_before_training_takes_the_corrected_settings(tmp_path: Path, capsys) -> None:
    out = tmp_path / "study"
    with pytest.raises(SystemExit) as exit_:  # the run's refusal, as the command ends with it
        main(["--out", str(out), *TINY, "+trainer.bogus_arg=1"])
    assert exit_.value.code == 2
    assert "bogus_arg" in capsys.readouterr().err
    assert (out / SETTINGS_FILE).is_file()  # written before the first run built (and refused)
    assert not list((out / "runs").glob(f"*/{RUN_RECORD}"))  # no run started training
    corrected = study_config(["experiment=study", *TINY])
    check_settings(out, corrected)  # not refused: nothing was trained with the refused settings

    started = out / "runs" / "flash" / RUN_RECORD  # a run that started training under them
    started.parent.mkdir(parents=True, exist_ok=True)
    started.write_text("{}")
    with pytest.raises(ValueError, match=r"holds a study trained with other settings.*bogus_arg"):
        check_settings(out, corrected)
