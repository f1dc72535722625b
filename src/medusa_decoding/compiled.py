"""The compiled engine (`--kernels compiled`): every step of a fixed shape, compiled once per tree size.

Eager `transformers` runs a step as hundreds of small ops and Python module calls around the few that matter
(SmolLM2 on a 2-core EPYC, a whole decoding step at a 512-token context: one token 18.0 ms eagerly against 11.8
compiled, 4 tokens 26.5 against 19.8); on a GPU it is bound by launching them. `torch.compile` removes them only
where shapes do not change, so a step here never changes shape with the context: the KV cache has a fixed capacity
whose every column the step attends (cache.py, `whole`: the mask hides the columns not in use), writes its nodes at
a column tensor, builds its positions and mask inside the graph from the tree's tensors and the rows' lengths, and
runs greedy acceptance inside too; the accepted paths move into place with one gather/scatter
(`cache.gather_paths`), and the heads' proposal (decoding.candidates) is a graph of its own per tree. One graph then
serves a tree size (and batch size) for every request and context length up to the capacity, and a step reads the
device once (the accepted paths). The prefill stays eager: it runs once per request, at a length no two requests
share.

On a GPU the graphs replay as CUDA graphs (`triton.cudagraphs`, what `mode="reduce-overhead"` sets); inductor
caches what it compiled on disk (`torch._inductor` FX graph cache, under the project's cache directory), so a second
process compiles faster. Where compiling is unavailable (no C++
compiler for inductor on a CPU, no Triton on a GPU), kernels.resolve_kernels says so in one line.
"""

import functools
import os
import types
import weakref

import torch
from transformers import Cache, PreTrainedModel

from . import cache as kv
from .default_model import cache_root
from .heads import run_backbone
from .tree import on_device, padded

CAPACITY = 2048  # the positions a compiled engine attends to, unless a request needs more (which compiles anew)


def verify_graph(model: PreTrainedModel, cache: Cache, tokens: torch.Tensor, lengths: torch.Tensor,
                 depths: torch.Tensor, parents: torch.Tensor, attention: torch.Tensor, chains: torch.Tensor,
                 layers: tuple[int, ...]):
    """One verification step of fixed shape. tokens, depths, parents [B, T], attention, chains [B, T, T] (tree.padded),
    lengths [B] -> logits [B, T, V], the heads' input states [B, T, (1 + L) H] (heads.run_backbone with the heads'
    feature `layers`) and greedy acceptance (accept_greedy)."""
    mask = kv.step_mask(lengths, attention, cache.layers[0].capacity, model.dtype)
    hidden, state = run_backbone(model, layers, input_ids=tokens, past_key_values=cache, use_cache=True,
                                 attention_mask=mask, position_ids=lengths[:, None] + depths)
    logits = model.get_output_embeddings()(hidden)
    return logits, state, accept_greedy(tokens, logits.argmax(-1), depths, parents, attention, chains)


def accept_greedy(tokens: torch.Tensor, argmax: torch.Tensor, depths: torch.Tensor, parents: torch.Tensor,
                  attention: torch.Tensor, chains: torch.Tensor) -> torch.Tensor:
    """acceptance.greedy for a batch, in tensor ops only (no read of the device): tokens, argmax (the base model's
    token after each node) [B, T] and the trees' padded tensors -> [B, 2+T]: the accepted count, the token after the
    path, then the path's node indices (continued by the chains' padding, past the count)."""
    accepted = (tokens == argmax.gather(1, parents)) | (depths == 0)  # the root (and padding) stands
    good = ~(attention & ~accepted[:, None, :]).any(-1)  # [B, T]: every node of its path accepted
    best = (good * (depths + 1)).argmax(-1)  # the deepest: greedy accepts one chain (ties: the root, first)
    rows = torch.arange(len(tokens), device=tokens.device)
    count, root = depths[rows, best] + 1, argmax[rows, best]
    return torch.cat([count[:, None], root[:, None], chains[rows, best]], dim=1)


