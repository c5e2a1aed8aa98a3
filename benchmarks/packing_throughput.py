"""Packed rows against padding, and attention inside segments against a dense masked call: training real tokens/s.

    python benchmarks/packing_throughput.py [--rounds 3] [--steps 4]

Settings, each measured side by side in one run (modes interleaved round-robin, ``--rounds`` times, so machine drift
hits all alike; the median step of each mode is reported):

* ``vlm_default``: the reference VLM (``--preset``) on the embedded default data at one per-batch budget
  (768 patches, 768 tokens): ``none`` / ``bucket`` / ``pack`` with dense masked attention / ``pack`` with
  ``attention="segments"`` / ``pack`` with ``"auto"``.
* ``vlm_long_rows``: the same model on packed rows of ``--long-tokens`` tokens (and 2x as many patches) each,
  dense masked against per-segment attention (and ``"auto"``).
* ``hf_llama``: the tiny HF Llama of ``examples/hf/hf_llama.yaml`` on the default captions: ``none`` / ``bucket`` /
  ``pack`` (transformers' own packed-sequence attention: positions restart, no mask).
* ``hf_llava``: ``examples/hf/hf_llava.yaml``'s LLaVA-style model on the same batches (each image back on a canvas,
  its image tokens before its caption), ``none`` / ``bucket`` / ``pack``.

Real tokens = non-padding caption tokens + image patches (VLM), caption tokens (Llama), caption + image tokens
(LLaVA), per second of
forward + backward + AdamW step, the batches loaded beforehand so data time is not counted.

First, attention alone over row shapes around ``auto``'s threshold (dense against per-segment).

Writes ``benchmarks/results/packing_throughput.json`` and a bar plot, and prints tables.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import warnings
from pathlib import Path

import torch

from lightning_mm.datamodules.regroup import batch_padding
from lightning_mm.datamodules.web import ImageTextWebDataModule
from lightning_mm.models import VisionLanguageModel, build_config, compute_losses
from lightning_mm.models.attention import SegmentLayout


def _datamodule(regroup: str, patches: int, tokens: int, rows: int, args) -> ImageTextWebDataModule:
    return ImageTextWebDataModule(
        synthetic_preset="default",
        patch_size=16,
        max_patches_per_image=args.max_patches_per_image,
        max_text_tokens=args.max_text_tokens,
        regroup=regroup,
        batch_size=min(patches // args.max_patches_per_image, tokens // args.max_text_tokens),
        max_patches_per_batch=patches,
        max_tokens_per_batch=tokens,
        rows_per_batch=rows,
        buffer_size=args.buffer_size,
        seed=0,
    )


def _batches(dm: ImageTextWebDataModule, count: int) -> list:
    loaded = []
    for batch in dm.train_dataloader():
        loaded.append(batch)
        if len(loaded) == count:
            break
    return loaded


class _VLMStep:
    def __init__(self, config) -> None:
        torch.manual_seed(0)
        self.model = VisionLanguageModel(config)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def real_tokens(self, batch) -> int:
        counts = batch_padding(batch)
        return counts["real_patches"] + counts["real_tokens"]

    def slots(self, batch) -> int:
        return batch.patch_segment.numel() + batch.token_segment.numel()

    def __call__(self, batch) -> None:
        loss = compute_losses(self.model(batch), batch).total
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()


LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
"""examples/hf/hf_llama.yaml's decoder (longer positions: LLaVA rows hold image tokens too)."""


def _llava(image_size: int) -> dict:
    """examples/hf/hf_llava.yaml's model, its canvas sized for the benchmark's images."""
    vision = {
        "model_type": "clip_vision_model",
        "image_size": image_size,
        "patch_size": 32,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
    }
    return {"model_type": "llava", "tie_word_embeddings": False, "text_config": LLAMA, "vision_config": vision}


