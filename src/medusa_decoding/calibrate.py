"""Calibrated sparse trees: the tree that decodes fastest for these heads, this model and this device.

The MEDUSA paper's model: head k's rank-i token is the correct one (the token k+2 ahead) with
probability a_k^(i), independently across heads. A node (r_1, ..., r_d) is accepted when every
token on its path is correct, so a tree accepts on average sum over nodes of prod_j a_{j-1}^(r_j)
candidates per step, plus the one token every step yields. Adding the node of highest path
probability one at a time gives the best tree of every size (a child never beats its parent), and
the size that wins is the one with the most expected tokens per second of measured step time.
"""

import hashlib
import heapq
import itertools
import json
import math
import platform
import statistics
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch

from . import cache as kv
from .config import CalibrateConfig, GenerationConfig
from .base import context_limit
from .decoding import Batch
from .heads_draft import propose, propose_confident
from .config import cache_root
from .guard import Guard, Ladder, first_sizes, interpolate, yields
from .kernels import (Q8_KINDS, block_codes, code_digest, cpu_variants, guess_projection, reads_blocks,
                      reset_kernels, set_guess_vocab, variant)
from .formats import CALIBRATION_NAME, TREE_NAME
from .training import positions
from .training import data
from .training.data import IGNORE_INDEX, build_examples
from .tree import Tree, build

Node = tuple[int, ...]  # a tree node's path: the rank taken in each head's top-k, root excluded
PLOT_NAMES = {"accuracy": "accuracy.png", "tree": "tree.png", "speed": "tokens_per_s.png", "yields": "yields.png"}
DEFAULTS = CalibrateConfig()
HEADS_CHUNK = 256  # positions per heads call: K x 256 x V logits stay ~200 MB for a 50k vocabulary
TRIED_SIZES = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128)
STALE_FIT = 1.4  # a cached fit whose plain step is this much slower than now was timed under load (noise: a few %)


def path_probability(path: Node, accuracy: torch.Tensor) -> float:
    """prod_j a_{j-1}^(r_j): the probability that every token on the path is correct."""
    return math.prod(float(accuracy[depth, rank]) for depth, rank in enumerate(path))


def expected_acceptance(paths, accuracy: torch.Tensor) -> float:
    """Expected accepted candidates per step of the tree `paths` under independence (add 1 for tokens/step).

    accuracy: [K, S], a_k^(i) = P(head k's rank-i token is correct).

    >>> expected_acceptance([(0,), (0, 0)], torch.tensor([[0.5, 0.25], [0.5, 0.25]]))
    0.75
    """
    return sum(path_probability(tuple(p), accuracy) for p in paths)


def check_accuracy(accuracy: torch.Tensor) -> None:
    if accuracy.ndim != 2 or accuracy.numel() == 0:
        raise ValueError(f"accuracy must be a non-empty [heads, ranks] table, got shape {list(accuracy.shape)}")
    if accuracy.min() < 0 or accuracy.max() > 1:
        raise ValueError(f"accuracy: probabilities must lie in [0, 1], got {accuracy.min():.3g}..{accuracy.max():.3g}")


def grow_tree(accuracy: torch.Tensor, num_nodes: int) -> tuple[list[Node], list[float]]:
    """Greedy tree search: (paths in the order added, expected acceptance after each addition).

    The first n paths are the best tree of n nodes; fewer than num_nodes come back only when every
    node of depth <= K and rank < S is in. accuracy: [K, S].

    >>> grow_tree(torch.tensor([[0.5, 0.25], [0.5, 0.25]]), 3)   # (1,) ties (0, 0): the shallower first
    ([(0,), (1,), (0, 0)], [0.5, 0.75, 1.0])
    """
    check_accuracy(accuracy)
    if not isinstance(num_nodes, int) or num_nodes < 1:
        raise ValueError(f"num_nodes must be a positive integer, got {num_nodes!r}")
    depth, ranks = accuracy.shape
    # heap entries (-probability, depth, path): on ties the parent (shorter) comes first
    frontier = [(-path_probability((r,), accuracy), 1, (r,)) for r in range(ranks)]
    heapq.heapify(frontier)
    paths, expected = [], []
    while frontier and len(paths) < num_nodes:
        negative, length, path = heapq.heappop(frontier)
        paths.append(path)
        expected.append((expected[-1] if expected else 0.0) - negative)
        if length < depth:
            for r in range(ranks):
                child = path + (r,)
                heapq.heappush(frontier, (-path_probability(child, accuracy), length + 1, child))
    return paths, expected


def greedy_trees(accuracy: torch.Tensor, sizes) -> list[Tree]:
    """The best tree of each size: the first n nodes of the greedy tree search. accuracy: [K, S]"""
    paths, _ = grow_tree(accuracy, max(sizes))
    if len(paths) < max(sizes):
        raise ValueError(f"tree sizes: the heads allow at most {len(paths)} nodes, asked for {max(sizes)}")
    return [build(tuple(paths[:n])) for n in sizes]


def tried_sizes(max_nodes: int) -> list[int]:
    """The tree sizes whose step latency is measured: every size up to 6, then ever sparser (latency is smooth)."""
    return sorted({n for n in TRIED_SIZES if n <= max_nodes} | {max_nodes})


