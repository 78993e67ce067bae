"""A few AdamW steps of any model, recorded so that two runs can be compared bit for bit."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["assert_identical", "train_steps"]


def train_steps(
    model: nn.Module,
    batch: Callable[[int], dict[str, Any]],
    output: Callable[[Any], torch.Tensor],
    steps: int = 2,
    *,
    call: Callable[..., Any] | None = None,
) -> dict[str, list[torch.Tensor]]:
    """``steps`` AdamW steps on ``batch(step)``; the loss is the mean square of ``output(model(...))``.

    Args:
        model: the model whose parameters are trained.
        batch: keyword arguments of the forward for a step.
        output: picks the tensor to train on from the model's output.
        steps: optimizer steps.
        call: what to call instead of ``model`` (e.g. its compiled wrapper).

    Returns:
        ``outputs`` and ``grads`` per step, the final ``weights`` and the global ``rng`` state.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(1)
    outputs, grads = [], []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        out = output((model if call is None else call)(**batch(step)))
        out.float().square().mean().backward()
        outputs.append(out.detach().clone())
        grads.append([p.grad.clone() if p.grad is not None else None for p in model.parameters()])
        opt.step()
    return {
        "outputs": outputs,
        "grads": grads,
        "weights": [p.detach().clone() for p in model.parameters()],
        "rng": [torch.get_rng_state()],
    }


def assert_identical(a: dict[str, list], b: dict[str, list]) -> None:
    """Outputs, gradients, weights and RNG state are bit-identical (``torch.equal``)."""
    for step, (x, y) in enumerate(zip(a["outputs"], b["outputs"], strict=True)):
        assert torch.equal(x, y), f"output differs at step {step}"
    for step, (ga, gb) in enumerate(zip(a["grads"], b["grads"], strict=True)):
        for i, (x, y) in enumerate(zip(ga, gb, strict=True)):
            assert (x is None) == (y is None), f"grad {i} present in one run only (step {step})"
            assert x is None or torch.equal(x, y), f"grad {i} differs at step {step}"
    for i, (x, y) in enumerate(zip(a["weights"], b["weights"], strict=True)):
        assert torch.equal(x, y), f"weight {i} differs after training"
    assert torch.equal(a["rng"][0], b["rng"][0]), "the probe consumed random numbers"
