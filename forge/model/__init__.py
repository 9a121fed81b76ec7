"""The model side room: loading, precision, LoRA, the reference policy, export (the names
of these modules)."""

from forge.logging.logger import note
from forge.model.decode_plan import merged_adapters
from forge.model.export import load_for_eval, merge_and_export
from forge.model.loading import (
    DEFAULT_MODEL,
    count_parameters,
    default_cache_dir,
    load_model,
    packaged_gguf_file,
    packaged_model_path,
    prepare_tokenizer,
)
from forge.model.lora import (
    LORA_INSTALL_HINT,
    apply_lora,
    default_lora_targets,
    is_peft_model,
)
from forge.model.policy import Policy, make_reference_model, prepare_policy, reference_context
from forge.model.precision import (
    Precision,
    as_master_weights,
    choose_precision,
    cpu_has_bf16_units,
    cpu_name,
    lora_inputs_uncast,
    resolve_device,
    resolve_dtype,
)

__all__ = [
    "DEFAULT_MODEL",
    "LORA_INSTALL_HINT",
    "Policy",
    "Precision",
    "apply_lora",
    "as_master_weights",
    "choose_precision",
    "count_parameters",
    "cpu_has_bf16_units",
    "cpu_name",
    "default_cache_dir",
    "default_lora_targets",
    "is_peft_model",
    "load_for_eval",
    "load_model",
    "lora_inputs_uncast",
    "make_reference_model",
    "merge_and_export",
    "merged_adapters",
    "note",
    "packaged_gguf_file",
    "packaged_model_path",
    "prepare_policy",
    "prepare_tokenizer",
    "reference_context",
    "resolve_device",
    "resolve_dtype",
]
