"""The KV cache: `transformers`' own DynamicCache, plus the one operation MEDUSA adds to it.

After a verification pass the cache holds the prefix followed by every tree node; `commit` keeps the
accepted path's entries, moved to sit right after the prefix, and drops the rest.
"""

import torch
from transformers import DynamicCache


def commit(cache: DynamicCache, prefix_len: int, path: torch.Tensor) -> None:
    """Keep tree nodes `path` (node indices, root first) after the first `prefix_len` entries."""
    # path: [A] increasing node indices; entries of node i sit at prefix_len + i
    keep = prefix_len + path
    end = prefix_len + len(path)
    for layer in cache.layers:
        for name in ("keys", "values"):
            kv = getattr(layer, name)  # [B, heads, S, head_dim]
            kv[..., prefix_len:end, :] = kv[..., keep, :]
            setattr(layer, name, kv[..., :end, :])

