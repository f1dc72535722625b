"""Which kernels run the embedded default's few-token forward passes fastest on this CPU, and what they change.

For each of stock (MKL), native (the project's batch-invariant few-row kernel, csrc/linear.cpp, reading the GGUF's
Q4_1/Q8_0 blocks, with batch-invariant attention; the heads guess through an int8 copy of the LM head), q8 (the
same blocks with 8-bit activations and integer dot products), native-float32 (the same kernel on the
float32 weights, as before it read blocks), compiled (the compiled engine, native linears, the same int8 guesses),
compiled-q8 (the compiled engine with q8 linears), int8 (torch.ao dynamic quantization) and bf16 (the model in
bfloat16: oneDNN AMX tiles where the CPU has them), the last two measured here and not offered by the library, side
by side:
  - the median time of one full MEDUSA step (propose, verify, accept, commit) over 1..64 tokens after a
    256-token prefix, the kernels taking turns so that noise hits all of them alike;
  - greedy plain decoding of a few MT-Bench first turns: how many tokens agree with stock float32 before the
    first difference, and whether greedy MEDUSA equals greedy plain decoding on the same kernels (lossless).
  - a plain step at a 100- and a 2000-token context (attention's cost per key);
  - with --variants, native and q8 on every other instruction-set variant this CPU runs too (NAME@VARIANT: the
    engine's ops switched to that variant's around its turns; kernels.VARIANTS): the plain step at both contexts, and
    the first prompt's answers, which must be the same tokens (the baseline is slow on x86: not swept by size).
Prints a table, writes JSON and a PNG.   usage: .venv/bin/python benchmarks/cpu_kernels.py [--out PREFIX]
[--kernels NAME ...] [--variants] (stock always runs: the others' reference)
"""

import argparse
import contextlib
import copy
import json
import statistics
import sys
from pathlib import Path
from unittest import mock

import torch

from medusa_decoding import GenerationConfig, MedusaModel
from medusa_decoding import kernels as kernel_ops
from medusa_decoding.bench import read_questions
from medusa_decoding.calibrate import device_name, measure_step_latency
from medusa_decoding.config import CalibrateConfig
from medusa_decoding.tree import Tree

KERNELS = ("stock", "native", "q8", "native-float32", "compiled", "compiled-q8", "int8", "bf16")
# the setups the library offers: name -> (kernels, engine)
OFFERED = {"stock": ("stock", "eager"), "native": ("native", "eager"), "q8": ("q8", "eager"),
           "compiled": ("native", "compiled"), "compiled-q8": ("q8", "compiled")}
