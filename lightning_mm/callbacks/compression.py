"""``CompressedAllToAll``: data-parallel gradient sync through Top-k + INT8 codecs with error feedback, and the
expert-parallel dispatch / combine exchange through INT8.

Thin Lightning glue over :mod:`lightning_mm.parallel.compression` (the codecs, the compressed collectives, the DDP
comm hook and the FSDP2 custom reduce-scatter live there and work in a hand-written loop too) and
:class:`lightning_mm.parallel.experts.ActivationCodec` (the hook of the expert dispatcher).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn.parallel import DistributedDataParallel

from lightning_mm.callbacks._common import _logs_after_this_batch, _rank, _steps_after_this_batch, _world
from lightning_mm.parallel.compression import (
    AutoTrial,
    CodecConfig,
    CommStats,
    GradCompressionState,
    register_ddp_compression,
    register_fsdp_compression,
)
from lightning_mm.parallel.experts import ActivationCodec, expert_modules
from lightning_mm.validation import require_int

__all__ = ["CompressedAllToAll"]

_TARGETS = ("grad", "moe")
# Optimizers with per-element adaptive step sizes; see _check_adaptive_topk.
_ADAPTIVE_OPTIMIZERS = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adamax,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
)
_STATE_VERSION = 1


@dataclasses.dataclass
class _Interval:
    """A ``CommStats`` summed over the batches since the metrics were last logged (every micro-batch's exchanges
    under gradient accumulation), and the optimizer steps those batches made."""

    stats: CommStats = dataclasses.field(default_factory=CommStats)
    steps: int = 0
    exact_backward_bytes: int = 0

    def add(self, stats: CommStats, exact_backward_bytes: int = 0) -> None:
        self.stats.add(stats)
        self.exact_backward_bytes += exact_backward_bytes

    @property
    def exchanged(self) -> bool:
        return self.stats.calls + self.stats.uncompressed_calls > 0


def _default_codec(
    targets: tuple[str, ...],
    topk_ratio: float,
    block_size: int,
    bits: int | None,
    scale_dtype: str | None,
    rotation: bool | None,
) -> tuple[int, str, bool]:
    """``(bits, scale_dtype, rotation)``: the Adam-safe T1 codec (INT4, rotated blocks, bf16 scales) when the codec is
    left to its defaults on the dense gradient exchange alone (with a power-of-two ``block_size``); otherwise each
    unset argument's plain default (INT8, float32 scales, no rotation), the setting measured on the expert exchange
    and with Top-k."""
    left_to_defaults = bits is None and scale_dtype is None and rotation is None
    power_of_two = block_size > 0 and not block_size & (block_size - 1)  # (rotation's Hadamard blocks need one)
    if left_to_defaults and targets == ("grad",) and topk_ratio == 1.0 and power_of_two:
        return 4, "bfloat16", True
    return 8 if bits is None else bits, "float32" if scale_dtype is None else scale_dtype, bool(rotation)


class CompressedAllToAll(pl.Callback):
    """Compress the data-parallel gradient exchange (``"grad"``: Top-k sparsification + INT8 or INT4 block
    quantization, with per-rank error-feedback residuals kept in checkpoints) and / or the expert-parallel token
    exchange (``"moe"``: dense block quantization of the dispatched activations, no error feedback).

    ``targets=("grad",)``:

    * under DDP (``strategy="ddp"``) a DDP comm hook replaces each bucket's all-reduce by a compressed
      reduce-scatter (ZeRO++ qgZ style: quantize on the wire, dequantize, sum in fp32) and a compressed all-gather
      of the reduced chunks; each parameter is encoded on its own (per-tensor Top-k). Lightning's own
      ``DDPStrategy(ddp_comm_hook=...)`` registers hooks on CUDA only, so this callback registers on the wrapped
      model itself in ``on_fit_start`` (CPU / gloo included);
    * under FSDP2 (``HybridParallelStrategy``, Lightning's ``ModelParallelStrategy``) every FSDP unit gets a custom
      reduce-scatter (``FSDPModule.set_custom_reduce_scatter``, feature-detected). With HSDP the all-reduce over
      the replicate axis that follows stays uncompressed.

    ``targets=("moe",)``: the expert-parallel token exchange (``HybridParallelStrategy(expert_parallel > 1)``; setup
    raises otherwise). At fit start an :class:`~lightning_mm.parallel.experts.ActivationCodec` is installed on the
    dispatcher of every expert module (and removed again at teardown): the forward dispatch (tokens to their
    experts) and combine (expert outputs back) payloads are block-quantized with ``bits`` / ``block_size`` /
    ``scale_dtype`` / ``min_numel`` (per off-rank segment) and dequantized on arrival; ``topk_ratio`` does not
    apply (always dense: Top-k of an activation zeroes most features of every token). Segments holding NaN / Inf are
    sent raw and counted. The backward exchanges (gradients w.r.t. those activations) are sent exact
    (straight-through: the upstream gradients are exact at the quantized forward), so per training step the
    dispatch / combine traffic shrinks by at least ``(1 - 1/r) / 2``, r ~3.8-3.9 for INT8 over fp32 (more where an
    exchange's output does not reach the loss, as its backward never runs). Validation inside
    ``fit`` goes through the codec as well (the model is evaluated as it is trained).

    Error feedback applies to ``"grad"`` only. For gradients, a residual carried to the next step is meaningful: the
    same position holds the same parameter's gradient every step, and feedback makes the sum of sent values track the
    sum of true ones. For activations, rows are different tokens every step (and a different number of them), so
    there is no "next value of the same quantity" to add the error to; each call's INT8 error is instead a fresh
    perturbation bounded by ``max|block| / 254`` per element, which does not accumulate. Hence
    ``error_feedback=True`` together with ``targets=("moe",)`` alone is refused (``ValueError``); with
    ``("moe", "grad")`` it acts on the gradients; the default ``error_feedback=None`` means "on for ``"grad"``".

    Logged when Lightning writes its logs (every ``log_every_n_steps`` optimizer steps; this rank's values, per
    optimizer step over the steps since the last log, under ``compression/``): ``bytes_before`` (what the same
    collectives move off this rank uncompressed: ``2 (world - 1) / world`` of the gradient bytes for DDP, the
    ring all-reduce volume; ``(world - 1) / world`` for FSDP2's reduce-scatter), ``bytes_after`` (what really
    leaves: payloads with indices, scales, headers, padding and size words), ``ratio``, ``encode_ms``,
    ``decode_ms``, ``break_even_gbit_s`` (``B* = S (1 - 1/r) / T_c``: compression pays on links slower than this),
    ``raw_nonfinite`` (payloads sent uncompressed because they held NaN / Inf), ``active`` and ``topk_ratio`` (the
    fraction sent this step: ``sparsity_warmup_steps`` ramps it; 1 while uncompressed).

    Optimizers: Top-k (``topk_ratio < 1``) delivers each gradient element as a rare accumulated burst. Error
    feedback keeps the *sum* of sent gradients equal to the sum of true ones, which carries over to the parameters
    only for updates linear in the gradient (plain SGD); per-element adaptive optimizers (Adam, AdamW, ...) trained
    far worse on that stream with the reference model (+102 % final loss at 300 AdamW steps, +150 % at 1000; with
    the 1-bit-Adam recipe, a frozen second moment, still +65 %), so :meth:`on_fit_start` refuses Top-k gradients
    with such an optimizer unless ``allow_topk_with_adaptive_optimizer=True`` (experiments; it then warns). Dense
    INT8 and INT4 with rotation (``topk_ratio=1.0``) are the settings measured close to uncompressed; for 100x and
    more under Adam, synchronise replicas less often instead (:class:`~lightning_mm.callbacks.ReplicaSync`).

    Checkpoints: residuals are per rank. Lightning writes a callback's state from rank 0 only, so
    :meth:`state_dict` gathers every rank's residuals to rank 0 (a collective: every rank must save, as
    ``Trainer.save_checkpoint`` requires anyway) and :meth:`load_state_dict` picks this rank's. Resuming on a
    different number of ranks restarts the residuals from zero, with a warning.

    Defaults: ``CompressedAllToAll()`` is the setting measured safe under AdamW from step 0, T1: dense (no Top-k)
    INT4 with rotated blocks, bf16 scales and error feedback on the gradient exchange (7.7x fewer bytes, final
    held-out loss inside the fp32 3-seed spread after 1000 AdamW steps; docs/compression.md). ``bits``,
    ``scale_dtype`` and ``rotation`` left unset otherwise (Top-k, or the ``"moe"`` target) mean INT8, float32 scales,
    no rotation.

    Args:
        topk_ratio: fraction of each gradient tensor's elements sent, in ``(0, 1]``; ``1.0`` (default) is dense
            quantization.
        bits: 8 or 4 bits per sent value (default: see above).
        error_feedback: add what was not sent to the next step's gradient (keeps Top-k training on track);
            ``"grad"`` only (see above). ``None`` (default): on when ``"grad"`` is a target.
        targets: ``"grad"`` and/or ``"moe"`` (see above).
        min_numel: tensors with fewer elements go uncompressed (DDP: parameters inside a bucket, and buckets;
            FSDP2: per-rank chunks of a unit; moe: each off-rank segment of a dispatch / combine).
        warmup_steps: optimizer steps at the start with uncompressed sync.
        sparsity_warmup_steps: after ``warmup_steps``, the fraction of elements sent decays geometrically from 1 to
            ``topk_ratio`` over this many optimizer steps (DGC's exponential warm-up, Lin et al. 2018,
            https://arxiv.org/abs/1712.01887 section 3.3): step ``s`` of it sends ``topk_ratio ** ((s + 1) / n)``
            (see :meth:`topk_ratio_at`; logged as ``compression/topk_ratio``). Early in training gradients change
            fastest, and a residual held back for ~``1 / topk_ratio`` steps is most out of date. ``"grad"`` only,
            and only with ``topk_ratio < 1``.
        block_size: elements sharing one quantization scale.
        scale_dtype: ``"float32"`` or ``"bfloat16"`` scales (default: see above).
        allow_topk_with_adaptive_optimizer: run Top-k gradients with Adam-like optimizers anyway (measured unsafe,
            see above); ``False`` refuses the combination at fit start.
        rotation: rotate each block by a randomized Hadamard matrix before quantizing
            (:func:`~lightning_mm.parallel.compression.block_rotation`; ``block_size`` a power of two), the outlier
            care of 4-bit gradient exchange (SDP4Bit); on by default with the default INT4 codec (see above).
        auto: compress only where it pays, measured: after ``warmup_steps`` (and ``sparsity_warmup_steps``),
            optimizer steps plain and compressed in ABBA order: ``AUTO_WARMUP_STEPS`` (4) untimed, then
            ``AUTO_TRIAL_STEPS`` (32) timed whole (every micro-batch; an interval holding validation or a
            checkpoint save is not counted); compression stays on for the rest of the fit if the slowest rank's
            median compressed step is at least ``AUTO_MARGIN`` (5 %) faster than its median plain one, else the
            exchange stays plain (and the trial's residuals are dropped); rank 0 logs both figures and the choice
            (``auto.decision``, ``auto.measured``; :class:`~lightning_mm.parallel.compression.AutoTrial`). With
            ample bandwidth the codec's time is not paid back; on a slow link it is. Each ``fit`` measures
            again. ``"grad"`` only.
    """

    def __init__(
        self,
        topk_ratio: float = 1.0,
        bits: Literal[4, 8] | None = None,
        error_feedback: bool | None = None,
        targets: Sequence[Literal["grad", "moe"]] = ("grad",),
        min_numel: int = 1024,
        warmup_steps: int = 0,
        sparsity_warmup_steps: int = 0,
        block_size: int = 128,
        scale_dtype: Literal["float32", "bfloat16"] | None = None,
        rotation: bool | None = None,
        allow_topk_with_adaptive_optimizer: bool = False,
        auto: bool = False,
    ) -> None:
        targets = (targets,) if isinstance(targets, str) else tuple(targets)
        if not targets or any(t not in _TARGETS for t in targets):
            raise ValueError(f"targets must be a non-empty subset of {_TARGETS}, got {targets!r}")
        bits, scale_dtype, rotation = _default_codec(targets, topk_ratio, block_size, bits, scale_dtype, rotation)
        for name, value in (("warmup_steps", warmup_steps), ("sparsity_warmup_steps", sparsity_warmup_steps)):
            require_int(name, value, minimum=0)
        # CodecConfig validates the codec arguments with errors that use these same names.
        self.config = CodecConfig(
            bits=bits,
            block_size=block_size,
            topk_ratio=topk_ratio,
            scale_dtype=scale_dtype,
            min_numel=min_numel,
            rotation=rotation,
        )
        if error_feedback and "grad" not in targets:
            raise ValueError(
                f"CompressedAllToAll(error_feedback=True, targets={targets!r}): error feedback applies to the 'grad' "
                "target only; the 'moe' exchange carries activations (different tokens every step), where a residual "
                "has nothing to be fed back into. Use error_feedback=False (or None) with targets=('moe',)"
            )
        if sparsity_warmup_steps and (topk_ratio >= 1.0 or "grad" not in targets):
            raise ValueError(
                f"CompressedAllToAll(sparsity_warmup_steps={sparsity_warmup_steps}) ramps the Top-k fraction of the "
                f"'grad' exchange down to topk_ratio; with topk_ratio={topk_ratio} and targets={targets!r} there is "
                "no Top-k to ramp. Use topk_ratio < 1 with 'grad' in targets, or sparsity_warmup_steps=0"
            )
        self.targets = targets
        self.allow_topk_with_adaptive_optimizer = allow_topk_with_adaptive_optimizer
        self.warmup_steps = warmup_steps
        self.sparsity_warmup_steps = sparsity_warmup_steps
        self.error_feedback = "grad" in targets if error_feedback is None else bool(error_feedback)
        if not isinstance(auto, bool):
            raise ValueError(f"auto must be a bool, got {auto!r}")
        if auto and targets != ("grad",):
            raise ValueError(
                f"CompressedAllToAll(auto=True, targets={targets!r}): the automatic choice times the gradient "
                "exchange only; use targets=('grad',)"
            )
        self.auto = AutoTrial() if auto else None
        """The plain-vs-compressed trial of ``auto=True`` (None otherwise); ``auto.decision`` and ``auto.measured``
        tell what it chose and why."""
        self.state = GradCompressionState(self.config, error_feedback=self.error_feedback)
        self.registered: Literal["ddp", "fsdp2"] | None = None
        """Where the gradient codec was installed at the last ``fit`` (None: nothing to compress)."""
        self.moe_codec = ActivationCodec(self.config, active=warmup_steps == 0)
        """The codec of the expert dispatch / combine (dense: ``topk_ratio`` forced to 1)."""
        self.moe_dispatchers: list[Any] = []
        """Expert dispatchers the codec is installed on (during ``fit``)."""
        self._grad_interval = _Interval()
        self._moe_interval = _Interval()

    # ------------------------------------------------------------------------------------------------ setup

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if "moe" not in self.targets:
            return
        strategy = getattr(trainer, "strategy", None)
        try:  # HybridParallelStrategy, after setup_environment (which runs before the setup hooks)
            expert_parallel = strategy.parallel_dims.ep
        except (AttributeError, RuntimeError):
            expert_parallel = 1
        if expert_parallel <= 1:
            raise ValueError(
                f"CompressedAllToAll(targets={self.targets!r}): 'moe' compresses the expert dispatch / combine "
                f"all-to-all, which needs expert parallelism (HybridParallelStrategy(expert_parallel > 1)); "
                f"{type(strategy).__name__} has expert_parallel={expert_parallel}. Use targets=('grad',) or enable "
                "expert parallelism"
            )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After strategy.setup (the model is wrapped / sharded by now) and before the first backward.
        self.registered = None
        self.state.stats.reset()
        self._grad_interval, self._moe_interval = _Interval(), _Interval()
        if self.auto is not None:
            self.auto.reset()  # each fit measures again (another machine, link or model after a resume)
        if "moe" in self.targets:
            self._install_moe(pl_module)
        if "grad" in self.targets:
            self._register_grad(trainer, pl_module)
            if self.registered is not None:
                self._check_adaptive_topk(trainer)

    def _check_adaptive_topk(self, trainer: pl.Trainer) -> None:
        """Refuse (or, when allowed, warn about) Top-k gradients feeding an adaptive optimizer: measured to train
        much worse (docs/compression.md, "Top-k under AdamW")."""
        if self.config.topk_ratio >= 1.0:
            return
        adaptive = sorted(
            {type(o).__name__ for o in getattr(trainer, "optimizers", []) if isinstance(o, _ADAPTIVE_OPTIMIZERS)}
        )
        if not adaptive:
            return
        message = (
            f"CompressedAllToAll(topk_ratio={self.config.topk_ratio}) feeds {', '.join(adaptive)}: Top-k sends "
            f"each gradient element about once every {1 / self.config.topk_ratio:.0f} steps, as one large "
            "accumulated value, and per-element adaptive optimizers train much worse on that stream than on "
            "the dense one (reference model, AdamW: final loss +102 % at Top-1 % after 300 steps and +150 % after "
            "1000, +58 % at Top-10 %, +65 % with the 1-bit-Adam recipe of a frozen second moment; dense INT8 / INT4 "
            "within the seed spread; docs/compression.md, 'Top-k under AdamW'). Use topk_ratio=1.0 (dense INT8, or "
            "bits=4 with rotation=True), or ReplicaSync for 100x+ fewer bytes between replica groups"
        )
        if not self.allow_topk_with_adaptive_optimizer:
            raise ValueError(message + "; allow_topk_with_adaptive_optimizer=True runs it anyway (experiments)")
        rank_zero_warn(message)

    def _install_moe(self, pl_module: pl.LightningModule) -> None:
        dispatchers = [m.dispatcher for m in expert_modules(pl_module) if getattr(m, "dispatcher", None) is not None]
        if not dispatchers:
            raise RuntimeError(
                "CompressedAllToAll(targets=('moe',)): the model has no expert-parallel expert module "
                "(ModalityExperts with a dispatcher) after the strategy's setup"
            )
        for dispatcher in dispatchers:
            if dispatcher.codec is not None and dispatcher.codec is not self.moe_codec:
                raise RuntimeError(
                    "CompressedAllToAll: the expert dispatcher already has a codec (two 'moe' callbacks?); use one"
                )
            dispatcher.codec = self.moe_codec
        self.moe_dispatchers = dispatchers
        self.moe_codec.reset()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # The dispatchers outlive the fit (trainer.validate / predict afterwards): leave them exact again.
        for dispatcher in self.moe_dispatchers:
            if dispatcher.codec is self.moe_codec:
                dispatcher.codec = None
        self.moe_dispatchers = []
        self.state.close()  # the DDP worker thread ends with the fit, not whenever the state is collected

    def _register_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = trainer.strategy.model
        if isinstance(model, DistributedDataParallel):
            try:
                register_ddp_compression(model, self.state)
            except RuntimeError as error:
                if "only be called once" not in str(error):
                    raise
                raise RuntimeError(
                    "CompressedAllToAll cannot install its DDP comm hook: the model already has one (e.g. from "
                    "DDPStrategy(ddp_comm_hook=...)); DDP allows a single hook, so use one or the other"
                ) from error
            self.registered = "ddp"
            return
        from torch.distributed.fsdp import FSDPModule

        if any(isinstance(m, FSDPModule) for m in pl_module.modules()):
            try:
                register_fsdp_compression(pl_module, self.state)
            except RuntimeError as error:
                raise RuntimeError(f"CompressedAllToAll: FSDP2 gradient compression unavailable: {error}") from error
            self.registered = "fsdp2"
            return
        data_parallel = getattr(trainer.strategy, "data_parallel_size", trainer.world_size)
        if data_parallel == 1:
            rank_zero_warn(
                "CompressedAllToAll: no data-parallel gradient sync to compress (one data-parallel rank); "
                "the callback does nothing"
            )
            return
        raise RuntimeError(
            f"CompressedAllToAll(targets=('grad',)) compresses the gradient sync of DDP (strategy='ddp') or FSDP2 "
            f"(HybridParallelStrategy, ModelParallelStrategy); {type(trainer.strategy).__name__} uses neither. "
            "Switch the strategy or remove the callback"
        )

    # ------------------------------------------------------------------------------------------------ steps

    def topk_ratio_at(self, step: int) -> float | None:
        """Fraction of each gradient tensor sent at optimizer step ``step`` (0-based); ``None`` while uncompressed.

        ``topk_ratio ** ((s + 1) / sparsity_warmup_steps)`` for ``s = step - warmup_steps`` in
        ``[0, sparsity_warmup_steps)``, then ``topk_ratio``. E.g. 0.01 over 100 steps: 0.955, 0.912, ... 0.1 at
        ``s = 49``, 0.01 from ``s = 99`` on. Where a fraction makes Top-k + indices larger than the dense INT8
        payload, the codec sends the dense one (``encode``), so the first ramp steps cost what INT8 costs.
        """
        since = step - self.warmup_steps
        if since < 0:
            return None
        if since >= self.sparsity_warmup_steps:
            return self.config.topk_ratio
        return self.config.topk_ratio ** ((since + 1) / self.sparsity_warmup_steps)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # global_step is the same on every rank, so all ranks switch on and ramp at the same step (they must agree:
        # an uncompressed rank would run a plain all-reduce against its peers' compressed exchange).
        step = trainer.global_step
        ratio = self.topk_ratio_at(step)
        eligible = ratio is not None and step >= self.warmup_steps + self.sparsity_warmup_steps
        if self.auto is not None and self.registered is not None and eligible:
            undecided = self.auto.decision is None
            if not self.auto.begin_step(step, pl_module.device):
                ratio = None
            if undecided and self.auto.decision is not None:
                self._report_auto()
        self.state.active = ratio is not None
        if ratio is not None and ratio != self.state.config.topk_ratio:
            self.state.config = dataclasses.replace(self.config, topk_ratio=ratio)
        self.moe_codec.active = self.state.active
        self.moe_codec.reset()  # drop validation traffic: the moe counters cover one training step

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.auto is not None:
            self.auto.interrupt()  # a step interval that holds validation would not time the exchange

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        if self.auto is not None:
            self.auto.interrupt()  # nor one that holds a checkpoint save

    def _report_auto(self) -> None:
        if not self.auto.decision:
            # Plain from now on: what the trial's compressed steps held back would never be sent.
            self.state.feedback.clear()
            self.state.gather_feedback.clear()
        measured = self.auto.measured
        if not measured:
            rank_zero_warn(
                f"CompressedAllToAll(auto=True): too many trial steps were interrupted (validation or checkpoints in "
                f"most of {4 * self.auto.steps} steps after {self.auto.warmup} untimed ones) to time both sides; the "
                "gradient exchange stays plain"
            )
            return
        plain, compressed = measured["plain_seconds"], measured["compressed_seconds"]
        rank_zero_info(
            f"CompressedAllToAll(auto=True): over {self.auto.steps} optimizer steps (ABBA) after "
            f"{self.auto.warmup} untimed ones (slowest rank's medians) a step took {1e3 * plain:.1f} ms with the "
            f"plain exchange and {1e3 * compressed:.1f} ms compressed ({100 * (compressed / plain - 1):+.1f} %; "
            f"compression is kept when at least {100 * self.auto.margin:.0f} % faster): the gradient exchange stays "
            f"{'compressed' if self.auto.decision else 'plain (compression does not pay on this link and machine)'} "
            "for the rest of this fit"
        )

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # The counters of every batch are summed, and logged only when Lightning writes its logs (every
        # ``log_every_n_steps`` optimizer steps, as Lightning's own LearningRateMonitor and ThroughputMonitor do): a
        # Lightning ``log`` of a Python number costs ~0.5 ms of CPU on this machine (a new tensor, the result
        # collection), and 9 of them every step made ``auto=True``'s plain steps 3 % slower than no callback
        # (benchmarks/compression_time_to_target.py, compression_auto_overhead.py).
        logs_now, steps = _logs_after_this_batch(trainer), _steps_after_this_batch(trainer)
        if self.moe_dispatchers:
            self._moe_interval.add(self.moe_codec.stats, self.moe_codec.exact_backward_bytes)
            self.moe_codec.reset()
        if self.registered is not None:
            self._grad_interval.add(self.state.stats)
            self.state.stats.reset()
        for interval in (self._moe_interval, self._grad_interval):
            interval.steps += int(steps and interval.exchanged)
        if self._moe_interval.exchanged and logs_now:
            pl_module.log_dict(self.moe_metrics(), on_step=True, on_epoch=False, batch_size=1)
            self._moe_interval = _Interval()
        if self._grad_interval.exchanged and logs_now:
            pl_module.log_dict(self.metrics(), on_step=True, on_epoch=False, batch_size=1)
            self._grad_interval = _Interval()
        resets = self.state.feedback.resets + self.state.gather_feedback.resets
        if resets:
            rank_zero_warn(
                f"CompressedAllToAll: residuals of {sorted(set(resets))[:5]} had another shape than the "
                "gradients (checkpoint from another model or layout) and restarted from zero"
            )
            self.state.feedback.resets.clear()
            self.state.gather_feedback.resets.clear()

    @staticmethod
    def _stats_metrics(prefix: str, interval: _Interval) -> dict[str, float]:
        """Bytes, ratio, codec time, break-even bandwidth of one exchange's counters as ``compression/<prefix>*``:
        bytes and milliseconds per optimizer step (means over the steps since the last log), the ratio and the
        break-even bandwidth of their sums, the payloads sent raw for non-finite values in all of them."""
        stats, steps = interval.stats, max(interval.steps, 1)
        return {
            f"compression/{prefix}bytes_before": stats.bytes_before / steps,
            f"compression/{prefix}bytes_after": stats.bytes_after / steps,
            f"compression/{prefix}ratio": stats.ratio,
            f"compression/{prefix}encode_ms": 1e3 * stats.encode_seconds / steps,
            f"compression/{prefix}decode_ms": 1e3 * stats.decode_seconds / steps,
            f"compression/{prefix}break_even_gbit_s": 8e-9 * stats.break_even_bytes_per_second,
            f"compression/{prefix}raw_nonfinite": float(stats.raw_nonfinite),
        }

    def metrics(self) -> dict[str, float]:
        """What :meth:`on_train_batch_end` logs for the gradient exchange: the steps since the last log (see
        :meth:`_stats_metrics`), whether the current step compresses and its Top-k fraction."""
        return {
            **self._stats_metrics("", self._grad_interval),
            "compression/active": float(self.state.active),
            "compression/topk_ratio": self.state.config.topk_ratio if self.state.active else 1.0,
        }

    def moe_metrics(self) -> dict[str, float]:
        """The ``compression/moe_*`` values :meth:`on_train_batch_end` logs (expert dispatch / combine), over the
        steps since the last log; ``moe_exact_backward_bytes`` per step."""
        interval = self._moe_interval
        return {
            **self._stats_metrics("moe_", interval),
            "compression/moe_exact_backward_bytes": interval.exact_backward_bytes / max(interval.steps, 1),
            "compression/moe_active": float(self.moe_codec.active),
        }

    # ------------------------------------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Every rank's residuals, gathered to rank 0 (collective when more than one process).

        ``{"version", "world_size", "residuals_by_rank": [rank 0's, rank 1's, ...]}``; other ranks return
        ``residuals_by_rank=None`` (Lightning saves rank 0's dict only).
        """
        world, rank = _world(), _rank()
        local = self.state.residual_state() if self.error_feedback else {}
        if world == 1:
            by_rank: list[Any] | None = [local]
        else:
            by_rank = [None] * world if rank == 0 else None
            dist.gather_object(local, by_rank, dst=0)
        return {"version": _STATE_VERSION, "world_size": world, "residuals_by_rank": by_rank}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        by_rank = state_dict.get("residuals_by_rank")
        if not self.error_feedback or by_rank is None:
            return
        world, rank = _world(), _rank()
        if len(by_rank) != world:
            rank_zero_warn(
                f"CompressedAllToAll: the checkpoint holds error-feedback residuals of {len(by_rank)} "
                f"rank(s), this run has {world}; residuals restart from zero"
            )
            return
        self.state.load_residual_state(by_rank[rank])

    def residual_norm(self) -> float:
        """L2 norm of this rank's residuals (all keys); 0 without error feedback."""
        norms = [
            r.float().norm() ** 2
            for fb in (self.state.feedback, self.state.gather_feedback)
            for r in fb.state_dict().values()
        ]
        return float(torch.stack(norms).sum().sqrt()) if norms else 0.0
