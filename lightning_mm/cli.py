"""``lightning-mm``: LightningCLI for fit / validate / test with any LightningModule and DataModule, plus the tools
``make-shards``, ``consolidate``, ``export-hf`` and ``plan``.

lightning-mm fit --config examples/configs/default.yaml       # VLMModule x ImageTextWebDataModule (the defaults)
lightning-mm fit --config examples/hf/hf_llama.yaml           # a Hugging Face causal LM (model: class_path: ...)
lightning-mm fit --model=my_package.MyModule --data=my_package.MyDataModule
lightning-mm make-shards --preset tiny --output-dir /tmp/shards
lightning-mm consolidate CKPT_DIR OUT.ckpt
lightning-mm export-hf CKPT OUT_DIR
lightning-mm plan --preset small --devices 8 --memory-gb 80 --devices-per-node 8
"""

from __future__ import annotations

import importlib
import inspect
import netrc
import os
import sys
from dataclasses import dataclass
from functools import partial
from typing import Any

import lightning as L
from lightning.pytorch.cli import LightningCLI
from typing_extensions import override

__all__ = [
    "DEFAULT_DATA",
    "DEFAULT_MODEL",
    "LINKED_FROM_DATA",
    "LightningMMCLI",
    "VLMLightningCLI",
    "configure_wandb_mode",
    "main",
]

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


@dataclass(frozen=True)
class _Tool:
    """A subcommand outside LightningCLI: ``entry_point(argv) -> exit code``, imported on use (the tools need
    neither the models nor, most of them, Lightning), parsing its own arguments."""

    entry_point: str
    help: str

    def __call__(self, argv: list[str]) -> int:
        return _import(self.entry_point)(argv)


_TRAINER_COMMANDS = {
    "fit": "train a model (LightningCLI; `lightning-mm fit --help` lists every option)",
    "validate": "run one validation pass",
    "test": "run one test pass",
}
_TOOLS = {
    "make-shards": _Tool(
        "lightning_mm.datamodules.synthetic_cli:make_shards_main",
        "write the embedded synthetic image-text dataset as WebDataset shards",
    ),
    "consolidate": _Tool(
        "lightning_mm.checkpoint:consolidate_main",
        "write a sharded checkpoint directory (HybridParallelStrategy) as one checkpoint file",
    ),
    "export-hf": _Tool(
        "lightning_mm.models.hf.export:export_main",
        "write an HFCausalLMModule checkpoint as a Hugging Face directory (needs the [hf] extra)",
    ),
    "plan": _Tool(
        "lightning_mm.planning:main",
        "rank device meshes for a model by estimated memory and step time (`lightning-mm plan --help`)",
    ),
}


def _overview() -> str:
    commands = {**_TRAINER_COMMANDS, **{name: tool.help for name, tool in _TOOLS.items()}}
    width = max(map(len, commands))
    lines = "\n".join(f"  {name:<{width}}  {help}" for name, help in commands.items())
    return f"""usage: lightning-mm {{{",".join(commands)}}} ...

Multimodal (vision-language) training with PyTorch Lightning.

subcommands:
{lines}

fit / validate / test take any LightningModule and DataModule by class path (--model=package.Class,
--data=package.Class, or class_path in the config); without one, lightning_mm.models.VLMModule and
lightning_mm.datamodules.ImageTextWebDataModule.

examples:
  lightning-mm fit --config examples/configs/default.yaml
  lightning-mm fit --config examples/hf/hf_llama.yaml
"""


def configure_wandb_mode(environ: dict[str, str] = os.environ) -> str:
    """Use W&B offline unless the user configured an API key (or chose a mode with ``WANDB_MODE``).

    Returns the mode in effect. A key counts as configured when ``WANDB_API_KEY`` is set or ``wandb
    login`` stored one in the netrc file for api.wandb.ai.
    """
    if environ.get("WANDB_MODE"):
        return environ["WANDB_MODE"]
    has_key = bool(environ.get("WANDB_API_KEY"))
    if not has_key:
        try:
            has_key = netrc.netrc(environ.get("NETRC")).authenticators("api.wandb.ai") is not None
        except (FileNotFoundError, netrc.NetrcParseError, OSError):
            has_key = False
    mode = "online" if has_key else "offline"
    environ["WANDB_MODE"] = mode
    return mode


def main(argv: list[str] | None = None) -> None:
    from_command_line = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _TOOLS:
        raise SystemExit(_TOOLS[argv[0]](argv[1:]))
    if not argv or argv[0] in ("-h", "--help"):
        print(_overview())
        raise SystemExit(0)
    configure_wandb_mode()
    LightningMMCLI(
        # None when the arguments are the process's own: LightningCLI then reads sys.argv itself and does not warn
        # that `args` is meant for programmatic use (it did on every torchrun launch).
        args=None if from_command_line else argv,
        save_config_kwargs={"overwrite": True},
        # The regrouping DataModules plan a new batch count every epoch; Lightning reads a loader's length once
        # unless it rebuilds the loader each epoch (ImageTextWebDataModule refuses a multi-epoch run without it).
        trainer_defaults={"reload_dataloaders_every_n_epochs": 1},
    )


if __name__ == "__main__":
    main()
