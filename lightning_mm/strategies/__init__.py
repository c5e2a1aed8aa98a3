"""Lightning strategies over ``lightning_mm.parallel`` (HybridParallelStrategy lands with its issue)."""
