"""A setting ``flashprobe train`` refuses before Hydra starts is refused without importing Lightning
(whose import is most of a refusal's seconds): the check composes and validates, and nothing is built."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_CHECK = """
import sys
from flashprobe.app.train import cli_main
code = cli_main(sys.argv[1:])
print("lightning imported:", "lightning" in sys.modules)
sys.exit(code)
"""


def test_a_refused_setting_does_not_import_lightning(tmp_path: Path) -> None:
    run = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-c", _CHECK, "trainer.max_steps=0", f"hydra.run.dir={run}"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    assert "trainer.max_steps=0 must be positive" in done.stderr
    assert "lightning imported: False" in done.stdout
    assert not run.exists()
