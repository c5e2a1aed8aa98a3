"""What a model declares so that a strategy can parallelize it without knowing it (plain torch; no Lightning).

torchtitan's pattern: the model package owns *how* it is parallelized, the trainer only asks. A model (in
lightning-mm: a ``LightningModule`` with a ``parallel_plan()`` method, see :class:`ParallelPlanProvider`) returns a
:class:`ParallelPlan`; every field is optional, and what is missing falls back to a generic rule:

==========================  =============================================  ==========================================
field                       says                                           without it
==========================  =============================================  ==========================================
``tp_plan``                 ``{fqn_pattern: style}`` for tensor parallel   the strategy's ``tp_plan`` argument
                            (and sequence parallel, when asked for)        (an error if ``tensor_parallel > 1``)
``blocks``                  FSDP2 and activation-checkpointing units       outermost ``nn.ModuleList`` items
``apply_expert_parallel``   shards the model's experts over an ep mesh     ``expert_parallel > 1`` is refused
``pipeline``                a :class:`PipelineSpec`                        generic cut by ``pipeline_split`` FQNs
``initialize``              fills a meta-built model's parameters once     each submodule's ``reset_parameters()``
                            they are allocated (loads pretrained shards)   (Lightning's rule)
==========================  =============================================  ==========================================

A module that builds its layers on the meta device (in ``configure_model``, when the strategy says
:func:`materializes_meta_modules`) is parallelised while still meta; the strategy then allocates this rank's shards
(``to_empty``) and calls ``initialize`` (:mod:`lightning_mm.parallel.materialize`).

FQN patterns and names are relative to the module that returns the plan (the ``LightningModule``), so one plan
serves ``state_dict`` keys, TP, FSDP and the pipeline split alike.

Pipeline objective. A pipeline schedule computes the loss one microbatch at a time on the last stage and starts
backward before later microbatches ran forward (1F1B). A loss that couples samples (a contrastive loss over all
pairs, a balance loss over all routed tokens) cannot be computed that way without changing the objective.
:class:`PipelineObjective` therefore has two passes:

1. *statistics pass* (only when :attr:`PipelineObjective.needs_statistics` is true): a forward-only run of the
   schedule over the whole batch; :meth:`~PipelineObjective.observe` sees every microbatch's last-stage outputs
   (no grad) and :meth:`~PipelineObjective.prepare` turns them into whole-batch quantities (e.g. the gradient of
   the contrastive loss with respect to every embedding, GradCache-style; the routing fractions of the whole batch).
2. *training pass*: :meth:`~PipelineObjective.microbatch_loss` returns each microbatch's share; the shares sum to
   the whole-batch loss and their gradients to its gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from lightning_mm.parallel.collectives import at_least_float32

if TYPE_CHECKING:
    from lightning_mm.parallel.pipeline import PipelineSplit

__all__ = [
    "MeanLossObjective",
    "ParallelPlan",
    "ParallelPlanProvider",
    "PipelineObjective",
    "PipelineSpec",
    "materializes_meta_modules",
]


class PipelineObjective:
    """How the last stage's outputs become the loss, one microbatch at a time (see the module docstring).

    The strategy calls, per optimizer step and on every rank: :meth:`begin` (before any pass; collectives over the
    data-parallel ``group`` allowed), then on the ranks holding the last stage: :meth:`observe` per microbatch and
    :meth:`prepare` (statistics pass, when :attr:`needs_statistics`), :meth:`microbatch_loss` per microbatch
    (training pass), :meth:`values` for logging. Validation runs :meth:`begin`, the forward-only pass with
    :meth:`observe`, ``prepare(group, train=False)`` and :meth:`values`, whatever :attr:`needs_statistics` says.
    A model whose objective needs to know which batch rows a microbatch holds carries their indices through its
    stages (the reference model does), since a schedule may run microbatches in any order.
    """

    needs_statistics: bool = False
    """Run a forward-only pass over the whole batch before the training pass."""

    def begin(self, batch: Any, group: dist.ProcessGroup | None) -> None:
        """Whole-batch quantities every rank can compute from the batch alone (e.g. global token counts)."""

    def observe(self, output: Any, target: Any) -> None:
        """Statistics pass: one microbatch's last-stage outputs (no grad)."""

    def prepare(self, group: dist.ProcessGroup | None, train: bool) -> None:
        """After the statistics pass, on the last stage's ranks (collectives over ``group`` allowed); ``train``:
        a training pass follows (validation only needs :meth:`values`)."""

    def microbatch_loss(self, output: Any, target: Any) -> torch.Tensor:
        """Training pass: this microbatch's share of the batch loss (shares sum to the batch loss)."""
        raise NotImplementedError

    def pass_context(self) -> AbstractContextManager:
        """Entered around each whole pass (the schedule's forward and backward of every microbatch), on every rank:
        e.g. ``loss_parallel()`` for a loss over vocab-sharded logits. Nothing by default."""
        return nullcontext()

    def values(self) -> dict[str, torch.Tensor]:
        """Scalar losses of the whole batch for logging; ``"loss"`` is the one Lightning reports (last stage)."""
        raise NotImplementedError


