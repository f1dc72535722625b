"""What the native attention costs a step's tokens over a long cache, on every variant this CPU runs.

medusa::attention (csrc/attention.cpp: the native engines' attention, bitwise the same for a token whatever the tokens
beside it) in SmolLM2's shape (9 query heads, 3 kv heads, head dim 64) over a float16 cache (the default engine's) of
256 and 2000 keys, for a pass over 1, 2, 4, 8 and 16 tokens of a chain (each token sees the prefix and the tokens
before it), 30 calls a pass (the model's layers). Every round times every (variant, context, tokens) pass once, in
turn, so a burst of load from elsewhere hits all of them; each variant's build is loaded at once (kernels.VARIANTS).
The tree's tokens over a long prefix are where a CPU's MEDUSA step spends beyond one token's: at 2000 keys attention
is compute-bound from a few tokens on.
Prints a table, writes JSON and a PNG.   usage: .venv/bin/python benchmarks/attention.py [--out PREFIX] [--rounds N]
"""

import argparse
import json
import statistics
from functools import partial
from pathlib import Path

import torch
from q8_linears import in_turns  # (benchmarks/ is the script's path)

from medusa_decoding import kernels
from medusa_decoding.calibrate import device_name

TOKENS = (1, 2, 4, 8, 16)
CONTEXTS = (256, 2000)
HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30


def inputs(tokens: int, context: int) -> tuple[torch.Tensor, ...]:
    """A pass's query, float16 cache (the prefix, then the tokens) and chain mask."""
    keys = context + tokens
    q = torch.randn(1, HEADS, tokens, HEAD_DIM)
    k, v = (torch.randn(1, KV_HEADS, keys, HEAD_DIM).half() for _ in range(2))
    seen = torch.ones(tokens, keys, dtype=torch.bool)
    seen[:, context:] = torch.ones(tokens, tokens, dtype=torch.bool).tril()
    return q, k, v, torch.where(seen, 0.0, torch.finfo(torch.float32).min)[None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/attention", help="writes OUT.json and OUT.png")
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    torch.manual_seed(0)
    variants = [isa for isa in kernels.cpu_variants() if isa != "baseline"]  # the baseline: correct, not tuned
    ops = {isa: kernels.load_native(isa) for isa in variants}
    passes = {(s, t): inputs(t, s) for s in CONTEXTS for t in TOKENS}

    def run(isa: str, key: tuple[int, int]) -> None:
        for _ in range(LAYERS):
            ops[isa].attention(*passes[key], HEAD_DIM**-0.5)

    seconds = in_turns({(isa, key): partial(run, isa, key) for isa in variants for key in passes}, args.rounds)
    record = {"device": device_name(torch.device("cpu")), "torch": torch.__version__, "rounds": args.rounds,
              "layers": LAYERS, "tokens": TOKENS, "contexts": CONTEXTS,
              "median_ms": {f"{isa}@{s}": [1000 * statistics.median(seconds[isa, (s, t)]) for t in TOKENS]
                            for isa in variants for s in CONTEXTS}}
    print(f"medusa::attention, SmolLM2's shape, float16 cache, {LAYERS} calls a pass, {args.rounds} rounds, "
          f"on {record['device']} (median ms)")
    print(f"{'variant@keys':>16}" + "".join(f"{t:>8} tok" for t in TOKENS))
    for name, ms in record["median_ms"].items():
        print(f"{name:>16}" + "".join(f"{m:>10.2f}ms" for m in ms))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(record, indent=1) + "\n")
    plot(record, f"{args.out}.png")


def plot(record: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name, ms in record["median_ms"].items():
        axes.plot(record["tokens"], ms, marker="o", label=name)
    axes.set_xscale("log", base=2)
    axes.set_xticks(record["tokens"], [str(t) for t in record["tokens"]])
    axes.set_yscale("log")
    axes.set_xlabel("tokens in the pass")
    axes.set_ylabel(f"{record['layers']} attention calls (median ms)")
    axes.set_title(f"native attention over a float16 cache\n{record['device']}", fontsize=10)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


if __name__ == "__main__":
    main()
