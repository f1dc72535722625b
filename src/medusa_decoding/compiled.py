"""The compiled engine (`--kernels compiled`): every step of a fixed shape, compiled once per tree size.

Eager `transformers` runs a step as hundreds of small ops and Python module calls around the few that matter; on a
GPU it is bound by launching them and by the host waiting for the device. `torch.compile` removes them only where
shapes do not change, so a step here never changes shape with the context: the KV cache has a fixed capacity whose
every column the step attends (cache.py, `whole`: the mask hides the columns not in use), writes its nodes at a
column tensor and builds its positions and mask inside the graph from the tree's tensors and the rows' lengths.

A greedy step under a fixed tree (the common case: `Batch.device_tree`) is one graph that leaves nothing to the
host (device_graph): verify, accept, move the accepted paths into place, advance the lengths, run the heads on the
accepted node and write the next step's tree tokens, all in place in buffers that the cache keeps (DeviceRows);
the host reads back one small record a step (`read`, the one place it waits). On a GPU that step is captured as one
CUDA graph (`capture`) and replayed on the same addresses request after request (whole caches are pooled per
model: `cache_for`). Other steps (sampling, confident trees, `--tree auto`'s guard, heads with a prefix layer) run
verify_graph with greedy acceptance inside, the path mover (`cache.gather_paths`) and the proposal as graphs of
their own, and read the accepted paths. The prefill stays eager: it runs once per request, at a length no two
requests share.

Inductor caches what it compiled on disk (`torch._inductor` FX graph cache, under the project's cache directory),
so a second process compiles faster. Where compiling is unavailable (no C++ compiler for inductor on a CPU, no
Triton on a GPU), kernels.resolve_kernels says so in one line.
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
from .proposal import candidates
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


STEPS = weakref.WeakKeyDictionary()  # model -> {step function: its compiled copy for that model}


def model_graph(function, model: PreTrainedModel, fullgraph: bool = False, **options):
    """`function` (verify_graph, device_graph) compiled for `model` alone, without guards on its modules. Dynamo
    would otherwise re-check some 7000 attributes of the model's modules before every step (1.4 ms of a 9 ms SmolLM2
    step on a 2-core EPYC), for changes the engine never makes once use_kernels has run; the inputs' shapes stay
    guarded (one graph per tree size and batch size). Dynamo keeps its graphs per code object, so each model gets a
    copy of the function's code: no model ever runs a graph traced through another's modules. fullgraph: a graph
    break is an error; options: inductor's, over compile_settings'."""
    steps = STEPS.setdefault(model, {})
    if (step := steps.get(function)) is None:
        fresh = types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__)
        settings = compile_settings(model.device.type)
        settings["options"] = {**settings.get("options", {}), **options,
                               "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        step = steps[function] = torch.compile(fresh, fullgraph=fullgraph, **settings)
    return step


@functools.cache
def graph(function, device_type: str):
    """`function` compiled for a device type, one graph per shape of its inputs (and per module it runs): the path
    mover (cache.gather_paths, one graph per cache shape) and the heads' proposal (proposal.candidates, one per heads
    and tree). Their modules stay guarded: a few, unlike the model's thousands (model_graph)."""
    return torch.compile(function, **compile_settings(device_type))


def verify(model: PreTrainedModel, cache: Cache, tokens: torch.Tensor, lengths: torch.Tensor,
           padded: list[tuple[torch.Tensor, ...]], layers: tuple[int, ...] = ()
           ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[list[int], int]]]:
    """A compiled step over tokens [B, T] at rows of `lengths` [B], each of a tree padded to T (tree.padded)
    -> (logits [B, T, V], the heads' input states [B, T, (1 + L) H], each row's greedy (accepted path, next token))."""
    depths, parents, attention, chains = (torch.stack(t) for t in zip(*padded))
    step = model_graph(verify_graph, model)
    logits, hidden, greedy = step(model, cache, tokens, lengths, depths, parents, attention, chains, layers)
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


