"""Activation checkpointing (``lightning_mm.parallel.fsdp.apply_activation_checkpointing``): the block's forward
really runs again in backward, gradients and FQNs are unchanged, and a second application is a no-op; the selective
mode recomputes only the matmuls whose outputs it did not keep."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_mm.parallel.fsdp import apply_activation_checkpointing
from lightning_mm.parallel.options import activation_checkpointing_mode
from lightning_mm.strategies import HybridParallelStrategy


class _Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.fc(x))


def test_checkpointed_block_recomputes_in_backward_with_the_same_gradients():
    torch.manual_seed(0)
    plain = nn.Sequential(_Counting(), _Counting())
    checkpointed = copy.deepcopy(plain)
    apply_activation_checkpointing([checkpointed[0]])
    apply_activation_checkpointing([checkpointed[0]])  # idempotent
    x = torch.randn(4, 8)
    plain(x).square().sum().backward()
    checkpointed(x).square().sum().backward()
    assert [m.calls for m in plain] == [1, 1]
    assert [m.calls for m in checkpointed] == [2, 1]  # forward once more in backward, only where applied
    assert list(dict(checkpointed.named_parameters())) == list(dict(plain.named_parameters()))
    for (name, a), (_, b) in zip(plain.named_parameters(), checkpointed.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def _matmuls_in_backward(model: nn.Module, x: torch.Tensor) -> int:
    """aten.mm / addmm calls while ``model(x)``'s backward runs (recomputed forward matmuls included)."""
    loss = model(x).square().sum()
    with _CountMatmuls() as counter:
        loss.backward()
    return counter.count


class _CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


class _FourLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def test_selective_mode_recomputes_every_second_matmul_and_keeps_the_gradients():
    torch.manual_seed(0)
    plain = _FourLinears()
    full, selective = copy.deepcopy(plain), copy.deepcopy(plain)
    apply_activation_checkpointing([full], "full")
    apply_activation_checkpointing([selective], "selective")
    x = torch.randn(4, 8)
    counts = {name: _matmuls_in_backward(m, x) for name, m in [("plain", plain), ("full", full), ("sac", selective)]}
    # full recomputes the 4 forward matmuls, selective the 2nd and 4th (the 1st and 3rd outputs were kept)
    assert counts["full"] - counts["plain"] == 4
    assert counts["sac"] - counts["plain"] == 2
    for (name, a), (_, b), (_, c) in zip(
        plain.named_parameters(), full.named_parameters(), selective.named_parameters(), strict=True
    ):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(c.grad, a.grad, rtol=0, atol=0, msg=name)


def test_activation_checkpointing_argument():
    assert [activation_checkpointing_mode(v) for v in (False, True, "full", "selective")] == [
        None,
        "full",
        "full",
        "selective",
    ]
    with pytest.raises(ValueError, match=r"activation_checkpointing must be True, False or one of"):
        activation_checkpointing_mode("op")
    with pytest.raises(ValueError, match="activation_checkpointing must be"):
        HybridParallelStrategy(activation_checkpointing="sometimes")  # refused where it is given
    assert HybridParallelStrategy(activation_checkpointing="selective").activation_checkpointing == "selective"
    # the selective policy does not see inside compiled blocks: refused together, full checkpointing is not
    with pytest.raises(ValueError, match="'selective' with compile"):
        HybridParallelStrategy(activation_checkpointing="selective", compile=True)
    assert HybridParallelStrategy(activation_checkpointing=True, compile=True).activation_checkpointing == "full"
    disabled = HybridParallelStrategy(activation_checkpointing="selective", compile={"disable": True})
    assert disabled.compile_options is None
