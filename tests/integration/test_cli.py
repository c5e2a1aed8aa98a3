"""The command line: every shipped config parses through LightningCLI; `fit` runs end to end, with the default
classes and with a user's own LightningModule / DataModule by class path."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import WandbLogger

from lightning_mm._collection import imports_kept_out_of_collections
from lightning_mm.checkpoint import read_topology
from lightning_mm.cli import LightningMMCLI, configure_wandb_mode, main
from lightning_mm.datamodules import ImageTextWebDataModule, SimpleImageTextDataModule
from lightning_mm.models import VLMModule
from lightning_mm.testing.wandb_offline import find_offline_runs, metric_series, read_offline_history

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "examples" / "configs").glob("*.yaml"))
HF_LLAMA = REPO / "examples/hf/hf_llama.yaml"


class UserModule(L.LightningModule):
    """A user's own module: no `vocab_size` / `patch_size` parameter; a loss over the default DataModule's tokens."""

    def __init__(self, learning_rate: float = 0.5, width: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(1, width)

    def training_step(self, batch, batch_idx):
        x = batch.tokens.float().mean(dim=1, keepdim=True) / 100  # (R, 1)
        loss = self.layer(x).pow(2).mean()
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.learning_rate)


class VocabModule(UserModule):
    """A user's module that needs the tokenizer's vocabulary."""

    def __init__(self, vocab_size: int, learning_rate: float = 0.5) -> None:
        super().__init__(learning_rate)


class NoVocabData(L.LightningDataModule):
    """A user's DataModule without a tokenizer."""


