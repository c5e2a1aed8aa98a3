"""Train a tiny Llama (built from a config: nothing is downloaded) on the captions of lightning-mm's embedded
synthetic dataset with ``HybridParallelStrategy``, then export the last checkpoint as a Hugging Face directory.

    .venv/bin/python examples/hf/train_llama.py                                      # one process
    .venv/bin/python examples/hf/train_llama.py --devices 2                          # FSDP2 over 2 ranks
    .venv/bin/python examples/hf/train_llama.py --devices 2 --pipeline-parallel 2    # 2 pipeline stages
    .venv/bin/python examples/hf/train_llama.py --devices 2 --tensor-parallel 2      # tensor parallel
    .venv/bin/python examples/hf/train_llama.py --devices 2 --lora                   # LoRA adapters, FSDP2

The output directory (``--out``, default ``runs/train_llama``) gets ``checkpoints/last.ckpt`` (a sharded checkpoint
directory, loadable on any mesh) and ``hf/`` (``AutoModelForCausalLM.from_pretrained(hf)``; with ``--lora``:
the adapters, ``PeftModel.from_pretrained(base, hf)``), the same as ``lightning-mm export-hf CKPT OUT``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_mm.datamodules import ImageTextWebDataModule
from lightning_mm.models.hf import HFCausalLMModule
from lightning_mm.strategies import HybridParallelStrategy

MAX_TEXT_TOKENS = 64  # captions are cut here (BOS + caption + EOS); also the pipeline's fixed sequence length

LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": MAX_TEXT_TOKENS,
    "tie_word_embeddings": False,  # tied embeddings cannot be split by tensor / pipeline parallel
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=1, help="CPU processes")
    parser.add_argument("--pipeline-parallel", type=int, default=1, help="pipeline stages")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="tensor-parallel degree")
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters on q/v projections only")
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8, help="captions per batch and data-parallel rank")
    parser.add_argument("--out", default="runs/train_llama", help="checkpoints and the exported model go here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    L.seed_everything(0)

    # One caption per row (a causal LM has no use for packed multi-caption rows); the images are not used.
    data = ImageTextWebDataModule(
        synthetic_preset="tiny",
        regroup="none",
        batch_size=args.batch_size,
        max_text_tokens=MAX_TEXT_TOKENS,
        max_patches_per_image=4,
        num_workers=0,
    )
    model = HFCausalLMModule(
        config=LLAMA,
        vocab_size=data.vocab_size,  # the embedding table matches the dataset's tokenizer
        lora={"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]} if args.lora else None,
        learning_rate=3e-3,
        warmup_steps=2,
        max_length=MAX_TEXT_TOKENS,  # pipelined batches are padded to this length
    )
    strategy = HybridParallelStrategy(
        pipeline_parallel=args.pipeline_parallel,
        tensor_parallel=args.tensor_parallel,
        data_parallel_shard="auto",  # the rest of the processes: FSDP2
        microbatches=2 if args.pipeline_parallel > 1 else None,
    )
    checkpoint = ModelCheckpoint(dirpath=out / "checkpoints", save_last=True, save_top_k=0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.max_steps,
        val_check_interval=args.max_steps,  # one validation pass, at the end
        check_val_every_n_epoch=None,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        gradient_clip_val=1.0,
        log_every_n_steps=5,
        logger=False,
        callbacks=[checkpoint],
        enable_model_summary=False,
        default_root_dir=out,
    )
    trainer.fit(model, datamodule=data)
    metrics = {name: f"{float(value):.3f}" for name, value in trainer.callback_metrics.items()}
    print(f"rank {trainer.global_rank}: train/loss {metrics['train/loss']} val/loss {metrics['val/loss']}")

    if trainer.global_rank == 0:
        # `lightning-mm export-hf CKPT OUT` reads every shard of the checkpoint in one fresh process (outside this
        # run's process group) and writes a `from_pretrained` directory.
        shutil.rmtree(out / "hf", ignore_errors=True)
        export = [sys.executable, "-m", "lightning_mm.cli", "export-hf", checkpoint.last_model_path, str(out / "hf")]
        subprocess.run(export, check=True)


if __name__ == "__main__":
    main()
