"""The networks of a run: the policy (float32 trainable masters, LoRA or full) and its frozen reference.

GRPO needs two views of the same network: the policy being trained, and a frozen reference policy for
the KL penalty. With LoRA the reference is free: the base weights never change, so turning the adapters
off (``reference_context``) gives the reference exactly and no copy is made. With full fine-tuning the
reference is a frozen deep copy made once before training (``make_reference_model``).
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from forge.logging.logger import note
from forge.model.loading import load_model, prepare_tokenizer, tokenizer_of
from forge.model.lora import apply_lora, is_peft_model
from forge.model.precision import Precision, as_master_weights, choose_precision

# --------------------------------------------------------------------------------------------------
# reference policy
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def reference_context(model: nn.Module, reference_model: nn.Module | None = None) -> Iterator[nn.Module]:
    """Run the reference policy: ``with reference_context(policy, ref) as reference: reference(**batch)``.

    With LoRA (``model`` is a PeftModel and no ``reference_model``) the adapters are switched off for
    the duration, which is exactly the frozen base model; no copy is made. With full fine-tuning pass
    the frozen copy from ``make_reference_model`` as ``reference_model``. Gradients are off inside:
    reference log-probs are constants in the GRPO loss.
    """
    with torch.no_grad():
        if reference_model is not None:
            yield reference_model
        elif is_peft_model(model):
            with model.disable_adapter():
                yield model
        else:
            raise ValueError(
                "a fully fine-tuned model is not its own reference; build one before training with "
                "make_reference_model(model) and pass it as reference_model=, or use LoRA (apply_lora)"
            )


def make_reference_model(model: nn.Module) -> nn.Module:
    """A frozen deep copy of ``model`` for full fine-tuning (doubles the weight memory; LoRA needs no
    copy)."""
    reference = copy.deepcopy(model)
    reference.eval()
    reference.requires_grad_(False)
    return reference


# --------------------------------------------------------------------------------------------------
# the policy of a run
# --------------------------------------------------------------------------------------------------


@dataclass
class Policy:
    """The networks of a run, ready to train: `model` (float32 trainable weights), its tokenizer, the frozen
    reference (None under LoRA, where it is the adapter-disabled model, or when kl_beta == 0)."""

    model: nn.Module
    tokenizer: PreTrainedTokenizerBase
    reference: nn.Module | None
    is_lora: bool
    precision: Precision
    trainable: list[nn.Parameter]  # the parameters the optimizer steps (after sharding: the sharded ones)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def prepare_policy(model, tokenizer, config, *, device: torch.device | None = None,
                   seed=lambda seed: torch.manual_seed(seed), sync=lambda params: None,
                   announce: bool = True, shard=None, peft_config=None) -> Policy:
    """What GRPOTrainer does to the model it is given (a model object, or a name `load_model` understands):
    choose the precision, load, prepare the tokenizer (a model object's own checkpoint's when none is given,
    as in TRL), add LoRA (its random init seeded by `seed(config.seed)`), make the trainable weights float32
    masters, move to `device`, `sync(trainable parameters)` (every process starts from the same weights),
    enable checkpointing, build the reference; `announce` logs the precision.
    `shard` (FSDP2, forge/parallel/sharding.py): shards the model and the reference over the processes, which
    also puts each rank's shards on its device, instead of moving the whole model there. `peft_config`: a peft
    LoraConfig that apply_lora hands to peft as it is (config's lora_* fields are then its record)."""
    named = isinstance(model, (str, os.PathLike))
    precision = choose_precision(config.dtype, device or (None if named else next(model.parameters()).device))
    if named:  # LoRA: the frozen base in the compute dtype; full fine-tuning: fp32 master weights
        model, tokenizer = load_model(str(model),
                                      dtype=precision.compute if config.use_lora else torch.float32)
    tokenizer = prepare_tokenizer(tokenizer_of(model) if tokenizer is None else tokenizer)
    if config.use_lora or is_peft_model(model):
        seed(config.seed)  # the adapters' random init is part of the seeded run
        model = apply_lora(model, r=config.lora_r, alpha=config.lora_alpha, dropout=config.lora_dropout,
                           target_modules=config.lora_target_modules, peft_config=peft_config)
    lora = is_peft_model(model)
    model = as_master_weights(model, precision, lora=lora)
    if device is not None and shard is None:
        model = model.to(device)  # several processes on GPUs: one GPU per rank
    sync([p for p in model.parameters() if p.requires_grad])
    reference = None  # LoRA: the same weights with adapters off. Full: a frozen copy, only if needed.
    if config.kl_beta > 0 and not lora:
        reference = make_reference_model(model).to(precision.compute)
    if shard is not None:
        model, reference = shard(model), reference if reference is None else shard(reference)
    if announce:
        compute = str(precision.compute).removeprefix("torch.")
        note(f"precision: {compute} compute, float32 master weights ({precision.reason})" if precision.mixed
             else f"precision: float32 ({precision.reason})")
        if lora and precision.mixed:
            note(f"LoRA inputs: {precision.lora_inputs_reason}")
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("the model has no trainable parameters (all requires_grad=False)")
    return Policy(model, tokenizer, reference, lora, precision, trainable)


