"""Override strings are read as Hydra reads them: the last value of a key wins."""

from __future__ import annotations

from flashprobe.app.overrides import override_key, override_value


def test_the_last_value_wins_and_prefixes_name_the_same_key() -> None:
    args = ["resume=a", "+trainer.max_steps=4", "model=tiny", "resume=b", "~callbacks.kill", "x"]
    assert override_value(args, "resume") == "b"
    assert override_value(args, "trainer.max_steps") == "4"
    assert override_value(args, "callbacks.kill") is None  # a deletion sets no value
    assert override_value(args, "seed") is None
    assert override_value(["a=b=c"], "a") == "b=c"  # only the first '=' separates
    assert [override_key(a) for a in ("+a.b=1", "~c", "d=2")] == ["a.b", "c", "d"]
