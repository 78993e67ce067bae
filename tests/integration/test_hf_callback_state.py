"""AttentionProbeCallback's checkpoint state, restored as ``transformers.Trainer`` restores it
(``type(cb)(**args)``, then ``setattr`` of each attribute, after a JSON round trip)."""

from __future__ import annotations

import json

import pytest

hf = pytest.importorskip("flashprobe.integrations.hf")


def test_the_state_restores_settings_progress_failures_tally_and_bias() -> None:
    callback = hf.AttentionProbeCallback(plot=False, backward=True, on_failure="stop", log_every_n_steps=3)
    failure = {"site": "h.0.attn", "direction": "dq", "step": 1, "kind": "l2", "value": 40.0, "limit": 1.0,
               "reason": "x", "repro": None}  # fmt: skip
    callback.session.load_state_dict(
        {
            "last_logged_step": 6,
            "records": 2,
            "failures": [failure],
            "bias": {"h.0.attn": [1.0, 2.0, 3.0]},
            "tally": {"nonfinite": 5, "primary_nonfinite": 1, "worst": None, "sites": {}},
        }
    )
    saved = json.loads(json.dumps(callback.state()))  # trainer_state.json
    restored = type(callback)(**saved["args"])
    for attribute, value in saved["attributes"].items():
        setattr(restored, attribute, value)
    assert restored.config == callback.config and restored.on_failure == "stop"
    assert restored.log_every_n_steps == 3 and restored.last_logged_step == 6 and restored.records == 2
    assert restored.session.state_dict() == callback.session.state_dict()
    assert restored.session.tally.nonfinite == 5
    assert restored.session.restored_bias == {"h.0.attn": [1.0, 2.0, 3.0]}
    # an older checkpoint's state, without the bias, restores too
    older = {k: v for k, v in saved["attributes"].items() if k != "_restored_bias"}
    again = type(callback)(**saved["args"])
    for attribute, value in older.items():
        setattr(again, attribute, value)
    assert again._restored_failures == [failure] and again.session.restored_bias == {}