def _run_fit(
    tmp_path: Path, config: str, *overrides: str, env: dict[str, str] | None = None, timeout: int = 300
) -> subprocess.CompletedProcess:
    """``lightning-mm fit --config examples/configs/<config>`` in a real process, writing under ``tmp_path``."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_mm.cli",
            "fit",
            "--config",
            str(REPO / "examples/configs" / config),
            f"--trainer.default_root_dir={tmp_path}",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
            *overrides,
        ],
        cwd=tmp_path,
        env=env if env is not None else {**os.environ, "WANDB_MODE": "offline"},
        check=True,
        capture_output=True,
        timeout=timeout,
    )


def test_configs_exist():
    assert {p.name for p in CONFIGS} >= {"default.yaml", "tiny.yaml", "tiny_fixed_batches.yaml"}


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_config_parses_and_instantiates(config, tmp_path):
    import yaml

    raw = yaml.safe_load(config.read_text())
    # The CLI of `lightning-mm` (its default classes: the configs name no model class). The tiny synthetic dataset
    # stands in for the default one (same code path, seconds not minutes).
    cli = LightningMMCLI(
        run=False,
        args=[
            "--config",
            str(config),
            "--data.init_args.synthetic_preset=tiny",
            f"--trainer.default_root_dir={tmp_path}",
        ],
    )
    assert isinstance(cli.model, VLMModule)
    assert isinstance(cli.datamodule, (SimpleImageTextDataModule, ImageTextWebDataModule))
    assert cli.datamodule.hparams.get("regroup", "none") == raw["data"]["init_args"].get("regroup", "none")
    # the named DataModule starts from its own defaults, not from the default class's (ImageTextWebDataModule's 32)
    assert cli.datamodule.hparams.batch_size == raw["data"]["init_args"].get("batch_size", 32)
    assert cli.model.hparams.preset == raw["model"]["preset"]
    assert cli.trainer.max_steps == raw["trainer"]["max_steps"]
    # Linked from the data: the model's tables match the tokenizer and the patching.
    assert cli.model.config.vocab_size == cli.datamodule.vocab_size
    assert cli.model.config.patch_size == raw["data"]["init_args"]["patch_size"]
    assert cli.model.config.max_patches_per_image == raw["data"]["init_args"]["max_patches_per_image"]
    assert isinstance(cli.trainer.logger, WandbLogger)


def test_hf_llama_config_parses_with_the_hf_model_and_only_its_links(tmp_path):
    from lightning_mm.models.hf import HFCausalLMModule

    cli = LightningMMCLI(
        run=False, args=["--config", str(HF_LLAMA), "--trainer.devices=1", f"--trainer.default_root_dir={tmp_path}"]
    )
    assert isinstance(cli.model, HFCausalLMModule)
    assert cli.model.hparams.vocab_size == cli.datamodule.vocab_size  # linked: the only name the model takes
    assert "patch_size" not in cli.model.hparams and "max_patches_per_image" not in cli.model.hparams
    # HFCausalLMModule's own default, not VLMModule's 0.05 (jsonargparse would carry it over from the default class)
    assert cli.model.hparams.weight_decay == 0.0


def test_print_config_shows_the_named_model_with_its_own_defaults(capsys, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")  # main() would set it in this process
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(HF_LLAMA), "--print_config"])
    assert exit_info.value.code == 0
    model = capsys.readouterr().out.split("\nmodel:\n", 1)[1].split("\ndata:\n", 1)[0]
    assert "class_path: lightning_mm.models.hf.HFCausalLMModule" in model
    assert "weight_decay: 0.0" in model and "preset" not in model  # nothing of VLMModule's


def test_fit_a_users_own_module_by_class_path(tmp_path, monkeypatch):
    """`lightning-mm fit --model=package.Class` with a module that takes nothing from the data: it trains on the
    default DataModule, gets nothing linked (its checkpoint loads), and starts from its own defaults."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    main(
        [
            "fit",
            f"--model={__name__}.UserModule",
            "--data.synthetic_preset=tiny",
            "--data.regroup=none",
            "--data.batch_size=4",
            "--trainer.accelerator=cpu",
            "--trainer.devices=1",
            "--trainer.max_steps=2",
            "--trainer.limit_val_batches=0",
            "--trainer.logger=false",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            f"--trainer.default_root_dir={tmp_path}",
        ]
    )
    (checkpoint,) = tmp_path.glob("checkpoints/*.ckpt")
    assert checkpoint.name == "epoch=0-step=2.ckpt"
    hparams = torch.load(checkpoint, weights_only=False)["hyper_parameters"]
    assert hparams["learning_rate"] == 0.5 and not {"vocab_size", "patch_size"} & set(hparams)
    assert UserModule.load_from_checkpoint(checkpoint).hparams.width == 4


def test_a_datamodule_without_what_the_model_takes_is_an_error_naming_both(tmp_path):
    args = [f"--model={__name__}.VocabModule", f"--trainer.default_root_dir={tmp_path}"]
    with pytest.raises(ValueError, match=r"NoVocabData has no `vocab_size`, which model .*VocabModule takes"):
        LightningMMCLI(run=False, args=[*args, f"--data={__name__}.NoVocabData"])
    with pytest.raises(ValueError, match=r"VocabModule takes `vocab_size` from the DataModule, but no DataModule"):
        LightningMMCLI(run=False, args=[*args, "--data=null"])
    # the same module with a DataModule that has a tokenizer: linked
    cli = LightningMMCLI(run=False, args=[*args, "--data.synthetic_preset=tiny"])
    assert cli.model.hparams.vocab_size == cli.datamodule.vocab_size


def test_wandb_is_offline_without_api_key(tmp_path):
    env = {"NETRC": str(tmp_path / "no-netrc")}
    assert configure_wandb_mode(env) == "offline" and env["WANDB_MODE"] == "offline"
    env = {"WANDB_API_KEY": "x" * 40}
    assert configure_wandb_mode(env) == "online"
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    assert configure_wandb_mode({"NETRC": str(netrc)}) == "online"
    assert configure_wandb_mode({"WANDB_MODE": "disabled"}) == "disabled"


