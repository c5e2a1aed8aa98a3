"""The parallel plan of a Hugging Face model held by a user's LightningModule that declares none.

A LightningModule written the usual way (``self.model = LlamaForCausalLM(config)``, its ``training_step`` calling
``self.model(input_ids=..., labels=...)``) gets what :class:`~lightning_mm.models.hf.HFCausalLMModule` gets, from the
model it holds (:func:`held_model_plan`):

* the FSDP2 / activation-checkpointing units (the decoder layers, and a vision tower's layers);
* tensor parallel from the model's own ``base_model_tp_plan``, resolved relative to where the model sits in the
  LightningModule, plus the vocab-sharded embedding and LM head
  (:func:`~lightning_mm.models.hf.parallelize.hf_tp_plan`);
* for ``pipeline_parallel > 1``, when the module defines no ``pipeline_loss`` of its own: the causal LM's pipeline
  units, split by their costs unless ``pipeline_split`` names the starts, with the causal-LM loss (cross entropy
  summed over the microbatch's tokens, divided by the global batch's token count), which is what
  ``self.model(..., labels=...).loss`` on the whole batch computes. Batches are Hugging Face mappings
  (``input_ids`` with optional ``attention_mask`` / ``labels``) or the DataModule's
  (:func:`~lightning_mm.models.hf.parallelize.as_causal_lm_batch`).

Only a module holding one such model is planned. One holding several (a teacher and a student), or a model that is
not a decoder-only causal LM, gets the generic rules, as before (which to shard how is the user's choice:
``tp_plan=``, ``pipeline_split=`` with ``pipeline_loss``); the log says why.
"""

from __future__ import annotations

import logging

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from transformers import PreTrainedModel

from lightning_mm.models.hf.parallelize import causal_lm_parallel_plan, decoder_layout
from lightning_mm.parallel.protocol import ParallelPlan

__all__ = ["held_model_plan", "held_models"]

log = logging.getLogger(__name__)


def held_models(root: nn.Module) -> dict[str, PreTrainedModel]:
    """``{FQN: model}`` of the outermost ``transformers.PreTrainedModel`` instances inside ``root``."""
    found: dict[str, PreTrainedModel] = {}
    for name, module in root.named_modules():
        if isinstance(module, PreTrainedModel) and not any(name.startswith(f"{outer}.") for outer in found):
            found[name] = module
    return found


def held_model_plan(root: nn.Module, *, microbatches: int = 1, sequence_parallel: bool = False) -> ParallelPlan | None:
    """The plan of the one Hugging Face causal LM inside ``root`` (a LightningModule with no ``parallel_plan``), or
    None when it holds none. Raises ``ValueError`` for several, or for one whose decoder lightning-mm does not know
    (naming what to pass instead).

    ``sequence_parallel``: Megatron-style sequence parallelism between the layers' tensor-parallel regions, as
    :class:`~lightning_mm.models.hf.HFCausalLMModule` has it. The logits come back whole (no loss parallel): the
    module's ``training_step`` computes its loss from them as it does on one process."""
    found = held_models(root)
    if not found:
        return None
    if len(found) > 1:
        log.info(
            "%s holds several Hugging Face models (%s): no plan is taken from them (which to shard how is the "
            "user's choice: tp_plan=..., pipeline_split=... with pipeline_loss)",
            type(root).__name__,
            ", ".join(map(repr, found)),
        )
        return None
    ((name, model),) = found.items()  # (inside a peft wrapper: the model it wraps)
    try:
        decoder_layout(root, model)
    except ValueError as error:  # not a decoder-only causal LM: the generic rules, as for any module
        log.info("%s: no plan is taken from the Hugging Face model it holds: %s", type(root).__name__, error)
        return None
    plan = causal_lm_parallel_plan(root, model, microbatches=microbatches, sequence_parallel=sequence_parallel)
    own_loss = callable(getattr(root, "pipeline_loss", None))
    if own_loss:
        # the module's pipeline_loss and pipeline_split cut it as any chain, whatever the decoder family
        plan.pipeline = None
        decoder_checks = plan.check_degrees
        plan.check_degrees = lambda degrees: decoder_checks({**degrees, "pp": 1})
    log.info(
        "%s declares no parallel plan: using the one of the %s at %r (decoder layers as FSDP units, "
        "%s.base_model_tp_plan for tensor parallel)",
        type(root).__name__,
        type(model).__name__,
        name,
        type(model.config).__name__,
    )
    if not own_loss:
        pipelined = plan.check_degrees

        def check_degrees(degrees) -> None:
            pipelined(degrees)
            if degrees["pp"] > 1:
                rank_zero_warn(
                    f"pipeline_parallel={degrees['pp']}: {type(root).__name__} defines no pipeline_loss, so the "
                    f"pipeline trains the {type(model).__name__} at {name!r} on the causal-LM cross entropy over the "
                    "global batch's tokens (what its labels= loss is on the whole batch); its training_step is not "
                    "called. Define pipeline_loss(output, target) for another objective."
                )

        plan.check_degrees = check_degrees
    return plan
