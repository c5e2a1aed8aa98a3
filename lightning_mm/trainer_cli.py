"""``LightningMMCLI``: the ``fit`` / ``validate`` / ``test`` subcommands of ``lightning-mm`` (LightningCLI for any
LightningModule and DataModule).

Kept apart from :mod:`lightning_mm.cli`, which imports it only for those subcommands: importing Lightning costs about
3 s of CPU, which ``lightning-mm --help``, ``consolidate`` and ``plan --hf-config`` do not need.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from functools import partial
from typing import Any

import lightning as L
from lightning.pytorch.cli import LightningCLI
from typing_extensions import override

__all__ = ["DEFAULT_DATA", "DEFAULT_MODEL", "LINKED_FROM_DATA", "LightningMMCLI", "VLMLightningCLI"]

DEFAULT_MODEL = "lightning_mm.models.VLMModule"
"""The model class of a config whose ``model`` section has no ``class_path`` (every ``examples/configs/*.yaml``)."""
DEFAULT_DATA = "lightning_mm.datamodules.ImageTextWebDataModule"
"""The DataModule class when neither the config nor ``--data`` names one."""
LINKED_FROM_DATA = ("vocab_size", "patch_size", "max_patches_per_image")
"""DataModule attributes given to the model's ``__init__`` parameter of the same name, where the model has one."""


class LightningMMCLI(LightningCLI):
    """LightningCLI for any LightningModule and DataModule, chosen by class path.

    ``model`` and ``data`` take ``class_path`` / ``init_args`` (or ``--model=package.Class``); without a class path
    they configure :data:`DEFAULT_MODEL` / :data:`DEFAULT_DATA`, so ``model: {preset: tiny}`` means a tiny
    ``VLMModule``. ``--data=null`` leaves the data to the model's own ``*_dataloader`` hooks. Given classes
    (``LightningMMCLI(VLMModule, ...)``) work as in LightningCLI.

    The model's vocabulary and patching must match the data's tokenizer and patchifier, so a config sets them once,
    under ``data``: each name in :data:`LINKED_FROM_DATA` that the chosen model's ``__init__`` takes is set from the
    instantiated DataModule's attribute of that name (over any value the config gives). A model without such a
    parameter (a user's own module) gets nothing; a DataModule without an attribute that the model takes is an error
    naming both.

    How: the links are jsonargparse's, ``link_arguments("data", "model.init_args.<name>", apply_on="instantiate")``
    (which also makes a linked parameter optional in the config). The parser is first built for
    :data:`DEFAULT_MODEL` / :data:`DEFAULT_DATA`; where the parsed config names other classes, it is built and parsed
    again with those as the defaults and only the links their model takes (:meth:`parse_arguments` says why).
    """

    _classes: dict[str, str] = {}
    """The ``model`` / ``data`` class paths the config names, where they are not the defaults (for the rebuild)."""
    _model_takes: tuple[str, ...] = LINKED_FROM_DATA
    """The names of :data:`LINKED_FROM_DATA` that the model takes (subclass mode: the first parse tells)."""

    @override
    def add_arguments_to_parser(self, parser) -> None:
        self._set_default_classes(parser)
        self._link_data_to_model(parser)
        parser.add_argument(
            "--preemption",
            type=bool,
            default=True,
            help="Save a checkpoint at the next optimizer step and exit non-zero on SIGTERM / SIGINT "
            "(lightning_mm.callbacks.PreemptionCheckpoint with its defaults, unless trainer.callbacks has one). "
            "--preemption=false leaves the signals to Lightning (it stops without a checkpoint).",
        )

    def _set_default_classes(self, parser) -> None:
        """The named classes, else :data:`DEFAULT_MODEL` / :data:`DEFAULT_DATA`, where the model / data may be any
        subclass of a base that they derive from (a given class is its own default)."""
        for key, subclass_mode, base, default in (
            ("model", self.subclass_mode_model, self._model_class, DEFAULT_MODEL),
            ("data", self.subclass_mode_data, self._datamodule_class, DEFAULT_DATA),
        ):
            if key in self._classes:
                parser.set_defaults({key: {"class_path": self._classes[key]}})
            elif subclass_mode and isinstance(base, type) and issubclass(_import(default), base):
                parser.set_defaults({key: {"class_path": default}})

    def _link_data_to_model(self, parser) -> None:
        if self.subclass_mode_model:
            model = self._classes.get("model", DEFAULT_MODEL)
            targets = {name: f"model.init_args.{name}" for name in self._model_takes}
        else:
            model = getattr(self._model_class, "__name__", str(self._model_class))
            parameters = inspect.signature(self._model_class).parameters
            targets = {name: f"model.{name}" for name in LINKED_FROM_DATA if name in parameters}
        for name, target in targets.items():
            compute_fn = partial(_from_data, name, model)
            compute_fn.__name__ = f"data.{name}"  # how jsonargparse names the link in `--help` and errors
            parser.link_arguments("data", target, compute_fn=compute_fn, apply_on="instantiate")

    @override
    def parse_arguments(self, parser, args) -> None:
        """Parses as LightningCLI does, and again, with a parser built for them, if the config names other model or
        data classes than the defaults, or a model that does not take every name of :data:`LINKED_FROM_DATA`.

        Two things need the rebuild. jsonargparse starts a class named over a default one from the default class's
        arguments that the named class also takes (VLMModule's ``learning_rate``, ImageTextWebDataModule's
        ``batch_size``): a user's class would run with those instead of its own defaults. And a link into
        ``model.init_args`` that the named class lacks is skipped at instantiation, but LightningCLI still stores its
        value in the model's ``hparams``, with which ``load_from_checkpoint`` would then call the class.
        """
        argv = sys.argv[1:] if args is None else args
        printing = isinstance(argv, list) and any(map(_is_print_config, argv))
        if printing:  # this parse only finds the classes: the config printed must be the second parse's
            self.config = parser.parse_args([arg for arg in argv if not _is_print_config(arg)])
        else:
            super().parse_arguments(parser, args)
        subparser, config = self._subcommand_parser_and_config(parser)
        classes = {}
        for key, subclass_mode in (("model", self.subclass_mode_model), ("data", self.subclass_mode_data)):
            if not subclass_mode:  # a given class: nothing to choose
                continue
            default, value = _class_path(subparser.get_default(key)), _class_path(config.get(key))
            if default and value and value != default:
                classes[key] = value
        if self.subclass_mode_model:
            # the parsed config holds exactly the model's parameters; the links keep the linked ones in it
            takes = tuple(name for name in LINKED_FROM_DATA if f"model.init_args.{name}" in config)
        else:
            takes = self._model_takes
        if classes or takes != self._model_takes:
            self._classes, self._model_takes = classes, takes
            from lightning_mm.strategies._compat import rebuild_cli_parser

            rebuild_cli_parser(self)
        elif not printing:
            return
        super().parse_arguments(self.parser, args)

    def _subcommand_parser_and_config(self, parser):
        """The parser and parsed config of the subcommand (``fit``, ...), or the given ones without subcommands."""
        subcommand = self.config.get("subcommand")
        if subcommand:
            from lightning_mm.strategies._compat import cli_subcommand_parser

            return cli_subcommand_parser(self, subcommand), self.config[subcommand]
        return parser, self.config

    @override
    def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
        """The trainer, with a default :class:`PreemptionCheckpoint` (``--preemption``): a scheduler's SIGTERM must
        leave a checkpoint, and without one Lightning 2.6 exits 0 without any (or, on several ranks, one rank dies
        in a mismatched broadcast)."""
        from lightning_mm.callbacks import PreemptionCheckpoint

        if self._get(self.config_init, "preemption", default=True) and "callbacks" not in kwargs:
            configured = self._get(self.config_init, "trainer", default={}).get("callbacks") or []
            configured = list(configured) if isinstance(configured, (list, tuple)) else [configured]
            if not any(isinstance(callback, PreemptionCheckpoint) for callback in configured):
                kwargs["callbacks"] = [*configured, PreemptionCheckpoint()]
        return super().instantiate_trainer(**kwargs)


def _from_data(attribute: str, model: str, datamodule: L.LightningDataModule | None) -> Any:
    """The value of the link ``data -> model.<attribute>``, which the model ``model`` takes."""
    if datamodule is None:
        raise ValueError(
            f"model: {model} takes `{attribute}` from the DataModule, but no DataModule is configured; set `data` "
            f"(--data=package.Class) to one that has a `{attribute}` attribute"
        )
    if not hasattr(datamodule, attribute):
        data = type(datamodule).__name__
        raise ValueError(
            f"data: {data} has no `{attribute}`, which model {model} takes from the DataModule; give {data} a "
            f"`{attribute}` attribute (or property), or choose a model without a `{attribute}` parameter"
        )
    return getattr(datamodule, attribute)


VLMLightningCLI = LightningMMCLI
"""The former name (the CLI once took only ``VLMModule``); ``VLMLightningCLI(VLMModule, ...)`` still works."""


def _is_print_config(arg: Any) -> bool:
    return isinstance(arg, str) and (arg == "--print_config" or arg.startswith("--print_config="))


def _class_path(value: Any) -> str | None:
    """The ``class_path`` of a parsed class spec (a Namespace or dict), else None."""
    try:
        return value["class_path"]
    except (KeyError, TypeError):
        return None


def _import(path: str) -> Any:
    """``"package.module.Name"`` or ``"package.module:name"`` -> the object."""
    module, _, name = path.rpartition(":") if ":" in path else path.rpartition(".")
    return getattr(importlib.import_module(module), name)
