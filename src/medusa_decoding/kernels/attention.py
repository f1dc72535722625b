"""The attention functions the kernels register with `transformers` (AttentionInterface), by name:
`grouped_sdpa` (SDPA reading grouped keys and values in place), `grouped_attention` (the compiled engine's on a GPU)
and `invariant_attention` (medusa::attention: a tree node gets bitwise what a one-token pass gives its token).
query: [B, H, T, D]; key, value: [B, H_kv, S, D] -> [B, T, H, D], as `transformers` passes and takes them.
"""

from torch import nn
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from .build import native_ops
from .linears import MAX_ROWS, recorded

GROUPED_SDPA = "grouped_sdpa"
PLAIN_ATTENTION_KWARGS = {"dropout", "scaling", "position_ids", "use_cache", "sliding_window", "cache_position",
                          "output_hidden_states"}  # the last: passed down by models, unread by attention


def grouped_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """`transformers`' SDPA attention, except that a masked pass over several queries with grouped keys and values
    leaves the grouping to SDPA (enable_gqa) instead of copying them per query head. query: [B, H, T, D];
    key, value: [B, H_kv, S, D] -> [B, T, H, D]."""
    grouped = getattr(module, "num_key_value_groups", 1) > 1 and attention_mask is not None and query.shape[2] > 1
    if not grouped or dropout or not kwargs.keys() <= PLAIN_ATTENTION_KWARGS:  # anything else: transformers' own
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                                     enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)  # the prefill's causal mask, built as for sdpa

GROUPED_ATTENTION = "grouped_attention"


def grouped_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """The compiled engine's attention on a GPU: a step's few queries under a float mask as two matmuls, each group
    of query heads side by side against its one key/value head, softmax in float32; the cache is read once, not
    copied per query head (`transformers`' SDPA path repeats every layer's keys and values when a mask is given).
    The prefill and anything else: grouped_sdpa. query: [B, H, T, D]; key, value: [B, H_kv, S, D] -> [B, T, H, D]."""
    mask, (batch, heads, queries, dim), kv_heads = attention_mask, query.shape, key.shape[1]
    step = mask is not None and mask.dtype == query.dtype and mask.dim() == 4 and queries <= MAX_ROWS
    if not step or dropout or not kwargs.keys() <= PLAIN_ATTENTION_KWARGS:
        return grouped_sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    scale = scaling if scaling is not None else dim ** -0.5
    grouped = query.reshape(batch, kv_heads, heads // kv_heads * queries, dim)  # a group's heads are adjacent
    scores = (grouped @ key.transpose(-1, -2)).float().unflatten(2, (heads // kv_heads, queries)) * scale
    weights = (scores + mask[:, :, None].float()).softmax(-1).to(value.dtype).flatten(2, 3)
    return (weights @ value).view(batch, heads, queries, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_ATTENTION, grouped_attention)
AttentionMaskInterface.register(GROUPED_ATTENTION, sdpa_mask)

INVARIANT_ATTENTION = "medusa_attention"


def invariant_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """The attention of native kernels: a MEDUSA step's queries (a float mask, 0 where a key is seen, or one query
    seeing every key) through medusa::attention, whose output for a query depends only on the keys it sees, in
    position order; a tree node then gets bitwise what a one-token pass gives its token, and a row of a batch what
    it gets alone. The prefill (a causal pass over the prompt), a pass autograd records and anything else through
    grouped_sdpa. query: [B, H, T, D]; key, value: [B, H_kv, S, D] -> [B, T, H, D]."""
    mask, (batch, _, queries, _) = attention_mask, query.shape
    step = (mask is None and queries == 1) or (mask is not None and mask.dtype == query.dtype and mask.dim() == 4
                                               and mask.shape[1] == 1 and queries <= MAX_ROWS)
    if not step or dropout or recorded(query, key, value) or not kwargs.keys() <= PLAIN_ATTENTION_KWARGS:
        return grouped_sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    mask = None if mask is None else mask[:, 0].expand(batch, -1, -1)
    return native_ops().attention(query, key, value, mask, scale), None


AttentionInterface.register(INVARIANT_ATTENTION, invariant_attention)
AttentionMaskInterface.register(INVARIANT_ATTENTION, sdpa_mask)
