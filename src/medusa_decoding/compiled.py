"""The compiled engine (`--engine compiled`): every step of a fixed shape, compiled once per tree size. `Compiled` is
an engine.Engine, as eager.Eager is.

Eager `transformers` runs a step as hundreds of small ops and Python module calls around the few that matter; on a
GPU it is bound by launching them and by the host waiting for the device. `torch.compile` removes them only where
shapes do not change, so a step here never changes shape with the context: the KV cache has a fixed capacity of
which the step attends a fixed window (cache.py, `whole`, `attend`: the mask hides the columns not in use), writes
its nodes at a column tensor and builds its positions and mask inside the graph from the tree's tensors and the rows'
lengths.

A step under a fixed or confident tree, greedy or sampled (the common case: `Compiled.device_tree`), is one graph
that leaves nothing to the host (device_graph): verify, accept (device_acceptance.py), move the accepted paths into
place, advance the lengths, run the heads on the accepted node and write the next step's tree, all in place in
buffers that the cache keeps (DeviceRows); the host reads back one small readout a step (`read`, the one place it
waits). On a GPU that step is captured as one CUDA graph (`capture`, one per window) and replayed on the same
addresses request after request (whole caches are pooled per model: `cache_for`), each step launched before the last
one is read (DeviceRows, `ahead`). The guard's picks (`--tree auto`, `confident` without a size) run verify_graph
with greedy acceptance inside, the path mover (`cache.gather_paths`) and the heads' candidates (candidates.py) as
graphs of their own, and read the accepted paths. The prefill runs eagerly on a CPU; on a GPU, whose eager launches
cost more than its arithmetic, it goes through verify_graph `prefill_chunk` tokens at a time (`Compiled.prefill`): one
graph for every length.

Inductor caches what it compiled on disk (`torch._inductor` FX graph cache, under the project's cache directory),
so a second process compiles faster. Where compiling is unavailable (no C++ compiler for inductor on a CPU, no
Triton on a GPU), kernels.resolve_kernels says so in one line.
"""

import functools
import types
import weakref

import torch
from torch.utils._pytree import tree_map
from transformers import Cache, PreTrainedModel

from . import cache as kv
from .base import context_limit, sliding_window
from .candidates import candidates, confident_tree
from .device_acceptance import accept_greedy, accept_sampled
from .eager import prefill
from .heads import run_backbone
from .tree import Tree, on_device, padded, spanning

CAPACITY = 2048  # the positions a compiled engine attends to, unless a request needs more (which compiles anew)
PREFILL_CHUNK = 128  # a prompt's tokens a pass on a GPU (Compiled.prefill)


def verify_graph(model: PreTrainedModel, cache: Cache, tokens: torch.Tensor, lengths: torch.Tensor,
                 depths: torch.Tensor, parents: torch.Tensor, attention: torch.Tensor, chains: torch.Tensor,
                 layers: tuple[int, ...]):
    """One verification step of fixed shape. tokens, depths, parents [B, T], attention, chains [B, T, T] (tree.padded),
    lengths [B] -> logits [B, T, V], the heads' input states [B, T, (1 + L) H] (heads.run_backbone with the heads'
    feature `layers`) and greedy acceptance (accept_greedy)."""
    positions, mask = kv.step_inputs(lengths, depths, attention, cache.layers[0].window, model.dtype,
                                     sliding_window(model))
    hidden, state = run_backbone(model, layers, input_ids=tokens, past_key_values=cache, use_cache=True,
                                 attention_mask=mask, position_ids=positions)
    logits = model.get_output_embeddings()(hidden)
    return logits, state, accept_greedy(tokens, logits.argmax(-1), depths, parents, attention, chains)


def compile_settings(device_type: str) -> dict:
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)  # tree sizes x batches
    if device_type == "cuda":  # mode="reduce-overhead", as an option: torch.compile takes a mode or options, not both
        return {"dynamic": False, "options": {"triton.cudagraphs": True}}
    # inductor's size asserts re-check every op output that the fixed shapes already fix
    return {"dynamic": False, "options": {"size_asserts": False}}


MODEL_GRAPHS = weakref.WeakKeyDictionary()  # model -> {step function: its compiled copy for that model}