@dataclass(frozen=True)
class Calibration:
    """What calibration found; the per-size lists follow `sizes`, whose 0 is plain decoding."""

    accuracy: list[list[float]]  # [K, S]
    paths: list[Node]  # the greedy order: paths[:n] is the best tree of n nodes
    sizes: list[int]  # tree sizes measured (candidates, root not counted), 0 first
    expected_tokens: list[float]  # 1 + expected acceptance, per size
    contexts: list[int]  # [C] context lengths the step latency was measured at, increasing
    latency_s: list[list[float]]  # [C][sizes] measured seconds per decoding step
    tokens_per_s: list[float]  # predicted at the middle context, contexts[C // 2]: expected_tokens / latency_s
    size: int  # the chosen size, >= 1: the fastest predicted at the middle context
    guess_vocab: list[int] | None = None  # the tokens the heads guess from (kernels.set_guess_vocab); None: all
    batch_sizes: list[int] = (1,)  # batches the ladder's step latency was measured at
    batch_latency_s: list[list[float]] | None = None  # [batch_sizes][ladder trees] a batch's step seconds
    # tokens per step measured by simulating each size's tree on the data (measure_yields): the static tree (paths[:n])
    # and the confident one (each step's likeliest n); None where calibrated before they were
    simulated_tokens: list[float] | None = None
    confident_tokens: list[float] | None = None
    confident_size: int | None = None  # the size confident trees decode fastest at (their tokens, the same latency)

    @property
    def tree_paths(self) -> list[Node]:
        return self.paths[: self.size]

    def ladder(self, confident: bool = False) -> Ladder:
        """The trees `--tree auto` chooses among at run time (guard.py): the chosen one and every smaller size
        (confident: `--tree confident`'s sizes, each step's likeliest nodes)."""
        return ladder(torch.tensor(self.accuracy, dtype=torch.float64), self.sizes, self.contexts, self.latency_s,
                      self.size, self.batch_sizes, self.batch_latency_s, self.confident_size,
                      self.confident_tokens if confident else None)


def ladder(accuracy: torch.Tensor, sizes: list[int], contexts: list[int], latency_s: list[list[float]],
           size: int, batch_sizes=(1,), batch_latency_s: list[list[float]] | None = None,
           confident_size: int | None = None, confident_tokens: list[float] | None = None) -> Ladder:
    """The best tree of each of `sizes` up to the chosen `size` (accuracy [K, S]), their expected tokens per step and
    step latency. Larger trees are left out: on this calibration they are predicted slower, and whether one beats
    the chosen tree on a prompt hinges on a few percent that per-request estimates cannot resolve (measured:
    picking a 4-candidate tree over the chosen 3 on math prompts lost 3%).

    confident_tokens (measure_yields' per size): the ladder of confident trees instead, up to confident_size, with
    those tokens per step; its trees stand for their sizes. batch_latency_s covers the trees up to the larger size.
    """
    confident = confident_tokens is not None and confident_size is not None
    top = confident_size if confident else size
    paths, expected = grow_tree(accuracy, top)
    kept = [i for i, n in enumerate(sizes) if n <= top]
    tokens = [confident_tokens[i] if confident else 1.0 + (expected[sizes[i] - 1] if sizes[i] else 0.0) for i in kept]
    return Ladder(trees=tuple(build(tuple(paths[: sizes[i]])) for i in kept), expected_tokens=tuple(tokens),
                  contexts=tuple(contexts), latency_s=tuple(tuple(row[i] for i in kept) for row in latency_s),
                  batch_sizes=tuple(batch_sizes),
                  batch_latency_s=None if batch_latency_s is None else tuple(tuple(row[: len(kept)]) for row in batch_latency_s),
                  confident=confident)


def choose_tree(accuracy: torch.Tensor, sizes: list[int], contexts: list[int], latencies: list[list[float]],
                confident_tokens: list[float] | None = None) -> Calibration:
    """The tree size with the most predicted tokens/s at the middle context. latencies[c][i]: step seconds with
    sizes[i] candidates at contexts[c] tokens. confident_tokens: confident trees' tokens per step per size
    (measure_yields), whose fastest size is chosen too: they verify as many nodes as a static tree, at its cost."""
    if len(sizes) < 2 or sizes[0] != 0 or sorted(set(sizes)) != sizes:
        raise ValueError(f"latencies: need step times for sizes 0 < n1 < n2 < ..., got sizes {sizes!r}")
    if not contexts or len(latencies) != len(contexts) or any(len(row) != len(sizes) for row in latencies):
        raise ValueError(f"latencies: need one step time per size at each of the contexts {contexts!r}")
    if min(map(min, latencies)) <= 0:
        raise ValueError(f"latencies: step times must be positive, got {latencies!r}")
    assert confident_tokens is None or len(confident_tokens) == len(sizes), "confident tokens: one per size"
    paths, expected = grow_tree(accuracy, sizes[-1])
    if len(paths) < sizes[-1]:
        raise ValueError(f"latencies: size {sizes[-1]} measured, but the heads allow only {len(paths)} nodes")
    tokens = [1.0 + (expected[n - 1] if n else 0.0) for n in sizes]
    middle = latencies[len(contexts) // 2]
    speed = [t / s for t, s in zip(tokens, middle)]
    best = max(range(1, len(sizes)), key=speed.__getitem__)
    confident = None if confident_tokens is None else max(range(1, len(sizes)),
                                                          key=lambda i: confident_tokens[i] / middle[i])
    return Calibration(accuracy.tolist(), paths, list(sizes), tokens, list(contexts), [list(r) for r in latencies],
                       speed, sizes[best], confident_tokens=confident_tokens,
                       confident_size=None if confident is None else sizes[confident])


@torch.inference_mode()
def answer_positions(medusa, conversations: list[list[dict]], config: CalibrateConfig = DEFAULTS
                     ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]]:
    """The answer positions of `conversations`, teacher-forced, a batch of conversations at a time, as training reads
    them: (the heads' input state [n, (1 + L) H] (heads.run_backbone) at each position t where some head has a target,
    targets [K, n] (token t+k+2, IGNORE_INDEX past the answer), what hydra heads read of the true tokens after t
    [n, K, H] (else None), roots [n]: token t+1)."""
    model, heads, tokenizer = medusa.model, medusa.heads, medusa.tokenizer
    examples = build_examples(tokenizer, conversations, config.max_length)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    for state, targets, path in positions.answer_positions(model, heads, examples, pad_id, config.batch_size):
        yield state, targets, positions.path_embeddings(heads.config, model.get_input_embeddings(), path), path[:, 0]


