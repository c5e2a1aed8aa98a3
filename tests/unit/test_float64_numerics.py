"""float64 stays float64: the "upcast to float32" steps of losses, routers, rotary tables, clipping and pipeline
values never round a float64 model down to float32, and HybridParallelStrategy accepts Lightning's DoublePrecision.

The parity tests (tests/distributed/test_*parity*.py) train in float64 so that mesh and one process differ only by
float64 rounding; a single float32 step in between (``x.float()``) put float32 rounding back: rotary tables in
float32 made the fsdp2 step-0 loss differ by 9.5e-11 relative from one process (vectorised ``cos`` rounds a tensor's
tail differently, and each rank pads to another length), against 2e-16 with float64 tables.
"""

from __future__ import annotations

import torch
from lightning.pytorch.plugins.precision import DoublePrecision

from lightning_mm.datamodules.stages import collate_one_per_row
from lightning_mm.models.vlm import VisionLanguageModel, build_config
from lightning_mm.models.vlm.losses import caption_loss_sum, compute_losses, contrastive_loss_sum
from lightning_mm.models.vlm.model import rotary_tables
from lightning_mm.parallel.clip import total_grad_norm
from lightning_mm.parallel.collectives import at_least_float32
from lightning_mm.parallel.fsdp import mixed_precision_policy
from lightning_mm.parallel.protocol import MeanLossObjective
from lightning_mm.strategies.precision import MeshDoublePrecision, with_mesh_clipping
from tests.helpers import random_samples


def test_at_least_float32_upcasts_and_never_downcasts():
    for dtype, expected in [
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
    ]:
        assert at_least_float32(torch.ones(2, dtype=dtype)).dtype == expected


def test_losses_keep_float64():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 7, generator=gen, dtype=torch.float64)
    labels = torch.tensor([[1, 2, -100], [3, -100, -100]])
    assert caption_loss_sum(logits, labels).dtype == torch.float64
    assert caption_loss_sum(logits.bfloat16(), labels).dtype == torch.float32  # low precision still upcast
    embeds = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    scale = torch.tensor(2.0, dtype=torch.float64)
    assert contrastive_loss_sum(embeds, embeds.flip(0), scale).dtype == torch.float64


def test_rotary_tables_in_float64_do_not_depend_on_the_padded_length():
    positions = torch.arange(13)[None]
    cos, sin = rotary_tables(positions, 16, 10000.0, dtype=torch.float64)
    assert cos.dtype == sin.dtype == torch.float64
    # The same positions inside a longer (padded) row give the same tables to float64 rounding (float32 tables
    # differed by up to one float32 ulp, ~6e-8).
    longer_cos, longer_sin = rotary_tables(torch.arange(37)[None], 16, 10000.0, dtype=torch.float64)
    torch.testing.assert_close(longer_cos[..., :13, :], cos, rtol=0, atol=1e-15)
    torch.testing.assert_close(longer_sin[..., :13, :], sin, rtol=0, atol=1e-15)
    assert rotary_tables(positions, 16, 10000.0)[0].dtype == torch.float32  # default unchanged


def test_float64_model_computes_every_loss_and_router_in_float64():
    torch.manual_seed(0)
    model = VisionLanguageModel(build_config("tiny")).double()
    batch = DoublePrecision().convert_input(collate_one_per_row(random_samples(4, seed=3), pad_id=0))
    output = model(batch)
    assert output.router_stats and all(s.prob_sums.dtype == torch.float64 for s in output.router_stats)
    losses = compute_losses(output, batch)
    for value in (losses.total, losses.caption, losses.contrastive, losses.moe_aux):
        assert value.dtype == torch.float64
    losses.total.backward()
    assert total_grad_norm(model.parameters()).dtype == torch.float64  # the clipping coefficient too


def test_pipeline_mean_loss_values_keep_float64():
    objective = MeanLossObjective(lambda output, target: (output - target).pow(2).mean(), microbatches=1)
    objective.begin(None, None)
    objective.microbatch_loss(torch.ones(3, dtype=torch.float64) / 3, torch.zeros(3, dtype=torch.float64))
    assert objective.values()["loss"].dtype == torch.float64


def test_hybrid_strategy_accepts_double_precision():
    assert mixed_precision_policy("64-true") is None  # FSDP keeps the float64 parameters
    plugin = with_mesh_clipping(DoublePrecision(), tuple)
    assert isinstance(plugin, MeshDoublePrecision) and plugin.precision == "64-true"
