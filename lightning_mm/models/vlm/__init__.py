"""The reference vision-language model and how it is parallelized (torchtitan's layout: one package per model).

``model.py`` (the network, one readable file), ``losses.py``, ``module.py`` (``VLMModule``, the LightningModule),
``parallelize.py`` (TP / SP plan, FSDP units, experts: :mod:`lightning_mm.parallel.protocol`), ``pipeline.py``
(stage modules, stage costs, the exact pipeline objective).
"""

from lightning_mm.models.vlm.model import *  # noqa: F403  (the network's public names)
from lightning_mm.models.vlm.model import __all__ as _model_names

__all__ = list(_model_names)
