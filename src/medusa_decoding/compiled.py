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
    return logits, hidden.clone(), [(row[2 : 2 + row[0]], row[1]) for row in greedy.tolist()]  # one read


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
