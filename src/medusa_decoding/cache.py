"""The KV cache: `transformers`' own cache interface, its storage allocated once and grown rarely, and the
operations MEDUSA and batching add to it.

`DynamicCache` appends with `torch.cat`, copying every layer's whole cache at every step (a cost that grows with
the context). Here each layer's keys and
values are views [B, kv_heads, S, head_dim] of buffers with room for more rows and positions, so a step writes only
its own tokens.

A batch's rows share the cache's columns: row b holds its own `lengths[b]` entries at columns 0.. (a row's own
prefix, never another's), and a step writes row b's tree node i at column lengths[b] + i, right after the row's own
entries (`place`), so a plain step's token is where it stays. After a verification pass `commit` moves each row's
accepted path into place and drops the rest; the columns past a row's entries, up to the longest row's, are a hole
its attention mask hides (`step_inputs`).

A batch's cache keeps every layer's buffers as views of one tensor (`stack`), so that moving the accepted paths is
one gather/scatter over all of them (`commit`), not one a buffer. The compiled engine (compiled.py) needs the same
shapes every step: its cache is `whole`, attending a fixed window of the buffers' columns whatever the width in use
(`attend`; the mask hides those not in use), writing each step's nodes at a column tensor (`place`) and moving the
accepted paths in fixed shapes (`gather_paths`).
"""