def compile_settings(device_type: str) -> dict:
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)  # tree sizes x batches
    # what inductor compiles stays in the project's cache (not /tmp, which a reboot clears): a second run compiles none
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))
    if device_type == "cuda":  # mode="reduce-overhead", as an option: torch.compile takes a mode or options, not both
        return {"dynamic": False, "options": {"triton.cudagraphs": True}}
    # inductor's size asserts re-check every op output that the fixed shapes already fix (~1 ms a CPU step)
    return {"dynamic": False, "options": {"size_asserts": False}}


STEPS = weakref.WeakKeyDictionary()  # model -> its compiled verification step


def step_graph(model: PreTrainedModel):
    """`model`'s compiled verification step: verify_graph compiled for it alone, without guards on its modules.
    Dynamo would otherwise re-check some 7000 attributes of the model's modules before every step (1.4 ms of a 9 ms
    SmolLM2 step on a 2-core EPYC), for changes the engine never makes once use_kernels has run; the inputs' shapes
    stay guarded (one graph per tree size and batch size). Dynamo keeps its graphs per code object, so each model
    gets a copy of verify_graph's code: no model ever runs a graph traced through another's modules."""
    if (step := STEPS.get(model)) is None:
        code = verify_graph.__code__.replace()  # an equal, distinct code object
        fresh = types.FunctionType(code, verify_graph.__globals__, verify_graph.__name__)
        options = compile_settings(model.device.type)
        options["options"] = {**options.get("options", {}),
                              "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        step = STEPS[model] = torch.compile(fresh, **options)
    return step


@functools.cache
def graph(function, device_type: str):
    """`function` compiled for a device type, one graph per shape of its inputs (and per module it runs): the path
    mover (cache.gather_paths, one graph per cache shape) and the heads' proposal (decoding.candidates, one per heads
    and tree). Their modules stay guarded: a few, unlike the model's thousands (step_graph)."""
    return torch.compile(function, **compile_settings(device_type))


def verify(model: PreTrainedModel, cache: Cache, tokens: torch.Tensor, lengths: torch.Tensor,
           padded: list[tuple[torch.Tensor, ...]], layers: tuple[int, ...] = ()
           ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[list[int], int]]]:
    """A compiled step over tokens [B, T] at rows of `lengths` [B], each of a tree padded to T (tree.padded)
    -> (logits [B, T, V], the heads' input states [B, T, (1 + L) H], each row's greedy (accepted path, next token))."""
    depths, parents, attention, chains = (torch.stack(t) for t in zip(*padded))
    logits, hidden, greedy = step_graph(model)(model, cache, tokens, lengths, depths, parents, attention, chains,
                                               layers)
    return logits, hidden.clone(), [(row[2 : 2 + row[0]], row[1]) for row in read(greedy)]


def commit(cache: Cache, lengths: list[int], paths: list[list[int]], width: int, on_device: torch.Tensor) -> None:
    """kv.commit for a compiled tree step (lengths: on the host, and `on_device`): the accepted paths, each continued
    to `width` (the heads + 1: any path's longest, whatever the tree's size, so one graph serves every tree), move
    in one compiled gather/scatter. Paths already in place (node i at the i-th column after the row: the root alone,
    or the first chain) move nothing, and most steps accept no more than that; the mover still runs on the first
    tree step of each shape, so that it compiles in the warm-up, not at the first path that moves."""
    shape = (on_device.device.type, tuple(cache.layers[0].key_buffer.shape), len(paths), width)
    if shape not in MOVED or any(node != i for path in paths for i, node in enumerate(path)):
        moves = torch.tensor([path + list(range(len(path), width)) for path in paths], device=on_device.device)
        graph(kv.gather_paths, on_device.device.type)(cache, on_device, moves)
        MOVED.add(shape)
    kv.settle(cache, lengths, paths)


MOVED = set()  # the shapes the path mover has run at (commit)


