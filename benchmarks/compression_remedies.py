"""Why Top-1 % + INT8 with error feedback misses "within 1 % of uncompressed" under AdamW: runs that isolate the cause.

    python benchmarks/compression_remedies.py [--steps 300] [--runs ...]

Every run is part 2 of ``benchmarks/compression.py`` (tiny reference model, DDP on 2 gloo ranks, the same data
order, seed, learning-rate schedule and clipping), changing one thing:

* ``uncompressed`` and ``top1% gradient, ef (shipped)``: the baseline and ``CompressedAllToAll(topk_ratio=0.01)``
  (two-phase compressed all-reduce: reduce-scatter, then all-gather, each Top-k with its own residual).
* ``oracle: exact all-reduce, top1% ef of the mean gradient``: no bytes saved. The gradient is all-reduced
  exactly, then Top-1 % + INT8 with error feedback is applied to the averaged gradient (identically on every rank).
  Compared with the shipped run, it tells whether the two-phase exchange or the sparsification of the applied
  gradient costs the loss.
* ``oracle: top1% ef of the AdamW update``: no bytes saved. Exact gradients, AdamW steps as usual; then each
  parameter's change is replaced by Top-1 % + INT8 of (change + residual), the rest kept as residual. Sparsifies
  *after* Adam's per-element normalisation instead of before it.
* ``local AdamW, int8 / top1% ef update exchange``: a scheme that really saves bytes in the spirit of the oracle
  above. No gradient sync (DDP's ``noop_hook``); every rank steps its own AdamW on its own gradients; the parameter
  change is averaged over ranks through the compressed all-reduce of ``lightning_mm.parallel.compression`` (error
  feedback per rank), so parameters stay identical while optimizer states differ per rank (which Lightning's
  rank-0 checkpoint would not keep: a research probe, not a feature).
* ``AdamW second moment frozen at 30`` and ``... + top1% ef gradient from 30``: 1-bit Adam's recipe (Tang et al.
  2021, https://arxiv.org/abs/2102.02888): uncompressed warm-up, then Adam's variance frozen so that the update is
  linear in the gradient, which is where error feedback's "sum of sent = sum of true" carries over to the weights.
  The uncompressed run with the freeze alone shows what the freeze itself costs in a 300-step run.

Final loss is the median of the last 20 steps' global training loss; "ratio" is the whole run's bytes before /
after on rank 0 (oracles save nothing). Writes ``benchmarks/results/compression_remedies.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compression as bench  # noqa: E402  (benchmarks/compression.py: data, recorder, training loop)

from lightning_mm.models import VLMModule  # noqa: E402
from lightning_mm.parallel.compression import (  # noqa: E402
    CodecConfig,
    ErrorFeedback,
    GradCompressionState,
    compressed_all_reduce_coalesced,
    decode,
    encode,
)

TOP1 = {"topk_ratio": 0.01, "bits": 8}
FREEZE_AT = 30


class FrozenVarianceAdamW(torch.optim.AdamW):
    """torch's AdamW until ``freeze_at`` steps, then the same update with the bias-corrected second moment of that
    step held fixed (1-bit Adam's variance freeze). A probe for this benchmark: torch has no such switch, and
    ``betas=(b1, 1.0)`` divides by a zero bias correction."""

    def __init__(self, params, freeze_at: int, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.freeze_at = freeze_at
        self.steps_taken = 0

    @torch.no_grad()
    def step(self, closure=None):
        if self.steps_taken < self.freeze_at:
            self.steps_taken += 1
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.steps_taken += 1
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "frozen_variance" not in state:  # v_hat at the freeze: v / (1 - beta2^t)
                    state["frozen_variance"] = state["exp_avg_sq"] / (1 - beta2 ** float(state["step"]))
                state["step"] += 1
                p.mul_(1 - group["lr"] * group["weight_decay"])
                state["exp_avg"].lerp_(p.grad, 1 - beta1)
                denominator = state["frozen_variance"].sqrt().add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denominator, value=-group["lr"] / (1 - beta1 ** float(state["step"])))
        return loss


class FrozenVarianceModule(VLMModule):
    """The reference module with :class:`FrozenVarianceAdamW` (same groups, betas, schedule)."""

    def configure_optimizers(self):
        config = super().configure_optimizers()
        adamw = config["optimizer"]
        frozen = FrozenVarianceAdamW(
            adamw.param_groups, FREEZE_AT, lr=self.hparams.learning_rate, betas=adamw.defaults["betas"]
        )
        config["lr_scheduler"]["scheduler"] = torch.optim.lr_scheduler.LambdaLR(
            frozen, config["lr_scheduler"]["scheduler"].lr_lambdas[0]
        )
        config["optimizer"] = frozen
        return config


def _sparsify_with_feedback(name: str, x: torch.Tensor, config: CodecConfig, feedback: ErrorFeedback) -> torch.Tensor:
    """``decode(encode(x + residual))``, the rest kept as ``name``'s residual (tensors under min_numel: exact)."""
    if x.numel() < config.min_numel:
        return x
    compensated = feedback.compensate(name, x)
    sent = decode(encode(compensated, config)).view_as(x)
    feedback.update(name, compensated, sent)
    return sent.to(x.dtype)


class GradientOracle(L.Callback):
    """DDP hook: exact all-reduce of the bucket, then Top-k + EF per parameter of the averaged gradient."""

    def __init__(self, config: CodecConfig) -> None:
        self.config, self.feedback = config, ErrorFeedback()

    def on_fit_start(self, trainer, pl_module) -> None:
        model = trainer.strategy.model
        names = {id(p): name for name, p in model.module.named_parameters()}

        def hook(_, bucket: dist.GradBucket) -> torch.futures.Future:
            params = bucket.parameters()
            future = dist.all_reduce(bucket.buffer().div_(dist.get_world_size()), async_op=True).get_future()

            def sparsify(done: torch.futures.Future) -> torch.Tensor:
                grads = done.value()[0].split([p.numel() for p in params])
                return torch.cat(
                    [
                        _sparsify_with_feedback(names[id(p)], g, self.config, self.feedback)
                        for p, g in zip(params, grads, strict=True)
                    ]
                )

            return future.then(sparsify)

        hook.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
        model.register_comm_hook(None, hook)


class UpdateCompression(L.Callback):
    """Replace each optimizer step's parameter change by a compressed one (see the module docstring).

    ``exchange=False``: the oracle (gradients synced exactly by DDP, the change sparsified locally, identically on
    every rank). ``exchange=True``: no gradient sync; the per-rank changes are averaged through the compressed
    all-reduce with per-rank residuals, and the bytes are logged like ``CompressedAllToAll``'s.
    """

    def __init__(self, config: CodecConfig, exchange: bool) -> None:
        self.config, self.exchange = config, exchange
        self.state = GradCompressionState(config)  # residuals (per parameter name) and byte counters
        self.before: dict[str, torch.Tensor] = {}

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.exchange:
            trainer.strategy.model.register_comm_hook(None, noop_hook)  # gradients stay local

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.before = {name: p.detach().clone() for name, p in pl_module.named_parameters()}

    @torch.no_grad()
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        named = list(pl_module.named_parameters())
        changes = [p - self.before[name] for name, p in named]
        if self.exchange:
            flat = [c.reshape(-1) for c in changes]
            residuals, gather = self.state.all_reduce_residuals(
                [name for name, _ in named], [c.numel() for c in flat], dist.get_world_size(), flat[0].device
            )
            stats = self.state.stats
            stats.reset()
            changes = compressed_all_reduce_coalesced(flat, self.config, None, "avg", residuals, gather, stats)
            pl_module.log_dict(
                {
                    "compression/bytes_before": float(stats.bytes_before),
                    "compression/bytes_after": float(stats.bytes_after),
                    "compression/ratio": stats.ratio,
                },
                on_step=True,
                on_epoch=False,
                batch_size=1,
            )
        else:
            changes = [
                _sparsify_with_feedback(name, c, self.config, self.state.feedback)
                for (name, _), c in zip(named, changes, strict=True)
            ]
        for (name, p), change in zip(named, changes, strict=True):
            p.copy_(self.before[name] + change.view_as(p))


def _runs(args: argparse.Namespace) -> dict[str, tuple[dict | None, type[VLMModule] | None, list[L.Callback]]]:
    """name -> (CompressedAllToAll arguments or None, module type or None, extra callbacks); fresh callbacks."""
    top1 = CodecConfig(min_numel=args.min_numel, **TOP1)
    int8 = CodecConfig(min_numel=args.min_numel, bits=8)
    return {
        "uncompressed": (None, None, []),
        "top1% gradient, ef (shipped)": (TOP1, None, []),
        "oracle: exact all-reduce, top1% ef of the mean gradient": (None, None, [GradientOracle(top1)]),
        "oracle: top1% ef of the AdamW update": (None, None, [UpdateCompression(top1, exchange=False)]),
        "local AdamW, int8 update exchange": (None, None, [UpdateCompression(int8, exchange=True)]),
        "local AdamW, top1% ef update exchange": (None, None, [UpdateCompression(top1, exchange=True)]),
        f"AdamW second moment frozen at {FREEZE_AT}": (None, FrozenVarianceModule, []),
        f"... + top1% ef gradient from {FREEZE_AT}": ({**TOP1, "warmup_steps": FREEZE_AT}, FrozenVarianceModule, []),
    }


def _rank_runs(rank: int, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    warnings.filterwarnings("ignore")
    out = []
    for name, (compression, module_type, callbacks) in _runs(args).items():
        if name in args.runs:
            out.append(bench._train(name, compression, 0, args, module_type, callbacks))
            if rank == 0:
                print(f"    {name}: {out[-1]['wall_seconds']:.0f} s", flush=True)
    return out


def main() -> None:
    names = list(_runs(argparse.Namespace(min_numel=0)))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--runs", nargs="+", default=names, choices=names)
    parser.add_argument("--rows-per-batch", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--warmup-steps", type=int, default=30, help="learning-rate warm-up")
    parser.add_argument("--warmup-compression", type=int, default=5, help="steps left out of per-step medians")
    parser.add_argument("--min-numel", type=int, default=1024)
    parser.add_argument("--output", default="benchmarks/results/compression_remedies.json")
    args = parser.parse_args()
    args.optimizer = "adamw"
    print(f"convergence, tiny preset, DDP x2 (gloo), {args.steps} AdamW steps per run")
    runs = bench.run_distributed(_rank_runs, 2, args, timeout=24 * 3600, pg_timeout=600)[0]
    base = runs[0]["final_loss_median_last20"] if runs[0]["name"] == "uncompressed" else None
    print(f"{'run':58} {'final loss':>10} {'vs unc.':>8} {'val R@1':>8} {'ratio':>6}")
    for run in runs:
        final = run["final_loss_median_last20"]
        gap = f"{100 * (final / base - 1):+7.1f}%" if base else ""
        ratio = run["compression_median_per_step"].get("ratio_whole_run") or 1.0
        print(f"{run['name']:58} {final:10.4f} {gap:>8} {run['val_recall_at_1']:8.4f} {ratio:6.1f}")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"machine": bench.machine(), "args": vars(args), "runs": runs}, indent=1))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