def test_fit_tiny_end_to_end_logs_to_offline_wandb(tmp_path):
    # A real process, as a user runs it: W&B writes its run file completely only at process exit.
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_MODE", "WANDB_API_KEY")}
    env["NETRC"] = str(tmp_path / "no-netrc")  # no key configured -> the CLI must choose offline
    result = _run_fit(tmp_path, "tiny.yaml", env=env)
    # The data accounting is printed on a normal run too (nothing skipped on the embedded data).
    for line in ("data (train, indexed): skipped 0 of", "data (val, indexed): skipped 0 of", "data (end of fit)"):
        assert line in result.stderr.decode(), line
    runs = find_offline_runs(tmp_path)
    assert len(runs) == 1
    history = read_offline_history(runs[0])
    for key in (
        "train/loss",
        "train/caption_loss",
        "train/device/samples_per_sec",
        "val/loss",
        "val/recall_at_1",
        "val/token_accuracy",
        "val/perplexity",
        "data/padding_pct",
        "data/real_tokens",
    ):
        assert metric_series(history, key), key
    assert len(metric_series(history, "train/loss")) == 6  # log_every_n_steps: 1, max_steps: 6
    assert len(metric_series(history, "val/recall_at_1")) == 2  # val_check_interval: 3


def test_console_script_help_lists_subcommands():
    out = subprocess.run(
        [sys.executable, "-m", "lightning_mm.cli", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for word in ("fit", "validate", "test", "make-shards"):
        assert word in out


def test_an_unknown_subcommand_lists_the_tools_too(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["nosuchcmd"])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "unknown subcommand 'nosuchcmd'; choose from fit, validate, test, predict, make-shards" in error
    assert "plan" in error


def test_command_line_imports_are_frozen_and_collection_restored(monkeypatch):
    """``lightning-mm fit`` as the process's own command imports Lightning with the collector off and freezes what the
    imports built; called with arguments (a caller's process), it leaves the collector alone."""
    from lightning_mm import trainer_cli

    runs = []
    monkeypatch.setattr(trainer_cli, "LightningMMCLI", lambda **kwargs: runs.append(kwargs))
    gc.collect()  # (earlier tests' garbage is not frozen with the rest)
    frozen_before = gc.get_freeze_count()
    try:
        main(["fit", "--print_config"])
        assert gc.get_freeze_count() == frozen_before and gc.isenabled()
        monkeypatch.setattr(sys, "argv", ["lightning-mm", "fit", "--print_config"])
        main()
        assert gc.get_freeze_count() > frozen_before and gc.isenabled()
        assert [run["args"] for run in runs] == [["fit", "--print_config"], None]
        with pytest.raises(RuntimeError), imports_kept_out_of_collections():
            raise RuntimeError("an import failed")
        assert gc.isenabled()
    finally:
        if frozen_before == 0:  # (a session that froze objects itself keeps them frozen)
            gc.unfreeze()


def test_make_shards_subcommand_is_wired(tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "make-shards",
                "--preset",
                "tiny",
                "--num-train",
                "8",
                "--num-val",
                "4",
                "--output-dir",
                str(tmp_path / "shards"),
            ]
        )
    assert exit_info.value.code == 0
    assert (tmp_path / "shards" / "manifest.json").is_file()
    result = subprocess.run(
        [sys.executable, "-m", "lightning_mm.cli", "make-shards", "--num-train", "-3"], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "--num-train" in result.stderr


TWO_PROCESS_CONFIGS = ("tiny_hybrid.yaml", "tiny_replica_sync.yaml")


# Time: two `lightning-mm fit` launches side by side, tiny_hybrid.yaml and tiny_replica_sync.yaml as shipped: 2 fresh
# interpreters each, one after the other (Lightning's launcher starts rank 1 once rank 0 reaches fit), 6 steps, 2
# validation passes, 1 DCP checkpoint; start-up is most of it. The YAML-built strategy under Lightning's own launcher
# is what is tested, so they stay real commands; tiny_replica_sync's 6 steps hold the sync at step 4 asserted below.
@pytest.fixture(scope="module")
def two_process_fits(tmp_path_factory) -> dict[str, Path]:
    roots = {config: tmp_path_factory.mktemp(config.removesuffix(".yaml")) for config in TWO_PROCESS_CONFIGS}
    with ThreadPoolExecutor(len(roots)) as pool:
        for fit in [pool.submit(_run_fit, root, config) for config, root in roots.items()]:
            fit.result()
    return roots


def test_fit_with_hybrid_strategy_from_yaml_on_two_processes(two_process_fits):
    """The strategy built from YAML, Lightning's own launcher starting the second process, a DCP checkpoint."""
    root = two_process_fits["tiny_hybrid.yaml"]
    checkpoints = list(root.glob("**/checkpoints/*.ckpt"))
    assert len(checkpoints) == 1 and checkpoints[0].is_dir()
    topology = read_topology(checkpoints[0])
    assert topology["world_size"] == 2 and topology["mesh"]["dp_shard"] == 2
    history = read_offline_history(find_offline_runs(root)[0])
    assert len(metric_series(history, "train/loss")) == 6


def test_fit_with_replica_sync_from_yaml_on_two_processes(two_process_fits):
    """T2 selected from YAML: 2 replica groups synchronised every 4 steps by compressed pseudo-gradients; the W&B
    history holds the replica-link saving (frequency x codec: more than the 4x of the frequency alone)."""
    root = two_process_fits["tiny_replica_sync.yaml"]
    history = read_offline_history(find_offline_runs(root)[0])
    assert len(metric_series(history, "train/loss")) == 6
    syncs = metric_series(history, "replica_sync/syncs")
    assert syncs[0] == 0 and syncs[-1] == 1  # the sync at step 4 (the closing one at step 6 is after the last log)
    assert metric_series(history, "replica_sync/bytes_vs_fp32")[-1] > 4
    checkpoints = list(root.glob("**/checkpoints/*.ckpt"))
    assert len(checkpoints) == 1 and read_topology(checkpoints[0])["mesh"]["dp_replicate"] == 2


def _fit_losses(tmp_path: Path, *overrides: str) -> list[float]:
    tmp_path.mkdir(parents=True)
    _run_fit(
        tmp_path,
        "tiny_hybrid.yaml",
        "--trainer.max_steps=8",  # 2 validation passes; every step's loss is compared
        "--trainer.val_check_interval=4",
        "--trainer.enable_checkpointing=false",
        *overrides,
        timeout=400,
    )
    return metric_series(read_offline_history(find_offline_runs(tmp_path)[0]), "train/loss")


# Time: 2 CLI launches side by side: 1 process, and pp2 (2 processes started one after the other), 8 steps and 2
# validation passes each (20 steps before: nothing asserted needed them); the 3 start-ups dominate. The
# reference must be a CLI run of the same config and data for the per-step losses to be comparable.
def test_fit_pipeline_parallel_keeps_the_losses_of_one_process(tmp_path):
    """``lightning-mm fit`` with pp2 (2 processes, one data-parallel rank) vs one process on the same data: the
    per-step losses agree, contrastive and expert balance losses included (the pipeline keeps the objective). The
    strategy is given by class path on the command line."""
    with ThreadPoolExecutor(2) as pool:  # side by side: each launch's start-ups are serial
        one = pool.submit(_fit_losses, tmp_path / "pp1", "--trainer.devices=1")
        pipelined = pool.submit(
            _fit_losses,
            tmp_path / "pp2",
            "--trainer.devices=2",
            "--trainer.strategy=lightning_mm.strategies.HybridParallelStrategy",
            "--trainer.strategy.pipeline_parallel=2",
            "--trainer.strategy.pipeline_schedule=1F1B",
        )
        one, pipelined = one.result(), pipelined.result()
    assert len(one) == len(pipelined) == 8
    assert one[0] != one[-1]
    torch.testing.assert_close(torch.tensor(pipelined), torch.tensor(one), rtol=1e-5, atol=0)
