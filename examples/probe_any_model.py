"""Probe a stock ``nn.TransformerEncoder`` during training and print a per-site table.

    python examples/probe_any_model.py [--primary tiled:mask_value=-5e4] [--steps 5]

The model is not modified: every ``scaled_dot_product_attention`` call it makes (here through
``nn.MultiheadAttention``) runs the primary kernel — by default torch's own SDPA, so training is
exactly what it would be without the probe — and, on the same inputs, the baseline at the same
dtype and the FP64 golden value, forward and backward. A site fails when its error / limit
(``err/limit``) exceeds 1 in any direction; the judge's criteria and limits are in docs/probe.md.
``ratio`` is ``max|primary − golden| / max|baseline − golden|``, shown for reference.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from flashprobe import probe


def _cell(value: float | int | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--primary", default=None, help="kernel spec of the primary (default: torch SDPA)")
    parser.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    args = parser.parse_args()

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(
        d_model=64, nhead=4, dim_feedforward=128, dropout=0.0, batch_first=True
    )
    model = nn.Sequential(nn.Linear(8, 64), nn.TransformerEncoder(layer, num_layers=3), nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 32, 8), torch.randn(8, 32, 1)

    with probe(model, primary=args.primary, golden=True, backward=True) as p:
        for _ in range(args.steps):
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            p.next_step()
        stats = p.stats()  # one host copy for everything
        summary = p.summary()

    header = (
        "site",
        "verdict",
        "err/limit",
        "calls",
        "max|p-b|",
        "max|p-g|",
        "max|b-g|",
        "ratio",
        "dq ratio",
        "dk ratio",
        "dv ratio",
        "nonfinite",
    )
    rows = [header]
    for site, s in stats.items():
        out, bwd = s["forward"]["out"], s["backward"]
        nonfinite = sum(s["nonfinite_inputs"].values()) + sum(
            out[pair]["nonfinite"] for pair in ("primary_baseline", "primary_golden", "baseline_golden")
        )
        rows.append(
            (
                site,
                s["verdict"],
                _cell(max((e["limit_ratio"] or 0.0) for e in (out, *(bwd[g] for g in ("dq", "dk", "dv"))))),
                _cell(s["forward"]["calls"]),
                _cell(out["primary_baseline"]["max_abs"]),
                _cell(out["primary_golden"]["max_abs"]),
                _cell(out["baseline_golden"]["max_abs"]),
                _cell(out["error_ratio"]),
                *(_cell(bwd[g]["error_ratio"]) for g in ("dq", "dk", "dv")),
                _cell(nonfinite),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for i, row in enumerate(rows):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    ratio, site = summary.limit_ratio, summary.max_limit_ratio_site
    verdict = summary.verdict.upper()
    print(f"\nverdict {verdict}: worst error / limit {_cell(ratio)} (> 1 fails); worst forward at {site}")


if __name__ == "__main__":
    main()
