"""WeightSnapshot in real (tiny, CPU) Lightning runs: steps, manifest, atomicity, resume, sharding."""

from __future__ import annotations

import json
import os
import types
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import OmegaConf
from safetensors import safe_open
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import flashprobe.weights.store as store_module
from flashprobe.callbacks.weight_snapshot import WeightSnapshot
from flashprobe.weights import SnapshotStore

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*(does not have many workers|is smaller than the logging interval).*",
    "ignore:.*isinstance.treespec, LeafSpec.*",
    "ignore:.*resuming from a checkpoint that ended before the epoch ended.*",
    "ignore:Checkpoint directory .* exists and is not empty",
)


class TinyRegressor(pl.LightningModule):
    """Two linear layers with a batch norm (which has buffers); optionally crashes at one step."""

    def __init__(self, attention: str = "math", crash_at_step: int | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.global_step == self.hparams.crash_at_step:
            raise RuntimeError("simulated crash")
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _data(batches: int = 20) -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(4 * batches, 4, generator=gen), torch.randn(4 * batches, 1, generator=gen))
    return DataLoader(ds, batch_size=4)


def _trainer(root: Path, max_steps: int, callbacks: list, **kwargs) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        default_root_dir=root,
        logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **kwargs,
    )


def _checkpoint(directory: Path, step: int) -> Path:
    (path,) = directory.glob(f"*step={step}.ckpt")
    return path


