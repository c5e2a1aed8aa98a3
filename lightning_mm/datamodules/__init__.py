"""DataModules and the data stages they are built from."""

from lightning_mm.datamodules.simple import SimpleImageTextDataModule
from lightning_mm.datamodules.stages import PatchedSample, TextTokenizer, collate_one_per_row, patch_grid, patchify
from lightning_mm.datamodules.web import ImageTextWebDataModule

__all__ = [
    "ImageTextWebDataModule",
    "PatchedSample",
    "SimpleImageTextDataModule",
    "TextTokenizer",
    "collate_one_per_row",
    "patch_grid",
    "patchify",
]
