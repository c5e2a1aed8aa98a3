"""``EpochAwareLoader`` starts a pass at its first batch, so a position restored after ``iter()`` still reaches it."""

from __future__ import annotations

from lightning.fabric.utilities.types import _Stateful
from torch.utils.data import IterableDataset

from lightning_mm.datamodules.common import EpochAwareLoader, ResumableEpochAwareLoader


class _Counting(IterableDataset):
    """Yields ``range(skip, 6)``: the batches after the ones a resumed epoch consumed."""

    def __init__(self) -> None:
        self.skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.skip = skip

    def __len__(self) -> int:
        return 6

    def __iter__(self):
        return iter(range(self.skip, 6))


def test_the_position_is_read_at_the_first_batch_not_at_iter():
    position = {"skip": 0}
    loader = EpochAwareLoader(_Counting(), lambda: (0, position["skip"]))
    iterator = iter(loader)  # what Lightning does when it builds the loader, before restoring a checkpoint
    position["skip"] = 3  # the restore
    assert list(iterator) == [3, 4, 5]


def test_the_resumable_loader_speaks_lightnings_stateful_protocol():
    saved = {"batches": 3}
    loaded = []
    loader = ResumableEpochAwareLoader(_Counting(), lambda: 0, (lambda: dict(saved), loaded.append))
    assert isinstance(loader, _Stateful)  # Lightning's "not resumable" warning keys on this
    assert not isinstance(EpochAwareLoader(_Counting(), lambda: 0), _Stateful)
    loader.load_state_dict(loader.state_dict())
    assert loaded == [saved]
