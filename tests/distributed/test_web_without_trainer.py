"""ImageTextWebDataModule used without a Trainer while a process group exists (e.g. rank 0 of a benchmark building
held-out batches alone): a whole pass ends with its own counts, with no collective the other ranks would have to
join."""

from __future__ import annotations

import torch.distributed as dist

from lightning_mm.datamodules import ImageTextWebDataModule
from tests.helpers import run_distributed


def _rank_zero_iterates_alone(rank: int, world: int) -> int | None:
    count = None
    if rank == 0:
        dm = ImageTextWebDataModule(
            synthetic_preset="tiny",
            regroup="pack",
            rows_per_batch=4,
            max_patches_per_batch=192,
            max_tokens_per_batch=256,
            buffer_size=128,
            patch_size=16,
            max_patches_per_image=16,
            max_text_tokens=48,
            num_workers=0,
            seed=0,
        )
        dm.setup("validate")
        count = sum(int((batch.sample_ids >= 0).sum()) for batch in dm.val_dataloader())  # to the end of the pass
    dist.barrier()  # rank 1 waits here only: a collective inside the pass on rank 0 would deadlock or fail
    return count


def test_a_pass_without_a_trainer_ends_without_collectives():
    counts = run_distributed(_rank_zero_iterates_alone, 2, timeout=120, pg_timeout=30)
    assert counts[1] is None and counts[0] > 0