def model_graph(function, model: PreTrainedModel, fullgraph: bool = False, **options):
    """`function` (verify_graph, device_graph) compiled for `model` alone, without guards on its modules. Dynamo
    would otherwise re-check thousands of attributes of the model's modules before every step, for changes the engine
    never makes once use_kernels has run; the inputs' shapes stay
    guarded (one graph per tree size and batch size). Dynamo keeps its graphs per code object, so each model gets a
    copy of the function's code: no model ever runs a graph traced through another's modules. fullgraph: a graph
    break is an error; options: inductor's, over compile_settings'."""
    graphs = MODEL_GRAPHS.setdefault(model, {})
    if (step := graphs.get(function)) is None:
        fresh = types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__)
        settings = compile_settings(model.device.type)
        settings["options"] = {**settings.get("options", {}), **options,
                               "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        step = graphs[function] = torch.compile(fresh, fullgraph=fullgraph, **settings)
    return step


@functools.cache
def graph(function, device_type: str):
    """`function` compiled for a device type, one graph per shape of its inputs (and per module it runs): the path
    mover (cache.gather_paths, one graph per cache shape) and the heads' candidates (candidates.py, one per heads
    and tree). Their modules stay guarded: a few, unlike the model's thousands (model_graph)."""
    return torch.compile(function, **compile_settings(device_type))


class Compiled:
    """The compiled engine: steps of fixed shapes through graphs, and where every row is under one fixed or confident
    tree, the whole step as one graph on the device (device_step)."""

    guesses_own_tokens = False  # a row's own tokens change in number every step; a graph takes fixed shapes

    def __init__(self, model: PreTrainedModel, heads):
        self.model, self.heads = model, heads
        self.layers = heads.config.feature_layers if heads is not None else ()
        self.width = heads.config.num_heads + 1 if heads is not None else 1  # any accepted path's longest
        self.device_rows: DeviceRows | None = None  # the rows as the last device step left them
        # on a GPU only: DeviceRows' steps run one ahead of the host, and attend a window of the cache's columns. On
        # a CPU a step runs on the cores the host would go over it with (ahead gains nothing), and the native
        # attention skips masked columns (windows would only add graphs, compiled mid-answer)
        self.ahead = self.windowed = model.device.type == "cuda"
        # on a GPU a prompt goes through the step's graph `prefill_chunk` tokens at a time: eagerly, a prefill's
        # hundreds of launches from the host cost several steps; on a CPU the work is in the arithmetic, not launches
        self.prefill_chunk = PREFILL_CHUNK if model.device.type == "cuda" else 0

    def cache(self, batch) -> Cache:
        return cache_for(batch, self.model)

    def prefill(self, prompt: torch.Tensor) -> tuple[Cache, torch.Tensor, torch.Tensor]:
        """Eager.prefill's outcome; with a `prefill_chunk`, passes of that many tokens (a chain through verify_graph:
        one graph whatever the prompt's length) into a one-row whole cache kept for the next prompt. The last pass ends
        at the prompt's end (it computes again what the one before wrote: the same entries); a shorter prompt's pass is
        padded past it, entries the row never keeps."""
        chunk = self.prefill_chunk
        if not chunk:
            return prefill(self.model, prompt, prompt.shape[-1], self.layers)
        length, device = prompt.shape[-1], prompt.device
        cache = PREFILLS.get(self.model)
        if cache is None:
            cache = PREFILLS[self.model] = kv.allocate(self.model, CAPACITY, whole=True)
        if self.layers and self.model not in RECORDING:
            # transformers hooks the layers whose outputs it records at the first pass that asks: eagerly, not in a
            # graph (a graph break there left its remainder compiled without the model's guards: another model's)
            prefill(self.model, prompt[:1], 1, self.layers)
            RECORDING.add(self.model)
        kv.reserve(cache, 1, max(length, chunk))
        tokens = torch.zeros(max(length, chunk), dtype=torch.long, device=device)
        tokens[:length] = prompt
        starts = [*range(0, length - chunk, chunk), max(0, length - chunk)]
        for start in starts:
            kv.place(cache, [start], chunk)
            logits, states, _ = model_graph(verify_graph, self.model)(
                self.model, cache, tokens[start: start + chunk].unsqueeze(0), torch.tensor([start], device=device),
                *chain(chunk, device), self.layers)
        kv.settle(cache, [length], [[]])
        last = length - 1 - starts[-1]  # the prompt's last token, in the last pass
        return cache, logits[0, last].clone(), states[0, last].clone()

    def nodes(self, plans: list) -> int:
        """The step's width: the room its proposers keep, whatever they offer this step (one graph a size)."""
        return max(plan.nodes for plan in plans)

    def candidates(self, *args, own=None):
        """candidates.candidates as a graph (one per heads and tree); copies: a CUDA graph's outputs live until its
        next replay. Its rows have no `own` tokens (guesses_own_tokens): the guess vocabulary alone, as on the device
        step."""
        return tree_map(torch.clone, graph(candidates, self.model.device.type)(*args))

    def verify(self, cache: Cache, packed) -> tuple[torch.Tensor, torch.Tensor, list[tuple[list[int], int]]]:
        """One pass (verify_graph) -> (logits [B, T, V], the heads' input states [B, T, S], each row's greedy
        (accepted path, next token), read from the device at once)."""
        rows, nodes = packed.tokens.shape
        kv.reserve(cache, rows, kv.width(cache) + max(nodes, self.width if nodes > 1 else 1))
        kv.place(cache, packed.lengths, nodes)
        self.attend(cache, kv.width(cache) + nodes)
        logits, states, greedy = model_graph(verify_graph, self.model)(
            self.model, cache, packed.tokens, packed.on_device, *packed.trees, self.layers)
        return logits, states.clone(), [(row[2 : 2 + row[0]], row[1]) for row in read(greedy)]

    def commit(self, cache: Cache, packed, paths: list[list[int]]) -> None:
        """kv.commit; a tree step's paths, each continued to `width` (so one graph serves every tree), move in one
        compiled gather/scatter. Paths already in place (node i at the i-th column after the row: the root alone, or
        the first chain) move nothing, and most steps accept no more than that; the mover still runs on the first
        tree step of each shape, so that it compiles in the warm-up, not at the first path that moves."""
        if packed.tokens.shape[1] == 1:  # a plain step's token is in place already
            return kv.commit(cache, packed.lengths, paths)
        device = packed.on_device.device
        width = self.width if max(map(len, paths)) <= self.width else packed.tokens.shape[1]  # a draft's chain: deeper
        shape, moved = (tuple(cache.layers[0].key_buffer.shape), len(paths), width), MOVED.setdefault(cache, set())
        if shape not in moved or any(node != i for path in paths for i, node in enumerate(path)):
            moves = torch.tensor([path + list(range(len(path), width)) for path in paths], device=device)
            graph(kv.gather_paths, device.type)(cache, packed.on_device, moves)
            moved.add(shape)
        kv.settle(cache, packed.lengths, paths)

    def device_tree(self, rows: list) -> tuple[Tree, bool] | None:
        """(the tree of a step that can run whole on the device, whether its nodes are chosen anew each step: a
        confident tree, of which `tree` is the shape), else None: every row under the same fixed or confident tree
        (not the guard's pick), positions within the model's context for this step and one more (run ahead)."""
        fixed = [row.heads_draft.fixed_tree() for row in rows]
        trees = {(id(tree), confident): (tree, confident) for tree, confident in fixed} if None not in fixed else {}
        if len(trees) != 1:
            return None
        (tree, confident), = trees.values()
        tree = spanning(tree.num_nodes - 1, self.heads.config.num_heads) if confident else tree
        within = max(row.length for row in rows) + 2 * tree.depth + 1 < context_limit(self.model)
        return (tree, confident) if within else None

    def device_step(self, batch) -> tuple[Tree, list[list[int]]] | None:
        """The step as one graph on the device and one read of it (device_graph) -> (its tree, the tokens each row
        produced, EOS and budget not applied), or None where the step needs the host."""
        rows = list(batch.rows)
        tree, confident = self.device_tree(rows) or (None, False)
        if self.device_rows is not None and (tree is None or not self.device_rows.holds(rows, tree, confident,
                                                                                           batch.cache)):
            self.device_rows.release()
            self.device_rows = None
            kv.settle(batch.cache, [row.length for row in rows], [[] for _ in rows])  # the views as the rows stand
        if tree is None:
            return None
        # room and a window for this step and the one run ahead of it, whatever the last one accepted
        needed = max(row.length for row in rows) + tree.depth + 1 + tree.num_nodes
        kv.reserve(batch.cache, len(rows), needed)
        window = self.attend(batch.cache, needed)
        if self.device_rows is None:
            device, shape = self.model.device, None
            if confident:  # every row's first tree at once (candidates.confident_tree), its tensors as the step's
                tokens, shape = confident_tree(self.heads, batch.lm_head, batch.embed,
                                               torch.stack([row.heads_input for row in rows]),
                                               torch.tensor([row.root for row in rows], device=device),
                                               tree.num_nodes - 1)
            else:  # each row's first tree through the candidates' graph of one row: one graph whatever the batch size
                k, tree_here = tree.topk_per_head(), on_device(tree, device)
                tokens = torch.stack([
                    torch.tensor([row.root], device=device) if tree.num_nodes == 1 else
                    self.candidates(self.heads, batch.lm_head, batch.embed, row.heads_input[None],
                                    torch.tensor([row.root], device=device), tree_here, k)[0][0]
                    for row in rows])
            self.device_rows = DeviceRows(rows, tree, self.heads, tokens, batch.cache, self.ahead, shape)
        return tree, self.device_rows.step(self.model, batch.lm_head, batch.embed, batch.cache, self.layers, window)

    def attend(self, cache: Cache, needed: int) -> int:
        """kv.attend where the engine is `windowed`, else every column."""
        return kv.attend(cache, needed if self.windowed else cache.layers[0].capacity)


@functools.cache
def chain(nodes: int, device: torch.device) -> list[torch.Tensor]:
    """A chain of `nodes` tokens as a step's tree tensors for one row (Compiled.prefill): each sees those before it."""
    return [t[None] for t in padded(spanning(nodes - 1, nodes - 1), nodes, device)]


# a cache -> the shapes its path mover has run at (Compiled.commit). Per cache: another model's cache of the same
# shape may need its own graph (another layer count, another thread count), and a model's caches are pooled
MOVED = weakref.WeakKeyDictionary()


def device_graph(model: PreTrainedModel, heads, lm_head, embed, cache: Cache, tokens: torch.Tensor,
                 lengths: torch.Tensor, columns: torch.Tensor, heads_input: torch.Tensor, readout: torch.Tensor,
                 depths: torch.Tensor, parents: torch.Tensor, attention: torch.Tensor, chains: torch.Tensor, tree,
                 layers: tuple[int, ...], k: int, sampling: tuple | None = None, filters: bool = False,
                 confident: bool = False) -> None:
    """A whole step on the device, in place, reading nothing back: verify every row's tree `tokens` [B, T] at
    `lengths` [B] (verify_graph; row b's nodes go to the cache at `columns` [B, T], the index every layer holds),
    accept (greedily; where `sampling` holds the rows' parameters, device_acceptance.accept_sampled's rules with
    `filters`), move the accepted paths into place (an identity move costs what any other does), advance
    `lengths`, keep the accepted node's heads' input state in `heads_input` [B, S], write the next step's tree tokens
    (the next root, then the heads' guesses over `tree`: candidates.candidates; `confident`: each row's likeliest
    nodes, candidates.confident_tree, their tree written over depths .. chains) into `tokens`, and what the host reads
    of the step into `readout` [B, 1 + W]: the accepted count n, then the n tokens produced (the path's candidates,
    then the token after them). W: the tree's depth + 1, its longest path. heads: None for plain decoding."""
    width = readout.shape[1] - 1
    columns.copy_(lengths[:, None] + torch.arange(tokens.shape[1], device=tokens.device))
    logits, state, accepted = verify_graph(model, cache, tokens, lengths, depths, parents, attention, chains, layers)
    if sampling is not None:  # (the greedy outcome then goes unused, and the compiler drops it)
        accepted = accept_sampled(tokens, logits, lengths, depths, parents, attention, chains, *sampling, filters)
    count, root, path = accepted[:, 0], accepted[:, 1], accepted[:, 2: 2 + width]
    if width > 1:
        kv.gather_paths(cache, lengths, path)
    last = path.gather(1, count[:, None] - 1)  # [B, 1]: the accepted node
    heads_input.copy_(state.gather(1, last[:, :, None].expand(-1, -1, state.shape[-1]))[:, 0])
    produced = torch.cat([tokens.gather(1, path[:, 1:]), tokens[:, :1]], 1)  # the path's candidates, then room
    after = torch.arange(width, device=tokens.device) == count[:, None] - 1
    readout.copy_(torch.cat([count[:, None], torch.where(after, root[:, None], produced)], 1))
    lengths.add_(count)
    if confident:  # the next step's tree too: each row's likeliest nodes
        new, shape = confident_tree(heads, lm_head, embed, heads_input, root, tokens.shape[1] - 1)
        for buffer, value in zip((tokens, depths, parents, attention, chains), (new, *shape)):
            buffer.copy_(value)
    else:
        tokens.copy_(root[:, None] if heads is None else
                     candidates(heads, lm_head, embed, heads_input, root, tree, k)[0])


host_reads = 0  # the compiled engine's reads of the device (read): the suite holds a device step to one


def read(tensor: torch.Tensor, ready: torch.cuda.Event | None = None) -> list:
    """`tensor` on the host, once `ready` (the event after its copy from the device): the one place a compiled step
    waits for the device."""
    global host_reads
    host_reads += 1
    if ready is not None:
        ready.synchronize()
    return tensor.tolist()


# what a device step changes, besides the cache (a confident step, the tree tensors too)
STATE = ("tokens", "lengths", "columns", "heads_input", "readout", "depths", "parents", "attention", "chains")


class DeviceRows:
    """A batch's rows as device_graph steps them, in buffers that the cache keeps for this tree, heads and batch size
    (on a GPU the step is one CUDA graph per attended window that replays on those very addresses, request after
    request): the STATE (the next tree tokens [B, T], lengths [B], write columns [B, T], heads' input states [B, S],
    the last step's readout [B, 1 + W], the tree's tensors: a confident step writes them too). Built from the rows'
    own state (root, heads' input, length) whenever they change by other means than `step` (a row joins or leaves,
    another tree, a step taken elsewhere): `holds` says whether it still stands for them, and `release` gives the
    rows their state back.

    ahead: each step launches the next one before it reads its own readout (copied to the host behind it),
    as vLLM's and SGLang's asynchronous schedulers do, so the device never waits for the host to go over a step; a
    step run ahead for rows that then change (one ends) is dropped, its cache writes past every row's entries.
    """

    def __init__(self, rows: list, tree, heads, tokens: torch.Tensor, cache: Cache, ahead: bool = False,
                 confident: tuple[torch.Tensor, ...] | None = None):
        """tokens [B, T]: each row's tree tokens for its next step (the heads' candidates); confident: the tensors of
        each row's tree (tree.from_parents) where the step chooses its nodes anew each time, of the shape `tree`."""
        self.tree, self.rows, self.heads, self.ahead = tree, rows, heads if tree.num_nodes > 1 else None, ahead
        self.confident = confident is not None
        self.buffers = buffers_for(cache, tree, self.heads, len(rows), rows[0].heads_input, self.confident)
        self.state = [self.buffers[name] for name in STATE]
        self.tokens, self.lengths, self.columns, self.heads_input, self.readout = self.state[:5]
        self.tokens.copy_(tokens)
        for buffer, value in zip(self.state[5:], confident or ()):
            buffer.copy_(value)
        self.heads_input.copy_(torch.stack([row.heads_input for row in rows]))
        self.lengths.copy_(torch.tensor([row.length for row in rows], device=tokens.device))
        configs = [row.config for row in rows]
        self.sampling = None  # all greedy; else the rows' parameters of device_acceptance.accept_sampled
        # (a greedy row's top-k or top-p changes nothing: its p is the argmax)
        self.filters = any(c.temperature > 0 and (c.top_k or c.top_p < 1) for c in configs)
        if any(c.temperature > 0 for c in configs):
            self.sampling = self.buffers["sampling"]
            values = zip(*[(c.temperature, c.top_k, c.top_p, c.rule == "typical", c.typical_epsilon, c.typical_delta,
                            row.key) for c, row in zip(configs, rows)])
            for tensor, column in zip(self.sampling, values):
                tensor.copy_(torch.tensor(column, dtype=tensor.dtype))
        placed = (self.buffers["rows_index"], slice(None), self.columns)
        for layer in cache.layers:
            layer.placed = placed
        self.launched: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []  # readouts of steps not read yet
        self.slot = 0  # the host buffer the next readout goes to (two: one being read, one on its way)
        self.seen = self.now()

    def now(self) -> list[tuple[int, int]]:
        return [(row.root, row.length) for row in self.rows]

    def holds(self, rows: list, tree, confident: bool, cache: Cache) -> bool:
        """Whether these rows stand as the last step left them, and the cache still writes at this state's columns
        (a step on the host path places its own)."""
        return (tree is self.tree and confident == self.confident and rows == self.rows and self.now() == self.seen
                and cache.layers[0].placed is not None and cache.layers[0].placed[2] is self.columns)

    def step(self, model: PreTrainedModel, lm_head, embed, cache: Cache, layers: tuple[int, ...], window: int
             ) -> list[list[int]]:
        """One step (device_graph over `window` columns, kv.attend) -> the tokens each row produced. The rows are then
        `seen` where the host moves them (decoding.Batch.advance_on_device): each past all it produced (one that stops
        short, at an EOS or its budget, leaves the batch)."""
        def run() -> None:  # on a GPU captured here, not by inductor
            model_graph(device_graph, model, fullgraph=True, **{"triton.cudagraphs": False})(
                model, self.heads, lm_head, embed, cache, *self.state, self.buffers["tree"], layers=layers,
                k=self.tree.topk_per_head(), sampling=self.sampling, filters=self.filters, confident=self.confident)

        for _ in range(1 + self.ahead - len(self.launched)):
            self.launch(run, cache, window)
        produced = [row[1: 1 + row[0]] for row in read(*self.launched.pop(0))]
        self.seen = [(new[-1], length + len(new)) for (_, length), new in zip(self.seen, produced)]
        return produced

    def launch(self, run, cache: Cache, window: int) -> None:
        """Runs (on a GPU replays) a step, and copies its readout to the host behind it."""
        if self.launched:  # the state after the step not read yet, for `release`
            self.buffers["before"].copy_(self.heads_input)
        if self.tokens.is_cuda:
            graphs, where = self.buffers["graphs"], cache.layers[0].key_buffer.data_ptr()  # grown: capture anew
            kind = (window, self.sampling is not None, self.filters)
            if graphs.get(kind, (None, None))[1] != where:
                graphs[kind] = capture(run, self.state), where
            graphs[kind][0].replay()
        else:
            run()
        host, self.slot = self.buffers["host"][self.slot], 1 - self.slot
        host.copy_(self.readout, non_blocking=True)
        ready = torch.cuda.Event() if self.tokens.is_cuda else None
        if ready is not None:
            ready.record()
        self.launched.append((host, ready))

    def release(self) -> None:
        """The rows that still stand as the last step read left them take their heads' input state back (copies: the
        buffers go on to other steps); a step launched ahead is dropped."""
        state = self.buffers["before"] if self.launched else self.heads_input
        for b, (row, seen) in enumerate(zip(self.rows, self.seen)):
            if (row.root, row.length) == seen:
                row.heads_input = state[b].clone()
        self.launched.clear()


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


def buffers_for(cache: Cache, tree, heads, rows: int, like: torch.Tensor, confident: bool) -> dict:
    """DeviceRows' buffers for `rows` rows verifying `tree` (confident: trees of its shape) with `heads` (None: plain
    steps), heads' input states like `like` [S], allocated once per cache."""
    pool = BUFFERS.setdefault(cache, {})
    key = (tree, heads, rows, like.shape[-1], like.dtype, confident)
    if (found := pool.get(key)) is None:
        device, nodes, width = like.device, tree.num_nodes, tree.depth + 1
        long = {"dtype": torch.long, "device": device}
        found = pool[key] = {
            "tokens": torch.zeros(rows, nodes, **long), "lengths": torch.zeros(rows, **long),
            "columns": torch.zeros(rows, nodes, **long), "readout": torch.zeros(rows, 1 + width, **long),
            "heads_input": torch.zeros(rows, like.shape[-1], dtype=like.dtype, device=device),
            "rows_index": torch.arange(rows, device=device)[:, None], "graphs": {}}
        found["before"] = torch.empty_like(found["heads_input"])  # DeviceRows.launch
        # temperature, top_k, top_p, typical, epsilon, delta, key (device_acceptance.accept_sampled)
        found["sampling"] = tuple(torch.zeros(rows, dtype=dtype, device=device) for dtype in (
            torch.float, torch.long, torch.float, torch.bool, torch.float, torch.float, torch.long))
        found["host"] = [torch.empty(found["readout"].shape, dtype=torch.long, pin_memory=device.type == "cuda")
                         for _ in range(2)]
        for name, tensor in zip(STATE[5:], padded(tree, nodes, device)):  # copies: a confident step writes them
            found[name] = tensor.repeat(rows, *(1,) * tensor.dim())
        found["tree"] = on_device(tree, device)
    return found


CACHES = weakref.WeakKeyDictionary()  # model -> the whole caches no batch holds
PREFILLS = weakref.WeakKeyDictionary()  # model -> the one-row whole cache its prompts go through (Compiled.prefill)
RECORDING = weakref.WeakSet()  # models that ran a pass recording layers' outputs eagerly (Compiled.prefill)


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