class _HFStep:
    """The HF module's own training computation (``HFCausalLMModule``: batch conversion, packed layout, loss); real
    tokens are the model's non-padding inputs (caption tokens; LLaVA: and image tokens)."""

    def __init__(self, config: dict, vocab_size: int) -> None:
        from lightning_mm.models.hf import HFCausalLMModule

        # training_step logs through self.log; without a Trainer Lightning warns once per call.
        warnings.filterwarnings("ignore", message=".*self.trainer. reference is not registered.*")
        torch.manual_seed(0)
        self.module = HFCausalLMModule(config=config, vocab_size=vocab_size)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=1e-4)

    def _inputs(self, batch) -> torch.Tensor:
        from lightning_mm.models.hf import ImageTokens, as_causal_lm_batch

        return as_causal_lm_batch(batch, ImageTokens.of(self.module.causal_lm))["attention_mask"]

    def real_tokens(self, batch) -> int:
        return int(self._inputs(batch).sum())

    def slots(self, batch) -> int:
        return self._inputs(batch).numel()

    def __call__(self, batch) -> None:
        loss = self.module.training_step(batch, 0)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()


def _measure(modes: dict, rounds: int, steps: int) -> dict:
    """``modes``: name -> (step callable, batches). Interleaved rounds; median real tokens/s per mode."""
    rates = {name: [] for name in modes}
    padding = {name: [] for name in modes}
    for round_index in range(rounds):
        for name, (step, batches) in modes.items():
            for index in range(steps):
                batch = batches[(round_index * steps + index) % len(batches)]
                start = time.perf_counter()
                step(batch)
                elapsed = time.perf_counter() - start
                if round_index or index:  # the first step of each mode warms allocators up
                    rates[name].append(step.real_tokens(batch) / elapsed)
                padding[name].append(1 - step.real_tokens(batch) / step.slots(batch))
    base = statistics.median(rates[next(iter(modes))])
    return {
        name: {
            "real_tokens_per_s_median": statistics.median(rates[name]),
            "vs_first": statistics.median(rates[name]) / base,
            "padding_fraction_mean": statistics.fmean(padding[name]),
            "steps_timed": len(rates[name]),
        }
        for name in modes
    }