import torch
from transformers import Cache, PreTrainedModel
from transformers.cache_utils import DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """A DynamicLayer whose `keys`/`values` are views of buffers of `slots` rows and `capacity` positions, of `dtype`
    (None: the keys' own; a narrower one rounds the entries as they are written, and `update` widens them back)."""

    def __init__(self, capacity: int, whole: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        self.capacity, self.slots, self.whole, self.storage = capacity, 0, whole, dtype
        self.window = capacity  # the columns a whole cache's step attends (`attend`)
        self.placed: tuple | None = None  # `place`'s index: (rows [B, 1], every head, columns [B, T])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states, value_states: [B, kv_heads, T, head_dim] -> all keys and values so far [B, kv_heads, S, head_dim]
        rows = key_states.shape[0]
        if self.whole and self.placed is not None:  # a compiled step: its window, whatever the width in use
            self.key_buffer[self.placed] = key_states.transpose(1, 2)
            self.value_buffer[self.placed] = value_states.transpose(1, 2)
            return self.key_buffer[:rows, :, : self.window], self.value_buffer[:rows, :, : self.window]
        width = self.keys.shape[-2] if self.is_initialized else 0
        if not self.is_initialized:
            self.begin(key_states, value_states, rows)
        end = width + key_states.shape[-2]
        assert rows == self.keys.shape[0] and end <= self.capacity, f"KV cache: {rows} x {end} written, " \
            f"{self.keys.shape[0]} x {self.capacity} allocated"  # the decoding loop reserves what a step needs
        if self.placed is None:
            self.key_buffer[:rows, :, width:end] = key_states
            self.value_buffer[:rows, :, width:end] = value_states
        else:  # indexed on dims 0 and 2, the buffers take [B, T, kv_heads, head_dim]
            self.key_buffer[self.placed] = key_states.transpose(1, 2)
            self.value_buffer[self.placed] = value_states.transpose(1, 2)
        self.view(rows, end)
        if self.keys.dtype != key_states.dtype:  # a narrower cache: what transformers' attention reads, widened
            return self.keys.to(key_states.dtype), self.values.to(value_states.dtype)
        return self.keys, self.values

    def begin(self, keys: torch.Tensor, values: torch.Tensor, slots: int, buffers: tuple | None = None) -> None:
        """Buffers for `slots` rows shaped like keys, values [B, kv_heads, T, head_dim] (and typed like them unless the
        layer's dtype says otherwise), no entry yet; `buffers`: as `grow`'s."""
        self.dtype, self.device, self.is_initialized = self.storage or keys.dtype, keys.device, True
        self.keys, self.values = keys[:, :, :0].to(self.dtype), values[:, :, :0].to(self.dtype)
        self.grow(slots, self.capacity, buffers)

    def grow(self, slots: int, capacity: int, buffers: tuple | None = None) -> None:
        """Buffers of at least `slots` rows and `capacity` positions, the entries so far copied over; `buffers`: these
        (keys, values) of that size, a batch cache's views of its stacked tensor (`stack`)."""
        if buffers is None and slots <= self.slots and capacity <= self.capacity and self.slots:
            return
        slots, capacity = max(slots, self.slots), max(capacity, self.capacity)
        rows, width = self.keys.shape[0], self.keys.shape[-2]
        shape = (slots, self.keys.shape[1], capacity, self.keys.shape[-1])
        # every column of the old buffers: a compiled step's entries lie past the views until they settle
        old = (self.key_buffer, self.value_buffer) if self.slots else (self.keys, self.values)
        # zeros, not garbage: stock attention reads the holes it masks, and 0 * NaN would be NaN
        self.key_buffer, self.value_buffer = buffers or (self.keys.new_zeros(shape), self.values.new_zeros(shape))
        if self.whole and self.key_buffer.is_cuda:  # CUDA graphs replay on these very buffers
            torch._dynamo.mark_static_address(self.key_buffer)
            torch._dynamo.mark_static_address(self.value_buffer)
        for buffer, entries in zip((self.key_buffer, self.value_buffer), old):
            buffer[: entries.shape[0], :, : entries.shape[2]] = entries
        self.slots, self.capacity, self.window = slots, capacity, capacity
        self.view(rows, width)

    def view(self, rows: int, width: int) -> None:
        self.keys, self.values = self.key_buffer[:rows, :, :width], self.value_buffer[:rows, :, :width]


def allocate(model: PreTrainedModel, capacity: int, whole: bool = False, dtype: torch.dtype | None = None) -> Cache:
    """An empty cache with room for `capacity` positions (one request: prompt + new tokens + one tree), its entries
    of `dtype` (None: the model's keys'). A whole cache has its buffers from the start, for one row, shaped from the
    model's config: a compiled pass writes at indexed columns only (`place`), into buffers that exist."""
    config = model.config.get_text_config()
    cache = Cache(layers=[PreallocatedLayer(capacity, whole, dtype) for _ in range(config.num_hidden_layers)])
    if whole:
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        empty = torch.empty(0, kv_heads, 0, head_dim, dtype=dtype or model.dtype, device=model.device)  # no row yet
        for layer, buffers in zip(cache.layers, stack(cache, 1, capacity, empty)):
            layer.begin(empty, empty, 1, buffers)
    return cache


def stack(cache: Cache, slots: int, capacity: int, like: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A batch cache's buffers for `slots` rows and `capacity` positions, each layer's (keys, values): views of one
    tensor, `cache.stacked` [layers, 2, slots, kv_heads, capacity, head_dim] (zeros, typed and placed like `like`
    [B, kv_heads, T, head_dim]), so that a step's path move is one gather/scatter (commit, gather_paths), not one a
    buffer (benchmarks/gpu_anatomy.py times both)."""
    cache.stacked = like.new_zeros((len(cache.layers), 2, slots, like.shape[1], capacity, like.shape[-1]))
    if cache.stacked.is_cuda:  # CUDA graphs replay on these very buffers
        torch._dynamo.mark_static_address(cache.stacked)
    return [(keys, values) for keys, values in cache.stacked]


def width(cache: Cache) -> int:
    """The columns in use: the longest row's entries."""
    return cache.layers[0].keys.shape[-2] if cache.layers[0].is_initialized else 0


def reserve(cache: Cache, rows: int, columns: int) -> None:
    """Room for `rows` rows of `columns` positions: buffers too small grow (at least doubling: rarely)."""
    first = cache.layers[0]  # every layer's buffers have the same size
    if not first.is_initialized or (rows <= first.slots and columns <= first.capacity):  # every step: one check
        return
    slots = max(rows, 2 * first.slots if rows > first.slots else 0, first.slots)
    capacity = max(columns, 2 * first.capacity if columns > first.capacity else 0, first.capacity)
    for layer, buffers in zip(cache.layers, stack(cache, slots, capacity, first.keys)):
        layer.grow(slots, capacity, buffers)


def insert(cache: Cache, row: Cache, capacity: int) -> None:
    """Appends the one-row cache `row` (a prefill) as the last row; `capacity`: the positions that row may need."""
    first, length = cache.layers[0], width(row)
    rows, wide = first.keys.shape[0] if first.is_initialized else 0, max(width(cache), length)
    if not first.is_initialized:  # the first row: buffers for it, stacked, typed as the cache stores
        capacity = max(first.capacity, capacity)
        like = row.layers[0].keys[:, :, :0].to(first.storage or row.layers[0].keys.dtype)
        for layer, new, buffers in zip(cache.layers, row.layers, stack(cache, 1, capacity, like)):
            layer.capacity = capacity
            layer.begin(new.keys, new.values, 1, buffers)
    reserve(cache, rows + 1, capacity)
    for layer, new in zip(cache.layers, row.layers):
        layer.key_buffer[rows, :, :length], layer.value_buffer[rows, :, :length] = new.keys[0], new.values[0]
        layer.view(rows + 1, wide)


def place(cache: Cache, lengths: list[int], tokens: int) -> None:
    """The next pass writes row b's `tokens` tokens at columns lengths[b].. (right after the row's own entries),
    where by default they go after the longest row's: the same where every row is as long (a batch of one).
    A whole cache is always placed: a compiled step's writes are indexed by tensors, whatever the lengths."""
    if len(set(lengths)) > 1 or cache.layers[0].whole:
        device = cache.layers[0].device
        placed = (torch.arange(len(lengths), device=device)[:, None], slice(None),
                  torch.tensor(lengths, device=device)[:, None] + torch.arange(tokens, device=device))
        for layer in cache.layers:
            layer.placed = placed


def commit(cache: Cache, lengths: list[int], paths: list[list[int]]) -> None:
    """After a pass that wrote row b's node i at column lengths[b] + i: row b keeps the nodes `paths[b]` (node
    indices, root first) right after its own entries; the cache is then as wide as the longest row, and the next pass
    writes after it unless placed again."""
    # a path's leading 0, 1, 2, ... are in place already, and only the rest move (a plain step's [0] moves nothing)
    moves = [(b, length + i, length + node) for b, (length, path) in enumerate(zip(lengths, paths))
             for i, node in enumerate(path) if i != node]
    if moves:
        rows, to, source = (torch.tensor(column, device=cache.layers[0].device) for column in zip(*moves))
        cache.stacked[:, :, rows, :, to] = cache.stacked[:, :, rows, :, source]  # every layer's keys and values
    settle(cache, lengths, paths)


def settle(cache: Cache, lengths: list[int], paths: list[list[int]]) -> None:
    """After the accepted paths moved into place (commit, gather_paths): the cache is as wide as the longest row, and
    the next pass writes after it unless placed again."""
    wide = max(length + len(path) for length, path in zip(lengths, paths)) if paths else 0
    for layer in cache.layers:
        layer.view(len(lengths), wide)
        layer.placed = None


def attend(cache: Cache, needed: int) -> int:
    """A whole cache's next steps attend the first columns of its buffers that hold `needed`: an eighth, a quarter,
    half or all of its capacity (one graph each), not always all of it (the attention's cost grows with them)."""
    capacity = cache.layers[0].capacity
    window = next((capacity >> k for k in (3, 2, 1) if needed <= capacity >> k), capacity)
    for layer in cache.layers:
        layer.window = window
    return window


def step_inputs(lengths: torch.Tensor, depths: torch.Tensor, attention: torch.Tensor, columns: int, dtype: torch.dtype,
                window: int | None = None) -> tuple[torch.Tensor, torch.Tensor | dict[str, torch.Tensor]]:
    """A step's position ids [B, T] and additive mask [B, 1, T, columns], for rows of lengths[b] entries whose T nodes
    (of depths [B, T]) go to columns lengths[b].. (`place`): a node sits at its row's length plus its depth, and sees
    its row's own entries and the step's nodes that attention [B, T, T] lets it (itself and its ancestors:
    tree.padded), never the hole past a shorter row nor a column not yet written. Both engines build them here.
    window: a model's sliding window (base.sliding_window): the mask is then one per kind of layer, as `transformers`
    takes them, the sliding layers' seeing only entries less than `window` positions before the node."""
    nodes = attention.shape[-1]
    index = torch.arange(columns, device=lengths.device)
    offset = index - lengths[:, None]  # [B, S]: the column's node, if >= 0
    node = offset.clamp(0, nodes - 1)
    ours = attention.gather(2, node[:, None, :].expand(-1, nodes, -1))  # [B, T, S]
    seen = (offset < 0)[:, None] | (ours & (offset < nodes)[:, None])
    positions = lengths[:, None] + depths
    if window is None:
        return positions, additive(seen, dtype)
    at = torch.where(offset < 0, index, lengths[:, None] + depths.gather(1, node))  # [B, S]: each column's position
    near = seen & (at[:, None, :] > positions[:, :, None] - window)
    return positions, {"full_attention": additive(seen, dtype), "sliding_attention": additive(near, dtype)}


def additive(seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """seen [B, T, S] -> the additive mask [B, 1, T, S]: 0 where seen, the dtype's least value elsewhere."""
    mask = torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, torch.finfo(dtype).min)
    return mask[:, None]


def gather_paths(cache: Cache, lengths: torch.Tensor, paths: torch.Tensor) -> None:
    """commit's moves in a whole cache as one gather/scatter over all its buffers (`stack`), of a fixed shape: row b's
    node paths[b, i] goes to column lengths[b] + i for every i < T, where paths [B, T] continues each accepted path
    with i itself (moving nothing). The views (the width in use) are then the caller's to `settle`."""
    rows = torch.arange(len(lengths), device=lengths.device)[:, None]
    to = lengths[:, None] + torch.arange(paths.shape[1], device=lengths.device)
    source = lengths[:, None] + paths
    move_columns(cache.stacked, rows, to, source)


@torch.library.custom_op("medusa_cache::move_columns", mutates_args=("stacked",))
def move_columns(stacked: torch.Tensor, rows: torch.Tensor, to: torch.Tensor, source: torch.Tensor) -> None:
    """stacked [layers, 2, slots, heads, capacity, dim]: row rows[b]'s column source[b, i] to to[b, i], in place: an
    op of its own, so that a compiled graph writes the few columns where they are (as an indexed assignment in the
    graph, inductor copied the whole cache twice a step: benchmarks/results/README.md, gguf_cost_curve_gemma3)."""
    stacked[:, :, rows, :, to] = stacked[:, :, rows, :, source]


def remove(cache: Cache, index: int, wide: int) -> None:
    """Drops row `index` (the last row takes its place) and narrows the cache to `wide` columns."""
    last = cache.layers[0].keys.shape[0] - 1
    if index != last:
        cache.stacked[:, :, index, :, :wide] = cache.stacked[:, :, last, :, :wide]  # every layer's keys and values
    for layer in cache.layers:
        layer.view(last, wide)