def device_graph(model: PreTrainedModel, heads, lm_head, cache: Cache, tokens: torch.Tensor, lengths: torch.Tensor,
                 columns: torch.Tensor, hidden: torch.Tensor, record: torch.Tensor, depths: torch.Tensor,
                 parents: torch.Tensor, attention: torch.Tensor, chains: torch.Tensor, tree_heads: torch.Tensor,
                 tree_ranks: torch.Tensor, layers: tuple[int, ...], k: int) -> None:
    """A whole greedy step on the device, in place, reading nothing back: verify every row's tree `tokens` [B, T] at
    `lengths` [B] (verify_graph; row b's nodes go to the cache at `columns` [B, T], the index every layer holds),
    accept greedily, move the accepted paths into place (an identity move costs what any other does), advance
    `lengths`, keep the accepted node's heads' input state in `hidden` [B, S], write the next step's tree tokens (the
    next root, then the heads' guesses at `tree_heads`/`tree_ranks`) into `tokens`, and the step's outcome into
    `record` [B, 1 + W]: the accepted count n, then the n tokens produced (the path's candidates, then the token
    after them). W: the tree's depth + 1, its longest path. heads: None for plain decoding."""
    width = record.shape[1] - 1
    columns.copy_(lengths[:, None] + torch.arange(tokens.shape[1], device=tokens.device))
    _, state, greedy = verify_graph(model, cache, tokens, lengths, depths, parents, attention, chains, layers)
    count, root, path = greedy[:, 0], greedy[:, 1], greedy[:, 2: 2 + width]
    if width > 1:
        kv.gather_paths(cache, lengths, path)
    last = path.gather(1, count[:, None] - 1)  # [B, 1]: the accepted node
    hidden.copy_(state.gather(1, last[:, :, None].expand(-1, -1, state.shape[-1]))[:, 0])
    produced = torch.cat([tokens.gather(1, path[:, 1:]), tokens[:, :1]], 1)  # the path's candidates, then room
    after = torch.arange(width, device=tokens.device) == count[:, None] - 1
    record.copy_(torch.cat([count[:, None], torch.where(after, root[:, None], produced)], 1))
    lengths.add_(count)
    if heads is None:
        tokens.copy_(root[:, None])
    else:  # guesses [D, B, k] -> the tree's candidates [B, N]
        guesses = heads.guesses(hidden, lm_head, k, width - 1)
        tokens.copy_(torch.cat([root[:, None], guesses[tree_heads, :, tree_ranks].T], 1))


DEVICE_STEPS = weakref.WeakKeyDictionary()  # model -> its compiled device step


