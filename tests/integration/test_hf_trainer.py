"""flashprobe.integrations.hf: the probe in a real ``transformers.Trainer`` (tiny GPT-2, 5 steps:
probe.jsonl, verdict, scalars in the Trainer's logs, training bit-identical to the run without it),
``attn_implementation="probe_kernel"`` (a tiny Llama trains with a flashprobe kernel that the probe
compares as its primary) and the attach-time warning for eager attention."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest
import torch

from flashprobe.formats.probe_log import read_probe_log
from flashprobe.probe import ProbeWarning, probe

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("flashprobe.integrations.hf")
needs_accelerate = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None, reason="transformers.Trainer needs accelerate"
)

VOCAB, TOKENS, STEPS = 64, 8, 5


class _Tokens(torch.utils.data.Dataset):
    """A few random token sequences; labels are the inputs (causal LM loss)."""

    def __init__(self, n: int = 2 * STEPS) -> None:
        self.ids = torch.randint(1, VOCAB, (n, TOKENS), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _gpt2(attn: str = "sdpa") -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=16, attn_pdrop=0.0,
        resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0, attn_implementation=attn,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _llama(attn: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, bos_token_id=0,
        eos_token_id=0, pad_token_id=0, attn_implementation=attn,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _train(model: torch.nn.Module, out: Path, callbacks: list | None = None):
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=2, learning_rate=1e-3,
        logging_steps=2, report_to=[], save_strategy="no", use_cpu=True, dataloader_num_workers=0,
        seed=0, disable_tqdm=True,
    )  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=callbacks)
    trainer.train()
    return trainer


@needs_accelerate
def test_trainer_callback_writes_records_and_training_is_bit_identical(tmp_path: Path) -> None:
    plain = _train(_gpt2(), tmp_path / "plain")
    callback = hf.AttentionProbeCallback(golden=True, backward=True)
    probed = _train(_gpt2(), tmp_path / "probed", [callback])
    for (name, a), b in zip(plain.model.named_parameters(), probed.model.parameters(), strict=True):
        assert torch.equal(a, b), f"{name} differs after training with the probe"
    assert callback.probe is None and not (tmp_path / "plain" / "probe.jsonl").exists()

    records = read_probe_log(tmp_path / "probed" / "probe.jsonl").records
    assert [r["step"] for r in records] == [2, 4, 5]  # every logging_steps, and the last step
    for record in records:
        assert set(record["sites"]) == {"transformer.h.0.attn", "transformer.h.1.attn"}
        assert record["summary"]["verdict"] == "pass" and record["summary"]["failures"] == []
        assert record["summary"]["backward_calls"] > 0
    # The summary's scalars are in the Trainer's logs (every report_to logger gets these).
    logged = [e for e in probed.state.log_history if "probe/max_error_ratio" in e]
    assert [e["step"] for e in logged] == [2, 4, 5] and all(e["probe/failed"] == 0.0 for e in logged)
    assert all("loss" in e for e in logged)


def test_trainer_callback_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="on_failure='halt' must be"):
        hf.AttentionProbeCallback(on_failure="halt")
    with pytest.raises(ValueError, match="log_every_n_steps=0"):
        hf.AttentionProbeCallback(log_every_n_steps=0)
    with pytest.raises(ValueError, match="plain file name"):
        hf.AttentionProbeCallback(filename="logs/probe.jsonl")


@needs_accelerate
def test_llama_with_flashprobe_attention_trains_and_is_probed(tmp_path: Path) -> None:
    hf.register_attention("probe_kernel", "tiled:block_q=4,block_k=4")
    model = _llama("probe_kernel")
    assert model.config._attn_implementation == "probe_kernel"
    ids = _Tokens()[0]["input_ids"][None]
    with probe(model, backward=True) as p:
        out = model(input_ids=ids).logits
        out.square().mean().backward()
    assert p.sites == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    summary = p.summary()
    assert summary["forward_calls"] == summary["backward_calls"] == 2
    # The primary is the flashprobe kernel (tiled, fp32): close to, not equal to, the math baseline.
    assert 0 < summary["max_abs"]["primary_baseline"] < 1e-5
    assert summary["verdict"] == "pass"
    # Without a probe the kernel still runs, and gives what sdpa gives up to rounding.
    reference = _llama("sdpa")(input_ids=ids).logits
    torch.testing.assert_close(_llama("probe_kernel")(input_ids=ids).logits, reference)

    callback = hf.AttentionProbeCallback()
    _train(_llama("probe_kernel"), tmp_path, [callback])
    (last, *_) = reversed(read_probe_log(tmp_path / "probe.jsonl").records)
    assert set(last["sites"]) == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    assert last["summary"]["verdict"] == "pass"


def test_register_attention_refuses_names_transformers_reads() -> None:
    with pytest.raises(ValueError, match="must be a new plain name"):
        hf.register_attention("eager")
    with pytest.raises(ValueError, match="would try to load flash-attn"):
        hf.register_attention("flashprobe")


def test_eager_attention_warns_at_attach_time() -> None:
    model = _gpt2(attn="eager")
    with pytest.warns(ProbeWarning, match="attn_implementation='eager'.*attn_implementation='sdpa'"):
        p = probe(model)
    p.detach()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProbeWarning)
        probe(_gpt2()).detach()  # sdpa: no warning


@needs_accelerate
def test_trainer_callback_on_an_eager_model_stops_with_the_fix(tmp_path: Path) -> None:
    with (
        pytest.warns(ProbeWarning, match="attn_implementation='eager'"),
        pytest.raises(RuntimeError, match="attn_implementation='sdpa'"),
    ):
        _train(_gpt2(attn="eager"), tmp_path, [hf.AttentionProbeCallback()])
