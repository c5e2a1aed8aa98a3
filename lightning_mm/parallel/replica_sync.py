"""Replica-link synchronisation every H steps from (optionally compressed) pseudo-gradients (plain torch).

DiLoCo (Douillard et al. 2023, https://arxiv.org/abs/2311.08105): replicas train on their own for ``H`` inner steps;
then every replica sends its *pseudo-gradient* ``anchor - local`` (how far its parameters moved since the last sync),
the average is taken over the replica group, and an outer optimizer (Nesterov SGD) moves the shared ``anchor`` by it.
Every replica then continues from the new anchor. SparseLoCo / DeMo compress the pseudo-gradient with Top-k, low-bit
values and error feedback (what is not sent is added to the next pseudo-gradient); here the codec of
:mod:`lightning_mm.parallel.compression` does it through :func:`compressed_all_reduce_coalesced`.

:class:`ReplicaSyncState` holds what the outer loop needs per rank: the anchor (fp32 copies of this rank's local
parameter tensors: the local shards under FSDP2 / TP), the outer optimizer (a real ``torch.optim.SGD`` over the
anchors), error-feedback residuals and byte counters. It works on whatever parameters it is given; the caller decides
which group is the replica group and keeps per-step gradient sync inside a replica only.

Identities the tests check: with ``outer_lr=1``, ``outer_momentum=0`` and no codec, a sync sets every replica to the
average of the replicas' parameters; with ``H=1`` and an inner optimizer linear in the gradient (SGD, with or without
momentum, no clipping) that is exactly data-parallel training (the average of the replicas' updates is the update of
the average gradient). With Adam it is not (each replica normalises its own gradient), by design of the method.

torchft ships DiLoCo (``torchft.local_sgd.DiLoCo``); it is not used here because it needs torchft's ``Manager`` (a
lighthouse server and a per-step quorum over its own reconfigurable process group) around every step, and its
pseudo-gradient quantization is a Triton (CUDA) kernel without Top-k or error feedback, so it neither runs on CPU /
gloo nor reaches the compression this sync needs (https://github.com/pytorch/torchft/blob/main/torchft/local_sgd.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_mm.parallel.compression import CodecConfig, CommStats, ErrorFeedback, compressed_all_reduce_coalesced

__all__ = ["ReplicaSyncState", "fp32_all_reduce_bytes"]


def fp32_all_reduce_bytes(numel: int, world: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``numel`` fp32 values over ``world`` ranks: ``2 (w-1)/w * 4n``."""
    return 2 * (world - 1) * -(-numel // world) * 4 if world > 1 else 0


class ReplicaSyncState:
    """The outer loop's state on one rank; every rank of the replica group calls :meth:`sync` at the same step.

    Args:
        params: ``{name: tensor}`` this rank's local parameter tensors (plain tensors, or the local shards of
            DTensors: pass ``p.to_local()``); :meth:`sync` writes the new anchor into them in place.
        group: the replica group (ranks holding the same parameter shards, training on different data).
        codec: ``None`` sends the pseudo-gradients as an exact fp32 all-reduce; a :class:`CodecConfig` compresses
            both halves of the all-reduce (reduce-scatter and all-gather) with it.
        error_feedback: keep what the codec did not send and add it to the next pseudo-gradient (with a codec only).
        outer_lr, outer_momentum, nesterov: the outer ``torch.optim.SGD`` (DiLoCo: 0.7, 0.9, Nesterov; the defaults
            are what measured best at H = 16 on the reference model, see :class:`lightning_mm.callbacks.ReplicaSync`).
    """

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        group: dist.ProcessGroup | None,
        codec: CodecConfig | None = None,
        error_feedback: bool = True,
        outer_lr: float = 0.9,
        outer_momentum: float = 0.3,
        nesterov: bool = True,
    ) -> None:
        if not params:
            raise ValueError("ReplicaSyncState needs at least one parameter tensor")
        self.group = group
        self.codec = codec
        self.error_feedback = bool(error_feedback and codec is not None)
        self.names = list(params)
        self.anchors = {name: p.detach().float().clone() for name, p in params.items()}
        self.outer = torch.optim.SGD(
            list(self.anchors.values()), lr=outer_lr, momentum=outer_momentum, nesterov=nesterov and outer_momentum > 0
        )
        self.feedback = ErrorFeedback()
        self.gather_feedback = ErrorFeedback()
        self.stats = CommStats()
        self.syncs = 0
        self.bytes_sent = 0
        """Bytes this rank has sent over the replica group since construction (or the restored value)."""

    @property
    def numel(self) -> int:
        return sum(a.numel() for a in self.anchors.values())

    def per_step_fp32_bytes(self) -> int:
        """What this rank would send per step with plain data parallelism over the group (fp32 ring all-reduce)."""
        return fp32_all_reduce_bytes(self.numel, dist.get_world_size(self.group))

    def reset_anchors(self, params: Mapping[str, torch.Tensor]) -> None:
        """Take ``params`` as the anchor (e.g. after loading weights); outer momentum and residuals are kept."""
        self._check_names(params)
        with torch.no_grad():
            for name, tensor in params.items():
                self.anchors[name].copy_(tensor.detach().float())

    def _check_names(self, params: Mapping[str, torch.Tensor]) -> None:
        if list(params) != self.names:
            missing = sorted(set(self.names) - set(params))
            extra = sorted(set(params) - set(self.names))
            raise ValueError(
                f"parameters differ from the ones the state was built with: missing {missing}, extra {extra}"
            )

    @torch.no_grad()
    def sync(self, params: Mapping[str, torch.Tensor]) -> None:
        """Average the pseudo-gradients ``anchor - param`` over the group, step the outer optimizer on the anchors and
        copy the new anchors into ``params`` (every replica leaves with the same values)."""
        self._check_names(params)
        deltas = [self.anchors[name] - params[name].detach().float() for name in self.names]
        before = self.stats.bytes_after
        if self.codec is None:
            averaged = self._exact_average(deltas)
        else:
            residuals = gather_residuals = None
            if self.error_feedback:
                world = dist.get_world_size(self.group)
                residuals = [
                    self.feedback.residual(n, d.shape, d.device) for n, d in zip(self.names, deltas, strict=True)
                ]
                gather_residuals = [
                    self.gather_feedback.residual(n, (-(-d.numel() // world),), d.device)
                    for n, d in zip(self.names, deltas, strict=True)
                ]
            averaged = compressed_all_reduce_coalesced(
                deltas, self.codec, self.group, "avg", residuals, gather_residuals, self.stats
            )
        self.bytes_sent += self.stats.bytes_after - before
        for name, delta in zip(self.names, averaged, strict=True):
            self.anchors[name].grad = delta.float()
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        for name in self.names:
            params[name].copy_(self.anchors[name].to(params[name].dtype))
        self.syncs += 1

    def _exact_average(self, deltas: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        flat = torch.cat([d.reshape(-1) for d in deltas])
        world = dist.get_world_size(self.group)
        dist.all_reduce(flat, group=self.group)
        flat /= world
        volume = fp32_all_reduce_bytes(flat.numel(), world)
        self.stats.bytes_before += volume
        self.stats.bytes_after += volume
        self.stats.uncompressed_calls += 1
        return [part.view(d.shape) for part, d in zip(flat.split([d.numel() for d in deltas]), deltas, strict=True)]

    # ------------------------------------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """CPU copies: anchors, outer optimizer, residuals, counters (this rank's; residuals differ per rank)."""
        return {
            "anchors": {name: a.detach().cpu().clone() for name, a in self.anchors.items()},
            "outer": self.outer.state_dict(),
            "feedback": self.feedback.state_dict(),
            "gather_feedback": self.gather_feedback.state_dict(),
            "syncs": self.syncs,
            "bytes_sent": self.bytes_sent,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        anchors = state["anchors"]
        self._check_names(anchors)
        with torch.no_grad():
            for name, value in anchors.items():
                if value.shape != self.anchors[name].shape:
                    raise ValueError(
                        f"anchor {name!r} has shape {tuple(value.shape)} in the checkpoint, "
                        f"{tuple(self.anchors[name].shape)} here (another layout?)"
                    )
                self.anchors[name].copy_(value)
        self.outer.load_state_dict(state["outer"])
        self.feedback.load_state_dict(state.get("feedback", {}))
        self.gather_feedback.load_state_dict(state.get("gather_feedback", {}))
        self.syncs = int(state.get("syncs", 0))
        self.bytes_sent = int(state.get("bytes_sent", 0))
