"""Activation checkpointing (``lightning_mm.parallel.fsdp.apply_activation_checkpointing``): the block's forward
really runs again in backward, gradients and FQNs are unchanged, and a second application is a no-op."""

from __future__ import annotations

import copy

import torch
from torch import nn

from lightning_mm.parallel.fsdp import apply_activation_checkpointing


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
