"""lightning-mm: multimodal (vision-language) training on N-D device meshes with PyTorch Lightning.

``import lightning_mm`` makes ``Trainer(strategy="hybrid")`` work whatever was imported first: with Lightning already
imported it imports :mod:`lightning_mm.strategies` (which registers ``HybridParallelStrategy``) at once; otherwise
it does so right after Lightning's ``lightning.pytorch`` finishes importing, through a one-shot import hook. So
``import lightning_mm.parallel`` (plain torch) never pulls in Lightning, and neither import order loses the name.
"""

import importlib.abc
import importlib.machinery
import sys

from lightning_mm.batch import MultimodalBatch

__version__ = "0.1.0"
__all__ = ["MultimodalBatch", "__version__"]

_LIGHTNING = "lightning.pytorch"


class _RegisterAfterLightning(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``lightning.pytorch`` with the normal path finder, runs its own loader, then imports
    :mod:`lightning_mm.strategies`. Removes itself once used; every other module is left to the other finders."""

    def __init__(self) -> None:
        self._loader: importlib.abc.Loader | None = None

    def find_spec(self, fullname, path, target=None):
        if fullname != _LIGHTNING:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        self._loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = module.__spec__.loader = self._loader  # the module keeps its real loader
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        self._loader.exec_module(module)
        try:
            import lightning_mm.strategies  # noqa: F401  (registers "hybrid")
        except Exception as error:  # never let lightning_mm break the user's `import lightning`
            import warnings

            warnings.warn(
                f"lightning_mm could not register the 'hybrid' strategy ({type(error).__name__}: {error}); "
                "`import lightning_mm.strategies` shows the full error",
                stacklevel=2,
            )


if _LIGHTNING in sys.modules:
    import lightning_mm.strategies  # noqa: F401  (registers "hybrid")
elif not any(isinstance(finder, _RegisterAfterLightning) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterAfterLightning())
