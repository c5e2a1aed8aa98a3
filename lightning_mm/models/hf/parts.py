"""The parts of a Hugging Face causal LM or vision-language model a fine-tune freezes: the vision tower, the
projector that maps its features into the decoder's embedding space, and the decoder (with its embeddings and LM
head). Found by the attribute names transformers gives them (LLaVA: ``vision_tower`` / ``multi_modal_projector``;
Qwen-VL: ``visual`` with its ``merger`` inside; Idefics3 / SmolVLM: ``vision_model`` / ``connector``)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

__all__ = ["PARTS", "freeze_parts", "model_parts"]

PARTS = ("vision", "projector", "decoder")
_VISION_TOWERS = ("vision_tower", "visual", "vision_model")
_PROJECTORS = ("multi_modal_projector", "merger", "connector", "mm_projector", "deepstack_merger_list")


def _named(model: nn.Module, names: Sequence[str]) -> list[nn.Module]:
    """The modules whose own attribute name is one of ``names``, outermost first (one inside another is left out:
    it is part of it)."""
    found: list[tuple[str, nn.Module]] = []
    for fqn, module in model.named_modules():
        if fqn.rpartition(".")[2] in names and not any(fqn.startswith(f"{outer}.") for outer, _ in found):
            found.append((fqn, module))
    return [module for _, module in found]


def model_parts(lm: nn.Module) -> dict[str, list[nn.Parameter]]:
    """``{part: its parameters}`` for the parts ``lm`` has (a text model: ``decoder`` only). The vision tower's
    parameters exclude the projector's where the projector sits inside it (Qwen-VL's ``visual.merger``)."""
    decoder = lm.get_decoder()
    parts = {"decoder": [*decoder.parameters(), *lm.get_output_embeddings().parameters()]}
    projectors, towers = _named(lm, _PROJECTORS), _named(lm, _VISION_TOWERS)
    if projectors:  # (Qwen3-VL: visual.merger and the deepstack mergers)
        parts["projector"] = [param for projector in projectors for param in projector.parameters()]
    if towers:
        inside = {id(param) for param in parts.get("projector", [])}
        parts["vision"] = [param for param in towers[0].parameters() if id(param) not in inside]
    return parts


def freeze_parts(lm: nn.Module, freeze: Sequence[str]) -> None:
    """Stop the gradients of the named parts of ``lm`` (``requires_grad=False``: they stay as loaded and are left out
    of the optimizer). An unknown part, or one the model does not have, is refused naming those it has."""
    parts = model_parts(lm)
    adapter_ids = {id(param) for fqn, param in lm.named_parameters() if "lora_" in fqn}  # (peft's adapter names)
    for name in freeze:
        if name not in PARTS:
            raise ValueError(f"freeze={list(freeze)}: {name!r} is not a part; the parts are {list(PARTS)}")
        if name not in parts:
            raise ValueError(f"freeze={list(freeze)}: {type(lm).__name__} has no {name} (its parts: {sorted(parts)})")
        adapters = [param for param in parts[name] if id(param) in adapter_ids]
        if adapters:
            raise ValueError(
                f"freeze={list(freeze)}: the {name} holds LoRA adapters ({len(adapters)} tensors), which would not "
                "train either; LoRA keeps the base weights frozen already: leave the part out of freeze, or the "
                "adapters' modules out of lora target_modules"
            )
        for param in parts[name]:
            param.requires_grad_(False)
    if not any(param.requires_grad for param in lm.parameters()):
        raise ValueError(f"freeze={list(freeze)} leaves nothing of {type(lm).__name__} to train")