def measure_accuracy(medusa, conversations: list[list[dict]], config: CalibrateConfig = DEFAULTS) -> torch.Tensor:
    """a_k^(i) [K, S] over the answer tokens of `conversations` (chat messages, e.g. `medusa distill`'s).

    Teacher-forced, as in training: at every position t whose token t+k+2 is an answer token, does
    head k rank that token i-th? (Hydra heads read the true tokens before it: the accuracy given that the path up
    to the guess is right, what a path's acceptance multiplies.) Stops after config.max_positions positions with a
    head-0 target.
    """
    from tqdm.auto import tqdm

    heads = medusa.heads
    num_heads, ranks = heads.config.num_heads, min(config.top_k, heads.config.vocab_size)
    hits = torch.zeros(num_heads, ranks, dtype=torch.long)
    counts = torch.zeros(num_heads, dtype=torch.long)
    lm_head = guess_projection(medusa.model)  # as the decoding loop guesses
    progress = tqdm(total=config.max_positions, desc="calibrate: head accuracy", unit="pos")
    with torch.inference_mode():
        for hidden, targets, embeds, _ in answer_positions(medusa, conversations, config):
            paths = itertools.repeat(None) if embeds is None else embeds.split(HEADS_CHUNK)
            for chunk_hidden, chunk_targets, chunk_embeds in zip(hidden.split(HEADS_CHUNK),
                                                                 targets.split(HEADS_CHUNK, dim=1), paths):
                top = heads.guesses(chunk_hidden, lm_head, ranks, embeds=chunk_embeds)  # [K, n, S]
                hits += (top == chunk_targets[..., None]).sum(1).cpu()  # an ignored target (-100) never matches
                counts += (chunk_targets != IGNORE_INDEX).sum(-1).cpu()
            progress.update(min(int(counts[0]), config.max_positions) - progress.n)
            if counts[0] >= config.max_positions:
                break
    progress.close()
    if counts[0] == 0:
        raise ValueError("calibration data: no answer token has a head target (answers too short)")
    return hits.double() / counts.clamp(min=1)[:, None]


def measure_yields(medusa, conversations: list[list[dict]], paths: list[Node], sizes: list[int],
                   config: CalibrateConfig = DEFAULTS) -> tuple[list[float], list[float]]:
    """Tokens per step of the static tree of each size (paths[:n]: the greedy order) and of the confident tree of each
    size, counted on about config.simulated_positions answer positions spread over all the data (every s-th position
    of every s-th conversation: neighbours are alike, and files differ), from the decoding loop's own proposals at
    each (heads_draft.propose, propose_confident; the root: the answer's next token) and the guard's count of what
    each tree accepts of the tokens that follow (guard.yields). What choose_tree predicts from products of
    accuracies, which assumes the heads right or wrong independently, measured; and for confident trees, whose
    nodes change every step, the only prediction there is."""
    from tqdm.auto import tqdm

    heads, largest = medusa.heads, build(tuple(paths[: sizes[-1]]))
    lm_head, embed = guess_projection(medusa.model), medusa.model.get_input_embeddings()
    static, confident, seen = [0] * len(sizes), [0] * len(sizes), 0
    first = first_sizes(paths, sizes)
    answers = sum(label != IGNORE_INDEX for example in build_examples(medusa.tokenizer, conversations, config.max_length)
                  for label in example["labels"])
    stride = math.ceil(math.sqrt(answers / config.simulated_positions))
    progress = tqdm(total=min(config.simulated_positions, math.ceil(answers / stride ** 2)), desc="calibrate: tree yields",
                    unit="pos")  # about: answers per conversation vary
    with torch.inference_mode():
        for hidden, targets, _, roots in answer_positions(medusa, conversations[::stride], config):
            for t in range(0, len(roots), stride):
                truth = targets[:, t].tolist()
                truth = truth[: truth.index(IGNORE_INDEX)] if IGNORE_INDEX in truth else truth
                _, guesses = propose(heads, lm_head, embed, hidden[t], int(roots[t]), largest, largest)
                counted = yields(guesses if isinstance(guesses, dict) else guesses.tolist(), truth, first, len(sizes))
                static = [a + b for a, b in zip(static, counted)]
                _, _, (tops, ranked) = propose_confident(heads, lm_head, embed, hidden[t], int(roots[t]), sizes[-1],
                                                         sizes[-1])
                counted = yields(tops, truth, first_sizes(ranked, sizes), len(sizes))
                confident = [a + b for a, b in zip(confident, counted)]
                seen += 1
                progress.update()
                if seen == config.simulated_positions:
                    break
            if seen == config.simulated_positions:
                break
    progress.close()
    if not seen:
        raise ValueError("calibration data: no answer token has a head target (answers too short)")
    return [n / seen for n in static], [n / seen for n in confident]


