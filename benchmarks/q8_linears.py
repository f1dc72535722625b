"""How a q8 pass over a tree's tokens costs against one token's, on every instruction-set path this CPU runs.

The embedded default's 210 decoder-layer q8 linears (medusa::linear_q8 over the GGUF's blocks, the default engine's
arithmetic) are called in turn over 1, 2, 4, 8 and 16 tokens, for each variant build this CPU runs (kernels.VARIANTS)
and each q8 instruction path that build runs (kernels.Q8_PATHS: AVX-512 VNNI, AVX-VNNI, AVX2; the plain C++ path
on the baseline build). Every round times every (path, tokens) pass once, in turn, so a burst of load from elsewhere
hits all of them; a pass over T tokens is judged by its ratio to the one-token pass of the same round (the median
of those paired ratios: a shared machine's speed drifts more from minute to minute than the ratio does). 1 token is
memory-bound (the weights stream from memory), a tree's few tokens compute-bound: on a CPU a MEDUSA tree pays when
its pass costs little more than one token's (issue 47 asks the AVX2 path's 4 tokens for <= 1.3x). Each call from
Python also pays what 1 and 4 tokens share (dispatch, quantizing, waking the second thread: ~1.3 ms of a ~3.4 ms
one-token pass on a 2-core Zen 3), so the ratio reads lower here than for the kernel alone (docs/kernels.md).
Prints a table, writes JSON and a PNG.   usage: .venv/bin/python benchmarks/q8_linears.py [--out PREFIX] [--rounds N]
"""

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

from medusa_decoding import MedusaModel, kernels, native_layers
from medusa_decoding.calibrate import device_name

TOKENS = (1, 2, 4, 8, 16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/q8_linears", help="writes OUT.json and OUT.png")
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    medusa = MedusaModel.from_pretrained(tree=None, kernels="q8")
    layers = native_layers.weights(medusa.model)
    if layers is None:
        sys.exit("the embedded default did not load as Llama-shaped q8 layers")
    linears = [(codes, scales, out) for _, _, all_codes, all_scales, outs, _, _ in layers
               for codes, scales, out in zip(all_codes, all_scales, outs)]
    inputs = {t: [torch.randn(t, codes.shape[1] * 32) for codes, _, _ in linears] for t in TOKENS}
    runs = {}  # "variant/path" -> (ops, path number): each path on the plainest build that runs it (plain C++:
    # the baseline build, where nothing else runs)
    for isa in reversed(kernels.cpu_variants()):
        ops = kernels.load_native(isa)
        for number, path in enumerate(kernels.Q8_PATHS):
            if (path == "scalar") == (isa == "baseline") and not any(name.endswith(f"/{path}") for name in runs):
                try:
                    ops.linear_q8(inputs[1][0], *linears[0], number)
                except RuntimeError:  # a path this build or CPU does not run
                    continue
                runs[f"{isa}/{path}"] = ops, number

    def run(ops, number: int, tokens: int) -> None:
        for x, (codes, scales, out) in zip(inputs[tokens], linears):
            ops.linear_q8(x, codes, scales, out, number)

    timed = in_turns({(name, t): partial(run, *runs[name], t) for name in runs for t in TOKENS}, args.rounds)
    seconds = {name: {t: timed[name, t] for t in TOKENS} for name in runs}
    record = {"device": device_name(torch.device("cpu")), "torch": torch.__version__, "linears": len(linears),
              "rounds": args.rounds, "tokens": TOKENS,
              "median_ms": {name: [1000 * statistics.median(s[t]) for t in TOKENS] for name, s in seconds.items()},
              "ratio_to_one_token": {name: [statistics.median(a / b for a, b in zip(s[t], s[1])) for t in TOKENS]
                                     for name, s in seconds.items()}}
    print(f"{len(linears)} q8 linears of the embedded default, {args.rounds} rounds, on {record['device']}")
    print(f"{'variant/path':>22}" + "".join(f"{t:>9} tok" for t in TOKENS) + "   (median ms; x: paired ratio to 1)")
    for name in runs:
        ms, ratios = record["median_ms"][name], record["ratio_to_one_token"][name]
        print(f"{name:>22}" + "".join(f"{m:>8.2f}ms" for m in ms))
        print(f"{'':>22}" + "".join(f"{r:>12.2f}x" for r in ratios))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(record, indent=1) + "\n")
    plot(record, f"{args.out}.png")


def in_turns(runs: dict, rounds: int) -> dict[object, list[float]]:
    """Seconds of each of `runs` (key -> a call) per round: every round calls each once, in turn, so that a burst of
    load from elsewhere hits all of them; a first round warms up."""
    seconds = {key: [] for key in runs}
    for round_ in range(rounds + 1):
        for key, run in runs.items():
            start = time.perf_counter()
            run()
            if round_:
                seconds[key].append(time.perf_counter() - start)
    return seconds


def plot(record: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (times, ratios) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in record["median_ms"]:
        times.plot(record["tokens"], record["median_ms"][name], marker="o", label=name)
        ratios.plot(record["tokens"], record["ratio_to_one_token"][name], marker="o", label=name)
    for axes in (times, ratios):
        axes.set_xscale("log", base=2)
        axes.set_xticks(record["tokens"], [str(t) for t in record["tokens"]])
        axes.set_xlabel("tokens in the pass")
        axes.legend(fontsize=8)
    times.set_yscale("log")
    times.set_ylabel(f"{record['linears']} q8 linears in turn (median ms)")
    times.set_title(f"q8 linears by instruction path\n{record['device']}", fontsize=10)
    ratios.axhline(1.3, color="grey", linestyle=":", linewidth=1)
    ratios.set_ylabel("pass / one-token pass (median of paired rounds)")
    ratios.set_yscale("log", base=2)
    ratios.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ratios.set_title("what a tree's extra tokens cost (dotted: 1.3x)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


if __name__ == "__main__":
    main()