def device_graph(model: PreTrainedModel, heads, lm_head, embed, cache: Cache, tokens: torch.Tensor,
                 lengths: torch.Tensor, columns: torch.Tensor, hidden: torch.Tensor, record: torch.Tensor,
                 depths: torch.Tensor, parents: torch.Tensor, attention: torch.Tensor, chains: torch.Tensor, tree,
                 layers: tuple[int, ...], k: int) -> None:
    """A whole greedy step on the device, in place, reading nothing back: verify every row's tree `tokens` [B, T] at
    `lengths` [B] (verify_graph; row b's nodes go to the cache at `columns` [B, T], the index every layer holds),
    accept greedily, move the accepted paths into place (an identity move costs what any other does), advance
    `lengths`, keep the accepted node's heads' input state in `hidden` [B, S], write the next step's tree tokens (the
    next root, then the heads' guesses over `tree`: proposal.candidates) into `tokens`, and the step's outcome into
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
    tokens.copy_(root[:, None] if heads is None else candidates(heads, lm_head, embed, hidden, root, tree, k)[0])


host_reads = 0  # the compiled engine's reads of the device (read): the suite holds a greedy step to one


def read(tensor: torch.Tensor) -> list:
    """`tensor` on the host: the one place a compiled step waits for the device."""
    global host_reads
    host_reads += 1
    return tensor.tolist()


STATE = ("tokens", "lengths", "columns", "hidden", "record")  # what a device step changes, besides the cache


class DeviceRows:
    """A batch's rows as device_graph steps them, in buffers that the cache keeps for this tree, heads and batch size
    (on a GPU the step is one CUDA graph that replays on those very addresses, request after request): the STATE (the
    next tree tokens [B, T], lengths [B], write columns [B, T], heads' input states [B, S], the last step's record
    [B, 1 + W]) and the tree's tensors. Built from the rows' own state (root, heads' input, length) whenever they
    change by other means than `step` (a row joins or leaves, another tree, a step taken elsewhere): `holds` says
    whether it still stands for them."""

    def __init__(self, rows: list, tree, heads, tokens: torch.Tensor, cache: Cache):
        """tokens [B, T]: each row's tree tokens for its next step (decoding.propose)."""
        self.tree, self.rows, self.heads = tree, rows, heads if tree.num_nodes > 1 else None
        self.buffers = buffers_for(cache, tree, self.heads, len(rows), rows[0].hidden)
        self.state = [self.buffers[name] for name in STATE]
        self.tokens, self.lengths, self.columns, self.hidden, self.record = self.state
        self.tokens.copy_(tokens)
        self.hidden.copy_(torch.stack([row.hidden for row in rows]))
        self.lengths.copy_(torch.tensor([row.length for row in rows], device=tokens.device))
        placed = (self.buffers["rows_index"], slice(None), self.columns)
        for layer in cache.layers:
            layer.placed = placed
        self.seen = self.now()

    def now(self) -> list[tuple[int, int]]:
        return [(row.root, row.length) for row in self.rows]

    def holds(self, rows: list, tree, cache: Cache) -> bool:
        """Whether these rows stand as the last step left them, and the cache still writes at this state's columns
        (a step on the host path places its own)."""
        return (tree is self.tree and rows == self.rows and self.now() == self.seen
                and cache.layers[0].placed is not None and cache.layers[0].placed[2] is self.columns)

    def step(self, model: PreTrainedModel, lm_head, embed, cache: Cache, layers: tuple[int, ...]) -> list[list[int]]:
        """One step (device_graph) -> the tokens each row produced; the caller then moves the rows on and `settled`."""
        def run() -> None:  # on a GPU captured here, not by inductor
            model_graph(device_graph, model, fullgraph=True, **{"triton.cudagraphs": False})(
                model, self.heads, lm_head, embed, cache, *self.state, *self.buffers["tree_tensors"], layers=layers,
                k=self.tree.topk_per_head())

        if self.tokens.is_cuda:
            where = cache.layers[0].key_buffer.data_ptr()  # buffers grown since (kv.reserve): capture anew
            if self.buffers.get("captured_at") != where:
                self.buffers["graph"], self.buffers["captured_at"] = capture(run, self.state), where
            self.buffers["graph"].replay()
        else:
            run()
        return [row[1: 1 + row[0]] for row in read(self.record)]

    def settled(self) -> None:
        """The rows moved on as the record says: each row's heads' input is its row of `hidden` (a view that
        follows it step after step)."""
        for b, row in enumerate(self.rows):
            row.hidden = self.hidden[b]
        self.seen = self.now()


def capture(run, state: list[torch.Tensor]) -> torch.cuda.CUDAGraph:
    """`run` as a CUDA graph. It changes `state` in place, and the cache only past each row's entries (the step's
    nodes, which the next step writes again): two warm-up runs on a side stream (compiling, tuning), `state` put back
    after each, then the capture, which runs nothing. Every graph shares one memory pool: they replay one at a time."""
    saved = [tensor.clone() for tensor in state]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
            for tensor, value in zip(state, saved):
                tensor.copy_(value)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=graph_pool(state[0].device)):
        run()
    return graph


@functools.cache
def graph_pool(device: torch.device):
    return torch.cuda.graph_pool_handle()


BUFFERS = weakref.WeakKeyDictionary()  # a cache -> {(tree, heads, B, S, dtype): DeviceRows' buffers}


def buffers_for(cache: Cache, tree, heads, rows: int, like: torch.Tensor) -> dict:
    """DeviceRows' buffers for `rows` rows verifying `tree` with `heads` (None: plain steps), heads' input states
    like `like` [S], allocated once per cache."""
    pool = BUFFERS.setdefault(cache, {})
    key = (tree, heads, rows, like.shape[-1], like.dtype)
    if (found := pool.get(key)) is None:
        device, nodes, width = like.device, tree.num_nodes, tree.depth + 1
        long = {"dtype": torch.long, "device": device}
        found = pool[key] = {
            "tokens": torch.zeros(rows, nodes, **long), "lengths": torch.zeros(rows, **long),
            "columns": torch.zeros(rows, nodes, **long), "record": torch.zeros(rows, 1 + width, **long),
            "hidden": torch.zeros(rows, like.shape[-1], dtype=like.dtype, device=device),
            "rows_index": torch.arange(rows, device=device)[:, None]}
        found["tree_tensors"] = (*(t.expand(rows, *t.shape).contiguous() for t in padded(tree, nodes, device)),
                                 on_device(tree, device))
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
