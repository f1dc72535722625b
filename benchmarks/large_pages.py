"""What large pages buy a decoding step: a model's GGUF blocks in one buffer of 2 MB pages, as loading leaves them
(kernels.in_large_pages), against the same blocks copied into ordinary 4 KB pages.

The embedded default on q8 (or --kernels native) kernels: a plain step and a 4-token chain's step at a 200-token
context (calibrate.measure_step_latency), the two placements swapped in turns within one process (a shared machine's
speed drifts more from run to run than this changes), each step judged by its ratio to the other placement's in the
same round. Run it with MEDUSA_ISA=avx2 for the AVX2 build. Prints a table, writes JSON and a PNG.
usage: .venv/bin/python benchmarks/large_pages.py [--out PREFIX] [--rounds N] [--kernels q8|native]
"""

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path

import torch

from medusa_decoding import MedusaModel, kernels
from medusa_decoding.bench import CALIBRATION
from medusa_decoding.calibrate import device_name, measure_step_latency
from medusa_decoding.tree import Tree

STEPS = {"plain step": [], "4-token chain": [3]}  # the trees' specs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/large_pages", help="writes OUT.json and OUT.png")
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--kernels", default="q8", choices=("q8", "native"))
    args = parser.parse_args()
    medusa = MedusaModel.from_pretrained(tree=None, kernels=args.kernels)
    on_blocks = [m for part in (medusa.model, medusa.heads) for m in part.modules() if "codes" in m._buffers]
    large = [(m._buffers["codes"], m._buffers["scales"]) for m in on_blocks]
    placements = {"2 MB pages": large, "4 KB pages": [(codes.clone(), scales.clone()) for codes, scales in large]}
    granted = huge_pages_kb()
    # short turns, many rounds: a shared machine's speed swings within seconds
    timing = replace(CALIBRATION, latency_contexts=(200,), latency_repeats=10)
    trees = [Tree.from_spec(spec) for spec in STEPS.values()]
    seconds = {name: [] for name in placements}
    for _ in range(args.rounds):
        for name, blocks in placements.items():
            for module, (codes, scales) in zip(on_blocks, blocks):
                module._buffers["codes"], module._buffers["scales"] = codes, scales
            seconds[name].append(measure_step_latency(medusa, trees, timing)[1][0])
    steps = list(STEPS)
    record = {"device": device_name(torch.device("cpu")), "variant": kernels.native_ops().variant(),
              "kernels": args.kernels, "torch": torch.__version__, "rounds": args.rounds, "context": 200,
              "steps": steps,
              "block_megabytes": sum(codes.nbytes + scales.nbytes for codes, scales in large) / 2**20,
              "anon_huge_pages_kb": granted,
              "median_ms": {name: [1000 * statistics.median(r[k] for r in s) for k in range(len(steps))]
                            for name, s in seconds.items()},
              "ratio_large_to_small": [statistics.median(a[k] / b[k] for a, b in zip(*seconds.values()))
                                       for k in range(len(steps))],
              "ratio_chain_to_plain": {name: statistics.median(r[1] / r[0] for r in s) for name, s in seconds.items()},
              "seconds": seconds}
    print(f"{record['block_megabytes']:.0f} MB of blocks, {args.kernels} kernels, {record['variant']} build, "
          f"{args.rounds} rounds, on {record['device']}; huge pages granted: {granted} kB")
    print(f"{'':>12}" + "".join(f"{step:>16}" for step in steps) + f"{'chain / plain':>16}")
    for name in placements:
        print(f"{name:>12}" + "".join(f"{ms:>14.2f}ms" for ms in record["median_ms"][name])
              + f"{record['ratio_chain_to_plain'][name]:>15.2f}x")
    print(f"{'2 MB / 4 KB':>12}" + "".join(f"{r:>15.3f}x" for r in record["ratio_large_to_small"])
          + "   (median of paired rounds)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(record, indent=1) + "\n")
    plot(record, f"{args.out}.png")


def huge_pages_kb() -> int | None:
    """The kilobytes of this process's anonymous memory in transparent huge pages (Linux), else None."""
    rollup = Path("/proc/self/smaps_rollup")
    if not rollup.is_file():
        return None
    fields = dict(line.split(":", 1) for line in rollup.read_text().splitlines() if ":" in line)
    return int(fields.get("AnonHugePages", "0 kB").split()[0])


def plot(record: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(record["steps"]), figsize=(11, 4.2))
    for k, (step, ax) in enumerate(zip(record["steps"], axes)):
        for name, rounds in record["seconds"].items():
            ax.plot(range(1, len(rounds) + 1), [1000 * r[k] for r in rounds], marker="o", label=name)
        ax.set_xlabel("round (the placements in turns)")
        ax.set_ylabel(f"{step} at a {record['context']}-token context (ms)")
        ax.set_title(f"{step}: 2 MB / 4 KB pages {record['ratio_large_to_small'][k]:.3f}x", fontsize=10)
        ax.legend(fontsize=8)
    figure.suptitle(f"{record['kernels']} kernels, {record['variant']} build, {record['block_megabytes']:.0f} MB of "
                    f"blocks\n{record['device']}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


if __name__ == "__main__":
    main()