class MeanLossObjective(PipelineObjective):
    """The objective of a model whose loss is a mean over samples: ``loss_fn(output, target)`` is the mean over the
    microbatch, and the batch loss is the mean over the ``microbatches`` equal-sized microbatches (exactly the mean
    over the batch). The user module's ``pipeline_loss`` hook is ``loss_fn``."""

    def __init__(self, loss_fn: Callable[[Any, Any], torch.Tensor], microbatches: int) -> None:
        self.loss_fn = loss_fn
        self.microbatches = microbatches
        self._parts: list[torch.Tensor] = []

    def begin(self, batch: Any, group: dist.ProcessGroup | None) -> None:
        self._parts = []

    def microbatch_loss(self, output: Any, target: Any) -> torch.Tensor:
        loss = self.loss_fn(output, target) / self.microbatches
        self._parts.append(at_least_float32(loss.detach()))
        return loss

    def observe(self, output: Any, target: Any) -> None:  # validation
        self._parts.append(at_least_float32(self.loss_fn(output, target).detach()) / self.microbatches)

    def values(self) -> dict[str, torch.Tensor]:
        # The last `microbatches` parts: on the first step torch's pipelining calls the loss once more, before the
        # real microbatches, on uninitialised tensors to infer backward metadata.
        return {"loss": torch.stack(self._parts[-self.microbatches :]).sum()}


@dataclass
class PipelineSpec:
    """How a model is cut into pipeline stages and how a batch flows through them.

    ``units`` are FQNs in forward order; a stage is a contiguous run of them, and ``pipeline_split`` names the
    units that begin stages 1, 2, ... (``"auto"``: balance ``unit_costs``). ``build_stages(split, stage_ids)`` is
    called once per rank with the split and the ids of its stages; it removes from the model what no local stage
    owns (FQNs of what stays are unchanged, so checkpoints are those of the unsplit model) and
    returns one ``nn.Module`` per local stage whose ``forward`` takes and returns tensors (what
    ``torch.distributed.pipelining`` sends between ranks; every tensor is chunked along dim 0 into microbatches).
    """

    units: Sequence[str]
    build_stages: Callable[[PipelineSplit, list[int]], list[nn.Module]]
    inputs: Callable[[Any], tuple[torch.Tensor, ...]]
    """Batch -> positional inputs of stage 0 (each chunked along dim 0 into microbatches)."""
    target: Callable[[Any], Any]
    """Batch -> the target the objective receives per microbatch (chunked along dim 0)."""
    objective: PipelineObjective
    unit_costs: Callable[[], Mapping[str, float]] | None = None
    """Forward FLOPs (or any cost) per unit, for ``pipeline_split="auto"``."""
    prepare_batch: Callable[[Any], Any] | None = None
    """Batch -> batch of the fixed shape pipelining needs (e.g. padding); identity when None."""
    num_rows: Callable[[Any], int] | None = None
    """Batch -> number of rows (what is split into microbatches); default: dim 0 of the first stage-0 input."""
    max_stages_per_rank: int | None = None
    """``None``: any number (interleaved schedules); ``1``: the model supports one stage per rank only."""
    sequence_shards: bool = False
    """Whether the stages run under ``sequence_parallel=True``: each tensor-parallel rank's stage sends and receives
    its ``1 / tp`` of the sequence (the stage returns the local shard of its sequence-sharded hidden states, and the
    model's tensor-parallel plan takes a received one back as a sequence shard). False: the strategy refuses
    ``sequence_parallel`` with ``pipeline_parallel > 1`` for the model."""


@dataclass
class ParallelPlan:
    """What the strategy needs to know to parallelize a model (see the module docstring)."""

    tp_plan: Mapping[str, Any] | None = None
    blocks: Sequence[nn.Module] | None = None
    apply_expert_parallel: Callable[..., Any] | None = None
    """``apply_expert_parallel(ep_mesh, placement)``: shard the experts in place; returns the expert modules."""
    pipeline: PipelineSpec | None = None
    check_degrees: Callable[[Mapping[str, int]], None] | None = None
    """``check_degrees({"pp": 2, "tp": 2, "ep": 1, "dp": 4})``: raise ``ValueError`` (saying what to do) for a mesh
    the model cannot run on; called by the strategy before anything is applied."""
    initialize: Callable[[], None] | None = None
    """For a module built on the meta device: called once the strategy parallelised it and allocated its parameters
    on their device (``to_empty``; plain tensors or DTensor shards), to fill them (load pretrained slices, initialise
    buffers). ``None``: each submodule's ``reset_parameters()``."""


@runtime_checkable
class ParallelPlanProvider(Protocol):
    """A module that says how it is parallelized (the reference ``VLMModule`` is one)."""

    def parallel_plan(
        self, *, sequence_parallel: bool = False, microbatches: int = 1, pipeline_shape: Sequence[int] | None = None
    ) -> ParallelPlan:
        """``sequence_parallel``: include sequence-parallel styles in ``tp_plan``; ``microbatches``: per step, for
        the pipeline objective; ``pipeline_shape``: the fixed batch shape the strategy was given, if any."""


def materializes_meta_modules(strategy: Any) -> bool:
    """Whether ``strategy`` parallelises a module built on the meta device and then fills it through
    :attr:`ParallelPlan.initialize` (a model may then build on meta in ``configure_model``; under other strategies it
    builds with memory). Strategies say so with a class attribute ``materializes_meta_modules = True``."""
    return getattr(type(strategy), "materializes_meta_modules", False) is True
