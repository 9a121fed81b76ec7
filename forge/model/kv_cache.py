"""The key/value caches of Forge's decode: written in place, and holding each group's prompt once.

- `PreallocatedLayer` (`preallocated`): transformers' DynamicLayer.update concatenates, which copies a layer's
  whole cache at every decode step; here the cache of a generation is sized for prompt + max_new_tokens up
  front, so a step writes one column.
- `SharedPrefixLayer` (`shared`, `attending`): the completions of a group share their prompt, so after the
  prefill the cache holds the prompt's keys/values once per prompt, (P, H_kv, Lp, D), and each completion's
  own keys/values in a preallocated buffer, (N, H_kv, T, D). A decode step's query of row n (group g = n //
  group_size) attends to the concatenation [prompt of g | own tokens of n]: the scores of both segments go
  through one softmax, as over the concatenated keys, and the output is the sum of the two segments' weighted
  values. The prompt segment is one matrix product per prompt for all its rows (the rows' queries stacked as
  the product's rows), so its keys are read once per step instead of once per row; the own segment is one
  batched product per row, as before. Scores and softmax are computed in fp32 over fp32 copies of the
  keys/values (bf16 values held exactly), as the CPU's fused attention kernel does internally, and the output
  is returned in the query's dtype: the same values as scaled_dot_product_attention over the repeated cache up
  to summation order (tests/units/test_shared_prefix.py). While `attending(configs, cache)` is active the
  model's attention implementation is "forge_shared_prefix", whose function finds its layer's prompt through
  the active cache; it is registered with transformers' AttentionInterface. The decode plan
  (forge/model/decode_plan.py) uses it when a group's prompt is shared, no tool results are fed, and the
  model's attention is plain full attention (`shared_attention_configs`).

Also the one place that speaks transformers' cache argument by the name this version knows (`CACHE_ARG`).
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections.abc import Iterator

import torch
from transformers import LlamaForCausalLM

# transformers 5 renamed the `past_key_values` argument to `cache`; speak whichever this version knows.
CACHE_ARG = ("cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters
             else "past_key_values")


# The last position as an index (logits_to_keep) for generation: the model gathers it into a contiguous
# (n, 1, C) input of the output layer. logits_to_keep=1 slices a strided view, which torch.matmul cannot fold
# into one matrix product: it copies the transposed output weight once per row instead (0.55 s for the demo's
# 4 prompts on a CPU, 60x the product itself). The same logits in bf16; in fp32 the one product and the
# per-row ones can differ in the last bit.
LAST_POSITION = torch.tensor([-1])


def returned_cache(output):
    cache = getattr(output, "cache", None)
    return output.past_key_values if cache is None else cache


try:
    from transformers.cache_utils import DynamicLayer
except ImportError:  # transformers < 4.56 keeps per-layer lists instead of layer objects
    DynamicLayer = None

if DynamicLayer is not None:

    class PreallocatedLayer(DynamicLayer):
        """A DynamicLayer whose keys/values live in a buffer sized for the whole generation.

        DynamicLayer.update concatenates, which copies the layer's entire cache at every decode step: for a
        500-token prompt that copy, not the model, was ~20% of generation time on CPU. Here a step writes
        its new column in place and the layer exposes views of the filled part: the same values, so the
        same attention results.
        """

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int, repeats: int = 1):
            super().__init__()
            batch, heads, length, dim = keys.shape
            # (n * repeats, H, capacity, D)
            self.key_buffer = keys.new_empty(batch * repeats, heads, capacity, dim)
            self.value_buffer = values.new_empty(batch * repeats, heads, capacity, values.shape[-1])
            # each row `repeats` times
            for buffer, filled in ((self.key_buffer, keys), (self.value_buffer, values)):
                buffer.view(batch, repeats, *buffer.shape[1:])[:, :, :, :length] = filled[:, None]
            self.length = length
            self.device, self.is_initialized = keys.device, True
            self._expose()

        def _expose(self) -> None:
            self.keys = self.key_buffer[:, :, :self.length]  # (n, H, length, D) views
            self.values = self.value_buffer[:, :, :self.length]

        def update(self, key_states, value_states, *args, **kwargs):
            new = key_states.shape[-2]
            if self.length + new > self.key_buffer.shape[-2]:  # fed tool results were not in the plan
                self._grow(self.length + new)
            self.key_buffer[:, :, self.length:self.length + new] = key_states
            self.value_buffer[:, :, self.length:self.length + new] = value_states
            self.length += new
            self._expose()
            return self.keys, self.values

        def _grow(self, needed: int) -> None:
            """Room for `needed` positions, and 64 more: the filled part moves into larger buffers."""
            capacity = max(needed, self.key_buffer.shape[-2] + 64)
            for name in ("key_buffer", "value_buffer"):
                old = getattr(self, name)
                new = old.new_empty(*old.shape[:-2], capacity, old.shape[-1])
                new[:, :, :self.length] = old[:, :, :self.length]
                setattr(self, name, new)

        def batch_repeat_interleave(self, repeats: int) -> None:
            self.key_buffer = self.key_buffer.repeat_interleave(repeats, dim=0)
            self.value_buffer = self.value_buffer.repeat_interleave(repeats, dim=0)
            self._expose()

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            # Rows leave the decode batch at many steps of a generation: the kept rows' filled positions move
            # into new buffers (index_select copies whole rows; indexing, buffer[indices], copies element by
            # element, ~3x slower on a CPU); the positions not yet written are not copied
            for name in ("key_buffer", "value_buffer"):
                old = getattr(self, name)
                new = old.new_empty(len(indices), *old.shape[1:])  # (n', H, capacity, D)
                torch.index_select(old[:, :, :self.length], 0, indices, out=new[:, :, :self.length])
                setattr(self, name, new)
            self._expose()


else:
    PreallocatedLayer = None


def preallocated(cache, capacity: int, repeats: int = 1):
    """Move a filled DynamicCache into buffers of `capacity` positions (see PreallocatedLayer), each row
    repeated `repeats` times in place (batch_repeat_interleave). Caches of other kinds (sliding windows, older
    transformers) are only repeated."""
    layers = getattr(cache, "layers", None)
    if DynamicLayer is None or not layers or any(type(layer) is not DynamicLayer or not layer.is_initialized
                                                 for layer in layers):
        if repeats > 1:
            cache.batch_repeat_interleave(repeats)
        return cache
    cache.layers = [PreallocatedLayer(layer.keys, layer.values, capacity, repeats) for layer in layers]
    return cache


# ----------------------------------------------------------------------------------------------------
# Each group's prompt once: the cache layer and the attention that reads it

try:
    from transformers import AttentionInterface
except ImportError:  # older transformers: no attention registry; the decode repeats prompts
    AttentionInterface = None

NAME = "forge_shared_prefix"
_active: contextvars.ContextVar = contextvars.ContextVar("forge_shared_prefix_cache", default=None)


class SharedPrefixLayer(DynamicLayer or object):
    """One layer's cache: the prompt once per group, each row's own keys/values after it.

    prompt_keys (P, H_kv, Lp, D) and prompt_bias (P, 1, 1, Lp) (0 on real prompt tokens, -inf on left padding)
    stay as they are for the whole generation; `own` (a PreallocatedLayer, fp32) holds
    each row's own keys/values, (N, H_kv, capacity, D), written one column per step; rows (n,) is the original
    row of each row still decoding (its group: rows // group_size).
    """

    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        prompt_mask: torch.Tensor,
        group_size: int,
        capacity: int,
    ):
        super().__init__()
        prompts, heads, length, dim = keys.shape
        self.prompt_keys = keys.float()  # (P, H_kv, Lp, D)
        self.prompt_values = values.float()  # (P, H_kv, Lp, Dv)
        self.prompt_bias = torch.zeros(prompts, 1, 1, length, device=keys.device)  # (P, 1, 1, Lp)
        self.prompt_bias.masked_fill_(~prompt_mask.bool().to(keys.device)[:, None, None, :], float("-inf"))
        rows = prompts * group_size
        # (N, H_kv, capacity, D): each row's own tokens, written in place
        self.own = PreallocatedLayer(self.prompt_keys.new_empty(rows, heads, 0, dim),
                                     self.prompt_values.new_empty(rows, heads, 0, values.shape[-1]),
                                     capacity)
        self.rows = torch.arange(rows, device=keys.device)  # (n,)
        self.group_size, self.prompt_length = group_size, length
        self.dtype = keys.dtype
        self.device, self.is_initialized = keys.device, True
        self.keys, self.values = self.own.keys, self.own.values  # (n, H_kv, t, D) views

    def update(self, key_states, value_states, *args, **kwargs):
        """Write the step's column (n, H_kv, 1, D) after the own tokens; return the own keys/values so far."""
        self.keys, self.values = self.own.update(key_states, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.prompt_length + self.own.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.prompt_length + self.own.length + query_length, 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.own.batch_select_indices(indices)
        self.keys, self.values = self.own.keys, self.own.values
        self.rows = self.rows[indices]

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("a shared-prefix cache holds its groups already")

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """query (n, H, 1, D) of the rows decoding -> (n, 1, H, Dv): attention over [own prompt | own
        tokens]. The prompt segment runs per prompt, its G rows' queries stacked (`_by_prompt`)."""
        n, heads, _, dim = query.shape
        kv_heads, length = self.prompt_keys.shape[1], self.prompt_length
        q = query.float().reshape(n, kv_heads, heads // kv_heads, dim)  # (n, H_kv, R, D)
        own = torch.matmul(q, self.keys.transpose(-1, -2)) * scaling  # (n, H_kv, R, t)
        prompt = torch.matmul(self._by_prompt(q), self.prompt_keys.transpose(-1, -2)) * scaling
        prompt = self._by_row(prompt + self.prompt_bias)  # (n, H_kv, R, Lp)
        weights = torch.softmax(torch.cat([prompt, own], dim=-1), dim=-1)  # (n, H_kv, R, Lp + t)
        from_prompt = torch.matmul(self._by_prompt(weights[..., :length]), self.prompt_values)
        out = torch.matmul(weights[..., length:], self.values) + self._by_row(from_prompt)  # (n, H_kv, R, Dv)
        return out.reshape(n, heads, -1).to(query.dtype)[:, None]  # (n, 1, H, Dv)

    def _by_prompt(self, rows: torch.Tensor) -> torch.Tensor:
        """(n, H_kv, R, X) per decoding row -> (P, H_kv, G R, X): each prompt's G rows stacked as one matrix's
        rows (a finished row's slot holds zeros)."""
        prompts, group = self.prompt_keys.shape[0], self.group_size
        _, kv_heads, per_kv, width = rows.shape
        if len(self.rows) != prompts * group:
            rows = rows.new_zeros(prompts * group, kv_heads, per_kv, width).index_copy_(0, self.rows, rows)
        grouped = rows.view(prompts, group, kv_heads, per_kv, width).transpose(1, 2)
        return grouped.reshape(prompts, kv_heads, group * per_kv, width)

    def _by_row(self, stacked: torch.Tensor) -> torch.Tensor:
        """(P, H_kv, G R, X) -> (n, H_kv, R, X) of the rows decoding: `_by_prompt`'s inverse."""
        prompts, kv_heads, _, width = stacked.shape
        group = self.group_size
        per_row = stacked.view(prompts, kv_heads, group, -1, width).transpose(1, 2)
        per_row = per_row.reshape(prompts * group, kv_heads, -1, width)  # (N, H_kv, R, X)
        return per_row if len(self.rows) == prompts * group else per_row.index_select(0, self.rows)


def _attention(
    module, query, key, value, attention_mask, scaling: float | None = None, dropout: float = 0.0, **kwargs
):
    """transformers' attention-function signature: the active cache's layer attends for a one-token query."""
    cache = _active.get()
    if cache is None or query.shape[2] != 1:
        raise RuntimeError(f"attention implementation {NAME!r} is for Forge's decode steps only")
    if any(kwargs.get(name) is not None for name in ("softcap", "sliding_window", "s_aux", "sinks")):
        raise RuntimeError(
            f"{type(module).__name__} attends with {sorted(k for k in kwargs if kwargs[k] is not None)}, "
            "which the shared-prompt decode does not implement; generate with share_prompt_prefix=False"
        )
    scaling = module.scaling if scaling is None else scaling
    with torch.autocast(query.device.type, enabled=False):
        return cache.layers[module.layer_idx].attend(query, scaling), None


if AttentionInterface is not None:
    AttentionInterface.register(NAME, _attention)


def shared_attention_configs(model) -> tuple:
    """The configs the model's attention modules read their implementation from (one object for most
    models), where its decode can attend over a shared prompt: sdpa or eager full attention, no logit
    soft-capping, every attention module knowing its layer; () where it cannot."""
    configs = {
        id(m.config): m.config
        for m in model.modules()
        if hasattr(m, "layer_idx") and hasattr(m, "scaling") and hasattr(m, "config")
    }
    if AttentionInterface is None or not configs or any(
        getattr(c, "_attn_implementation", None) not in ("sdpa", "eager")
        or getattr(c, "attn_logit_softcapping", None)
        for c in configs.values()
    ):
        return ()
    return tuple(configs.values())


def holds_full_attention(cache) -> bool:
    """Whether a prefilled cache is DynamicLayers of full attention (a sliding window has its own layer
    type)."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is DynamicLayer and layer.is_initialized for layer in layers)


def shared(cache, prompt_mask: torch.Tensor, group_size: int, capacity: int):
    """The prefilled cache of P prompts as SharedPrefixLayers for P * group_size rows with `capacity` new
    tokens; None, the cache unchanged, where it is not full attention in every layer."""
    if not holds_full_attention(cache):
        return None
    cache.layers = [
        SharedPrefixLayer(layer.keys, layer.values, prompt_mask, group_size, capacity)
        for layer in cache.layers
    ]
    return cache


@contextlib.contextmanager
def attending(configs: tuple, cache) -> Iterator[None]:
    """While inside, the attention of the model whose `shared_attention_configs` these are reads `cache`'s
    shared prompts (the configs name NAME)."""
    before = [c._attn_implementation for c in configs]
    token = _active.set(cache)
    for config in configs:
        config._attn_implementation = NAME
    try:
        yield
    finally:
        for config, implementation in zip(configs, before):
            config._attn_implementation = implementation
        _active.reset(token)