def _attention_sweep(rounds: int) -> dict:
    """Attention alone (forward + backward of one layer's q, k, v; layout built once, as a forward shares it):
    dense masked against per-segment, over row shapes around ``auto``'s threshold. Captions of 10-60 tokens packed
    back to back, 2 heads of 32."""
    gen = torch.Generator().manual_seed(0)
    sweep = {}
    for rows, length in ((32, 32), (16, 64), (8, 128), (4, 256), (4, 512), (4, 1024), (4, 2048)):
        segment = torch.full((rows, length), -1)
        for row in range(rows):
            start, slot = 0, 0
            while True:
                size = int(torch.randint(10, 60, (1,), generator=gen))
                if start + size > length:
                    break
                segment[row, start : start + size] = slot
                start, slot = start + size, slot + 1
        q, k, v = (torch.randn(rows, 2, length, 32, requires_grad=True) for _ in range(3))
        times = {}
        for implementation in ("dense", "segments", "auto"):
            layout = SegmentLayout(segment, segment, True, implementation)
            samples = []
            for _ in range(2 * rounds + 1):
                start = time.perf_counter()
                layout.attend(q, k, v).sum().backward()
                samples.append(time.perf_counter() - start)
            times[implementation] = statistics.median(samples)
        sweep[f"{rows}x{length}"] = {
            "query_key_pairs": rows * length * length,
            "dense_ms": 1e3 * times["dense"],
            "segments_ms": 1e3 * times["segments"],
            "segments_vs_dense": times["dense"] / times["segments"],
            "auto_choice": SegmentLayout(segment, segment, True, "auto").choose(q),
            "auto_vs_dense": times["dense"] / times["auto"],
        }
    return sweep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", help="reference VLM preset")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repeats")
    parser.add_argument("--steps", type=int, default=4, help="steps per mode and round")
    parser.add_argument("--max-patches-per-image", type=int, default=48)
    parser.add_argument("--max-text-tokens", type=int, default=64)
    parser.add_argument("--buffer-size", type=int, default=1000)
    parser.add_argument("--long-tokens", type=int, default=2048, help="tokens per packed row of vlm_long_rows")
    parser.add_argument("--long-rows", type=int, default=2, help="rows per batch of vlm_long_rows")
    parser.add_argument("--output", default="benchmarks/results/packing_throughput.json")
    args = parser.parse_args()
    batches_needed = args.rounds * args.steps

    attention = _attention_sweep(args.rounds)
    print(f"{'rows x length':>14} {'pairs':>10} {'dense ms':>9} {'segments ms':>12} {'seg vs dense':>13} {'auto':>9}")
    for shape, r in attention.items():
        print(
            f"{shape:>14} {r['query_key_pairs']:10d} {r['dense_ms']:9.2f} {r['segments_ms']:12.2f} "
            f"{r['segments_vs_dense']:13.2f} {r['auto_choice']:>9}"
        )
    results = {}
    # --- reference VLM, default data, one budget
    data = {mode: _datamodule(mode, 768, 768, 8, args) for mode in ("none", "bucket", "pack")}
    vocab = data["none"].vocab_size
    loaded = {mode: _batches(dm, batches_needed) for mode, dm in data.items()}

    def vlm(attention: str) -> _VLMStep:
        return _VLMStep(
            build_config(
                args.preset, vocab_size=vocab, max_patches_per_image=args.max_patches_per_image, attention=attention
            )
        )

    results["vlm_default"] = _measure(
        {
            "none": (vlm("dense"), loaded["none"]),
            "bucket": (vlm("dense"), loaded["bucket"]),
            "pack_dense": (vlm("dense"), loaded["pack"]),
            "pack_segments": (vlm("segments"), loaded["pack"]),
            "pack_auto": (vlm("auto"), loaded["pack"]),
        },
        args.rounds,
        args.steps,
    )
    # --- reference VLM, long packed rows
    rows = args.long_rows
    long_dm = _datamodule("pack", 2 * args.long_tokens * rows, args.long_tokens * rows, rows, args)
    long_batches = _batches(long_dm, batches_needed)
    results["vlm_long_rows"] = _measure(
        {
            "pack_dense": (vlm("dense"), long_batches),
            "pack_segments": (vlm("segments"), long_batches),
            "pack_auto": (vlm("auto"), long_batches),
        },
        args.rounds,
        max(2, args.steps // 2),
    )
    results["vlm_long_rows"]["tokens_per_row"] = float(long_batches[0].tokens.shape[1])
    # --- HF Llama on the captions, LLaVA on the image-caption pairs
    modes = ("none", "bucket", "pack")
    results["hf_llama"] = _measure({m: (_HFStep(LLAMA, vocab), loaded[m]) for m in modes}, args.rounds, args.steps)
    # The canvas covers the widest grid in the loaded batches (16 px data patches); the vision tower reads it in 32 px
    # patches, so an image of up to S x S data patches costs (S / 2)^2 image tokens.
    side = max(int(b.patch_pos.max()) + 1 for batches in loaded.values() for b in batches)
    llava = _llava(16 * (side + side % 2))
    results["hf_llava"] = _measure({m: (_HFStep(llava, vocab), loaded[m]) for m in modes}, args.rounds, args.steps)

    for setting, modes in results.items():
        print(f"\n{setting}")
        print(f"  {'mode':14} {'real tok/s':>11} {'vs first':>9} {'padding':>8}")
        for name, r in modes.items():
            if isinstance(r, dict):
                print(
                    f"  {name:14} {r['real_tokens_per_s_median']:11.0f} {r['vs_first']:9.2f} "
                    f"{100 * r['padding_fraction_mean']:7.1f}%"
                )
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    machine = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    payload = {"machine": machine, "args": vars(args), "results": results, "attention_only": attention}
    output.write_text(json.dumps(payload, indent=2))
    print(f"wrote {output}")
    _plot(results, output.with_suffix(".png"))


def _plot(results: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, axes = plt.subplots(1, len(results), figsize=(4 * len(results), 3.2))
    for ax, (setting, modes) in zip(axes, results.items(), strict=True):
        names = [n for n, r in modes.items() if isinstance(r, dict)]
        ax.bar(names, [modes[n]["real_tokens_per_s_median"] for n in names])
        ax.set_title(setting)
        ax.set_ylabel("real tokens / s (median step)")
        ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
