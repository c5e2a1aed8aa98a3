"""What one optimizer step trains on: the samples of a global batch (:class:`Workload`), the one microbatch a rank
runs at a time (:class:`Geometry`) and how a rank's share of the step is cut into them on a mesh
(:func:`step_schedule`)."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_mm.planning.hardware import Hardware
from lightning_mm.planning.mesh import Mesh
from lightning_mm.validation import require_int


@dataclass(frozen=True)
class Workload:
    """Per sample: ``tokens`` text tokens and ``patches`` image patches (reference VLM; 0 for a text model), one
    sample per row, no padding. ``micro_batch`` samples per forward on a data-parallel rank (one pipeline
    microbatch); ``global_batch`` samples per optimizer step (default: ``micro_batch x devices``, the same for every
    mesh, so step times compare)."""

    tokens: int
    patches: int = 0
    micro_batch: int = 1
    global_batch: int | None = None
    precision: str = "bf16-mixed"

    def __post_init__(self) -> None:
        require_int("tokens", self.tokens)
        require_int("patches", self.patches, 0)
        require_int("micro_batch", self.micro_batch)
        require_int("global_batch", self.global_batch, also=(None,))
        if self.precision not in ("32-true", "bf16-mixed"):
            raise ValueError(f"precision must be '32-true' or 'bf16-mixed', got {self.precision!r}")

    @property
    def act_bytes(self) -> int:
        """Bytes of an activation element (the compute dtype)."""
        return 4 if self.precision == "32-true" else 2


@dataclass(frozen=True)
class Geometry:
    """One microbatch on one rank: ``rows`` samples of ``tokens`` tokens and ``patches`` patches."""

    rows: int
    tokens: int
    patches: int

    @property
    def n_tokens(self) -> int:
        return self.rows * self.tokens

    @property
    def n_patches(self) -> int:
        return self.rows * self.patches


@dataclass(frozen=True)
class StepSchedule:
    """How a data-parallel rank runs its share of one optimizer step: ``microbatches`` pipeline microbatches
    (``pp > 1``) or ``accumulation`` gradient-accumulation micro-steps (``pp == 1``) of ``geo`` each; ``rank_geo``
    is the rank's whole share (one Lightning batch, every pipeline microbatch in it)."""

    microbatches: int
    accumulation: int
    geo: Geometry
    rank_geo: Geometry


def step_schedule(mesh: Mesh, workload: Workload, hardware: Hardware) -> StepSchedule:
    """The global batch (default ``micro_batch x devices``) split over ``mesh``'s data-parallel ranks, then into
    microbatches of ``workload.micro_batch`` samples."""
    global_batch = workload.global_batch or workload.micro_batch * hardware.devices
    per_rank = global_batch // mesh.dp
    steps = per_rank // workload.micro_batch  # microbatches (pp > 1) or accumulation micro-steps (pp == 1)
    microbatches, accumulation = (steps, 1) if mesh.pp > 1 else (1, steps)
    geo = Geometry(workload.micro_batch, workload.tokens, workload.patches)
    rank_geo = Geometry(workload.micro_batch * microbatches, workload.tokens, workload.patches)  # one Lightning batch
    return StepSchedule(microbatches, accumulation, geo, rank_geo)