def _assert_all_listed_readable(run_dir: Path) -> list[int]:
    manifest = json.loads((run_dir / "snapshots" / "manifest.json").read_text())
    steps = [e["step"] for e in manifest["snapshots"]]
    assert steps == sorted(set(steps)), f"duplicate or unsorted steps: {steps}"
    for entry in manifest["snapshots"]:
        with safe_open(run_dir / "snapshots" / entry["file"], framework="pt") as f:
            assert f.metadata()["step"] == str(entry["step"])
            for spec in manifest["tensors"]:
                assert list(f.get_tensor(spec["name"]).shape) == spec["shape"]
    return steps


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"every_n_steps": 0}, "every_n_steps must be a positive int or None, got 0"),
        ({"every_n_steps": 2.5}, "every_n_steps must be a positive int"),
        ({"steps": [3, -1]}, r"steps must be non-negative ints, got \[-1\]"),
        ({"save_initial": False, "save_last": False}, "would save nothing"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WeightSnapshot(**kwargs)


def test_config_must_be_json_serialisable() -> None:
    with pytest.raises(TypeError, match="JSON-serialisable"):
        WeightSnapshot(config={"x": object()})
    assert WeightSnapshot(config={"lr": 0.1, "sizes": (1, 2)}).config == {"lr": 0.1, "sizes": [1, 2]}
    hydra_like = OmegaConf.create({"model": {"width": 8}, "lr": "${model.width}"})
    callback = WeightSnapshot(steps=OmegaConf.create([5, 1]), precision=32, config=hydra_like)
    assert (callback.config, callback.steps, callback.precision) == (
        {"model": {"width": 8}, "lr": 8},
        (1, 5),
        "32",
    )


class _Sdpa(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return nn.functional.scaled_dot_product_attention(q, k, v)


class _Attending(pl.LightningModule):
    """One SDPA call per step, no hparams: only the run's callbacks and routes say its kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 12)
        self.attn = _Sdpa()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        q, k, v = self.proj(x).view(1, -1, 3, 4).permute(2, 0, 1, 3)[:, :, None]  # (1, 1, B, 4) each
        out = self.attn(q, k, v).reshape(-1, 4)
        return nn.functional.mse_loss(out.sum(1, keepdim=True), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _manifest_attention(tmp_path: Path, name: str, model: pl.LightningModule, callbacks: list) -> str | None:
    _trainer(tmp_path, 2, [WeightSnapshot(tmp_path / name), *callbacks]).fit(model, _data(2))
    return json.loads((tmp_path / name / "snapshots" / "manifest.json").read_text())["attention"]


def test_the_manifest_records_the_kernel_the_run_trained_with(tmp_path: Path) -> None:
    """Without ``attention=``: the probe's explicit primary (the model receives it in every training
    batch), else a ``use_kernel`` route on the module, else ``hparams["attention"]``, else the model's
    own attention, resolved when the run is recorded (never null: two default runs are like for like)."""
    from flashprobe.callbacks import AttentionProbe
    from flashprobe.probing import use_kernel

    assert _manifest_attention(tmp_path, "plain", _Attending(), []) == "own attention on cpu"
    assert _manifest_attention(tmp_path, "hparams", TinyRegressor(attention="tiled"), []) == "tiled"
    model = _Attending()
    with use_kernel(model.attn, "sdpa_math"):  # a route on a submodule: the module's attention
        assert _manifest_attention(tmp_path, "routed", model, []) == "sdpa_math"
        probe = AttentionProbe(primary="tiled:block_k=8", dirpath=tmp_path / "probed", plot=False)
        assert _manifest_attention(tmp_path, "probed", model, [probe]) == "tiled:block_k=8"
    given = [WeightSnapshot(tmp_path / "given", attention="mine")]
    _trainer(tmp_path, 2, given).fit(TinyRegressor(attention="tiled"), _data(2))
    assert json.loads((tmp_path / "given" / "snapshots" / "manifest.json").read_text())["attention"] == "mine"


def test_a_seed_pair_of_default_runs_is_like_for_like(tmp_path: Path) -> None:
    """Two runs with no kernel named anywhere, at two seeds, differ in the seed alone."""
    from flashprobe.weights.differences import is_like_for_like, run_differences

    for seed in (0, 1):
        pl.seed_everything(seed)
        _trainer(tmp_path, 2, [WeightSnapshot(tmp_path / f"seed{seed}")]).fit(_Attending(), _data(2))
    pair = run_differences(SnapshotStore(tmp_path / "seed0"), SnapshotStore(tmp_path / "seed1"))
    assert pair == {"differs": {"seed": [0, 1]}, "unrecorded": []} and is_like_for_like(pair)


def test_saves_configured_steps_with_a_complete_manifest(tmp_path: Path) -> None:
    pl.seed_everything(123)
    model = TinyRegressor(attention="sdpa_flash")
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    callback = WeightSnapshot(tmp_path / "run", every_n_steps=3, steps=[1], config={"lr": 0.1})
    _trainer(tmp_path, 7, [callback]).fit(model, _data())

    assert _assert_all_listed_readable(tmp_path / "run") == [0, 1, 3, 6, 7]  # initial, listed, every 3, last
    assert callback.saved_steps == [0, 1, 3, 6, 7]
    manifest = json.loads((tmp_path / "run" / "snapshots" / "manifest.json").read_text())
    assert manifest["format"] == "flashprobe.snapshots/1"
    assert manifest["run_id"] == "run"
    assert manifest["seed"] == 123
    assert manifest["attention"] == "sdpa_flash"
    assert manifest["precision"] == "32-true"
    assert manifest["config"] == {"lr": 0.1}
    expected = [[n, list(p.shape), "float32"] for n, p in model.named_parameters()]
    assert [[t["name"], t["shape"], t["dtype"]] for t in manifest["tensors"]] == expected

    store = SnapshotStore(tmp_path / "run")
    for name, value in initial.items():
        assert torch.equal(store.tensor(0, name), value)
    for name, param in model.named_parameters():  # the last snapshot is the trained model
        assert torch.equal(store.tensor(7, name), param.detach())
    assert not torch.equal(store.tensor(0, "net.0.weight"), store.tensor(7, "net.0.weight"))


def test_buffers_trainable_only_and_default_run_dir(tmp_path: Path) -> None:
    model = TinyRegressor()
    model.net[0].requires_grad_(False)
    callback = WeightSnapshot(steps=[2], save_initial=False, include_buffers=True, trainable_only=True)
    _trainer(tmp_path, 3, [callback]).fit(model, _data())
    store = SnapshotStore(tmp_path)  # logger=False: trainer.default_root_dir
    assert store.steps == [2, 3]
    assert store.names("parameter") == ["net.1.weight", "net.1.bias", "net.2.weight", "net.2.bias"]
    assert store.names("buffer") == ["net.1.running_mean", "net.1.running_var", "net.1.num_batches_tracked"]
    assert int(store.tensor(3, "net.1.num_batches_tracked")) == 3
    assert torch.equal(store.tensor(3, "net.1.running_mean"), model.net[1].running_mean)


def test_crash_during_a_write_leaves_only_complete_listed_snapshots(tmp_path: Path, monkeypatch) -> None:
    real_save = store_module.save_file

    def crash_midway(tensors, filename, metadata=None):
        if metadata["step"] == "4":  # write half a file, then die
            real_save(tensors, filename, metadata=metadata)
            data = Path(filename).read_bytes()
            Path(filename).write_bytes(data[: len(data) // 2])
            raise OSError("simulated crash while writing")
        real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(store_module, "save_file", crash_midway)
    with pytest.raises(OSError, match="simulated crash"):
        _trainer(tmp_path, 8, [WeightSnapshot(tmp_path / "run", every_n_steps=2)]).fit(
            TinyRegressor(), _data()
        )

    snapshots = tmp_path / "run" / "snapshots"
    assert _assert_all_listed_readable(tmp_path / "run") == [0, 2]
    assert sorted(p.name for p in snapshots.iterdir()) == [
        "manifest.json",
        "step_0000000.safetensors",
        "step_0000002.safetensors",
    ]  # no partial step_0000004 file, no temporary file


def test_stale_temporary_file_of_a_killed_writer_is_removed(tmp_path: Path) -> None:
    snapshots = tmp_path / "snapshots"
    snapshots.mkdir()
    stale = snapshots / ".step_0000004.safetensors.999.tmp"
    stale.write_bytes(b"partial")
    _trainer(tmp_path, 2, [WeightSnapshot(tmp_path)]).fit(TinyRegressor(), _data())
    assert not stale.exists()
    assert SnapshotStore(tmp_path).steps == [0, 2]


def test_resume_from_checkpoint_has_no_duplicate_or_missing_step(tmp_path: Path) -> None:
    ckpt = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    _trainer(tmp_path, 6, [WeightSnapshot(tmp_path / "run", every_n_steps=2), ckpt]).fit(
        TinyRegressor(), _data()
    )
    assert SnapshotStore(tmp_path / "run").steps == [0, 2, 4, 6]
    before = {p.name: p.read_bytes() for p in (tmp_path / "run" / "snapshots").glob("step_*")}

    callback = WeightSnapshot(tmp_path / "run", every_n_steps=2)
    ckpt = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    trainer = _trainer(tmp_path, 11, [callback, ckpt])
    trainer.fit(TinyRegressor(), _data(), ckpt_path=_checkpoint(tmp_path / "ckpt", 6))
    assert _assert_all_listed_readable(tmp_path / "run") == [0, 2, 4, 6, 8, 10, 11]
    assert callback.saved_steps == [0, 2, 4, 6, 8, 10, 11]  # restored from the checkpoint, then extended
    for name, data in before.items():  # the snapshots of steps 0-6 are not rewritten by the resume
        assert (tmp_path / "run" / "snapshots" / name).read_bytes() == data


def test_resume_after_a_crash_rewrites_the_abandoned_steps(tmp_path: Path) -> None:
    ckpt = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    with pytest.raises(RuntimeError, match="simulated crash"):
        _trainer(tmp_path, 20, [WeightSnapshot(tmp_path, every_n_steps=2), ckpt]).fit(
            TinyRegressor(crash_at_step=5), _data()
        )
    assert SnapshotStore(tmp_path).steps == [0, 2, 4]  # step 4 is later than the step-3 checkpoint

    ckpt = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    with pytest.warns(UserWarning, match=r"removed snapshots of steps \[4\]"):
        _trainer(tmp_path, 8, [WeightSnapshot(tmp_path, every_n_steps=2), ckpt]).fit(
            TinyRegressor(), _data(), ckpt_path=_checkpoint(tmp_path / "ckpt", 3)
        )
    assert _assert_all_listed_readable(tmp_path) == [0, 2, 4, 6, 8]


def test_state_dict_round_trip_and_old_checkpoints() -> None:
    callback = WeightSnapshot(every_n_steps=5)
    callback.load_state_dict({"saved_steps": [0, 5], "run_id": "abc"})
    assert callback.saved_steps == [0, 5]
    assert callback.state_dict()["saved_steps"] == [0, 5]
    assert callback.state_dict()["run_id"] == "abc"
    callback.load_state_dict({})  # a checkpoint written before these keys existed
    assert callback.saved_steps == []
    assert WeightSnapshot(every_n_steps=5).state_key != WeightSnapshot(every_n_steps=6).state_key


def test_only_rank_zero_writes(tmp_path: Path) -> None:
    """A rank other than zero takes the same decisions but writes nothing."""
    model = TinyRegressor()
    other_rank = types.SimpleNamespace(
        is_global_zero=False, global_step=0, current_epoch=0, strategy=types.SimpleNamespace(model=model)
    )
    callback = WeightSnapshot(tmp_path, every_n_steps=1)
    callback._run_dir = tmp_path
    callback.on_train_start(other_rank, model)
    other_rank.global_step = 1
    callback.on_train_batch_end(other_rank, model, None, None, 0)
    assert callback.saved_steps == [0, 1]
    assert not (tmp_path / "snapshots").exists()


def test_fully_sharded_parameters_are_gathered_in_full(tmp_path: Path, monkeypatch) -> None:
    """FSDP2 (``fully_shard``, DTensor parameters) in a one-process gloo group: full tensors saved."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    class Sharded(TinyRegressor):
        def configure_model(self) -> None:
            for layer in (self.net[0], self.net[2]):
                fully_shard(layer)
            fully_shard(self.net)

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = Sharded()
        _trainer(tmp_path, 2, [WeightSnapshot(tmp_path, save_initial=False)]).fit(model, _data())
        store = SnapshotStore(tmp_path)
        assert store.steps == [2]
        assert isinstance(model.net[0].weight, torch.distributed.tensor.DTensor)
        for name, param in model.named_parameters():
            saved = store.tensor(2, name)
            assert type(saved) is torch.Tensor
            assert torch.equal(saved, param.full_tensor().detach())
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif("not torch.cuda.is_available()", reason="needs a CUDA device")
def test_lightning_fsdp_strategy_on_gpu(tmp_path: Path) -> None:
    """Lightning's FSDPStrategy (FSDP1) on one GPU: snapshots are full tensors with the original names."""
    model = TinyRegressor()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    callback = WeightSnapshot(tmp_path, every_n_steps=2)
    trainer = pl.Trainer(
        accelerator="cuda",
        devices=1,
        strategy="fsdp",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    trainer.fit(model, _data())
    store = SnapshotStore(tmp_path)
    assert store.steps == [0, 2, 3]
    assert store.names() == list(initial)
    for name, value in initial.items():
        assert torch.equal(store.tensor(0, name), value)
        assert store.tensor(3, name).device.type == "cpu"
    assert not torch.equal(store.tensor(3, "net.0.weight"), initial["net.0.weight"])
