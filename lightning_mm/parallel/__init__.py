"""Plain torch.distributed building blocks (no Lightning imports): collectives now; mesh, plans, FSDP,
pipeline, experts and compression as the strategy issues land."""

from lightning_mm.parallel.dims import MeshAxis, ParallelDims

__all__ = ["MeshAxis", "ParallelDims"]
