"""How generation runs on one model: the decode loop's one seam, `DecodePlan`.

Generation (forge/core/rollout.py `generate` and its loop, `decode`) asks the plan for three things and reads
nothing else:

- `plan.sampling_weights(model)`: the weights and precision the loop runs with: a trainer's autocast, LoRA
  folded into the weights (`merged_adapters`, below), linear layers packed once per generation where that
  measured faster (forge/model/packed_linear.py);
- `plan.prefill(model, prompt_ids, prompt_mask, group_size, max_new_tokens)`: the prompts run through the
  model (once per group, and a chat template every prompt starts with once for all), giving the first
  next-token logits and the decode step;
- `step(tokens (n,), mask (n, L), positions (n,)) -> next-token logits (n, V)` once per token, and
  `step.keep(rows)` when completions finish and leave the batch.

What the plan decides once, when a trainer is built (or a `generate` call is given none), under the autocast
generation runs in: the decode step, `generation_backend`:

- `eager`: the model's forward over Forge's cache written in place (forge/model/kv_cache.py), the reference
  path; where the model's attention allows it, the cache holds each group's prompt once and a step's attention
  reads it once for all the group's rows (kv_cache.SharedPrefixLayer); SDPA with grouped heads gets a 4D mask.
- `compiled`: transformers' StaticCache, whose shapes never change, and one `torch.compile`d forward per
  (batch, capacity) bucket: the batch rounded up to a power of two (rows that finished stay in their slot
  until the live rows fit half the bucket, then the cache is compacted), the capacity
  (prompt + max_new_tokens) up to a multiple of 64, so a run compiles at most log2(rows) + 1 times per
  capacity. On a CPU inductor emits C++ kernels; on CUDA the same code is captured in CUDA graphs
  (mode="reduce-overhead"). Every step attends over the whole capacity (masked), which costs more than the
  eager step's filled length.
- `auto`: whichever measured faster on this kind of device and dtype (GENERATION_BACKEND_MEASURED); eager
  where nothing was measured. The choice and its reason are logged once.

The compiled step differs from the eager one by floating-point summation order only (the same weights, the
same masked attention), so greedy tokens agree but for near-ties (tests/units/test_decode_plan.py). The
plain reading of generation needs none of this room: forge/nano.py decodes with the model's own cache.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from forge.logging.logger import note
from forge.model.kv_cache import (
    CACHE_ARG,
    LAST_POSITION,
    SharedPrefixLayer,
    attending,
    preallocated,
    returned_cache,
    shared,
    shared_attention_configs,
)
from forge.model.packed_linear import may_pack, packed_linears
from forge.model.precision import Precision, _bf16_units

BACKENDS = ("eager", "compiled", "auto")
LENGTH_BUCKET = 64

# What measured faster, per (device type, compute dtype, what runs bf16 on a CPU or "GPU"): (backend, the
# measurement). bench/compiled_decode.py measures a new kind; unmeasured kinds decode eagerly.
GENERATION_BACKEND_MEASURED: dict[tuple[str, torch.dtype, str], tuple[str, str]] = {
    ("cpu", torch.bfloat16, "AMX tiles"): ("eager", (
        "compiled static-cache step 1.42x the time of the eager step on packed weights (SmolLM2-135M, "
        "32 rows, AMX Xeon; bench/compiled_decode.py)")),
    ("cpu", torch.bfloat16, "AVX512-BF16"): ("eager", (
        "compiled static-cache step 3.4x the time of the eager step on packed weights (SmolLM2-135M, "
        "32 rows, AVX512-BF16 AMD EPYC; bench/compiled_decode.py)")),
    ("cpu", torch.float32, "no bf16 units"): ("eager", (
        "compiled static-cache step 1.65x the time of the eager step in fp32 (SmolLM2-135M, 32 rows, "
        "AVX2-only AMD EPYC; bench/compiled_decode.py)")),
}
_announced: set[tuple[str, torch.dtype, str]] = set()


def resolve_backend(backend: str, device_type: str) -> str:
    """'eager' or 'compiled'; 'auto' from GENERATION_BACKEND_MEASURED for this device, its kind and the
    autocast dtype."""
    if backend not in BACKENDS:
        raise ValueError(f"generation_backend={backend!r}; use one of {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else torch.float32
    kind = (device_type, dtype, _bf16_units() if device_type == "cpu" else "GPU")
    chosen, why = GENERATION_BACKEND_MEASURED.get(kind, ("eager", (
        f"a compiled decode is not measured on {device_type} {str(dtype).removeprefix('torch.')}"
        f"{' with ' + kind[2] if device_type == 'cpu' else ''}; bench/compiled_decode.py measures it")))
    if kind not in _announced:
        _announced.add(kind)
        note(f"generation_backend auto: {chosen} ({why})")
    return chosen


@dataclass(frozen=True)
class DecodePlan:
    """How generation runs on one model, decided once (by the trainer when it is built, or by each `generate`
    call not given a plan) under the autocast generation runs in: what the decode loop then only reads."""

    backend: str = "eager"  # the decode step: "eager" or "compiled" ("auto" resolved, resolve_backend)
    pack: bool = False  # linear layers on weights packed once per generation (forge/model/packed_linear.py)
    shared_prompt: tuple = ()  # the attention configs a decode over each group's prompt once switches (the
    # model's attention allows it, forge/model/kv_cache.py); () = each row's own copy of its prompt
    grouped_mask: bool = False  # the repeated-prompt step passes a 4D mask (_sdpa_with_grouped_heads)
    mixed: Precision | None = None  # a trainer's mixed precision: sampling runs in its autocast
    # the LoRA layers whose adapters sampling folds into their weights (merge_lora: lora_to_fold); () = none
    lora_layers: tuple = field(default=(), repr=False)

    @classmethod
    def of(cls, model, backend: str = "auto", with_tools: bool = False, precision: Precision | None = None,
           merge_lora: bool = False) -> DecodePlan:
        """The plan for `model`; with tools (results are fed between tokens) the eager repeated-prompt
        step. A trainer gives its precision and whether sampling merges LoRA (merge_lora_for_generation)."""
        backend = "auto" if backend == "vllm" else backend  # a run sampling on vLLM elsewhere (async GRPO)
        backend = "eager" if with_tools else resolve_backend(backend, next(model.parameters()).device.type)
        eager = backend == "eager"
        shared = shared_attention_configs(model) if eager and not with_tools else ()
        mixed = precision if precision is not None and precision.mixed else None
        return cls(backend, eager and may_pack(model), shared, _sdpa_with_grouped_heads(model), mixed,
                   lora_to_fold(model) if merge_lora else ())

    @contextlib.contextmanager
    def sampling_weights(self, model) -> Iterator[None]:
        """The weights and precision the decode runs with: the trainer's autocast (mixed precision), LoRA
        folded into the weights (lora_layers), linear layers packed for the generation (pack); each only where
        the plan says, else the model as it is."""
        with self.mixed.autocast(model) if self.mixed else contextlib.nullcontext(), \
                folded_lora(model, self.lora_layers), \
                packed_linears(model) if self.pack else contextlib.nullcontext():
            yield

    def prefill(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_size: int,
                max_new_tokens: int, share_prompt_prefix: bool = True):
        """Prefill P prompts (P, Lp) for P * group_size completions: (the decode step, next-token logits
        (N, V), the attention mask (N, Lp)). The prompt runs once and its cache serves its group
        (share_prompt_prefix), or runs once per completion."""
        cache, next_logits, mask = prefill_groups(model, prompt_ids, prompt_mask, group_size,
                                                  share_prompt_prefix, max_new_tokens,
                                                  attend_shared=bool(self.shared_prompt))
        return self.decode_step(model, cache), next_logits, mask

    def decode_step(self, model, cache) -> EagerStep | StaticDecoder:
        """The step over a prefilled cache: the compiled one where the plan says so and the cache is Forge's
        preallocated one (only it says its capacity), else the eager one."""
        layers = getattr(cache, "layers", None)
        if self.backend == "eager" or not layers or not all(hasattr(layer, "key_buffer") for layer in layers):
            return EagerStep(model, cache, self)
        return StaticDecoder(model, cache)


class EagerStep:
    """The eager decode step: the model's forward over the prefilled cache, one token per live row."""

    def __init__(self, model, cache, plan: DecodePlan):
        self.model, self.cache = model, cache
        self.shared_prompt = plan.shared_prompt if is_shared(cache) else ()
        self.as_4d = not self.shared_prompt and plan.grouped_mask

    def keep(self, rows: torch.Tensor) -> None:
        """Keep the live rows `rows` (indices into the current live rows)."""
        self.cache.batch_select_indices(rows)

    def __call__(self, tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens (n,), mask (n, L), positions (n,) of the live rows -> their next-token logits (n, V)."""
        # a cache that holds each group's prompt once is read by its own attention
        with attending(self.shared_prompt, self.cache) if self.shared_prompt else contextlib.nullcontext():
            out = self.model(input_ids=tokens[:, None],
                             attention_mask=mask[:, None, None].bool() if self.as_4d else mask,
                             position_ids=positions[:, None], use_cache=True, **{CACHE_ARG: self.cache})
        return out.logits[:, -1]  # (n, V)


def is_shared(cache) -> bool:
    """Whether a prefilled cache holds each group's prompt once (kv_cache.SharedPrefixLayer)."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and isinstance(layers[0], SharedPrefixLayer)


# ----------------------------------------------------------------------------------------------------
# The weights for sampling: LoRA folded in

_MERGEABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _mergeable_lora_layers(model: nn.Module) -> list | None:
    """The LoRA linear layers of a PeftModel when every one can be merged by adding B @ A * scale to a weight
    of its own (plain LoRA on nn.Linear, no DoRA, no modules_to_save, weight used by no other module) and its
    adapters are on; None otherwise (adapters switched off, by the caller's `disable_adapter()` or an
    enclosing merge, leave nothing to merge)."""
    try:
        from peft import PeftModel
        from peft.tuners.lora import LoraLayer
        from peft.tuners.lora.layer import Linear as LoraLinear
    except ImportError:  # no peft: no adapters
        return None
    if not isinstance(model, PeftModel):
        return None

    adapted = [m for m in model.modules() if isinstance(m, LoraLayer)]
    if any(p.requires_grad and ".lora_A." not in n and ".lora_B." not in n
           for n, p in model.named_parameters()):
        return None  # modules_to_save and the like: switching the adapters off would switch them off too
    users: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            users[id(p)] = users.get(id(p), 0) + 1
    for m in adapted:
        weight = getattr(m.get_base_layer(), "weight", None)
        if (type(m) is not LoraLinear or type(m.get_base_layer()) is not nn.Linear or m.merged
                or m.fan_in_fan_out or m.disable_adapters
                or any(m.use_dora.get(a, False) for a in m.active_adapters) or users.get(id(weight), 0) != 1
                or type(weight.data) is not torch.Tensor  # DTensor (FSDP2), quantised
                or weight.is_meta  # offloaded
                or weight.dtype not in _MERGEABLE_DTYPES):
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


def _merged_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype a merged weight is stored in: the one its matmul runs in (autocast's when on, else the
    weight's)."""
    device_type = weight.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


@contextlib.contextmanager
def merged_adapters(model: nn.Module, enabled: bool = True, rounded: bool = False) -> Iterator[bool]:
    """Run a LoRA model with its adapters folded into a temporary copy of each adapted weight (no-grad use
    only: generation, evaluation). Yields whether it merged.

    A LoRA layer computes W x + s B A x, three matmuls where one would do. Inside, each adapted weight is
    replaced by W + s B A (a new tensor, the sum formed in fp32) and the adapters are switched off; on exit
    the original tensors are put back, so the trained weights are bit for bit what they were. Skipped (yields
    False) when the copy does not fit on the GPU, for models that are not plain LoRA on linear layers (DoRA,
    quantised or FSDP2-sharded weights, a weight shared by two modules), and when the adapters are off. Under
    bf16/fp16 autocast the merged weight would be rounded once to that dtype, which widens the sampler/trainer
    log-prob gap: only evaluation asks for that (`rounded=True`); training's sampling keeps the adapter path
    there. Measurements: docs/performance.md, "LoRA generation with merged weights".
    """
    layers = _mergeable_lora_layers(model) if enabled else None
    dtype = _merged_dtype(layers[0].get_base_layer().weight) if layers else torch.float32
    with folded_lora(model, layers if rounded or dtype == torch.float32 else (), dtype) as merged:
        yield merged


def lora_to_fold(model: nn.Module) -> tuple:
    """The LoRA layers a trainer's sampling folds into their weights, found once when its decode plan is built
    (under the autocast sampling runs in): every adapted layer of a model merged_adapters can merge, where the
    merged weight is not rounded (its matmul runs in fp32); () otherwise."""
    layers = _mergeable_lora_layers(model)
    if not layers or _merged_dtype(layers[0].get_base_layer().weight) != torch.float32:
        return ()
    return tuple(layers)


@contextlib.contextmanager
def folded_lora(model: nn.Module, layers: Sequence, dtype: torch.dtype = torch.float32) -> Iterator[bool]:
    """These LoRA layers' adapters folded into a temporary copy of each one's weight, stored in `dtype` (the
    one its matmul runs in, _merged_dtype: fp32 for a decode plan's lora_layers) (merged_adapters: which
    layers, and how); yields whether it merged: not for no layers, when the copy does not fit on the GPU, or
    when the adapters are off now (a caller's `disable_adapter()`, an enclosing merge)."""
    if not layers or any(m.merged or m.disable_adapters for m in layers) or not _room_for(layers):
        yield False
        return
    originals = [m.get_base_layer().weight.data for m in layers]
    try:
        # the sum in fp32 even under autocast (which would run addmm in bf16), rounded once at the end
        with torch.no_grad(), torch.autocast(originals[0].device.type, enabled=False):
            for m, weight in zip(layers, originals):
                merged = weight.float()
                for a in (a for a in m.active_adapters if a in m.lora_A):  # W + s B A in one op per adapter
                    merged = torch.addmm(merged, m.lora_B[a].weight.float(), m.lora_A[a].weight.float(),
                                         alpha=m.scaling[a])
                m.get_base_layer().weight.data = merged.to(dtype)  # (out, in), a new tensor
        with model.disable_adapter():
            yield True
    finally:
        for m, weight in zip(layers, originals):
            m.get_base_layer().weight.data = weight


# ----------------------------------------------------------------------------------------------------
# The prefill: prompts through the model once per group, a shared template once for all

MIN_SHARED_PREFIX = 8  # below this many tokens, a separate prefix pass costs more than it saves


def padded_positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that skip left padding: (n, L) -> (n, L)."""
    return (mask.cumsum(dim=1) - 1).clamp(min=0)


def prefill(model, ids: torch.Tensor, mask: torch.Tensor, share_template: bool = True,
            last_position: int | torch.Tensor = 1):
    """Run prompts (n, L) through the model; return (cache, logits of the last position (n, V)).
    last_position: the model's logits_to_keep; generation passes LAST_POSITION, the loss pass the slice (1).

    Leading columns that are the same real token in every row (a chat template every prompt starts with) are
    computed once and their cache expanded to all rows; gradients, when enabled, flow back through the
    expansion. That takes a second forward only for some batches; share_template=False always runs one (a
    sharded model needs the same number of forwards on every rank).
    """
    same = (ids == ids[:1]).all(dim=0) & mask.bool().all(dim=0)  # (L,)
    template = int(same.long().cumprod(0).sum()) if ids.shape[0] > 1 else 0
    template = min(template, ids.shape[1] - 1)
    if template < MIN_SHARED_PREFIX or not share_template:
        out = model(input_ids=ids, attention_mask=mask, position_ids=padded_positions(mask), use_cache=True,
                    logits_to_keep=last_position)
        return returned_cache(out), out.logits[:, -1]
    prefix = model(input_ids=ids[:1, :template], attention_mask=mask[:1, :template], use_cache=True,
                   logits_to_keep=last_position)
    cache = returned_cache(prefix)
    cache.batch_repeat_interleave(ids.shape[0])
    out = model(input_ids=ids[:, template:], attention_mask=mask,
                position_ids=padded_positions(mask)[:, template:], use_cache=True,
                logits_to_keep=last_position, **{CACHE_ARG: cache})
    return returned_cache(out), out.logits[:, -1]


def prefill_groups(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_size: int,
                   share_prompt_prefix: bool, max_new_tokens: int, attend_shared: bool = False):
    """Prefill P prompts (P, Lp) for P * group_size completions, ready to decode: the prompt runs once and its
    cache is expanded to the group (share_prompt_prefix), or runs once per completion. attend_shared (the
    model's attention allows it, DecodePlan.shared_prompt): keep the prompt's cache once per group, for decode
    steps that attend over it (forge/model/kv_cache.py SharedPrefixLayer).
    Returns (a cache with room for max_new_tokens more, next-token logits (N, V), the attention mask
    (N, Lp))."""
    device = next(model.parameters()).device
    ids, mask = prompt_ids.to(device), prompt_mask.to(device)  # (P, Lp)
    if not share_prompt_prefix:
        ids, mask = ids.repeat_interleave(group_size, 0), mask.repeat_interleave(group_size, 0)  # (N, Lp)
    cache, next_logits = prefill(model, ids, mask, last_position=LAST_POSITION)  # (P or N, V)
    if not share_prompt_prefix:
        return preallocated(cache, mask.shape[1] + max_new_tokens), next_logits, mask  # the cache: N rows
    next_logits = next_logits.repeat_interleave(group_size, 0)  # (N, V)
    rows_mask = mask.repeat_interleave(group_size, 0)  # (N, Lp)
    # the prompt P rows, the rest N
    if attend_shared and (once := shared(cache, mask, group_size, max_new_tokens)) is not None:
        return once, next_logits, rows_mask
    return preallocated(cache, mask.shape[1] + max_new_tokens, group_size), next_logits, rows_mask  # N rows


# ----------------------------------------------------------------------------------------------------
# The compiled step over a static cache


def _sdpa_with_grouped_heads(model) -> bool:
    """Whether the model's decode attention is SDPA with fewer key/value heads than query heads. Its mask then
    goes in as (n, 1, 1, L): from a 2D mask without padding transformers drops the mask, and SDPA without a
    mask runs grouped heads with enable_gqa, which on a CPU took 6.4x the time of the same attention with the
    query heads packed per key head (5.4 ms against 0.84 ms per layer of SmolLM2-135M, 32 rows, 200
    positions)."""
    config = getattr(model, "config", None)
    heads, kv_heads = (getattr(config, "num_attention_heads", None),
                       getattr(config, "num_key_value_heads", None))
    return (getattr(config, "_attn_implementation", None) == "sdpa" and bool(heads) and bool(kv_heads)
            and kv_heads < heads)


def _bucket(rows: int) -> int:
    return 1 << max(rows - 1, 0).bit_length()  # the next power of two


# tensors only: an int would recompile each step
def _forward(model, cache, ids, mask, positions, cache_position):
    return model(input_ids=ids, attention_mask=mask, position_ids=positions, cache_position=cache_position,
                 use_cache=True, **{CACHE_ARG: cache}).logits[:, -1]


_compiled: dict[str, Callable] = {}
# static caches by (model, rows, capacity, dtype): a new object would recompile
_pool: dict[tuple, object] = {}


def _static_cache(model, batch: int, capacity: int, keys: torch.Tensor, values: torch.Tensor):
    """A StaticCache of `batch` rows and `capacity` positions for this model, reused across generations."""
    from transformers import StaticCache

    key = (id(model), batch, capacity, keys.dtype, keys.device)
    if key not in _pool:
        cache = StaticCache(config=model.config, max_cache_len=capacity)
        for layer in cache.layers:
            layer.lazy_initialization(keys.new_empty(batch, keys.shape[1], 1, keys.shape[-1]),
                                      values.new_empty(batch, values.shape[1], 1, values.shape[-1]))
        _pool[key] = cache
    return _pool[key]


def _compiled_forward(device_type: str) -> Callable:
    if device_type not in _compiled:
        # one compile per (batch, capacity) bucket and model: allow that many specialisations
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        _compiled[device_type] = torch.compile(_forward, dynamic=False,
                                               mode="reduce-overhead" if device_type == "cuda" else None)
    return _compiled[device_type]


class StaticDecoder:
    """A static KV cache of (bucket rows, capacity) filled from a prefilled Forge cache, and the compiled
    step."""

    def __init__(self, model, cache):
        layers = cache.layers
        rows, filled = layers[0].keys.shape[0], layers[0].keys.shape[-2]
        capacity = getattr(layers[0], "key_buffer", layers[0].keys).shape[-2]
        self.model, self.capacity = model, math.ceil(capacity / LENGTH_BUCKET) * LENGTH_BUCKET
        self.device = layers[0].keys.device
        self.forward = _compiled_forward(self.device.type)
        self.slots = torch.arange(rows, device=self.device)  # the static row of each live row
        self.filled = filled
        self._fill([(layer.keys, layer.values) for layer in layers], _bucket(rows))

    def _fill(self, contents: list[tuple[torch.Tensor, torch.Tensor]], batch: int) -> None:
        """Put each layer's (rows, H, >= filled, D) keys/values in the static buffers of `batch` rows."""
        self.static = _static_cache(self.model, batch, self.capacity, *contents[0])
        for layer, (keys, values) in zip(self.static.layers, contents):
            layer.keys[:keys.shape[0], :, :self.filled] = keys[:, :, :self.filled]
            layer.values[:values.shape[0], :, :self.filled] = values[:, :, :self.filled]
            layer.cumulative_length.fill_(self.filled)
        self.batch = batch
        self.mask = torch.zeros(batch, self.capacity, dtype=torch.long, device=self.device)  # (B, C)
        self.mask[:, 0] = 1  # rows without a live completion attend somewhere (their outputs are dropped)
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=self.device)  # (B, 1)
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device=self.device)  # (B, 1)

    def keep(self, rows: torch.Tensor) -> None:
        """Keep the live rows `rows` (indices into the current live rows); compact when they fit half the
        bucket."""
        self.slots = self.slots[rows.to(self.device)]
        if self.batch > 1 and len(self.slots) <= self.batch // 2:
            contents = [(layer.keys[self.slots], layer.values[self.slots]) for layer in self.static.layers]
            old_mask = self.mask[self.slots]
            self._fill(contents, _bucket(len(self.slots)))
            self.mask[:len(old_mask)] = old_mask
            self.slots = torch.arange(len(old_mask), device=self.device)

    def __call__(self, tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens (n,), mask (n, L), positions (n,) of the live rows -> their next-token logits (n, V)."""
        length = mask.shape[1]
        if length > self.capacity:
            raise RuntimeError(f"static decode cache of {self.capacity} positions is full")
        self.mask[self.slots, :length] = mask
        self.mask[:, length - 1] = 1
        self.ids[self.slots, 0] = tokens
        self.positions[self.slots, 0] = positions
        cache_position = torch.tensor([length - 1], device=self.device)
        self.filled = length
        logits = self.forward(self.model, self.static, self.ids, self.mask, self.positions, cache_position)
        return logits[self.slots]  # (n, V), a copy (CUDA graphs reuse their output buffer)