SIZES = (0, 1, 2, 3, 5, 7, 15, 31, 63)  # candidates: passes over 1, 2, 3, 4, 6, 8, 16, 32, 64 tokens
ROUNDS = 5  # each round times every size on every kernel (2 steps each), the kernels taking turns
PROMPTS, NEW_TOKENS = 6, 64
CONTEXTS = (100, 2000)  # a plain step at each: within 2x of each other is the aim
QUESTIONS = Path(__file__).resolve().parents[2] / "shared" / "data" / "mt_bench_question.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/cpu_kernels", help="writes OUT.json and OUT.png")
    parser.add_argument("--questions", default=str(QUESTIONS))
    parser.add_argument("--kernels", nargs="+", choices=KERNELS[1:], default=KERNELS[1:])
    parser.add_argument("--variants", action="store_true", help="native and q8 on every variant this CPU runs too")
    args = parser.parse_args()
    kernels = ("stock", *[name for name in KERNELS[1:] if name in args.kernels])
    others = [isa for isa in kernel_ops.cpu_variants() if isa != kernel_ops.variant()] if args.variants else []
    kernels += tuple(f"{name}@{isa}" for isa in others for name in ("native", "q8") if name in kernels)

    base = MedusaModel.from_pretrained(kernels="stock")
    models = {name: MedusaModel(copy.deepcopy(base.model), base.tokenizer, base.heads, base.tree, *setup)
              for name, setup in OFFERED.items() if name in kernels}
    if "native-float32" in kernels:
        models["native-float32"] = MedusaModel(copy.deepcopy(base.model), base.tokenizer, base.heads, base.tree,
                                               "native")
        for module in models["native-float32"].model.modules():
            if hasattr(module, "codes"):  # no GGUF blocks: the kernel reads the float32 weights
                del module.codes, module.scales
    if "int8" in kernels:  # not offered by the library: lossy
        int8 = torch.ao.quantization.quantize_dynamic(copy.deepcopy(base.model), {torch.nn.Linear}, dtype=torch.qint8)
        models["int8"] = MedusaModel(int8, base.tokenizer, base.heads, base.tree)
    if "bf16" in kernels:  # lossy too: measured
        models["bf16"] = MedusaModel(copy.deepcopy(base.model).bfloat16(), base.tokenizer, copy.deepcopy(base.heads),
                                     base.tree)
    for name in kernels:
        if "@" in name:
            models[name] = MedusaModel(copy.deepcopy(base.model), base.tokenizer, base.heads, base.tree,
                                       name.split("@")[0])
    trees = [Tree.from_spec([n]) if n else Tree.from_spec([]) for n in SIZES]
    swept = [name for name in kernels if "@" not in name]
    timings = {name: [[] for _ in SIZES] for name in swept}
    once = CalibrateConfig(latency_repeats=2, latency_contexts=(256,))
    for round_ in range(ROUNDS):
        print(f"latency round {round_ + 1}/{ROUNDS}", file=sys.stderr)
        for name in swept:
            for timed, seconds in zip(timings[name], measure_step_latency(models[name], trees, once)[1][0]):
                timed.append(seconds)
    latency = {name: [statistics.median(t) for t in timings[name]] for name in swept}
    by_context = {name: [] for name in kernels}  # a plain step at each of CONTEXTS
    for name, medusa in models.items():
        with variant(name):
            timing = CalibrateConfig(latency_repeats=15, latency_contexts=CONTEXTS)
            by_context[name] = [row[0] for row in measure_step_latency(medusa, trees[:1], timing)[1]]

    prompts = [q.turns[0] for q in read_questions(args.questions, limit=PROMPTS)]
    config = GenerationConfig(max_new_tokens=NEW_TOKENS)
    outputs = {name: [] for name in kernels}
    lossless = {name: True for name in kernels}
    for index, prompt in enumerate(prompts):
        for name, medusa in models.items():
            if "@" in name and index:  # the variants: the first prompt
                continue
            with variant(name):
                plain = medusa.generate(prompt, config=config, medusa=False).token_ids
                outputs[name].append(plain)
                lossless[name] &= medusa.generate(prompt, config=config).token_ids == plain
    same_bits = {name: outputs[name] == outputs[name.split("@")[0]][:1] for name in kernels if "@" in name}

    def agreeing(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    agreement = {name: sum(agreeing(o, s) for o, s in zip(outputs[name], outputs["stock"])) /
                 sum(len(s) for s in outputs["stock"][: len(outputs[name])]) for name in kernels}
    record = {"device": device_name(torch.device("cpu")), "torch": torch.__version__, "tokens": [n + 1 for n in SIZES],
              "step_latency_s": latency, "greedy_agreement_with_stock": agreement,
              "medusa_equals_plain": lossless, "prompts": len(prompts), "new_tokens": NEW_TOKENS,
              "variant": kernel_ops.variant(), "contexts": CONTEXTS, "plain_step_by_context_s": by_context,
              "variant_answers_equal_engine_variant": same_bits}
    print(f"MEDUSA step latency (ms) on {record['device']}: embedded default, 256-token prefix")
    print(f"{'tokens':>7}" + "".join(f"{n:>16}" for n in swept) + "".join(f"{n + '/stock':>22}" for n in swept[1:]))
    for i, tokens in enumerate(record["tokens"]):
        ms = [1000 * latency[n][i] for n in swept]
        print(f"{tokens:>7}" + "".join(f"{m:>16.1f}" for m in ms) + "".join(f"{m / ms[0]:>22.2f}" for m in ms[1:]))
    for name in kernels:
        print(f"{name}: greedy tokens agreeing with stock float32 {agreement[name]:.1%}, "
              f"greedy MEDUSA == plain on the same kernels: {lossless[name]}"
              + (f", answers the same as on {kernel_ops.variant()}: {same_bits[name]}" if name in same_bits else ""))
    print(f"a plain step at a {CONTEXTS[0]} / {CONTEXTS[1]}-token context (ms), the engine's variant "
          f"{kernel_ops.variant()} unless named")
    for name, (short, long) in by_context.items():
        print(f"{name:>16} {1000 * short:8.1f} {1000 * long:8.1f}  {long / short:5.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(record, indent=1) + "\n")
    plot(record, f"{args.out}.png")


@contextlib.contextmanager
def variant(name: str):
    """NAME@VARIANT runs on that instruction-set variant's ops (the engine's own otherwise)."""
    isa = name.partition("@")[2]
    if isa:
        kernel_ops.load_native(isa)
    with mock.patch.object(kernel_ops.build, "engine_variant", lambda: isa) if isa else contextlib.nullcontext():
        yield


def plot(record: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (axes, contexts) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    for name in record["step_latency_s"]:
        axes.plot(record["tokens"], [1000 * s for s in record["step_latency_s"][name]], marker="o",
                  label=f"{name} (greedy agrees with stock: {record['greedy_agreement_with_stock'][name]:.0%})")
    axes.set_xscale("log", base=2)
    axes.set_xticks(record["tokens"], [str(t) for t in record["tokens"]])
    axes.set_xlabel("tokens in the verification pass (tree size + 1)")
    axes.set_ylabel("MEDUSA step latency (ms)")
    axes.set_ylim(bottom=0)
    axes.set_title(f"SmolLM2-135M step latency by kernels\n{record['device']}", fontsize=10)
    axes.legend(fontsize=8)
    by_context = record["plain_step_by_context_s"]
    for i, context in enumerate(record["contexts"]):
        contexts.bar([n + i * 0.4 for n in range(len(by_context))], [1000 * s[i] for s in by_context.values()],
                     width=0.4, label=f"{context}-token context")
    contexts.set_xticks([n + 0.2 for n in range(len(by_context))], list(by_context), rotation=30, ha="right",
                        fontsize=8)
    contexts.set_ylabel("plain step (ms)")
    contexts.set_yscale("log")
    contexts.set_title(f"a plain step by context (variant {record['variant']} unless named)", fontsize=10)
    contexts.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


if __name__ == "__main__":
    main()
