"""A weight tied between two modules (an input embedding and an LM head) under tensor parallel: one parameter after
``apply_tensor_parallel`` when both places shard it alike, refused naming both places otherwise; frozen parameters
stay frozen whatever the style. (Training parity of
tied HF models under tp2, tp2 x fsdp2 and pp2: tests/distributed/test_hf_causal_lm.py, ``qwen2_tied``.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_mm.parallel.plans import apply_tensor_parallel
from tests.helpers import run_distributed


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


VOCAB_SHARDED = {
    "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    "head": ColwiseParallel(output_layouts=Replicate()),
}


def _tie_under_tp(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = TiedLM()
    ids = torch.randint(0, 16, (2, 5))
    expected = model(ids)
    expected.sum().backward()
    expected_grad = model.embed.weight.grad.clone()
    model.zero_grad()
    apply_tensor_parallel(model, mesh, VOCAB_SHARDED)
    out = model(ids)
    out.sum().backward()
    errors = {}
    for name, plan in {
        "two layouts": {"embed": ColwiseParallel(), "head": "colwise"},  # Shard(1) of the table vs Shard(0)
        "one place unsharded": {"head": "colwise"},
    }.items():
        torch.manual_seed(0)
        try:
            apply_tensor_parallel(TiedLM(), mesh, plan)
        except ValueError as error:
            errors[name] = str(error)
    frozen = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8))
    frozen[0].requires_grad_(False)  # (LoRA freezes the base model's norms)
    apply_tensor_parallel(frozen, mesh, {"0": "sequence", "1": "colwise"})
    return {
        "frozen_kept": [p.requires_grad for p in frozen.parameters()],
        "tied": model.head.weight is model.embed.weight,
        "parameters": len(list(model.parameters())),
        "logits": torch.allclose(out, expected, atol=1e-6),
        "grad": torch.allclose(model.embed.weight.grad.full_tensor(), expected_grad, atol=1e-6),
        "errors": errors,
    }


@pytest.mark.slow
def test_a_tied_weight_stays_one_parameter_under_tensor_parallel_or_is_refused():
    for result in run_distributed(_tie_under_tp, 2):
        # torch's SequenceParallel re-registers parameters requiring grad; a frozen norm must stay frozen
        assert result["frozen_kept"] == [False, False, True, True]
        assert result["tied"] and result["parameters"] == 1
        assert result["logits"] and result["grad"]  # both uses' gradients land in the one sharded table
        assert set(result["errors"]) == {"two layouts", "one place unsharded"}
        for message in result["errors"].values():
            assert "tied weight embed.weight (also head.weight)" in message and "sharded differently" in message
