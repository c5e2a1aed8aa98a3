"""``ImageTextWebDataModule``: WebDataset image-text shards -> regrouped ``MultimodalBatch`` es.

Plain webdataset pipelines stream samples in whatever order the shards give them, which makes three
things impossible: equal step counts on every data-parallel rank (webdataset #188, #225), each sample
exactly once per epoch (#25) and exact mid-epoch resume (#234, #271). This DataModule plans instead of
streaming:

1. **Index** (once per shard, kept on disk: ``shard_index.py``): every shard is read once for its samples' file
   offsets, image sizes (header only) and caption token counts, under the shared bad-input policy, into 24 bytes
   per sample; later runs (and every rank) read the index back as one numpy array, with no per-sample Python
   object. Patch counts follow from the image sizes (``patch_grid``), so the cost of every sample is known before
   any pixel is decoded.
2. **Plan** (per epoch, identical on every rank; ``epoch_schedule.py``): shuffle all samples with ``(seed, epoch)``,
   regroup them on their lengths only (``regroup``), deal the global batches to the data-parallel ranks (round-robin,
   or evening the compute cost with ``balance=True``) so that every rank has the same number of steps. The remainder
   (the batches left out by the dealing, the last short batch) is counted in the plan and printed each epoch; every
   other sample is used exactly once per epoch, which ``sample_ids`` make checkable.
3. **Load** (in DataLoader workers; ``planned_split.py``): each worker seeks the samples of its share of the rank's
   planned batches in the shards, decodes, patchifies, tokenizes and collates them, in the plan's order.

Resume: the DataModule counts the training batches handed to the model (``on_before_batch_transfer``)
and saves ``(epoch, batches consumed by this rank, global batches consumed)`` in Lightning checkpoints
(``state_dict``). After ``Trainer.fit(ckpt_path=...)`` the epoch's global batch list is rebuilt (a pure function of
seed and epoch, whatever the number of ranks) and what the checkpoint had not consumed is dealt to the ranks of
*this* run, so a checkpoint of W data-parallel ranks resumes on W' (a divisor, a multiple or neither; the remainder
of the new dealing is the epoch's usual remainder): every sample of the epoch used once overall. The consumed
batches are skipped without being read.

Ranks that differ only in tensor / pipeline / expert coordinates receive identical batches: the plan
depends on the data-parallel rank and size only, taken from the strategy's mesh when it has one.

Remote shards: any fsspec URL (``s3://``, ``gs://``, ``https://``, ...) is read with byte-range requests
(``shard_io.py``): once front to back to index it, then one range per planned sample; the index goes to the cache
(or ``index_dir``), or is read from beside the shards when it was uploaded with them. ``pipe:`` URLs are refused:
planning needs random access.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import posixpath
from typing import Any, Literal

import lightning as L
import numpy as np

from lightning_mm.datamodules.accounting import PassAccounting, _print
from lightning_mm.datamodules.common import (
    EpochAwareLoader,
    ResumableEpochAwareLoader,
    data_parallel_rank_and_size,
    expand_urls,
    load_manifest,
    shard_identity,
)
from lightning_mm.datamodules.cost_model import cost_coefficients
from lightning_mm.datamodules.decode import (
    DEFAULT_MAX_IMAGE_PIXELS,
    ERROR_KINDS,
    IMAGE_KEYS,
    TEXT_KEYS,
    ErrorLog,
    ShardIndex,
    account_damaged_shards,
    check_image_pixels,
)
from lightning_mm.datamodules.epoch_schedule import EpochPlan, SplitConfig, _budget_from_ratio, deal_batches
from lightning_mm.datamodules.filters import FILTER_KINDS, QualityFilters, describe_counts
from lightning_mm.datamodules.planned_split import _all_padding, _PlannedSplit  # noqa: F401 (_all_padding: re-export)
from lightning_mm.datamodules.shard_index import (
    IndexSettings,
    LoadedShardIndex,
    SampleLengths,
    SampleTable,
    drop_too_large,
    ensure_shard_indexes,
)
from lightning_mm.datamodules.shard_io import is_remote, shard_versions
from lightning_mm.datamodules.stages import TextTokenizer
from lightning_mm.validation import require_int

# EpochPlan and deal_batches live in epoch_schedule.py, _PlannedSplit and _all_padding in planned_split.py; they are
# importable from here as before.
__all__ = ["ImageTextWebDataModule", "EpochPlan", "deal_batches"]
log = logging.getLogger(__name__)


Regroup = Literal["none", "bucket", "pack"]


def _fingerprint_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between a checkpoint's data fingerprint and this run's (``ImageTextWebDataModule._fingerprint``),
    one reason per part; empty when the saved position is valid for this run. The parts a checkpoint from an older
    version lacks (shard content, decode settings) cannot be compared and are not."""
    reasons = []
    if saved["shards"] != now["shards"]:
        reasons.append("the train shards (names and sizes) differ from the checkpoint's")
    elif "content" in saved and saved["content"] != now["content"]:
        pairs = zip(saved.get("shard_content", []), now["shard_content"], strict=False)  # (same names: same length)
        changed = [name for (name, before), (_, after) in pairs if before != after]
        named = f" {changed[:5]}" + (f" and {len(changed) - 5} more" if len(changed) > 5 else "") if changed else ""
        reasons.append(
            f"the content of train shard(s){named} changed since the checkpoint (same names and sizes: rewritten "
            "with other samples)"
        )
    # (older checkpoints list data_parallel_size among the settings; the global count made it irrelevant)
    saved_plan = {k: v for k, v in saved["plan_config"].items() if k != "data_parallel_size"}
    changed = sorted(k for k in {**saved_plan, **now["plan_config"]} if saved_plan.get(k) != now["plan_config"].get(k))
    if changed:
        reasons.append(f"batching settings changed: {changed}")
    if "decode" in saved:
        before, after = saved["decode"], now["decode"]
        changed = sorted(k for k in {**before, **after} if before.get(k) != after.get(k))
        if changed:
            what = " (another tokenizer)" if "tokenizer" in changed else ""
            reasons.append(f"decode settings changed: {changed}{what}")
    return reasons


