"""The KV cache: `transformers`' own cache interface, its storage allocated once per request, and the one
operation MEDUSA adds to it.

`DynamicCache` appends with `torch.cat`, copying every layer's whole cache at every step (on a 2-core CPU,
11 of a 48 ms SmolLM2 step at a 256-token context, growing with the context). Here each layer's keys and
values are views of buffers sized to the request, so a step writes only its own tokens. After a verification
pass the cache holds the prefix followed by every tree node; `commit` keeps the accepted path's entries, moved
to sit right after the prefix, and drops the rest.
"""

import torch
from transformers import Cache, PreTrainedModel
from transformers.cache_utils import DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """A DynamicLayer whose `keys`/`values` are views of buffers of `capacity` positions, written in place."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states, value_states: [B, kv_heads, T, head_dim] -> all keys and values so far [B, kv_heads, S, head_dim]
        if not self.is_initialized:
            self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
            self.key_buffer = key_states.new_empty(*key_states.shape[:-2], self.capacity, key_states.shape[-1])
            self.value_buffer = value_states.new_empty(*value_states.shape[:-2], self.capacity, value_states.shape[-1])
            self.keys, self.values = self.key_buffer[..., :0, :], self.value_buffer[..., :0, :]
        start = self.keys.shape[-2]
        end = start + key_states.shape[-2]
        assert end <= self.capacity, f"KV cache: {end} positions, {self.capacity} allocated"  # decode sizes it
        self.key_buffer[..., start:end, :] = key_states
        self.value_buffer[..., start:end, :] = value_states
        self.keys, self.values = self.key_buffer[..., :end, :], self.value_buffer[..., :end, :]
        return self.keys, self.values


def allocate(model: PreTrainedModel, capacity: int) -> Cache:
    """An empty cache for one request of at most `capacity` positions (prompt + new tokens + one tree)."""
    num_layers = model.config.get_text_config().num_hidden_layers
    return Cache(layers=[PreallocatedLayer(capacity) for _ in range(num_layers)])


def commit(cache: Cache, prefix_len: int, path: torch.Tensor) -> None:
    """Keep tree nodes `path` (node indices, root first) after the first `prefix_len` entries."""
    # path: [A] increasing node indices; entries of node i sit at prefix_len + i, so a path's leading 0, 1, 2, ...
    # are in place already and only the rest move (a plain step's [0] moves nothing)
    moved = next((i for i, node in enumerate(path.tolist()) if node != i), len(path))
    keep = prefix_len + path[moved:]
    start, end = prefix_len + moved, prefix_len + len(path)
    for layer in cache.layers:
        for name in ("keys", "values"):
            kv = getattr(layer, name)  # [B, heads, S, head_dim]
            if start < end:
                kv[..., start:end, :] = kv[..., keep, :]
            setattr(layer, name, kv[..., :end, :])
