"""The Hugging Face examples run end to end, as a user runs them (real processes, W&B offline).

``lightning-mm fit --config examples/hf/hf_llama.yaml`` (the installed console script) on one process and on 2
pipeline stages, and ``examples/hf/hf_llava.yaml`` (a LLaVA-style model on packed image-caption rows) as shipped, log
finite training (and validation) losses to W&B and write a complete sharded checkpoint;
``examples/hf/train_llama.py`` under tensor parallel on 2 processes trains and exports a directory that
``AutoModelForCausalLM.from_pretrained`` loads.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from lightning_mm.testing.wandb_offline import find_offline_runs, metric_series, read_offline_history

REPO = Path(__file__).resolve().parents[2]
STEPS = 3

pytestmark = pytest.mark.slow


def _run(tmp_path: Path, *command: str) -> subprocess.CompletedProcess:
    result = subprocess.run(
        list(command),
        cwd=tmp_path,
        env={**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


def _fit_hf_example(tmp_path: Path, example: str, *overrides: str) -> tuple[list[float], list[float]]:
    """``lightning-mm fit --config examples/hf/EXAMPLE.yaml`` in ``tmp_path`` (the YAML's paths are relative):
    the W&B train and val losses, each finite and near the log(vocab) of an untrained model, not zero or diverged."""
    console_script = Path(sys.executable).with_name("lightning-mm")  # what `pip install` put next to python
    _run(tmp_path, str(console_script), "fit", "--config", str(REPO / f"examples/hf/{example}.yaml"), *overrides)
    (run,) = find_offline_runs(tmp_path / f"runs/{example}")
    history = read_offline_history(run)
    train, val = metric_series(history, "train/loss"), metric_series(history, "val/loss")
    assert all(math.isfinite(loss) and 1.0 < loss < 10.0 for loss in train + val), (train, val)
    assert (tmp_path / f"runs/{example}/checkpoints/last.ckpt/COMPLETE").is_file()
    return train, val


# Time: the installed `lightning-mm` console script three times, side by side: the Llama YAML on one process (2 steps)
# and on 2 pipeline stages (2 fresh interpreters that also import transformers, started one after the other by
# Lightning's launcher, 3 steps, 1 validation pass), the LLaVA YAML as shipped (packed rows, FSDP2 on 2 processes,
# 3 steps, 1 validation pass); each writes a DCP last.ckpt. A launch's start-ups are serial, so several share the
# cores better than one after the other. The console script and the shipped YAMLs are what is tested: real commands.
@pytest.fixture(scope="module")
def hf_llama_fits(tmp_path_factory) -> dict[str, tuple[Path, list[float], list[float]]]:
    runs = {
        "one_process": ("hf_llama", "--trainer.devices=1", "--trainer.max_steps=2", "--trainer.limit_val_batches=0"),
        "two_stages": (
            "hf_llama",
            f"--trainer.max_steps={STEPS}",
            f"--trainer.val_check_interval={STEPS}",
            "--trainer.devices=2",
            "--trainer.strategy.init_args.pipeline_parallel=2",
        ),
        "llava_packed": ("hf_llava", f"--trainer.max_steps={STEPS}", f"--trainer.val_check_interval={STEPS}"),
    }
    roots = {name: tmp_path_factory.mktemp(name) for name in runs}
    with ThreadPoolExecutor(len(roots)) as pool:
        fits = {name: pool.submit(_fit_hf_example, roots[name], *runs[name]) for name in roots}
        return {name: (roots[name], *fit.result()) for name, fit in fits.items()}


def test_lightning_mm_fit_trains_the_hf_llama_yaml_on_one_process(hf_llama_fits):
    root, train, val = hf_llama_fits["one_process"]
    assert len(train) == 2 and not val
    assert (root / "runs/hf_llama/config.yaml").read_text().count("HFCausalLMModule") == 1


def test_lightning_mm_fit_trains_the_hf_llama_yaml_on_two_pipeline_stages(hf_llama_fits):
    _, train, val = hf_llama_fits["two_stages"]
    assert len(train) == STEPS and len(val) == 1


def test_lightning_mm_fit_trains_the_hf_llava_yaml_on_packed_rows(hf_llama_fits):
    root, train, val = hf_llama_fits["llava_packed"]
    assert len(train) == STEPS and len(val) == 1
    config = (root / "runs/hf_llava/config.yaml").read_text()
    assert "model_type: llava" in config and "regroup: pack" in config


# Time: the example script as users run it: 2 fresh interpreters importing transformers (rank 1 started by Lightning's
# launcher), 2 tp2 steps, 1 validation pass and a DCP save, then a 3rd interpreter for the `lightning-mm export-hf`
# the script itself runs; that export is what from_pretrained checks.
def test_train_llama_script_trains_with_tensor_parallel_and_exports(tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    script = str(REPO / "examples/hf/train_llama.py")
    result = _run(
        tmp_path, sys.executable, script, "--devices=2", "--tensor-parallel=2", "--max-steps=2", f"--out={out}"
    )
    losses = [float(x) for x in re.findall(r"rank \d: train/loss (\S+)", result.stdout)]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses), result.stdout
    model = AutoModelForCausalLM.from_pretrained(out / "hf")
    assert model.config.model_type == "llama" and model.config.vocab_size == 512  # linked from the tokenizer
    assert model.config.num_hidden_layers == 4