def latency_contexts(medusa, trees: list[Tree], config: CalibrateConfig = DEFAULTS) -> list[int]:
    """config.latency_contexts, each cut to what the model's context leaves room for beside the largest tree and
    the step after it (a budget that no step of it exhausts: measure_step_latency)."""
    room = context_limit(medusa.model) - step_budget(trees)
    return sorted({max(1, min(context, room)) for context in config.latency_contexts})


def step_budget(trees: list[Tree]) -> int:
    """New tokens that no two steps of any of `trees` exhaust, nor cut the next step's tree short (time_steps takes
    two steps a timing on the compiled engine)."""
    return max(t.num_nodes for t in trees) + 2 * max(t.depth for t in trees) + 4


def measure_step_latency(medusa, trees: list[Tree], config: CalibrateConfig = DEFAULTS, confident: bool = False
                         ) -> tuple[list[int], list[list[float]]]:
    """Median seconds of one full decoding step (decoding.Batch.step: guess, verify, greedy accept, commit, on the
    engine that decodes: eager or compiled) per tree, at each of the contexts `latency_contexts` gives: (contexts [C],
    seconds [C][len(trees)]). confident: each step picks its tree's size of likeliest nodes, as such a decoder does
    (on the host path, dearer than a static tree's step).

    The row goes back to the prefix after every step, so each starts alike; the trees take turns (time_steps).
    """
    model, heads, device = medusa.model, medusa.heads, medusa.model.device
    contexts = latency_contexts(medusa, trees, config)
    # the tree alone: lookup drafts would graft chains onto it (a rewound row repeats the text they copy)
    budget = GenerationConfig(max_new_tokens=step_budget(trees), lookup=0)
    table = []
    for prefix_len in contexts:
        prompt = torch.randint(heads.config.vocab_size, (prefix_len,), generator=torch.Generator().manual_seed(0))
        batch = Batch(model, heads, medusa.compiled)
        row = batch.join(prompt.to(device), budget, trees[0])  # no EOS: the row stays
        start = (row.root, row.heads_input, row.length, row.produced)

        def rewind(row=row, batch=batch, start=start) -> None:  # back to the prefix alone
            row.root, row.heads_input, row.length, row.produced = start
            with torch.inference_mode():
                kv.commit(batch.cache, [row.length], [[]])

        table.append(time_steps(batch, trees, config, rewind, f", {prefix_len}-token context", confident))
    return contexts, table


def time_steps(batch: Batch, trees: list[Tree], config: CalibrateConfig, rewind=None, what: str = "",
               confident: bool = False) -> list[float]:
    """Median seconds of a step of `batch` whose rows all verify the same tree, per tree. The trees take turns, so a
    burst of load from elsewhere slows all of them, not one; the first round is a warm-up (where the compiled engine
    compiles each tree size: minutes, hence the progress bar). rewind: run after each step."""
    from tqdm.auto import tqdm

    device, times = batch.model.device, [[] for _ in trees]
    bar = tqdm(total=len(trees) * (config.latency_repeats + 1), desc=f"step latency{what}", unit="step", leave=False)
    for _ in range(config.latency_repeats + 1):
        for tree, timed in zip(trees, times):
            for row in batch.rows:
                row.heads.guard = Guard(Ladder.fixed(tree, confident), row.root)
            if batch.engine.device_tree(batch.rows) is not None:  # a step that builds the rows' device state: the next one is timed
                batch.step()
            synchronize(device)
            start = time.perf_counter()
            batch.step()
            synchronize(device)
            timed.append(time.perf_counter() - start)
            bar.update()
            if rewind is not None:
                rewind()
    bar.close()
    return [statistics.median(timed[1:]) for timed in times]


