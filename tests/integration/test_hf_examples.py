"""The Hugging Face examples run end to end, as a user runs them (real processes, W&B offline).

``examples/hf/cli.py fit --config examples/hf/hf_llama.yaml`` on 2 pipeline stages logs finite training and
validation losses to W&B and writes a complete sharded checkpoint; ``examples/hf/train_llama.py`` under tensor
parallel on 2 processes trains and exports a directory that ``AutoModelForCausalLM.from_pretrained`` loads.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_mm.testing.wandb_offline import find_offline_runs, metric_series, read_offline_history

REPO = Path(__file__).resolve().parents[2]
STEPS = 3

pytestmark = pytest.mark.slow


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, *args],
        cwd=tmp_path,
        env={**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


def test_cli_yaml_trains_on_two_pipeline_stages_and_logs_finite_losses(tmp_path):
    _run(
        tmp_path,
        str(REPO / "examples/hf/cli.py"),
        "fit",
        "--config",
        str(REPO / "examples/hf/hf_llama.yaml"),
        f"--trainer.max_steps={STEPS}",
        f"--trainer.val_check_interval={STEPS}",
        "--trainer.devices=2",
        "--trainer.strategy.init_args.pipeline_parallel=2",
    )
    (run,) = find_offline_runs(tmp_path / "runs/hf_llama")
    history = read_offline_history(run)
    train = metric_series(history, "train/loss")
    val = metric_series(history, "val/loss")
    assert len(train) == STEPS and len(val) == 1
    losses = train + val
    # finite, and near the log(vocab) of an untrained model rather than zero or diverged
    assert all(math.isfinite(loss) and 1.0 < loss < 10.0 for loss in losses), losses
    assert (tmp_path / "runs/hf_llama/checkpoints/last.ckpt/COMPLETE").is_file()


def test_train_llama_script_trains_with_tensor_parallel_and_exports(tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    script = str(REPO / "examples/hf/train_llama.py")
    result = _run(tmp_path, script, "--devices=2", "--tensor-parallel=2", "--max-steps=2", f"--out={out}")
    losses = [float(x) for x in re.findall(r"rank \d: train/loss (\S+)", result.stdout)]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses), result.stdout
    model = AutoModelForCausalLM.from_pretrained(out / "hf")
    assert model.config.model_type == "llama" and model.config.vocab_size == 512  # linked from the tokenizer
    assert model.config.num_hidden_layers == 4
