"""A key/value cache for batched decoding that is allocated once and written in place.

transformers' DynamicLayer.update concatenates, which copies a layer's whole cache at every decode step; here
the cache of a generation is sized for prompt + max_new_tokens up front, so a step writes one column. Also the
one place that speaks transformers' cache argument by the name this version knows.
"""

from __future__ import annotations

import inspect

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
            if self.length + new > self.key_buffer.shape[-2]:
                raise RuntimeError(f"preallocated cache of {self.key_buffer.shape[-2]} positions is full")
            self.key_buffer[:, :, self.length:self.length + new] = key_states
            self.value_buffer[:, :, self.length:self.length + new] = value_states
            self.length += new
            self._expose()
            return self.keys, self.values

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


def grow(cache, needed: int) -> None:
    """Give preallocated cache layers room for `needed` positions (fed result tokens were not in the plan)."""
    for layer in getattr(cache, "layers", []):
        buffer = getattr(layer, "key_buffer", None)
        if buffer is None or buffer.shape[-2] >= needed:
            continue
        capacity = max(needed, buffer.shape[-2] + 64)
        for name in ("key_buffer", "value_buffer"):
            old = getattr(layer, name)
            new = old.new_empty(*old.shape[:-2], capacity, old.shape[-1])
            new[:, :, :layer.length] = old[:, :, :layer.length]
            setattr(layer, name, new)
        layer._expose()