def device_name(device: torch.device) -> str:
    """The CUDA device's name, or the CPU's model name, family and model number (Xeons of different generations
    share a name) and the threads torch uses."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        fields = dict(map(str.strip, line.split(":", 1)) for line in cpuinfo.read_text().splitlines() if ":" in line)
        if "model name" in fields:
            cpu = f"{fields['model name']} (family {fields.get('cpu family', '?')}, model {fields.get('model', '?')})"
    threads = torch.get_num_threads()
    return f"{cpu}, {threads} thread{'s' if threads > 1 else ''}"


def setup(medusa) -> str:
    """What a step latency holds for: the device, the model's dtype and its kernels (and whether they read blocks, and
    the instruction set they were built for where $MEDUSA_ISA forces one this CPU would not pick: the AVX2 build on
    an AVX-512 machine stands for an AVX2 machine, and its trees are fitted as there)."""
    dtype = str(medusa.model.dtype).removeprefix("torch.")
    blocks = " on GGUF blocks" if reads_blocks(medusa.model) else ""
    kernels = ON_THE_OTHER_ENGINE.get((medusa.kernels, medusa.compiled), medusa.kernels)
    forced = f", {variant()} build" if medusa.model.device.type == "cpu" and variant() != cpu_variants()[0] else ""
    return f"{device_name(medusa.model.device)}, {dtype}, {kernels} kernels{blocks}{forced}"


# what runs where a bench rival decodes the model's kernels (key) on the other engine: its latency is that one's
ON_THE_OTHER_ENGINE = {("stock", True): "compiled", ("native", True): "compiled", ("q8", True): "compiled-q8",
                       ("compiled", False): "native", ("compiled-q8", False): "q8"}


def choose_kernels(model, heads, medusa_on, config: CalibrateConfig = DEFAULTS) -> str:
    """kernels="auto" on a CPU in float32: of stock (where the model has float32 weights), native and (where some
    weights are blocks q8 reads: Q4_1 or Q8_0, or a GGUF file's Q4_K or Q6_K) q8, the kernels whose plain step and 3-candidate step take least time together
    on this machine, timed side by side on `model` itself (switched in turn, then back), once per setup: cached under
    cache_root()/kernels, keyed like the tree fits. Never slower than stock where stock is one of those timed. Says
    what it picked, and why, in one line.
    medusa_on(kernels): the MedusaModel of `model` and `heads` on those kernels."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    gguf = "blocks" in linears[0]._buffers  # a model read at its GGUF file's bytes: no float32 weights for stock
    q8 = any(m.kind in Q8_KINDS for m in linears) if gguf else block_codes(linears[0].weight) is not None
    candidates = ([] if gguf else ["stock"]) + ["native"] + (["q8"] if q8 else [])
    what = [device_name(model.device), str(model.dtype), model.name_or_path, model.config.to_diff_dict(),
            code_digest(), torch.__version__, candidates]
    key = hashlib.sha256(json.dumps(what, default=str).encode()).hexdigest()[:24]
    cached = cache_root() / "kernels" / f"auto-{key}.json"
    if cached.is_file():
        return json.loads(cached.read_text())["kernels"]
    trees = [Tree.from_spec([]), Tree.from_spec([3])]
    once = replace(config, latency_contexts=(config.latency_contexts[0],), latency_repeats=3)
    seconds = {}
    for name in candidates:
        medusa = medusa_on(name)
        seconds[name] = measure_step_latency(medusa, trees, once)[1][0]
        reset_kernels(model), reset_kernels(heads)
    best = min(candidates, key=lambda name: sum(seconds[name]))
    times = ", ".join(f"{name} {plain * 1e3:.1f} / {tree * 1e3:.1f}" for name, (plain, tree) in seconds.items())
    print(f"medusa: kernels auto -> {best}: the fastest here (ms a plain / 3-candidate step: {times}; measured once, "
          f"cached in {cached.parent})", file=sys.stderr)
    cached.parent.mkdir(parents=True, exist_ok=True)
    record = {"kernels": best, "setup": what[0], "latency_ms": {n: [t * 1e3 for t in s] for n, s in seconds.items()}}
    tmp = cached.with_suffix(".tmp")
    tmp.write_text(json.dumps(record) + "\n")
    tmp.replace(cached)
    return best


def measure_batch_latency(medusa, trees: list[Tree], config: CalibrateConfig = DEFAULTS) -> list[list[float]]:
    """Median seconds of one step of a batch (decoding.Batch) whose rows all verify the same tree, per batch size
    of config.batch_sizes and per tree: [batch_sizes][trees]. Rows of random prompts at the first latency context;
    the trees take turns (time_steps)."""
    model, device = medusa.model, medusa.model.device
    context = latency_contexts(medusa, trees, config)[0]
    longest = max(t.depth for t in trees) + 1  # the most a step yields
    # no row done, no tree cut at the budget's end, whatever is accepted (not a token per node: the context is finite);
    # the compiled engine takes two steps a timing (time_steps)
    budget = GenerationConfig(max_new_tokens=longest * (2 * (config.latency_repeats + 1) * len(trees) + 1) + 1,
                              lookup=0)
    table = []
    for rows in config.batch_sizes:
        batch = Batch(model, medusa.heads, medusa.compiled)
        for row in range(rows):
            prompt = torch.randint(medusa.heads.config.vocab_size, (context,), generator=torch.Generator().manual_seed(row))
            batch.join(prompt.to(device), budget, trees[0])  # no EOS: every row stays to the end
        table.append(time_steps(batch, trees, config, what=f", batches of {rows}"))
    return table


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fit_tree(medusa, accuracy: torch.Tensor, config: CalibrateConfig = DEFAULTS,
             confident_tokens: list[float] | None = None) -> Calibration:
    """The step latency of the greedy tree of each tried size up to max_nodes, then the fastest predicted (for
    confident trees too, given their tokens per size); then the latency of the trees the guard may pick against the
    batch size."""
    sizes = fit_sizes(accuracy, config)
    fitted = choose_tree(accuracy, sizes, *latency_model(medusa, accuracy, sizes, config), confident_tokens)
    return with_batch_latency(medusa, fitted, config)


def latency_model(medusa, accuracy: torch.Tensor, sizes: list[int], config: CalibrateConfig = DEFAULTS
                  ) -> tuple[list[int], list[list[float]]]:
    """measure_step_latency's (contexts, seconds [contexts][sizes]) for every size, measured at the sizes up to 4, the
    powers of 2 and the largest, at the shortest and longest context, and linear between: a step's cost is smooth in
    the nodes and linear in the context (attention), and a fit then takes seconds, not minutes."""
    measured = [n for n in sizes if n <= 4 or n & (n - 1) == 0 or n == sizes[-1]]
    ends = replace(config, latency_contexts=(min(config.latency_contexts), max(config.latency_contexts)))
    at, table = measure_step_latency(medusa, greedy_trees(accuracy, measured), ends)
    rows = tuple(tuple(interpolate(tuple(measured), tuple((t,) for t in row), n)[0] for n in sizes) for row in table)
    contexts = latency_contexts(medusa, greedy_trees(accuracy, sizes[-1:]), config)
    return contexts, [interpolate(tuple(at), rows, context) for context in contexts]


def fit_sizes(accuracy: torch.Tensor, config: CalibrateConfig = DEFAULTS) -> list[int]:
    """The tree sizes a fit measures: up to max_nodes, fewer where the heads allow fewer nodes."""
    return tried_sizes(len(grow_tree(accuracy, config.max_nodes)[0]))


def with_batch_latency(medusa, fitted: Calibration, config: CalibrateConfig = DEFAULTS) -> Calibration:
    """The fit, with the step latency of its ladders' trees (auto's and confident's) against the batch size."""
    trees = max(fitted.ladder().trees, fitted.ladder(confident=True).trees, key=len)
    batches = measure_batch_latency(medusa, list(trees), config)
    return replace(fitted, batch_sizes=list(config.batch_sizes), batch_latency_s=batches)


def calibrate(medusa, conversations: list[list[dict]], config: CalibrateConfig = DEFAULTS,
              vocab_conversations: list[list[dict]] | None = None) -> Calibration:
    """The tokens the heads guess from (those `vocab_conversations`' answers use most, the conversations' where
    None), the accuracy table of those guesses on the conversations, the tokens per step of every tree size simulated
    on them, then the trees fitted to this device. A calibration set of some 40k answer tokens fills a 4096-token
    vocabulary with tokens seen once or twice: the training answers, a hundred times more, rank it better."""
    vocab = guess_vocab(medusa, conversations if vocab_conversations is None else vocab_conversations, config)
    set_guess_vocab(medusa.model, vocab)
    accuracy = measure_accuracy(medusa, conversations, config)
    sizes = fit_sizes(accuracy, config)
    simulated, confident = measure_yields(medusa, conversations, grow_tree(accuracy, sizes[-1])[0], sizes, config)
    calibration = fit_tree(medusa, accuracy, config, confident)
    return replace(calibration, guess_vocab=None if vocab is None else vocab.tolist(), simulated_tokens=simulated)


def guess_vocab(medusa, conversations: list[list[dict]], config: CalibrateConfig = DEFAULTS) -> torch.Tensor | None:
    """The config.guess_vocab tokens the conversations' answers use most, most used first (then unused ones by id),
    or None: the whole vocabulary (guess_vocab 0 or not smaller, or heads with projections of their own)."""
    size = medusa.heads.config.vocab_size
    if not config.guess_vocab or config.guess_vocab >= size or medusa.heads.config.projection != "shared":
        return None
    return data.answer_vocab(build_examples(medusa.tokenizer, conversations, config.max_length), size, config.guess_vocab)


def save(calibration: Calibration, directory: str | Path, setup: str) -> None:
    """tree.json (read by MedusaModel.from_pretrained beside the heads), accuracy.json and three PNGs."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / TREE_NAME).write_text(json.dumps([list(p) for p in calibration.tree_paths]) + "\n")
    record = {**asdict(calibration), "paths": [list(p) for p in calibration.paths], "setup": setup}
    (directory / CALIBRATION_NAME).write_text(json.dumps(record, indent=1) + "\n")
    plot(calibration, directory, setup)


# what the guard's ladder is built from (confident_size: where confident trees were fitted too)
FIT = ("sizes", "contexts", "latency_s", "size", "batch_sizes", "batch_latency_s", "confident_size")


class HeadsCalibration(NamedTuple):
    """What `medusa calibrate` left beside the heads."""

    accuracy: torch.Tensor  # [K, S]
    setup: str | None  # what the latency was measured on
    guess_vocab: torch.Tensor | None  # the tokens the heads guess from; None: all
    fit: dict | None  # FIT's fields, measured on `setup`; None where the record predates latency by context
    confident_tokens: list[float] | None  # confident trees' tokens per step, per size of the fit (measure_yields)


def confident_yield(calibration: HeadsCalibration, size: int) -> float:
    """Tokens a step of `size` confident candidates yields: the calibration's simulation, linear between its sizes;
    beyond them, or where it simulated none, the static tree of that size's (a floor)."""
    sizes = calibration.fit["sizes"] if calibration.fit else []
    if calibration.confident_tokens and sizes and size <= sizes[-1]:
        return interpolate(sizes, [(t,) for t in calibration.confident_tokens], size)[0]
    return 1.0 + grow_tree(calibration.accuracy, size)[1][-1]


def read_accuracy(heads_dir: str | Path) -> HeadsCalibration | None:
    """The heads' calibration (accuracy.json), if they have one."""
    path = Path(heads_dir) / CALIBRATION_NAME
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        vocab = record.get("guess_vocab")
        vocab = None if vocab is None else torch.tensor(vocab, dtype=torch.long)
        fit = {name: record[name] for name in FIT if name in record} if "contexts" in record else None
        return HeadsCalibration(torch.tensor(record["accuracy"], dtype=torch.float64), record.get("setup"), vocab, fit,
                                record.get("confident_tokens"))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as error:
        raise ValueError(f"calibration: {path} is not a valid accuracy table: {error}") from None


def auto_tree(medusa, heads_dir: str | Path, calibration: HeadsCalibration, config: CalibrateConfig = DEFAULTS,
              confident: bool = False) -> Ladder:
    """`--tree auto`: the trees fitted to these heads, this model and this device, from the heads' calibration
    (`read_accuracy(heads_dir)`), as a Ladder for the guard to choose from at run time (confident: `--tree
    confident`'s, where the calibration simulated confident trees, else auto's).

    The calibration's own latency fit where it was measured on this very setup; else one fitted now (seconds of
    latency measurement), cached under cache_root()/trees, keyed by model, heads, setup, the kernels' code and what
    is measured.
    """
    here, fit, tokens = setup(medusa), calibration.fit, calibration.confident_tokens
    if calibration.setup == here and fit is not None and "batch_latency_s" in fit:  # measured on this very setup
        return ladder(calibration.accuracy, **fit, confident_tokens=tokens if confident else None)
    if fit is None or fit["sizes"] != fit_sizes(calibration.accuracy, config):
        tokens = None  # confident trees' tokens per size of the calibration's fit: not the sizes a refit measures
    vocab = calibration.guess_vocab
    what = [medusa.model.name_or_path, asdict(medusa.heads.config), calibration.accuracy.tolist(), here, code_digest(),
            None if vocab is None else vocab.tolist(), config.max_nodes, config.latency_contexts,
            config.batch_sizes, tokens]  # all the fit depends on
    key = hashlib.sha256(json.dumps(what).encode()).hexdigest()[:24]
    cached = cache_root() / "trees" / f"{key}.json"
    if cached.is_file():
        record = json.loads(cached.read_text())
        if not timed_under_load(medusa, record, config):
            return ladder(calibration.accuracy, **{name: record[name] for name in FIT},
                          confident_tokens=tokens if confident else None)
        print("tree auto: the cached fit's plain step is slower than this machine's now (timed under load): fitting "
              "again", file=sys.stderr)
    print(f"tree auto: fitting the trees to {here} (once; cached in {cached.parent})", file=sys.stderr)
    fitted = fit_tree(medusa, calibration.accuracy, config, tokens)
    cached.parent.mkdir(parents=True, exist_ok=True)
    record = {"tree": [list(p) for p in fitted.tree_paths], "setup": here, "model": medusa.model.name_or_path,
              "heads": str(heads_dir), "tokens_per_s": fitted.tokens_per_s, **{name: getattr(fitted, name) for name in FIT}}
    tmp = cached.with_suffix(".tmp")
    tmp.write_text(json.dumps(record) + "\n")
    tmp.replace(cached)  # whole or not at all
    return fitted.ladder(confident)


def timed_under_load(medusa, record: dict, config: CalibrateConfig = DEFAULTS) -> bool:
    """Whether a cached fit's plain step at its shortest context is STALE_FIT times slower than one timed now. Load
    from elsewhere only slows steps, so such a fit was timed under load, and its trees' relative costs with it;
    it is fitted again. A fit faster than now stands: this moment is the loaded one, which the guard's own timing
    corrects."""
    context = record["contexts"][0]
    _, ((now, *_),) = measure_step_latency(medusa, [build(())], replace(config, latency_contexts=(context,)))
    return record["latency_s"][0][0] > STALE_FIT * now


def plot(calibration: Calibration, directory: Path, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for name, draw in (("accuracy", plot_accuracy), ("tree", plot_tree), ("speed", plot_speed), ("yields", plot_yields)):
        if name == "yields" and calibration.simulated_tokens is None:
            continue
        figure = draw(plt, calibration, device)
        figure.tight_layout()
        figure.savefig(directory / PLOT_NAMES[name], dpi=100)
        plt.close(figure)


def plot_accuracy(plt, calibration: Calibration, device: str):
    """Heatmap of a_k^(i), each cell labelled."""
    table = torch.tensor(calibration.accuracy)
    figure, axes = plt.subplots(figsize=(1.0 + 0.7 * table.shape[1], 1.2 + 0.6 * table.shape[0]))
    image = axes.imshow(table.numpy(), cmap="viridis", vmin=0, vmax=max(float(table.max()), 1e-9), aspect="auto")
    for (k, i), value in zip(itertools.product(*map(range, table.shape)), table.flatten().tolist()):
        axes.text(i, k, f"{value:.2f}", ha="center", va="center", fontsize=8,
                  color="black" if value > 0.6 * float(table.max()) else "white")
    axes.set_xticks(range(table.shape[1]))
    axes.set_yticks(range(table.shape[0]), [f"head {k} (t+{k + 2})" for k in range(table.shape[0])])
    axes.set_xlabel("rank i in the head's top-k")
    axes.set_title("P(head k's rank-i token is correct)")
    figure.colorbar(image, ax=axes)
    return figure


def plot_tree(plt, calibration: Calibration, device: str):
    """The chosen tree: columns by depth, leaves one row each, nodes labelled head/rank and path probability."""
    table = torch.tensor(calibration.accuracy)
    paths = sorted(calibration.tree_paths, key=lambda p: (len(p), p))
    children = {(): []} | {p: [] for p in paths}
    for p in paths:
        children[p[:-1]].append(p)
    rows: dict[tuple, float] = {}

    def place(node: tuple, next_row: float) -> float:  # depth-first; a parent sits at its children's mean row
        if not children[node]:
            rows[node] = next_row
            return next_row + 1
        for child in sorted(children[node]):
            next_row = place(child, next_row)
        rows[node] = sum(rows[c] for c in children[node]) / len(children[node])
        return next_row

    leaves = place((), 0)
    depth = max((len(p) for p in paths), default=0)
    figure, axes = plt.subplots(figsize=(2.0 + 2.2 * depth, 1.0 + 0.32 * leaves))
    for p in paths:
        axes.plot([len(p) - 1, len(p)], [rows[p[:-1]], rows[p]], color="0.6", lw=0.8, zorder=1)
    axes.scatter([0], [rows[()]], s=60, color="black", zorder=2)
    axes.annotate("root", (0, rows[()]), xytext=(-6, 0), textcoords="offset points", ha="right", va="center",
                  fontsize=8)
    probabilities = [path_probability(p, table) for p in paths]
    axes.scatter([len(p) for p in paths], [rows[p] for p in paths], c=probabilities, cmap="viridis", vmin=0, vmax=1,
                 s=40, zorder=2)
    for p, probability in zip(paths, probabilities):
        axes.annotate(f"h{len(p) - 1} r{p[-1]}  {probability:.2f}", (len(p), rows[p]), xytext=(6, 0),
                      textcoords="offset points", va="center", fontsize=7)
    axes.set_xticks(range(depth + 1), ["root"] + [f"head {k}" for k in range(depth)])
    axes.set_xlim(-0.6, depth + 0.9)
    axes.invert_yaxis()
    axes.set_yticks([])
    expected = calibration.expected_tokens[calibration.sizes.index(calibration.size)]
    axes.set_title(f"chosen tree: {calibration.size} candidates, {expected:.2f} expected tokens/step\n"
                   f"(labels: head, rank, probability the whole path is accepted)", fontsize=9)
    return figure


def plot_speed(plt, calibration: Calibration, device: str):
    """Predicted tokens/s against tree size at each measured context, the measured step latency on a second axis."""
    sizes = calibration.sizes
    figure, axes = plt.subplots(figsize=(8, 4.5))
    latency = axes.twinx()
    for c, (context, row) in enumerate(zip(calibration.contexts, calibration.latency_s)):
        color = plt.cm.viridis(0.8 * c / max(len(calibration.contexts) - 1, 1))  # dark to green: no pale yellow
        speed = [tokens / seconds for tokens, seconds in zip(calibration.expected_tokens, row)]
        axes.plot(sizes, speed, marker=".", color=color, label=f"predicted tokens/s, {context}-token context")
        axes.axhline(speed[0], color=color, ls=":", lw=1)
        latency.plot(sizes, [1000 * s for s in row], color=color, ls="--", lw=1, label=f"step ms, {context} tokens")
    axes.axvline(calibration.size, color="tab:green", ls="--", lw=1, label=f"chosen: {calibration.size} candidates")
    axes.set_xlabel("tree size (candidate nodes; dotted: plain decoding)")
    axes.set_ylabel("predicted tokens / s (solid)")
    latency.set_ylabel("measured step latency, ms (dashed)")
    latency.set_ylim(bottom=0)
    lines = axes.get_legend_handles_labels()
    more = latency.get_legend_handles_labels()
    axes.legend(lines[0] + more[0], lines[1] + more[1], loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3,
                fontsize=7, frameon=False)
    axes.set_title(f"tree size vs speed: (1 + expected acceptance) / step latency\n{textwrap.fill(device, 100)}",
                   fontsize=9)
    return figure


def plot_yields(plt, calibration: Calibration, device: str):
    """Tokens per step against tree size: predicted from the accuracy table, and simulated on the data (measure_yields)
    for the static trees and for confidence-driven ones."""
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for tokens, label, style in ((calibration.expected_tokens, "static tree, predicted (products of accuracies)", ":"),
                                 (calibration.simulated_tokens, "static tree, simulated on the data", "-"),
                                 (calibration.confident_tokens, "confident tree (each step's likeliest), simulated", "-")):
        axes.plot(calibration.sizes, tokens, ls=style, marker=".", label=label)
    axes.axvline(calibration.size, color="tab:green", ls="--", lw=1, label=f"chosen: {calibration.size} candidates")
    axes.set_xscale("symlog", linthresh=1)
    axes.set_xlim(0, calibration.sizes[-1] * 1.1)
    axes.set_xlabel("tree size (candidate nodes)")
    axes.set_ylabel("tokens per step")
    axes.legend(fontsize=8)
    axes.grid(alpha=0.3)
    axes.set_title(f"tokens per step against tree size\n{textwrap.fill(device, 80)}", fontsize=9)
    return figure
