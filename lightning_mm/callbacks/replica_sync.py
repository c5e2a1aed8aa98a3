"""``ReplicaSync``: replica groups train on their own and synchronise every H steps from pseudo-gradients (DiLoCo),
optionally compressed (Top-k + low-bit values + error feedback, SparseLoCo-style).

Thin Lightning glue over :class:`lightning_mm.parallel.replica_sync.ReplicaSyncState` (the outer loop in plain
torch). The strategy keeps per-step gradient averaging inside a replica group
(``HybridParallelStrategy(sync_replicas_every_step=False)``, set by :meth:`ReplicaSync.setup`); this callback does
the rest at the end of every H-th optimizer step.
"""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_mm.callbacks._common import _local, _rank, _world
from lightning_mm.parallel.compression import CodecConfig
from lightning_mm.parallel.replica_sync import ReplicaSyncState
from lightning_mm.validation import require_int

__all__ = ["ReplicaSync"]

_STATE_VERSION = 1


class ReplicaSync(pl.Callback):
    """Synchronise the replica groups of ``HybridParallelStrategy(data_parallel_replicate=R > 1)`` every ``every``
    optimizer steps instead of every step.

    Inside a replica group training is unchanged (FSDP2 over ``dp_shard``, tensor / pipeline parallel, the loss over
    the group's own samples); across groups nothing is exchanged between syncs. At a sync every rank sends its
    pseudo-gradient ``anchor - local`` (its parameters' movement since the last sync) to its peers holding the same
    shards in the other groups (the ``dp_replicate`` axis), the average is the gradient of an outer
    ``torch.optim.SGD`` (Nesterov, DiLoCo's outer optimizer) on the shared anchor, and every replica continues from
    the new anchor. ``bits`` (and ``topk_ratio < 1``) compress that exchange, with error feedback on each rank.

    Per optimizer step this rank logs ``replica_sync/bytes_sent`` (replica-link bytes since the start of the fit, or
    since the checkpoint's start when resumed), ``replica_sync/bytes_vs_fp32`` (what per-step fp32 all-reduces of the
    same parameters would have sent over the same steps, divided by ``bytes_sent``) and ``replica_sync/syncs``.

    Checkpoints resume exactly, also between syncs: replicas differ by design (their parameters between syncs, their
    inner optimizer states always), and a distributed checkpoint stores one copy of replicated tensors, so this
    callback's state holds every rank's anchor, outer optimizer state, residuals, inner optimizer state and, between
    syncs, local parameters (gathered to rank 0 like the rest of a callback's state; restored at train start, after
    Lightning restored the model and optimizers). Its size is therefore about ``R x`` the optimizer state. Resuming
    with another number of ranks restarts the outer state from the loaded model, with a warning.

    The fit ends with a sync when the last step was not one, so every replica holds the same model afterwards.
    Gradient clipping (``Trainer(gradient_clip_val=...)``) acts on each replica's own gradients.

    Args:
        every: optimizer steps between syncs (DiLoCo's H).
        outer_lr, outer_momentum, nesterov: the outer SGD. ``outer_lr=1, outer_momentum=0`` averages the replicas'
            parameters; with ``every=1`` and an inner optimizer linear in the gradient (SGD) that is data parallelism.
            The defaults are the best of a sweep on the reference model (H = 16, 1000 AdamW steps:
            ``benchmarks/results/compression_convergence_outer_sweep.json``); DiLoCo's 0.7 / 0.9, tuned for H ~ 500
            on large language models, trained far worse there (+32 % vs +8 % held-out loss over data parallelism).
        bits: ``None`` sends the pseudo-gradients as an exact fp32 all-reduce; 8 or 4 quantizes them in blocks.
        topk_ratio: fraction of each pseudo-gradient tensor sent (with ``bits``); ``1.0`` is dense.
        error_feedback: carry what the codec did not send into the next sync (with ``bits``).
        block_size, scale_dtype, rotation, min_numel: the codec
            (:class:`~lightning_mm.parallel.compression.CodecConfig`).
    """

    def __init__(
        self,
        every: int = 64,
        outer_lr: float = 0.9,
        outer_momentum: float = 0.3,
        nesterov: bool = True,
        bits: Literal[4, 8] | None = None,
        topk_ratio: float = 1.0,
        error_feedback: bool = True,
        block_size: int = 128,
        scale_dtype: Literal["float32", "bfloat16"] = "float32",
        rotation: bool = False,
        min_numel: int = 0,
    ) -> None:
        require_int("every", every, hint="optimizer steps between syncs")
        if not outer_lr > 0:
            raise ValueError(f"outer_lr must be > 0, got {outer_lr!r}")
        if not 0 <= outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum!r}")
        if bits is None and topk_ratio != 1.0:
            raise ValueError(
                f"ReplicaSync(topk_ratio={topk_ratio}) needs a codec: set bits=8 or bits=4 (the Top-k values are "
                "sent quantized), or topk_ratio=1.0 for an exact fp32 sync"
            )
        self.every = every
        self.outer = {"outer_lr": outer_lr, "outer_momentum": outer_momentum, "nesterov": nesterov}
        self.codec = (
            None
            if bits is None
            else CodecConfig(
                bits=bits,
                block_size=block_size,
                topk_ratio=topk_ratio,
                scale_dtype=scale_dtype,
                min_numel=min_numel,
                rotation=rotation,
            )
        )
        self.error_feedback = bool(error_feedback) and bits is not None
        self.state: ReplicaSyncState | None = None
        self._steps_at_start = 0
        self._bytes_at_start = 0
        self._last_synced_step = -1
        self._pending: dict[str, Any] | None = None
        self._trainer: pl.Trainer | None = None

    # ------------------------------------------------------------------------------------------------ setup

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        # HybridParallelStrategy (duck-typed: callbacks do not import strategies). Under DDP / FSDP every rank's loss
        # and gradients are tied to every other's each step (the reference model's contrastive loss gathers
        # embeddings over the data-parallel group), so there is no replica group to leave alone between syncs.
        if not hasattr(strategy, "sync_replicas_every_step") or not hasattr(strategy, "replica_group"):
            raise ValueError(
                f"ReplicaSync needs HybridParallelStrategy(data_parallel_replicate > 1); {type(strategy).__name__} has "
                "no replica groups to synchronise every H steps"
            )
        replicas = strategy.parallel_dims.dp_replicate
        if replicas < 2:
            raise ValueError(
                f"ReplicaSync synchronises replica groups, but HybridParallelStrategy has data_parallel_replicate="
                f"{replicas}; use data_parallel_replicate >= 2 (e.g. one group per node)"
            )
        # Before configure_model / strategy.setup parallelise the model: FSDP2 then averages over dp_shard only.
        strategy.sync_replicas_every_step = False
        rank_zero_info(
            f"ReplicaSync: {replicas} replica groups train independently and synchronise every {self.every} steps "
            f"({'exact fp32' if self.codec is None else self._describe_codec()} pseudo-gradients, outer SGD "
            f"lr={self.outer['outer_lr']} momentum={self.outer['outer_momentum']})"
        )

    def _describe_codec(self) -> str:
        codec = self.codec
        top = f"Top-{100 * codec.topk_ratio:g} % + " if codec.topk_ratio < 1 else ""
        return f"{top}INT{codec.bits}{' + error feedback' if self.error_feedback else ''}"

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # ``state_dict`` needs the trainer (global step, optimizers, module); Lightning calls it without arguments.
        self._trainer = trainer

    @staticmethod
    def _local_params(pl_module: pl.LightningModule) -> dict[str, torch.Tensor]:
        return {name: _local(p.data) for name, p in pl_module.named_parameters() if p.requires_grad}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After the strategy wrapped the model and Lightning restored a checkpoint (model, optimizers, this callback).
        group = trainer.strategy.replica_group
        params = self._local_params(pl_module)
        self.state = ReplicaSyncState(params, group, self.codec, error_feedback=self.error_feedback, **self.outer)
        pending, self._pending = self._pending, None
        if pending is not None:
            self._restore(trainer, pl_module, pending, params)
        else:
            # Every replica starts from replica 0's parameters (seeded initialisation normally makes them equal
            # already; this makes it so for any model), and the anchor is that start.
            with torch.no_grad():
                for tensor in params.values():
                    dist.broadcast(tensor, group=group, group_src=0)
            self.state.reset_anchors(params)
        self._steps_at_start = trainer.global_step
        self._bytes_at_start = self.state.bytes_sent
        self._last_synced_step = trainer.global_step

    def _restore(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        pending: dict[str, Any],
        params: dict[str, torch.Tensor],
    ) -> None:
        mine = pending["by_rank"][_rank()]
        self.state.load_state_dict(mine["sync"])
        with torch.no_grad():
            for name, value in (mine.get("local_params") or {}).items():
                params[name].copy_(value)
        for optimizer, saved in zip(trainer.optimizers, mine["inner_optimizers"], strict=True):
            _load_local_optimizer_state(optimizer, saved)

    # ------------------------------------------------------------------------------------------------ steps

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if self.state is None or step == self._last_synced_step:
            return  # gradient accumulation: no optimizer step this batch
        if step % self.every == 0:
            self._sync(pl_module, step)
        steps = step - self._steps_at_start
        sent = self.state.bytes_sent - self._bytes_at_start
        fp32 = steps * self.state.per_step_fp32_bytes()
        pl_module.log_dict(
            {
                "replica_sync/bytes_sent": float(sent),
                "replica_sync/bytes_vs_fp32": fp32 / sent if sent else 0.0,
                "replica_sync/syncs": float(self.state.syncs),
            },
            on_step=True,
            on_epoch=False,
            batch_size=1,
        )

    def _sync(self, pl_module: pl.LightningModule, step: int) -> None:
        self.state.sync(self._local_params(pl_module))
        self._last_synced_step = step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.state is not None and trainer.global_step != self._last_synced_step:
            self._sync(pl_module, trainer.global_step)

    # ------------------------------------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Every rank's outer state, inner optimizer state and (between syncs) local parameters, gathered to rank 0
        (a collective when more than one process); other ranks return ``by_rank=None``."""
        if self.state is None:
            return {"version": _STATE_VERSION, "world_size": _world(), "by_rank": None}
        trainer = self._trainer
        between = trainer.global_step != self._last_synced_step
        local = {
            "sync": self.state.state_dict(),
            "local_params": (
                {name: t.detach().cpu().clone() for name, t in self._local_params(trainer.lightning_module).items()}
                if between
                else None
            ),
            "inner_optimizers": [_local_optimizer_state(o) for o in trainer.optimizers],
        }
        world, rank = _world(), _rank()
        if world == 1:
            by_rank: list[Any] | None = [local]
        else:
            by_rank = [None] * world if rank == 0 else None
            dist.gather_object(local, by_rank, dst=0)
        return {"version": _STATE_VERSION, "world_size": world, "every": self.every, "by_rank": by_rank}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        by_rank = state_dict.get("by_rank")
        if by_rank is None:
            return
        if len(by_rank) != _world():
            rank_zero_warn(
                f"ReplicaSync: the checkpoint holds the state of {len(by_rank)} rank(s), this run has {_world()}; the "
                "outer optimizer and residuals restart from the loaded model"
            )
            return
        self._pending = {"by_rank": by_rank}


def _local_optimizer_state(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Per parameter (in ``param_groups`` order), its optimizer state with DTensors as CPU copies of their local
    shards: what differs between replicas."""
    out = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            out.append(
                {k: _local(v).detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
            )
    return out


def _load_local_optimizer_state(optimizer: torch.optim.Optimizer, saved: list[dict[str, Any]]) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if len(params) != len(saved):
        raise ValueError(
            f"ReplicaSync: the checkpoint's inner optimizer state covers {len(saved)} parameters, the optimizer has "
            f"{len(params)}"
        )
    with torch.no_grad():
        for param, values in zip(params, saved, strict=True):
            state = optimizer.state[param]
            for key, value in values.items():
                current = state.get(key)
                if isinstance(value, torch.Tensor) and isinstance(current, torch.Tensor):
                    _local(current).copy_(value)
                else:
                    state[key] = value