class ImageTextWebDataModule(PassAccounting, L.LightningDataModule):
    """Image-text WebDataset shards with alignment-aware regrouping, equal steps per rank and exact resume.

    Args:
        train_urls: training shards: local paths, brace patterns (``shards/train-{000000..000127}.tar``) or
            globs. None: the embedded synthetic dataset (see ``data_dir``).
        val_urls: validation shards; required with ``train_urls``.
        tokenizer: path to an HF ``tokenizer.json``; required with ``train_urls``.
        data_dir: a dataset written by ``lightning-mm make-shards`` (manifest.json). None: the cache
            directory of ``synthetic_preset``, generated on first use.
        synthetic_preset: embedded dataset generated when neither ``train_urls`` nor ``data_dir`` is given.
        patch_size: patch side in pixels.
        max_patches_per_image: cap on patches per image (larger images are downscaled, aspect kept).
        max_text_tokens: cap on caption tokens including BOS/EOS (longer captions are cut, counted).
        regroup: ``none`` (fixed ``batch_size``, padded to the longest), ``bucket`` (similar lengths
            together, variable batch size under both budgets) or ``pack`` (several samples per row,
            constant shapes ``rows_per_batch x budget / rows_per_batch``).
        batch_size: samples per batch with ``regroup="none"``.
        max_patches_per_batch: patch budget per batch (``bucket``, ``pack``), padding included.
        max_tokens_per_batch: token budget per batch (``bucket``, ``pack``), padding included.
            One of the two budgets may be ``"auto"``: it is sized from the other by the training split's real
            ratio of caption tokens to image patches (summed over its indexed samples, under
            ``max_patches_per_image`` / ``max_text_tokens``, after the filters), rounded up to whole rows
            (``pack``) and to at least one largest sample per row / batch, and printed. A fixed split wastes the
            budget the data does not fill: on the embedded default data (0.79 caption tokens per image patch) a
            768 / 768 packed batch leaves 22 % of its token slots as padding, an ``"auto"`` token budget (616)
            under 3 %, at the same samples per batch.
        rows_per_batch: rows of a packed batch; each row holds up to ``budget / rows_per_batch``.
        buffer_size: samples regrouped together (bigger: less padding, batches drawn from a wider window).
        seed: seed of the plan (shuffle and regrouping); the plan changes every epoch.
        num_workers: DataLoader worker processes per rank.
        image_keys: sample keys holding the image, first present wins.
        text_keys: sample keys holding the caption (then ``json["caption"]``).
        on_error: ``skip`` (drop bad samples / the damaged rest of a shard, count each kind, log the
            counts) or ``raise`` (an exception naming the kind, shard URL and sample key).
        val_batch_size: samples per validation batch with ``regroup="none"``; None: ``batch_size``.
        epoch_policy: how every data-parallel rank gets the same number of training steps: ``drop`` (the
            last ``len % dp_size`` planned batches are left out this epoch, counted in the plan) or ``pad``
            (every batch is used; ranks short of one in the last round take an empty batch, whose
            losses are zero and whose gradients are zero, so nothing is lost and nothing is counted
            twice). Validation always uses ``pad`` and keeps the last short batch, so every validation
            pair is scored.
        max_image_pixels: images whose header declares more pixels are skipped and counted as
            ``image_too_large`` before any pixel is decoded (default 8192 x 8192; None: PIL's own limit only).
        max_skipped_fraction: the run fails, printing the skip summary, when more than this fraction of a split's
            samples is skipped as bad (at indexing, or when decoding an epoch); 0 fails on any skip, 1 never.
        require_images: fail when the image keys match no file of a shard, naming it and the extensions its
            samples hold (the run would otherwise train on text alone without a word), and skip (counted, per shard
            in the summary: ``image_key_mismatch``) samples whose image file has an extension ``image_keys`` does not
            list; set False for a deliberately text-only dataset.
        allow_replan: on resume, a checkpoint taken with other shards or other batching settings is refused (its
            position counts batches of a different plan); True restarts that epoch with the new plan instead
            (samples of the epoch seen before the checkpoint are then seen again), with a warning.
        curriculum: progressive resolution for the training split, ``{start_epoch: max_patches_per_image}``, e.g.
            ``{0: 16, 2: 64}``: images are patchified under a cap of 16 patches in epochs 0-1 (smaller images, more
            pairs per packed batch) and 64 from epoch 2; the plan of an epoch follows its cap, so a resume is exact.
            Caps must not exceed ``max_patches_per_image`` (what the model is built for).
        curriculum_unit: what the ``curriculum`` keys count: ``epoch`` (default) or ``step``, training steps from the
            start of the run (batches per data-parallel rank: optimizer steps without gradient accumulation), for
            runs of one or a few long epochs. The plan gives each sample the cap of the step the regrouping has
            reached when the sample enters its buffer, so a new cap takes over within about one buffer's worth of
            batches after its step; the caps are part of the plan (a pure function of seed, epoch, the epoch's first
            step and data-parallel size), so a resume, also on another number of ranks, is exact. Each epoch prints
            how many samples its plan takes under each cap. Not with ``carry_remainder`` (carrying replans earlier
            epochs, whose first steps a resumed run does not know).
        filters: quality filters for the training split (:mod:`lightning_mm.datamodules.filters`), e.g.
            ``{"min_image_side": 64, "max_aspect_ratio": 3, "min_caption_tokens": 3, "min_similarity": 0.28,
            "deduplicate": True}``; each dropped sample is counted by kind and printed after indexing.
        balance: deal the global batches so that the data-parallel ranks of every step get batches of similar
            compute cost (``balance_cost``) instead of round-robin: packed and fixed-size batches keep the
            round-robin steps (the same samples per step, in the same order) and move rows between the step's
            batches (shapes unchanged); bucket batches are grouped into steps of similar cost (steps shuffled with
            ``(seed, epoch)``). The dealing depends on the number of ranks; a resume on another number continues
            with the batches the checkpoint had not consumed. ``EpochPlan.step_balance`` (logged by
            ``PaddingStats`` as ``data/balance_max_over_mean``, printed per epoch) is computed either way.
        balance_cost: cost model of a batch (:func:`~lightning_mm.datamodules.regroup.batch_cost`): a reference
            model preset (FLOP coefficients from its widths and layers, varlen attention:
            :func:`~lightning_mm.datamodules.regroup.flop_coefficients`), ``{"preset": ..., "attention": "row"}``
            for dense masked attention over padded rows (the reference implementation), or the fields of
            :class:`~lightning_mm.datamodules.regroup.CostCoefficients` (e.g. fitted to measured step times).
        carry_remainder: training epochs do not yield their last, short batch (constant shapes; ``none``: fewer than
            ``batch_size`` samples, ``pack``: fewer than ``rows_per_batch`` rows). False (default): its samples are
            dropped for that epoch (counted, printed each epoch); True: they are planned again at the start of the
            next epoch (``EpochPlan.carried_in`` / ``carried_out``), a pure function of ``(seed, epoch)`` like the
            rest of the plan, so a resume replans the same. The dealing remainder (whole batches that would not give
            every data-parallel rank a step) depends on the number of ranks and is not carried: use
            ``epoch_policy="pad"`` to keep it.
        index_dir: where the shard indexes are written (:mod:`~lightning_mm.datamodules.shard_index`: 24 bytes per
            sample, built once, on first use or by ``lightning-mm index``). None: beside each shard
            (``<shard>.<digest>.lmm-index``; the digest names the tokenizer and the key settings, so other ones get
            indexes of their own), or in ``~/.cache/lightning-mm/index`` where the shard's directory is not writable
            and for remote shards (whose indexes are also read from beside them when uploaded there).

    Every skipped sample is counted by kind and printed: after indexing each split, at the end of every epoch
    and when the run ends (with an example shard / key per kind), whatever callbacks are present.
    """

    def __init__(
        self,
        train_urls: str | list[str] | None = None,
        val_urls: str | list[str] | None = None,
        tokenizer: str | None = None,
        data_dir: str | None = None,
        synthetic_preset: str = "default",
        patch_size: int = 16,
        max_patches_per_image: int = 64,
        max_text_tokens: int = 64,
        regroup: Regroup = "pack",
        batch_size: int = 32,
        max_patches_per_batch: int | Literal["auto"] = 2048,
        max_tokens_per_batch: int | Literal["auto"] = 2048,
        rows_per_batch: int = 8,
        buffer_size: int = 1000,
        seed: int = 0,
        num_workers: int = 0,
        image_keys: list[str] | None = None,
        text_keys: list[str] | None = None,
        on_error: Literal["skip", "raise"] = "skip",
        val_batch_size: int | None = None,
        epoch_policy: Literal["drop", "pad"] = "drop",
        max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS,
        max_skipped_fraction: float = 0.01,
        require_images: bool = True,
        allow_replan: bool = False,
        filters: dict[str, Any] | None = None,
        curriculum: dict[int, int] | None = None,
        curriculum_unit: Literal["epoch", "step"] = "epoch",
        balance: bool = False,
        balance_cost: str | dict[str, Any] = "1b",
        carry_remainder: bool = False,
        index_dir: str | None = None,
    ) -> None:
        super().__init__()
        check_image_pixels(max_image_pixels)
        self._filters = QualityFilters.from_options(filters)
        if curriculum_unit not in ("epoch", "step"):
            raise ValueError(f"curriculum_unit must be 'epoch' or 'step', got {curriculum_unit!r}")
        if curriculum and curriculum_unit == "step" and balance and regroup == "bucket":
            raise ValueError(
                "curriculum_unit='step' with balance=True and regroup='bucket' is not supported: the balanced bucket "
                "dealing reorders the epoch's steps by cost, so a cap planned for a step would be trained at another"
            )
        if curriculum and curriculum_unit == "step" and carry_remainder:
            raise ValueError(
                "curriculum_unit='step' with carry_remainder=True is not supported: carrying replans the previous "
                "epochs, whose first steps a resumed run does not know; use one of the two"
            )
        for start, cap in (curriculum or {}).items():
            require_int("curriculum key", start, minimum=0, hint=f"the {curriculum_unit} a patch cap starts at")
            require_int(
                f"curriculum[{start}]",
                cap,
                maximum=max_patches_per_image,
                hint=f"a patch cap per image; max_patches_per_image={max_patches_per_image}",
            )
        if isinstance(max_text_tokens, int) and max_text_tokens > 32769:
            raise ValueError(
                f"max_text_tokens must be <= 32769 (a shard index counts up to 32767 caption tokens), got "
                f"{max_text_tokens}"
            )
        if index_dir is not None and (not isinstance(index_dir, str) or not index_dir):
            raise ValueError(f"index_dir must be a directory path or None, got {index_dir!r}")
        if not isinstance(carry_remainder, bool):
            raise ValueError(f"carry_remainder must be True or False, got {carry_remainder!r}")
        if isinstance(max_skipped_fraction, bool) or not 0 <= max_skipped_fraction <= 1:
            raise ValueError(f"max_skipped_fraction must be in [0, 1], got {max_skipped_fraction!r}")
        if regroup not in ("none", "bucket", "pack"):
            raise ValueError(f"regroup must be one of 'none', 'bucket', 'pack', got {regroup!r}")
        if epoch_policy not in ("drop", "pad"):
            raise ValueError(f"epoch_policy must be 'drop' or 'pad', got {epoch_policy!r}")
        if on_error not in ("skip", "raise"):
            raise ValueError(f"on_error must be 'skip' or 'raise', got {on_error!r}")
        budgets = {"max_patches_per_batch": max_patches_per_batch, "max_tokens_per_batch": max_tokens_per_batch}
        auto = [name for name, value in budgets.items() if isinstance(value, str)]
        for name in auto:
            if budgets[name] != "auto":
                raise ValueError(f"{name} must be an integer or 'auto', got {budgets[name]!r}")
        if len(auto) == 2:
            raise ValueError(
                "max_patches_per_batch and max_tokens_per_batch are both 'auto': give one, the other is sized from it"
            )
        for name, value, low in (
            ("patch_size", patch_size, 1),
            ("max_patches_per_image", max_patches_per_image, 1),
            ("max_text_tokens", max_text_tokens, 2),
            ("batch_size", batch_size, 1),
            *((name, value, 1) for name, value in budgets.items() if name not in auto),
            ("rows_per_batch", rows_per_batch, 1),
            ("buffer_size", buffer_size, 1),
            ("num_workers", num_workers, 0),
        ):
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if regroup != "none":
            # One sample must fit the unit the budgets are cut into: a packed row, or a bucket batch.
            rows, unit = (rows_per_batch, "row") if regroup == "pack" else (1, "batch")
            per = " / rows_per_batch" if regroup == "pack" else ""
            for budget_name, budget, cap_name, cap in (
                ("max_patches_per_batch", max_patches_per_batch, "max_patches_per_image", max_patches_per_image),
                ("max_tokens_per_batch", max_tokens_per_batch, "max_text_tokens", max_text_tokens),
            ):
                if budget_name not in auto and budget // rows < cap:
                    raise ValueError(
                        f"{budget_name}{per} = {budget // rows} must be >= {cap_name} = {cap}, "
                        f"or the largest sample fits no {unit}"
                    )
        if train_urls is not None and (val_urls is None or tokenizer is None):
            raise ValueError("with train_urls, also give val_urls and tokenizer (path to an HF tokenizer.json)")
        self.save_hyperparameters()
        self.patch_size = patch_size
        self.max_patches_per_image = max_patches_per_image
        self.cost_coefficients = cost_coefficients(balance_cost, patch_size)
        """Cost model of the data-parallel balance (``balance_cost``)."""
        self.last_step_balance: float | None = None
        """max / mean batch cost over the data-parallel ranks of the training step being run (``PaddingStats``)."""
        self.error_log = ErrorLog(on_error)
        self._passes: dict[str, dict[str, Any]] = {}
        self._tokenizer: TextTokenizer | None = None
        self._splits: dict[str, tuple[SampleTable, SampleLengths]] = {}
        self._consumed = {"epoch": 0, "batches": 0, "global_batches": 0, "start_step": 0, "plan_world": None}
        self._steps_done = 0  # training batches this rank consumed over the run (the step curriculum's clock)
        self._resume: dict[str, int] | None = None
        self._restored_from: dict[str, Any] | None = None  # the checkpoint state load_state_dict applied last
        self._resume_world: int | None = None
        self._budgets: tuple[int, int] | None = None
        self._curriculum_printed: int | None = None
        self._known_samples: dict[str, int] = {}  # shard -> samples, from a manifest (damaged-shard accounting)
        self._caption_limit: int | None = None  # (_caption_chars)
        self._resolved_sources: tuple[dict[str, list[str]], str] | None = None  # (_sources)
        self._shard_digests: dict[str, str] = {}  # train shard -> content digest taken at indexing (fingerprint)
        self.filter_counts: dict[str, int] = dict.fromkeys(FILTER_KINDS, 0)
        """Training samples each quality filter dropped at indexing (:data:`~lightning_mm.datamodules.filters.
        FILTER_KINDS`)."""

    @property
    def batch_budgets(self) -> tuple[int, int]:
        """``(max_patches_per_batch, max_tokens_per_batch)``, an ``"auto"`` one sized from the training split (indexes
        it on first use; see the arguments)."""
        if self._budgets is None:
            hp = self.hparams
            patches, tokens = hp.max_patches_per_batch, hp.max_tokens_per_batch
            if "auto" in (patches, tokens):
                lengths = self._index("train")[1]
                real_patches, real_tokens = int(lengths.patches.sum()), int(lengths.tokens.sum())
                rows = hp.rows_per_batch if hp.regroup == "pack" else 1
                if tokens == "auto":
                    tokens = _budget_from_ratio(patches, real_tokens, real_patches, rows, hp.max_text_tokens)
                    if tokens is None:
                        raise ValueError("max_tokens_per_batch='auto': the training split has no image patches")
                    sized = f"max_tokens_per_batch='auto' -> {tokens}"
                else:
                    patches = _budget_from_ratio(tokens, real_patches, real_tokens, rows, hp.max_patches_per_image)
                    sized = f"max_patches_per_batch='auto' -> {patches}"
                if self._global_rank() == 0:
                    _print(
                        f"data (train): {sized} ({real_tokens / max(real_patches, 1):.3f} caption tokens per image "
                        f"patch over {len(lengths)} samples)"
                    )
            self._budgets = (patches, tokens)
        return self._budgets

    def regroup_config(self) -> dict[str, Any]:
        hp = self.hparams
        max_patches, max_tokens = self.batch_budgets
        return {
            "regroup": hp.regroup,
            "batch_size": hp.batch_size,
            "seed": hp.seed,
            "buffer_size": hp.buffer_size,
            "max_patches_per_batch": max_patches,
            "max_tokens_per_batch": max_tokens,
            "rows_per_batch": hp.rows_per_batch,
            "max_patches_per_row": max_patches // hp.rows_per_batch,
            "max_tokens_per_row": max_tokens // hp.rows_per_batch,
            "patch_size": hp.patch_size,
            "max_patches_per_image": hp.max_patches_per_image,
            "max_text_tokens": hp.max_text_tokens,
            "epoch_policy": hp.epoch_policy,
            # (only when set: a checkpoint from before the filters existed keeps its fingerprint)
            **({"filters": self._filters.as_dict()} if self._filters.active else {}),
            **({"curriculum": dict(sorted(hp.curriculum.items()))} if hp.curriculum else {}),
            **({"curriculum_unit": "step"} if hp.curriculum and hp.curriculum_unit == "step" else {}),
            # (only when set, as above: the balanced dealing orders the epoch by these costs)
            **({"balance": True, "balance_cost": self.cost_coefficients.as_dict()} if hp.balance else {}),
            # The packing algorithm makes the plan: a checkpoint of an older one counts batches of another plan.
            **({"pack_fit": "proportional"} if hp.regroup == "pack" else {}),
            **({"carry_remainder": True} if hp.carry_remainder else {}),
        }

    # ------------------------------------------------------------------------------------ indexing

    def _sources(self) -> tuple[dict[str, list[str]], str]:
        """Shards per split and the tokenizer path, resolved once per DataModule (as its indexes are): every
        checkpoint's state_dict asks, and each resolution stats every shard, a metadata storm on a parallel file
        system with many shards."""
        if self._resolved_sources is None:
            self._resolved_sources = self._resolve_sources()
        return self._resolved_sources

    def _resolve_sources(self) -> tuple[dict[str, list[str]], str]:
        hp = self.hparams
        if hp.train_urls is not None:
            urls = {"train": hp.train_urls, "val": hp.val_urls}
            for split, value in urls.items():
                for url in [value] if isinstance(value, str) else value:
                    if url.startswith("pipe:"):
                        raise ValueError(
                            f"{split}_urls: {url!r} is a pipe; ImageTextWebDataModule plans batches from an index "
                            "and reads samples by byte ranges: give a local path or an fsspec URL (s3://, gs://, "
                            "https://, ...)"
                        )
            expanded = {split: expand_urls(value, f"{split}_urls", must_exist=False) for split, value in urls.items()}
            for split, listed in expanded.items():
                missing = [url for url, version in zip(listed, shard_versions(listed), strict=True) if version is None]
                if missing:
                    # A listed shard that is not there would silently shrink the data, whatever on_error says.
                    unreachable = " or unreachable" if any(is_remote(url) for url in missing) else ""
                    raise FileNotFoundError(
                        f"{split}_urls: {len(missing)} of {len(listed)} listed shard(s) missing{unreachable}: "
                        f"{missing[:5]}" + (" ..." if len(missing) > 5 else "")
                    )
            train = {shard_identity(url) for url in expanded["train"]}
            shared = [url for url in expanded["val"] if shard_identity(url) in train]
            if shared and self._global_rank() == 0:  # (once: the sources are resolved once)
                # (allowed: overfitting a small set on purpose is a use; a typo in a glob is the usual cause)
                _print(
                    f"data: train_urls and val_urls share {len(shared)} shard(s) ({shared[:3]}): validation scores "
                    "samples the model trains on"
                )
            return expanded, hp.tokenizer
        dataset = load_manifest(hp.data_dir, hp.synthetic_preset)
        # (what a damaged shard held, for counting its lost samples: see decode.account_damaged_shards)
        self._known_samples = {
            url: count
            for split in dataset.shards
            for url, count in zip(dataset.shards[split], dataset.samples_per_shard[split], strict=True)
        }
        return dataset.shards, hp.tokenizer or dataset.tokenizer

    def _index_settings(self) -> IndexSettings:
        hp = self.hparams
        return IndexSettings(tuple(hp.image_keys or IMAGE_KEYS), tuple(hp.text_keys or TEXT_KEYS), hp.require_images)

    def _shard_indexes(self, split: str) -> list[LoadedShardIndex]:
        """Every shard's index (``shard_index.py``), built where missing or stale: once per node in
        ``prepare_data``, read back by every rank."""
        shards, _ = self._sources()
        say = _print if self._global_rank() == 0 else None
        return ensure_shard_indexes(shards[split], self.tokenizer, self._index_settings(), self.hparams.index_dir, say)

    def _index(self, split: str) -> tuple[SampleTable, SampleLengths]:
        """The split's samples (read from the shard indexes, O(24 bytes) each) and their planned lengths."""
        if split in self._splits:
            return self._splits[split]
        shards, _ = self._sources()
        hp = self.hparams
        since, since_shards = dict(self.error_log.counts), self.error_log.shard_snapshot()
        indexes = self._shard_indexes(split)
        scans: list[ShardIndex] = []
        for position, index in enumerate(indexes):
            index.replay(self.error_log)  # (the skips its build counted; under on_error="raise" the first raises)
            indexes[position] = drop_too_large(index, self.hparams.max_image_pixels, self.error_log)
            scan = index.scan()
            self._check_image_keys(split, scan, self._index_settings().image_keys)
            scans.append(scan)
        # A damaged shard counts the samples it lost, known from the manifest or estimated from its intact siblings.
        account_damaged_shards(scans, self.error_log, self._known_samples, "the dataset's manifest.json")
        self._count_short_shards(scans)
        if split == "train":
            self._shard_digests = {scan.url: scan.digest for scan in scans}
        table = SampleTable.from_indexes(indexes)
        del indexes  # (their arrays now live in the table)
        skipped = self.error_log.skipped - sum(since[kind] for kind in ERROR_KINDS)
        # (same on every rank)
        self._report(
            f"data ({split}, indexed)",
            skipped,
            len(table) + skipped,
            since,
            since_shards=since_shards,
            kept=table.counts(),
        )
        if not len(table):
            raise ValueError(
                f"{split}_urls: no valid sample in {len(shards[split])} shard(s); error counts: {self.error_log.counts}"
            )
        if split == "train" and self._filters.active:
            kept, counts = self._filters.apply_table(table, *dataclasses.astuple(self._index_settings())[:2])
            self.filter_counts = counts
            message = describe_counts(counts, len(table))
            if message is not None and self._global_rank() == 0:
                _print(f"data ({split}, indexed): {message}")
            if not len(kept):
                raise ValueError(f"filters drop all {len(table)} {split} samples ({counts}); loosen them")
            table = table.subset(kept)
        truncated = int(np.count_nonzero(table.caption_tokens + 2 > hp.max_text_tokens))
        if truncated:
            self.error_log.notice("caption_truncated", truncated)
        lengths = table.lengths(hp.patch_size, hp.max_patches_per_image, hp.max_text_tokens)
        self._splits[split] = (table, lengths)
        return self._splits[split]

    def _count_short_shards(self, indexes: list[ShardIndex]) -> None:
        """An intact shard holding fewer samples than the dataset's manifest.json lists for it (rewritten or replaced
        since) counts the missing ones as skips (``shard_short``), as a damaged shard counts what it lost: the run
        would otherwise train on less data than the dataset says it has without a word."""
        for index in indexes:
            expected = self._known_samples.get(index.url)
            if index.damage is None and expected is not None and index.samples < expected:
                detail = f"holds {index.samples} sample(s) where the dataset's manifest.json lists {expected}"
                self.error_log.error("shard_short", index.url, None, detail, samples=expected - index.samples)

    def _check_image_keys(self, split: str, index: ShardIndex, image_keys: tuple[str, ...]) -> None:
        """Fail on a shard whose samples hold no file under ``image_keys`` (``require_images``): every shard is
        checked, since a dataset can change key from one shard to the next (a later shard under another key would
        train on text alone). Samples under another key in a shard that also holds listed ones are counted skips
        (``image_key_mismatch``), shown per shard in the summary."""
        if not self.hparams.require_images or not index.samples or index.with_image:
            return
        extensions = sorted(index.extensions)
        raise ValueError(
            f"image_keys={list(image_keys)} match no file of the {index.samples} samples of the {split} shard "
            f"{index.url!r}, whose samples hold {extensions}: the run would train on text alone. Set image_keys to "
            "the image extension(s) of every shard, or require_images=False for a text-only dataset"
        )

    def _caption_chars(self) -> int:
        """Characters of a caption worth tokenizing: ``max_text_tokens`` tokens cover at most that many times the
        longest token of the vocabulary (a byte-level token may cover less than a character, never more than its own
        length), so a caption is cut well beyond (twice, and 1024 more) before tokenizing. Only a caption that long
        is cut, and only tokens past ``max_text_tokens`` (cut anyway) can change; without the cut a multi-MB caption
        cost ~275 bytes of memory per character in the tokenizer, every epoch."""
        if self._caption_limit is None:
            longest = max((len(token) for token in self.tokenizer.tokenizer.get_vocab()), default=1)
            self._caption_limit = 2 * self.hparams.max_text_tokens * max(longest, 1) + 1024
        return self._caption_limit

    def _global_rank(self) -> int:
        return self.trainer.global_rank if self.trainer is not None else 0

    def teardown(self, stage: str) -> None:
        # A fit that stopped inside an epoch (max_steps, early stopping) never reached the end of its pass: check what
        # it did train on. (Lightning calls this hook after a fit that ended without an exception, on every rank.)
        if getattr(stage, "value", stage) == "fit":
            self._close_stopped_pass("train")
        rank = self._global_rank()
        if rank == 0:  # the whole run, indexing and every pass (this rank's decode-time skips)
            _print(self.error_log.summary(f"data (end of {getattr(stage, 'value', stage)})"))

    @staticmethod
    def _digest(value: Any) -> str:
        return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]

    def _fingerprint(self) -> dict[str, Any]:
        """What the saved stream position depends on: the train shards (names and sizes), their content, the plan
        settings and what decoding makes of a sample (:func:`_fingerprint_changes` compares two)."""
        shards, _ = self._sources()
        versions = shard_versions(shards["train"])
        listing = [
            [posixpath.basename(u), v["size"] if v else -1] for u, v in zip(shards["train"], versions, strict=True)
        ]
        # The position counts global batches of this plan, whatever the number of data-parallel ranks.
        plan = self.regroup_config()
        self._index("train")  # (the content digests are taken while indexing: no extra pass over the shards)
        digests = [self._shard_digests.get(u, "") for u in shards["train"]]
        return {
            "shards": self._digest(listing),
            "plan": self._digest(plan),
            "plan_config": plan,
            # One digest over every shard's (decode.ShardIndex.digest), and a short one per shard to name a change.
            "content": self._digest(digests),
            "shard_content": [[posixpath.basename(u), d[:16]] for u, d in zip(shards["train"], digests, strict=True)],
            "decode": self._decode_settings(),
        }

    def _decode_settings(self) -> dict[str, Any]:
        """What turns a record into a sample besides the plan: the tokenizer (a digest of its whole definition) and
        the decode and key settings."""
        hp = self.hparams
        return {
            "tokenizer": self.tokenizer.digest,
            "image_keys": list(hp.image_keys or IMAGE_KEYS),
            "text_keys": list(hp.text_keys or TEXT_KEYS),
            "max_image_pixels": hp.max_image_pixels,
            "require_images": hp.require_images,
        }

    @property
    def tokenizer(self) -> TextTokenizer:
        if self._tokenizer is None:
            self._tokenizer = TextTokenizer(self._sources()[1])
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Vocabulary size of the tokenizer (the model's embedding table must be this large)."""
        return self.tokenizer.vocab_size

    def prepare_data(self) -> None:
        # Generates the embedded dataset if needed (once per node; ensure_synthetic_shards is race-safe), then builds
        # the shard indexes that are missing or stale, once per node (Lightning calls this on local rank 0 and holds
        # the node's other ranks at a barrier until it returns; the writes are atomic, so nodes sharing a file system
        # may build the same index at once).
        shards, _ = self._sources()
        for split in shards:
            self._shard_indexes(split)

    # ------------------------------------------------------------------------------------ loaders

    def _data_parallel_rank_and_size(self) -> tuple[int, int]:
        return data_parallel_rank_and_size(self.trainer)

    def _current_epoch(self) -> int:
        return self.trainer.current_epoch if self.trainer is not None else 0

    def _loader(self, split: str, shuffle: bool, epoch_fn) -> EpochAwareLoader:
        table, lengths = self._index(split)
        rank, world = self._data_parallel_rank_and_size()
        hp = self.hparams
        config = SplitConfig.from_settings(
            self.regroup_config(),
            cost=self.cost_coefficients,
            on_error=hp.on_error,
            max_image_pixels=hp.max_image_pixels,
            caption_chars=self._caption_chars(),
        )
        if split == "val":  # (every pair scored once, at full resolution)
            config = config.for_validation(hp.val_batch_size if hp.regroup == "none" else None)
        dataset = _PlannedSplit(table, lengths, self.tokenizer, config, shuffle, rank, world)
        if split == "train":
            # Lightning asks the loader's length before iterating it (and, unless it reloads the loader every epoch,
            # only once): the length must be that of the epoch the loader is made for, and a resumed epoch dealt to
            # another number of ranks has another one (the consumed batches plus this run's share of the rest).
            dataset.set_epoch(*self._train_position())
            self._check_epoch_lengths(len(dataset), dataset.skip)
        if len(dataset.plan(dataset.epoch).batches) == 0:
            raise ValueError(
                f"{split}: {len(table)} samples give no batch for each of {world} data-parallel "
                f"rank(s); lower batch_size / the budgets, or use fewer ranks"
            )

        def start(_epoch_fn=epoch_fn):
            self._start_pass(split)
            state = _epoch_fn()
            epoch = state[0] if isinstance(state, tuple) else state
            self._passes[split]["epoch"] = epoch  # (what the trainer's counter says changes when a fit stops)
            if split == "train":
                dataset.set_epoch(*state)  # (the loader sets it again after this returns: the same plan)
                self._check_resumed_length(len(dataset))
                if self.hparams.curriculum and self._global_rank() == 0 and epoch != self._curriculum_printed:
                    self._curriculum_printed = epoch  # (Lightning may start a pass's iterator twice)
                    _print(dataset.schedule.describe_curriculum(epoch))
            return state

        hooks = {
            "num_workers": self.hparams.num_workers,
            "on_batch": lambda batch: self._count_batch(split, batch, dataset),
            "on_exhausted": lambda: self._end_pass(split, dataset),
        }
        if split == "train":  # (Lightning's stateful-loader protocol: it knows the position is restored)
            return ResumableEpochAwareLoader(dataset, start, (self.state_dict, self.load_state_dict), **hooks)
        return EpochAwareLoader(dataset, start, **hooks)

    def _check_resumed_length(self, length: int) -> None:
        """Refuse a resumed epoch longer than the loader length Lightning counts with.

        Lightning reads the loader's length when it builds the loader, and under ``max_epochs`` that can be before the
        checkpoint is restored (``EpochAwareLoader``'s docstring). An epoch resumed on another number of data-parallel
        ranks has another length (the consumed batches plus this run's share of the rest); ``HybridParallelStrategy``
        rebuilds such a loader after the restore, other strategies keep the early length, which cuts a longer epoch
        short without a word.
        """
        trainer = self.trainer
        if self._resume is None or getattr(trainer, "limit_train_batches", None) != 1.0:
            return  # (no resume, no Trainer, or the user caps the epoch's batches on purpose)
        counted = trainer.num_training_batches
        if counted < length:
            raise RuntimeError(
                f"resuming epoch {self._resume['epoch']}: this run's share of it is {length} batches, but Lightning "
                f"counts {counted} (it read the loader's length before restoring the checkpoint, which was saved on "
                f"{self._resume_world} data-parallel ranks, not {self._data_parallel_rank_and_size()[1]}), so the "
                "epoch's last batches would be skipped. Resume on as many ranks, use HybridParallelStrategy "
                "(it rebuilds the loader after the restore), or train by max_steps"
            )

    def _train_position(self) -> tuple[int, int, int | None, int | None, int, int | None]:
        """``dataset.set_epoch`` arguments of the training epoch now: the epoch, this rank's batches consumed before a
        checkpoint of it, the global batches consumed, their data-parallel size (None, None without a resume), and
        the training steps before the epoch. Reads only: Lightning also builds the loader before the loops are
        restored (to estimate the stepping batches), when the current epoch is not yet the checkpoint's. The last:
        the data-parallel size the epoch was first planned with (None: this run's)."""
        epoch = self._current_epoch()
        if self._resume is None or self._resume["epoch"] != epoch:
            # (a new epoch: every step so far was before it; on resume, the checkpoint's count of them)
            counted = self._batches_lightning_counts_done()
            if counted:  # positions Lightning believes done: skipped, nothing of the plan consumed
                return epoch, counted, 0, None, self._steps_done, None
            return epoch, 0, None, None, self._steps_done, None
        resume = self._resume
        return (
            epoch,
            resume["batches"],
            resume["global_batches"],
            self._resume_world,
            resume["start_step"],
            resume["plan_world"],
        )

    def _batches_lightning_counts_done(self) -> int:
        """Batches of the epoch starting now that Lightning's restored loop already counts as done.

        Zero, except after a resume from a checkpoint saved at the last training batch of an epoch (e.g. by
        ``ModelCheckpoint(every_n_train_steps=...)`` on an epoch boundary): Lightning then starts the next epoch but
        keeps the restored batch count, unless it is at least the *new* loader's length (``_TrainingEpochLoop.reset``,
        https://github.com/Lightning-AI/pytorch-lightning/blob/2.6.0/src/lightning/pytorch/loops/training_epoch_loop.py
        ), which assumes every epoch is as long as the last. A longer next epoch would then train only the
        difference, silently. The loader counts that many positions as done (never loaded) instead, so the whole plan
        follows them. Read from Lightning's loop state: there is no public hook for it.
        """
        loop = getattr(getattr(self.trainer, "fit_loop", None), "epoch_loop", None)
        if loop is None or not getattr(loop, "restarting", False):
            return 0
        return int(loop.batch_progress.current.ready)

    def _train_epoch_and_skip(self) -> tuple[int, int, int | None, int | None, int, int | None]:
        """Epoch to plan and batches to skip, asked each time the train loader is iterated.

        Idempotent within an epoch (Lightning may create the iterator more than once before the first
        batch): the resume point holds until a later epoch starts.
        """
        position = self._train_position()
        epoch, skip, done, _, start_step, plan_world = position
        self._restored_from = None  # (a later fit restoring the same checkpoint must apply it again)
        if done is None:
            self._resume = None
        self._consumed = {
            "epoch": epoch,
            "batches": skip,
            "global_batches": done or 0,
            "start_step": start_step,
            "plan_world": plan_world or self._data_parallel_rank_and_size()[1],
        }
        return position

    def _check_epoch_lengths(self, length: int, done: int) -> None:
        """Refuse a run whose later epochs Lightning would cut short.

        Lightning reads a training loader's length once, when it builds the loader, and ends every epoch after that
        many batches (``fit_loop.max_batches``) unless ``Trainer(reload_dataloaders_every_n_epochs=1)`` rebuilds
        the loader each epoch. Here the batch count changes from epoch to epoch (``bucket`` / ``pack`` regroup a
        new shuffle; ``carry_remainder`` adds the carried samples; a ``curriculum`` changes the pairs per batch), so
        a longer later epoch would lose its last batches without a word. ``length``: the loader's batches for this
        epoch, ``done``: the first ones of them counted as done before this run (a resume).
        """
        trainer, hp = self.trainer, self.hparams
        reload = getattr(trainer, "reload_dataloaders_every_n_epochs", 1)
        # (fixed-size batches keep their count, unless samples are carried or the epoch resumes on another number
        # of ranks: its length is then the consumed batches plus this run's share of the rest)
        resumed_elsewhere = self._resume is not None and self._resume_world != self._data_parallel_rank_and_size()[1]
        if reload == 1 or not (hp.regroup != "none" or hp.carry_remainder or resumed_elsewhere):
            return
        max_epochs, max_steps = getattr(trainer, "max_epochs", 1), getattr(trainer, "max_steps", -1)
        accumulate = getattr(trainer, "accumulate_grad_batches", 1)
        if max_epochs == 1 or 0 <= max_steps * accumulate <= length - done:
            return  # (the run ends within this epoch)
        raise ValueError(
            f"ImageTextWebDataModule(regroup={hp.regroup!r}"
            + (", carry_remainder=True" if hp.carry_remainder else "")
            + f"): the number of training batches changes between epochs (this one has {length}), but Lightning "
            f"reads a loader's length once and cuts every later epoch to it unless the loader is rebuilt each "
            f"epoch: set Trainer(reload_dataloaders_every_n_epochs=1) (it is {reload}; `lightning-mm fit` sets 1), "
            f"or end the run within one epoch (max_epochs=1)"
        )

    def train_dataloader(self) -> EpochAwareLoader:
        return self._loader("train", shuffle=True, epoch_fn=self._train_epoch_and_skip)

    def val_dataloader(self) -> EpochAwareLoader:
        return self._loader("val", shuffle=False, epoch_fn=lambda: (0, 0))

    def test_dataloader(self) -> EpochAwareLoader:
        return self.val_dataloader()

    # ------------------------------------------------------------------------------------ state

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # (error counts were merged when the batch was fetched: EpochAwareLoader's on_batch)
        if self.trainer is not None and self.trainer.training:
            self._consumed["batches"] += 1  # this rank's (Lightning's count)
            self._steps_done += 1
            self._consumed["global_batches"] += self._data_parallel_rank_and_size()[1]  # one per data-parallel rank
            self.last_step_balance = getattr(batch, "step_balance", None)
        return batch

    def state_dict(self) -> dict[str, Any]:
        """Where the training stream stands: the epoch, the batches this rank consumed (Lightning's count) and the
        *global* batches consumed (all data-parallel ranks, so a resume on another number of ranks continues the
        epoch's global batch list), plus the bad-input counts."""
        return {
            "epoch": self._consumed["epoch"],
            "batches": self._consumed["batches"],
            "global_batches": self._consumed["global_batches"],
            "epoch_start_step": self._consumed["start_step"],
            "epoch_plan_world": self._consumed["plan_world"] or self._data_parallel_rank_and_size()[1],
            "steps": self._steps_done,
            "data_parallel_size": self._data_parallel_rank_and_size()[1],
            "seed": self.hparams.seed,
            "errors": dict(self.error_log.counts),
            "fingerprint": self._fingerprint(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the training stream's position (and bad-input counts) from a checkpoint.

        Idempotent: Lightning restores it through the DataModule and, when it builds the train loader after the
        restore, again through the loader (``ResumableEpochAwareLoader``), from the same checkpoint.
        """
        if self._restored_from is not None and state_dict == self._restored_from:
            return
        self._restored_from = copy.deepcopy(state_dict)
        if state_dict.get("seed", self.hparams.seed) != self.hparams.seed:
            raise ValueError(
                f"seed: the checkpoint's data stream used seed {state_dict['seed']}, this DataModule "
                f"{self.hparams.seed}; resuming would not replay the same batches"
            )
        batches = int(state_dict["batches"])
        saved = state_dict.get("fingerprint")
        # Checkpoints from before the global count: this rank's batches times the number of ranks they were dealt to.
        saved_world = state_dict.get("data_parallel_size") or (saved or {}).get("plan_config", {}).get(
            "data_parallel_size", self._data_parallel_rank_and_size()[1]
        )
        done = int(state_dict.get("global_batches", batches * int(saved_world)))
        # (checkpoints from before the step count: the epoch's own batches; only a step curriculum reads it)
        start_step = int(state_dict.get("epoch_start_step", 0))
        self._resume = {
            "epoch": int(state_dict["epoch"]),
            "batches": batches,
            "global_batches": done,
            "start_step": start_step,
            # the size the epoch was first planned with (a step curriculum's mapping), kept over later resumes
            "plan_world": int(state_dict.get("epoch_plan_world", saved_world)),
        }
        self._steps_done = int(state_dict.get("steps", start_step + batches))
        self._resume_world = int(saved_world)  # the ranks the consumed batches were dealt to (balance=True)
        if saved is not None:
            reasons = _fingerprint_changes(saved, self._fingerprint())
            if reasons:
                if not self.hparams.allow_replan:
                    raise ValueError(
                        f"resuming the data stream: {'; '.join(reasons)}, so the saved position "
                        f"({self._resume['batches']} batches into epoch {self._resume['epoch']}) counts batches of "
                        "another plan. Use the same shards and settings, or allow_replan=True to restart that "
                        "epoch with the new plan (its samples seen before the checkpoint are then seen again)"
                    )
                log.warning(
                    "resuming with a new data plan (%s): epoch %d restarts from its first batch",
                    "; ".join(reasons),
                    self._resume["epoch"],
                )
                # The epoch restarts with the new plan, by this run's ranks. Lightning still counts the batches it
                # restored as done: the loader counts that many positions as done too (never loaded), so the whole
                # new plan follows them.
                self._resume["global_batches"] = 0
                self._resume["plan_world"] = None
                self._resume["start_step"] = self._steps_done  # (the restarted epoch's steps come after those done)
        self.error_log.counts = dict.fromkeys(self.error_log.counts, 0)
        self.error_log.merge(state_dict.get("errors", {}))
