"""LoRA adapters (peft): default targets per architecture and applying them. Folding them into the weights for
no-grad passes (`merged_adapters`) is the sampling weights' business: forge/model/decode_plan.py."""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator

from torch import nn

LORA_INSTALL_HINT = "LoRA needs peft: pip install forge-rl[lora]"

# LoRA targets by architecture, checked in order: the first set whose names all occur in the model wins.
# Attention projections only, the usual choice for RL fine-tuning of small models.
_LORA_TARGET_CANDIDATES: list[tuple[str, list[str]]] = [
    ("llama / mistral / qwen / gemma", ["q_proj", "k_proj", "v_proj", "o_proj"]),
    ("phi-3 (fused qkv)", ["qkv_proj", "o_proj"]),
    ("phi-2", ["q_proj", "k_proj", "v_proj", "dense"]),
    ("gpt-2", ["c_attn", "c_proj"]),
    ("gpt-neox / falcon", ["query_key_value", "dense"]),
]


# --------------------------------------------------------------------------------------------------
# LoRA
# --------------------------------------------------------------------------------------------------


def is_peft_model(model: nn.Module) -> bool:
    """True for a peft ``PeftModel`` (False when peft is not installed)."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def default_lora_targets(model: nn.Module) -> list[str]:
    """Module names to put LoRA adapters on, decided from the names present in ``model``.

    Known architectures get their attention projections; anything else gets every linear layer
    except the output head.
    """
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    for _architecture, targets in _LORA_TARGET_CANDIDATES:
        if set(targets) <= present:
            return list(targets)
    linear_names = {
        name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, nn.Linear)
    }
    linear_names.discard("lm_head")
    if not linear_names:
        raise ValueError(
            f"found no linear layers to adapt in {type(model).__name__}; pass target_modules=[...] explicitly"
        )
    return sorted(linear_names)


@contextlib.contextmanager
def quiet_checkpointing_deprecation() -> Iterator[None]:
    """Hide the FutureWarning of transformers' deprecated `is_gradient_checkpointing` property, which peft
    reads when it wraps a model (every LoRA run would print it); other warnings pass."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                                category=FutureWarning)
        yield


_REFERENCE_KEEPING_INITS = (True, False, "gaussian")  # inits that leave the base weights as they are


def lora_fields(peft_config) -> dict:
    """GRPOConfig's LoRA fields as a peft `LoraConfig` sets them: the run's record of its adapters (apply_lora
    hands the LoraConfig itself to peft). Refuses, naming the field, what would make the adapter-disabled
    model, Forge's reference policy, differ from the model training started from: trained biases and inits
    that rewrite the base weights (PiSSA, OLoRA, LoftQ, ...); and other PEFT methods than LoRA."""
    try:
        from peft import LoraConfig
    except ImportError as error:
        raise ImportError(LORA_INSTALL_HINT) from error
    if not isinstance(peft_config, LoraConfig):
        raise TypeError(f"peft_config is a {type(peft_config).__name__}: Forge trains LoRA adapters; give a "
                        f"peft.LoraConfig (use_dora=True for DoRA)")
    if peft_config.bias != "none":
        raise TypeError(f"peft_config.bias={peft_config.bias!r}: Forge's reference policy is the model with "
                        f"its adapters off, which would keep the trained biases; use bias='none'")
    if peft_config.init_lora_weights not in _REFERENCE_KEEPING_INITS:
        raise TypeError(f"peft_config.init_lora_weights={peft_config.init_lora_weights!r} rewrites the base "
                        f"weights, so the adapter-disabled model (Forge's reference policy) would not be the "
                        f"initial model; use True (the default) or 'gaussian'")
    targets = peft_config.target_modules
    return {"use_lora": True, "lora_r": peft_config.r, "lora_alpha": peft_config.lora_alpha,
            "lora_dropout": peft_config.lora_dropout,
            "lora_target_modules": sorted(targets) if isinstance(targets, (set, list, tuple)) else targets}


def apply_lora(
    model: nn.Module,
    r: int = 16,
    alpha: int = 32,
    dropout: float = 0.0,
    target_modules: list[str] | str | None = None,
    peft_config=None,
) -> nn.Module:
    """Wrap ``model`` in LoRA adapters; only the adapter weights (and a LoraConfig's modules_to_save) stay
    trainable. A peft ``LoraConfig`` given as ``peft_config`` goes to peft as it is (a copy; task_type
    CAUSAL_LM when unset), so its target_modules ("all-linear", a regex, a list), layers_to_transform,
    modules_to_save, use_rslora and use_dora mean what they mean in peft; without one, the LoRA of r, alpha,
    dropout and target_modules (None: the attention projections, `default_lora_targets`). A PeftModel is
    returned as is."""
    try:
        from peft import LoraConfig, TaskType, get_peft_model
    except ImportError as error:
        raise ImportError(LORA_INSTALL_HINT) from error
    if is_peft_model(model):
        if peft_config is not None:
            raise TypeError("the model already has adapters (a PeftModel); pass peft_config with the base "
                            "model")
        return model
    if peft_config is not None:
        lora_fields(peft_config)  # refuses what Forge cannot train
        lora_config = copy.deepcopy(peft_config)
        lora_config.task_type = lora_config.task_type or TaskType.CAUSAL_LM
    else:
        lora_config = LoraConfig(task_type=TaskType.CAUSAL_LM, r=r, lora_alpha=alpha, lora_dropout=dropout,
                                 target_modules=target_modules or default_lora_targets(model))
    with quiet_checkpointing_deprecation():
        return get_peft_model(model, lora_config)