def device_step_graph(model: PreTrainedModel):
    """`model`'s compiled device step (device_graph): whole (a graph break is an error), guarded as step_graph."""
    if (step := DEVICE_STEPS.get(model)) is None:
        code = device_graph.__code__.replace()
        fresh = types.FunctionType(code, device_graph.__globals__, device_graph.__name__)
        options = compile_settings(model.device.type)
        options["options"] = {**options.get("options", {}),
                              "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        step = DEVICE_STEPS[model] = torch.compile(fresh, fullgraph=True, **options)
    return step


host_reads = 0  # the compiled engine's reads of the device (read): the suite holds a greedy step to one


def read(tensor: torch.Tensor) -> list:
    """`tensor` on the host: the one place a compiled step waits for the device."""
    global host_reads
    host_reads += 1
    return tensor.tolist()


class DeviceRows:
    """A batch's rows as device_graph steps them, in buffers the model keeps for batches of their shape (a CUDA graph
    replays on the same addresses, request after request): the next tree tokens [B, T], lengths [B], write columns
    [B, T], heads' input states [B, S] and the last step's record [B, 1 + W]. Built from the rows' own state (root,
    heads' input, length) whenever they change by other means than `step` (a row joins or leaves, another tree, a
    step taken elsewhere): `holds` says whether it still stands for them."""

    def __init__(self, rows: list, tree, tokens: torch.Tensor, cache: Cache):
        device, size = tokens.device, rows[0].hidden.shape[-1]
        self.tree, self.rows = tree, rows
        shape = (len(rows), tree.num_nodes, size, tree.depth + 1)
        self.buffers = buffers_for(device, shape, rows[0].hidden.dtype, cache)
        self.buffers["owner"] = self  # another batch of this shape takes them over: this one no longer holds
        self.tokens.copy_(tokens)
        self.hidden.copy_(torch.stack([row.hidden for row in rows]))
        self.lengths.copy_(torch.tensor([row.length for row in rows], device=device))
        depths, parents, attention, chains = padded(tree, tree.num_nodes, device)
        on = on_device(tree, device)
        self.tree_tensors = (*(t.expand(len(rows), *t.shape).contiguous() for t in (depths, parents, attention, chains)),
                             on.heads, on.ranks)
        placed = (torch.arange(len(rows), device=device)[:, None], slice(None), self.columns)
        for layer in cache.layers:
            layer.placed = placed
        self.seen = self.now()

    def __getattr__(self, name: str) -> torch.Tensor:
        return self.buffers[name]  # tokens, lengths, columns, hidden, record

    def now(self) -> list[tuple[int, int]]:
        return [(row.root, row.length) for row in self.rows]

    def holds(self, rows: list, tree, cache: Cache) -> bool:
        return (tree is self.tree and rows == self.rows and self.buffers["owner"] is self and self.now() == self.seen
                and cache.layers[0].placed is not None and cache.layers[0].placed[2] is self.columns)

    def step(self, model: PreTrainedModel, heads, lm_head, cache: Cache, layers: tuple[int, ...]) -> list[list[int]]:
        """One step (device_graph) -> the tokens each row produced; the caller then moves the rows on and `settled`."""
        plain = self.tree.num_nodes == 1
        device_step_graph(model)(model, None if plain else heads, lm_head, cache, self.tokens, self.lengths,
                                 self.columns, self.hidden, self.record, *self.tree_tensors, layers=layers,
                                 k=max(self.tree.topk_per_head(), 1))
        return [row[1: 1 + row[0]] for row in read(self.record)]

    def settled(self) -> None:
        """The rows moved on as the record says: each row's heads' input is its row of `hidden` (a view that
        follows it step after step)."""
        for b, row in enumerate(self.rows):
            row.hidden = self.hidden[b]
        self.seen = self.now()


BUFFERS = weakref.WeakKeyDictionary()  # a cache -> {shape: DeviceRows' buffers}


def buffers_for(device: torch.device, shape: tuple[int, int, int, int], dtype: torch.dtype, cache: Cache) -> dict:
    """DeviceRows' buffers for (rows B, nodes T, state size S, path width W), allocated once per cache."""
    pool = BUFFERS.setdefault(cache, {})
    if (found := pool.get((shape, dtype))) is None:
        rows, nodes, size, width = shape
        found = pool[(shape, dtype)] = {
            "tokens": torch.zeros(rows, nodes, dtype=torch.long, device=device),
            "lengths": torch.zeros(rows, dtype=torch.long, device=device),
            "columns": torch.zeros(rows, nodes, dtype=torch.long, device=device),
            "hidden": torch.zeros(rows, size, dtype=dtype, device=device),
            "record": torch.zeros(rows, 1 + width, dtype=torch.long, device=device), "owner": None}
        if device.type == "cuda":
            for name, tensor in found.items():
                if tensor is not None:
                    torch._dynamo.mark_static_address(tensor)
    return found


CACHES = weakref.WeakKeyDictionary()  # model -> the whole caches no batch holds


def cache_for(batch, model: PreTrainedModel) -> Cache:
    """A whole cache for a new batch on the compiled engine: one that a batch now gone held (its buffers, at the same
    addresses, are what the captured graphs replay on), else a new one. It goes back when `batch` does."""
    free = CACHES.setdefault(model, [])
    if free:
        cache = free.pop()
        kv.settle(cache, [], [])  # no rows
    else:
        cache = kv.allocate(model, CAPACITY, whole=True)
    weakref.finalize(batch, free.append, cache)
    return cache
