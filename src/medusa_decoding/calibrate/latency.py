"""The device timed: a decoding step's latency per tree, context and batch size, the latency model a fit reads, the
trees fitted to it, and the kernels `kernels="auto"` picks by the same timing."""

import hashlib
import json
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from .. import cache as kv
from ..base import context_limit
from ..config import CalibrateConfig, GenerationConfig, cache_root
from ..decoding import Batch
from ..guard import Guard, Ladder, interpolate
from ..kernels import Q8_KINDS, block_codes, code_digest, cpu_variants, reads_blocks, reset_kernels, variant
from ..tree import Tree
from .tree_search import DEFAULTS, Calibration, choose_tree, fit_sizes, greedy_trees


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
            prompt = torch.randint(medusa.heads.config.vocab_size, (context,),
                                   generator=torch.Generator().manual_seed(row))
            batch.join(prompt.to(device), budget, trees[0])  # no EOS: every row stays to the end
        table.append(time_steps(batch, trees, config, what=f", batches of {rows}"))
    return table


def time_steps(batch: Batch, trees: list[Tree], config: CalibrateConfig, rewind=None, what: str = "",
               confident: bool = False) -> list[float]:
    """Median seconds of a step of `batch` whose rows all verify the same tree, per tree. The trees take turns, so a
    burst of load from elsewhere slows all of them, not one; the first round is a warm-up (where the compiled engine
    compiles each tree size, slowly: hence the progress bar). rewind: run after each step."""
    from tqdm.auto import tqdm

    device, times = batch.model.device, [[] for _ in trees]
    bar = tqdm(total=len(trees) * (config.latency_repeats + 1), desc=f"step latency{what}", unit="step", leave=False)
    for _ in range(config.latency_repeats + 1):
        for tree, timed in zip(trees, times):
            for row in batch.rows:
                row.heads_draft.guard = Guard(Ladder.fixed(tree, confident), row.root)
            if batch.engine.device_tree(batch.rows) is not None:
                batch.step()  # a step that builds the rows' device state: the next one is timed
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


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def latency_model(medusa, accuracy: torch.Tensor, sizes: list[int], config: CalibrateConfig = DEFAULTS
                  ) -> tuple[list[int], list[list[float]]]:
    """measure_step_latency's (contexts, seconds [contexts][sizes]) for every size, measured at the sizes up to 4, the
    powers of 2 and the largest, at the shortest and longest context, and linear between: a step's cost is smooth in
    the nodes and linear in the context (attention), so a fit times a few trees, not every size at every context."""
    measured = [n for n in sizes if n <= 4 or n & (n - 1) == 0 or n == sizes[-1]]
    ends = replace(config, latency_contexts=(min(config.latency_contexts), max(config.latency_contexts)))
    at, table = measure_step_latency(medusa, greedy_trees(accuracy, measured), ends)
    rows = tuple(tuple(interpolate(tuple(measured), tuple((t,) for t in row), n)[0] for n in sizes) for row in table)
    contexts = latency_contexts(medusa, greedy_trees(accuracy, sizes[-1:]), config)
    return contexts, [interpolate(tuple(at), rows, context) for context in contexts]


def fit_tree(medusa, accuracy: torch.Tensor, config: CalibrateConfig = DEFAULTS,
             confident_tokens: list[float] | None = None) -> Calibration:
    """The step latency of the greedy tree of each tried size up to max_nodes, then the fastest predicted (for
    confident trees too, given their tokens per size); then the latency of the trees the guard may pick against the
    batch size."""
    sizes = fit_sizes(accuracy, config)
    fitted = choose_tree(accuracy, sizes, *latency_model(medusa, accuracy, sizes, config), confident_tokens)
    return with_batch_latency(medusa, fitted, config)


def with_batch_latency(medusa, fitted: Calibration, config: CalibrateConfig = DEFAULTS) -> Calibration:
    """The fit, with the step latency of its ladders' trees (auto's and confident's) against the batch size."""
    trees = max(fitted.ladder().trees, fitted.ladder(confident=True).trees, key=len)
    batches = measure_batch_latency(medusa, list(trees), config)
    return replace(fitted, batch_sizes=list(config.batch_sizes), batch_latency_s=batches)


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
    """What a step latency holds for: the device, the model's dtype, its kernels (and whether they read blocks, and
    the instruction set they were built for where $MEDUSA_ISA forces one this CPU would not pick: the AVX2 build on
    an AVX-512 machine stands for an AVX2 machine, and its trees are fitted as there) and the engine."""
    dtype = str(medusa.model.dtype).removeprefix("torch.")
    blocks = " on GGUF blocks" if reads_blocks(medusa.model) else ""
    engine = " on the compiled engine" if medusa.compiled else ""
    forced = f", {variant()} build" if medusa.model.device.type == "cpu" and variant() != cpu_variants()[0] else ""
    return f"{device_name(medusa.model.device)}, {dtype}, {medusa.kernels} kernels{blocks}{forced}{engine}"


def choose_kernels(model, heads, medusa_on, config: CalibrateConfig = DEFAULTS) -> str:
    """kernels="auto" on a CPU in float32: of stock (where the model has float32 weights), native and (where some
    weights are blocks q8 reads: Q4_1 or Q8_0, or a GGUF file's Q4_K or Q6_K) q8, the kernels whose plain step and
    3-candidate step take least time together on this machine, timed side by side on `model` itself (switched in
    turn, then back), once per setup: cached under cache_root()/kernels, keyed like the tree fits. Never slower than
    stock where stock is one of those timed. Says what it picked, and why, in one line.
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
