"""The pipeline training loop inside Lightning's steps: one rank's stages, schedules and the model's objective.

Lightning's automatic optimization runs ``training_step -> zero_grad -> backward -> optimizer.step``. Under pipeline
parallelism the schedule runs forward *and* backward inside ``training_step``, so the strategy skips Lightning's
own zero_grad + backward (the fit loop's ``_skip_backward`` flag, as Lightning's ``StochasticWeightAveraging``
does) and zeroes the gradients itself at the start of each accumulation window; the optimizer step, gradient
clipping (through the strategy's precision plugin) and schedulers stay Lightning's.

Per step (:meth:`PipelineRunner.run`), on every rank of the pipeline:

1. the batch is brought to the fixed shape pipelining needs (``PipelineSpec.prepare_batch``) and the objective
   computes its whole-batch counts (``begin``);
2. a forward-only pass of the schedule (``needs_statistics``, and always for validation) lets the objective
   ``observe`` every microbatch and ``prepare`` whole-batch quantities;
3. the training schedule runs forward + backward with the objective's ``microbatch_loss``;
4. the last stage's loss values are broadcast over the pipeline group, so every rank logs the same numbers.

:func:`training_step` and :func:`validation_step` are the strategy's steps under pipeline parallelism: they run the
runner on Lightning's batch and log the loss values with the module's ``log``.

The two passes use separate ``PipelineStage`` objects over the same stage modules, so neither re-initializes the
other's communication buffers each step (a stage switching between eval and train re-runs its shape inference).
The forward-only pass runs breadth first (GPipe / LoopedBFS) whatever the training schedule: without backward,
that order has the shortest span.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_mm.parallel.pipeline import PipelineSplit, TimelineRecorder, build_schedule, idle_fraction, plot_timeline
from lightning_mm.parallel.protocol import PipelineSpec
from lightning_mm.parallel.tied import TiedAcrossStages

__all__ = ["PipelineRunner", "counted_elsewhere", "training_step", "validation_step", "with_tied_gradients"]


class PipelineRunner:
    """This rank's stage(s) of a pipelined model and the schedules that run them."""

    def __init__(
        self,
        spec: PipelineSpec,
        split: PipelineSplit,
        stage_modules: Sequence[nn.Module],
        stage_ids: Sequence[int],
        device: torch.device,
        pp_group: dist.ProcessGroup,
        schedule: str,
        microbatches: int,
        tied: TiedAcrossStages | None = None,
    ) -> None:
        """``tied``: this rank's copies of weights another stage holds too (a tied embedding and LM head)."""
        from torch.distributed.pipelining import PipelineStage

        self.spec, self.split = spec, split
        self.stage_modules = list(stage_modules)
        self.stage_ids = list(stage_ids)
        self.pp_group = pp_group
        self.pp_size = dist.get_world_size(pp_group)
        self.device = device
        self.schedule_name = schedule
        self.microbatches = microbatches
        self.tied = tied
        num_stages = split.num_stages
        self.has_first = 0 in self.stage_ids
        self.has_last = num_stages - 1 in self.stage_ids

        def stages(cls: type[PipelineStage] = PipelineStage) -> list[PipelineStage]:
            return [
                cls(module, stage, num_stages, device, group=pp_group)
                for module, stage in zip(self.stage_modules, self.stage_ids, strict=True)
            ]

        self._loss_divisor = 1
        self.train_schedule = build_schedule(stages(), schedule, microbatches, self._train_loss)
        # Forward only, the breadth-first order is the shortest (no backward to interleave): GPipe for one stage per
        # rank, LoopedBFS for several; whatever the training schedule is.
        forward_schedule = "GPipe" if len(self.stage_ids) == 1 else "LoopedBFS"
        self.eval_schedule = build_schedule(stages(forward_only_stage()), forward_schedule, microbatches, self._observe)
        self.recorder = TimelineRecorder(_stages_of(self.train_schedule))
        self.recorder.watch(_stages_of(self.eval_schedule), forward_kind="S", forward_only=True)
        self._value_names: list[str] | None = None
        self._value_dtype = torch.float32
        self.timeline: dict | None = None

    # ------------------------------------------------------------------------------------------- loss callbacks

    def _train_loss(self, output: Any, target: Any) -> torch.Tensor:
        # scale_grads=False in build_schedule: gradients are the sum of these shares over the microbatches.
        return self.spec.objective.microbatch_loss(output, target) / self._loss_divisor

    def _observe(self, output: Any, target: Any) -> torch.Tensor:
        self.spec.objective.observe(output, target)
        return torch.zeros(())

    # ------------------------------------------------------------------------------------------- one step

    def run(
        self,
        batch: Any,
        group: dist.ProcessGroup | None,
        train: bool,
        loss_divisor: int,
        context: Callable[[], AbstractContextManager],
    ) -> dict[str, torch.Tensor]:
        """One step over ``batch`` (this rank's data-parallel share); returns the whole batch's loss values (this
        rank's share of the global ones, as without pipelining) on every rank. ``context()`` gives the precision
        plugin's step context (autocast), entered once per pass."""
        spec, objective = self.spec, self.spec.objective
        if spec.prepare_batch is not None:
            batch = spec.prepare_batch(batch)
        args = spec.inputs(batch)
        rows = spec.num_rows(batch) if spec.num_rows is not None else args[0].shape[0]
        if rows % self.microbatches:
            raise ValueError(
                f"a batch of {rows} rows does not split into microbatches={self.microbatches}; choose "
                "microbatches dividing the per-rank batch size"
            )
        target = spec.target(batch)
        args = args if self.has_first else ()
        # Lightning validates under inference_mode (with NCCL; gloo gets no_grad): the objective's state and the
        # schedules' receive buffers must be ordinary tensors, so the whole step runs outside it.
        with torch.inference_mode(False):
            objective.begin(batch, group)
            if not train or objective.needs_statistics:
                with torch.no_grad(), context(), objective.pass_context():
                    self.eval_schedule.eval(*[a.clone() for a in args], target=_clone(target), return_outputs=False)
                _release(self.eval_schedule)
                if self.has_last:
                    start = time.perf_counter()
                    objective.prepare(group, train)
                    if self.recorder.enabled:  # the objective's whole-batch work between the passes, on the timeline
                        self.recorder.events.append(("O", self.split.num_stages - 1, -1, start, time.perf_counter()))
            if train:
                self._loss_divisor = loss_divisor
                with context(), objective.pass_context():
                    self.train_schedule.step(*args, target=target, return_outputs=False)
                _release(self.train_schedule)
            values = objective.values() if self.has_last else {}
        return self._broadcast(values)

    def _broadcast(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self._value_names is None:  # the last stage names the values and their dtype once; a tensor per step after
            # The values travel in their promoted dtype, at least float32 (bf16 / float16 values are logged in
            # float32): a float64 model's losses stay float64, which its parity checks compare to 1e-10.
            dtype = functools.reduce(torch.promote_types, (v.dtype for v in values.values()), torch.float32)
            header = [(list(values), dtype)]
            dist.broadcast_object_list(header, group=self.pp_group, group_src=self.pp_size - 1)
            self._value_names, self._value_dtype = header[0]
        stacked = (
            torch.stack(
                [values[name].detach().to(self._value_dtype).reshape(()).to(self.device) for name in self._value_names]
            )
            if self.has_last
            else torch.zeros(len(self._value_names), dtype=self._value_dtype, device=self.device)
        )
        dist.broadcast(stacked, group=self.pp_group, group_src=self.pp_size - 1)
        return dict(zip(self._value_names, stacked, strict=True))

    # ------------------------------------------------------------------------------------------- timeline

    def record(self, enabled: bool) -> float:
        self.recorder.enabled = enabled
        return time.perf_counter()

    def collect_timeline(self, step_start: float, path, rank: int) -> dict:
        """Gather the recorded chunks of every pipeline rank; rank 0 draws them to ``path``."""
        self.recorder.enabled = False
        events = [e for e in self.recorder.events if e[3] >= step_start]
        self.recorder.events.clear()
        gathered: list[Any] = [None] * self.pp_size
        dist.all_gather_object(gathered, events, group=self.pp_group)
        p, m, v = self.pp_size, self.microbatches, len(self.stage_ids)
        # Every stage equally costly: (p - 1) idle slots of the v * m chunk slots per rank and pass.
        self.timeline = {
            "events": gathered,
            "idle_fraction": idle_fraction(gathered),
            "theory": (p - 1) / (v * m + p - 1),
            "schedule": self.schedule_name,
            "microbatches": m,
            "pp": p,
            "virtual_stages": v,
        }
        if path is not None and rank == 0:
            plot_timeline(
                gathered,
                path,
                f"{self.schedule_name} pp={p} m={m}: idle "
                f"{self.timeline['idle_fraction']:.2f} (theory {self.timeline['theory']:.2f})",
            )
        return self.timeline


def _stages_of(schedule: Any) -> list[Any]:
    # The schedules keep their stages as `_stage` (one per rank) or `_stages`; no public accessor in torch 2.13.
    return list(schedule._stages) if hasattr(schedule, "_stages") else [schedule._stage]


@functools.cache
def forward_only_stage() -> type:
    """A ``PipelineStage`` for forward-only schedules whose last stage keeps no microbatch while the pass runs.

    torch keeps each microbatch's inputs and outputs in the stage's ``fwd_cache`` for its backward; with no backward
    nothing removes them before the pass ends, so the last stage of a forward-only pass (validation, the reference
    VLM's statistics pass) held every microbatch's logits at once. Its output goes to the loss callback as the
    schedule's return value of ``forward_one_chunk`` and is sent nowhere, so the entry is dropped at once (one
    microbatch's logits alive instead of all of them). Earlier stages keep theirs until the pass ends: their sends
    read them. (torch's ``return_outputs=False``, https://github.com/pytorch/pytorch/pull/165822, stops the merge
    copy in ``output_chunks`` only; the cache stays.)
    """
    from torch.distributed.pipelining import PipelineStage

    class ForwardOnlyStage(PipelineStage):
        def forward_one_chunk(
            self, fwd_chunk_id: int, args: tuple, kwargs: dict | None = None, save_forward_output: bool = True
        ) -> Any:
            output = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
            if self.is_last:
                del self.fwd_cache[fwd_chunk_id]
            return output

        def get_fwd_send_ops(self, fwd_chunk_id: int) -> list:
            # (the last stage sends nothing; torch reads the dropped entry before finding no peer)
            return [] if self.is_last else super().get_fwd_send_ops(fwd_chunk_id)

    return ForwardOnlyStage


def _release(schedule: Any) -> None:
    """Drop what a pass leaves on its stages until the schedule's next step: the forward-only pass keeps every
    microbatch's inputs and outputs (``fwd_cache``: no backward pops them), and a last stage keeps its outputs for
    the schedule to merge (``output_chunks``, the logits of every microbatch). The objective has seen each output by
    then and nothing reads them again; ``return_outputs=False`` already skips the training pass's merge, this frees
    the rest at once instead of holding it through the other pass and the optimizer step."""
    for stage in _stages_of(schedule):
        stage.clear_runtime_states()


def _clone(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


# ----------------------------------------------------------------------------------------------- Lightning's steps


def training_step(
    runner: PipelineRunner,
    module: Any,
    optimizers: Sequence[torch.optim.Optimizer],
    batch: Any,
    batch_idx: int,
    group: dist.ProcessGroup | None,
    context: Callable[[], AbstractContextManager],
    timeline_request: tuple[int | None, str | Path | None],
    rank: int,
) -> torch.Tensor:
    """The strategy's ``training_step`` under pipeline parallelism: the schedule runs forward + backward over ``batch``
    (the module's ``training_step`` is not called) and ``train/loss`` (and the objective's other values) are logged
    with ``module.log``. ``group``: the data-parallel group the objective normalises over; ``context``: the precision
    plugin's ``train_step_context``; ``timeline_request``: ``(optimizer step, PNG path)`` of
    ``HybridParallelStrategy.record_timeline``."""
    trainer = module.trainer
    accumulate = trainer.accumulate_grad_batches
    if batch_idx % accumulate == 0:
        # Lightning's own zero_grad is skipped with its backward (skip_lightning_backward in on_train_start).
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
    record_step, path = timeline_request
    step_start = runner.record(
        record_step is not None and trainer.global_step == record_step and runner.timeline is None
    )
    values = runner.run(batch, group, train=True, loss_divisor=accumulate, context=context)
    if runner.recorder.enabled:
        runner.collect_timeline(step_start, path, rank)
    _log_values(module, "train", values, _rows(batch), on_step=True)
    # Lightning divides this by accumulate_grad_batches for its records, as for a module's own loss.
    return values["loss"]


def validation_step(
    runner: PipelineRunner,
    module: Any,
    batch: Any,
    group: dist.ProcessGroup | None,
    context: Callable[[], AbstractContextManager],
) -> None:
    """The strategy's ``validation_step`` under pipeline parallelism: the forward-only pass over ``batch``, its loss
    values logged as ``val/...`` epoch averages (``context``: the precision plugin's ``val_step_context``)."""
    values = runner.run(batch, group, train=False, loss_divisor=1, context=context)
    # Metrics that need logits / embeddings on every rank (token accuracy, recall) are not computed under
    # pipeline parallelism; the objective's losses are logged.
    _log_values(module, "val", values, _rows(batch), on_step=False)


def _log_values(module: Any, stage: str, values: dict[str, torch.Tensor], batch_size: int, on_step: bool) -> None:
    # Each value is this rank's share of the global batch's loss (as the module's own losses are), identical
    # over the pipeline ranks; sync_dist's mean over all ranks is the global loss.
    for name, value in values.items():
        module.log(
            f"{stage}/{name}",
            value,
            prog_bar=name == "loss",
            on_step=on_step,
            on_epoch=not on_step,
            batch_size=batch_size,
            sync_dist=True,
        )


def _rows(batch: Any) -> int:
    """Samples in a batch, for Lightning's epoch averages of logged values."""
    for attribute in ("num_samples", "num_rows"):
        value = getattr(batch, attribute, None)
        if isinstance(value, int):
            return max(value, 1)
    if isinstance(batch, torch.Tensor):
        return max(batch.shape[0], 1)
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor):
        return max(batch[0].shape[0], 1)
    return 1


def with_tied_gradients(runner: PipelineRunner | None, closure: Callable[[], Any]) -> Callable[[], Any]:
    """The optimizer step's closure (the step's last ``training_step``) followed, for a weight tied across stages,
    by summing its copies' gradients, so that clipping and the ``on_before_optimizer_step`` hooks see whole
    gradients (:mod:`lightning_mm.parallel.tied`)."""
    tied = runner.tied if runner is not None else None
    if tied is None:
        return closure

    def run() -> Any:
        result = closure()
        tied.all_reduce_grads_()
        return result

    return run


def counted_elsewhere(runner: PipelineRunner | None) -> list[torch.Tensor]:
    """This rank's parameters whose gradient another stage's norm counts (a tied weight's later copies)."""
    tied = runner.tied if runner is not None else None
    return tied.counted_elsewhere if tied is not None else []
