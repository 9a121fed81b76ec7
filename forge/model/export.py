"""Trained adapters after the run: merge them into a plain model, or load them for evaluation."""

from __future__ import annotations

import copy
import os
from pathlib import Path

from torch import nn
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from forge.model.loading import load_model, prepare_tokenizer
from forge.model.lora import LORA_INSTALL_HINT, is_peft_model, quiet_checkpointing_deprecation

# --------------------------------------------------------------------------------------------------
# export and evaluation
# --------------------------------------------------------------------------------------------------


def _tokenizer_saved_in(folder: str | os.PathLike) -> bool:
    return (Path(folder) / "tokenizer_config.json").is_file()


def merge_and_export(
    adapter_dir_or_model: str | os.PathLike | nn.Module,
    base_name_or_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> Path:
    """Fold LoRA adapters into the base weights and save a plain model that transformers loads alone.

    ``adapter_dir_or_model`` is a saved adapter folder (loaded on top of ``base_name_or_path``) or a live
    PeftModel (merged in a copy, so the training model keeps its adapters). The tokenizer is taken from
    ``tokenizer=``, else the adapter folder when one was saved there, else the base.
    """
    try:
        from peft import PeftModel
    except ImportError as error:
        raise ImportError(LORA_INSTALL_HINT) from error

    if isinstance(adapter_dir_or_model, nn.Module):
        if not is_peft_model(adapter_dir_or_model):
            raise TypeError("merge_and_export expects a PeftModel or an adapter folder, got a plain model")
        peft_model = copy.deepcopy(adapter_dir_or_model).to("cpu")
    else:
        adapter_dir = Path(adapter_dir_or_model)
        if not (adapter_dir / "adapter_config.json").is_file():
            raise FileNotFoundError(f"{adapter_dir} has no adapter_config.json; is it a saved LoRA adapter?")
        base_model, base_tokenizer = load_model(base_name_or_path, device="cpu")
        with quiet_checkpointing_deprecation():
            peft_model = PeftModel.from_pretrained(base_model, str(adapter_dir))
        if tokenizer is None:
            tokenizer = (
                AutoTokenizer.from_pretrained(str(adapter_dir))
                if _tokenizer_saved_in(adapter_dir)
                else base_tokenizer
            )
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(str(base_name_or_path))

    merged = peft_model.merge_and_unload()
    out_path = Path(out_dir)
    out_path.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(out_path, safe_serialization=True)
    tokenizer.save_pretrained(out_path)
    return out_path


def load_for_eval(
    model: str | os.PathLike | nn.Module,
    adapter: str | os.PathLike | None = None,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    **load_kwargs,
) -> tuple[nn.Module, PreTrainedTokenizerBase]:
    """A model in eval mode plus its tokenizer, with the LoRA ``adapter`` folder applied when given.

    ``model`` is anything ``load_model`` accepts (``load_kwargs`` go to it), or an already loaded model
    together with ``tokenizer=``.
    """
    if isinstance(model, nn.Module):
        if tokenizer is None:
            raise ValueError("load_for_eval got a loaded model without its tokenizer; pass tokenizer=")
        base_model = model
    else:
        base_model, base_tokenizer = load_model(model, **load_kwargs)
        tokenizer = tokenizer or base_tokenizer
    if adapter is not None:
        try:
            from peft import PeftModel
        except ImportError as error:
            raise ImportError(LORA_INSTALL_HINT) from error
        with quiet_checkpointing_deprecation():
            base_model = PeftModel.from_pretrained(base_model, str(adapter))
        if _tokenizer_saved_in(adapter):
            tokenizer = AutoTokenizer.from_pretrained(str(adapter))
    return base_model.eval(), prepare_tokenizer(tokenizer)


