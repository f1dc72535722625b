"""Heads side by side on held-out conversations: `medusa calibrate`'s accuracy table (teacher-forced, the guess
vocabulary of the data's most used answer tokens) and the tokens per step it predicts for the greedy trees of a few
sizes, for each heads directory, on the embedded default. Prints a table, writes JSON and a PNG of each head's top-1.
usage: .venv/bin/python benchmarks/heads_accuracy.py NAME=HEADS_DIR [...] --data FILE [...] --json PATH --png PATH
           [--max-positions 50000] [--guess-vocab 4096]
"""

import argparse
import json

from medusa_decoding import calibrate
from medusa_decoding.config import CalibrateConfig
from medusa_decoding.kernels import set_guess_vocab
from medusa_decoding.model import MedusaModel
from medusa_decoding.training.data import read_conversations

SIZES = (1, 3, 8, 64)  # candidates of the trees whose tokens per step are predicted


def measure(heads: str, conversations: list, config: CalibrateConfig) -> dict:
    medusa = MedusaModel.from_pretrained(heads=heads, tree=None)
    set_guess_vocab(medusa.model, calibrate.guess_vocab(medusa, conversations, config))
    accuracy = calibrate.measure_accuracy(medusa, conversations, config)
    tokens = {n: 1 + calibrate.expected_acceptance(calibrate.grow_tree(accuracy, n)[0], accuracy) for n in SIZES}
    return {"heads": heads, "top1": accuracy[:, 0].tolist(), "accuracy": accuracy.tolist(), "tokens_per_step": tokens}


def plot(results: dict[str, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(results)
    for i, (name, result) in enumerate(results.items()):
        heads = range(len(result["top1"]))
        bars = ax.bar([k + i * width for k in heads], result["top1"], width, label=name)
        ax.bar_label(bars, fmt="%.3f", fontsize=6, rotation=90, padding=2)
    low = min(min(r["top1"]) for r in results.values())
    ax.set_ylim(max(0.0, low - 0.05), max(max(r["top1"]) for r in results.values()) + 0.06)  # the differences show
    ax.set_xticks([k + width * (len(results) - 1) / 2 for k in heads], [f"head {k} (t+{k + 2})" for k in heads])
    ax.set_ylabel("held-out top-1 (path before it right)")
    ax.set_title("Heads side by side (calibrate's accuracy table)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("heads", nargs="+", metavar="NAME=HEADS_DIR")
    parser.add_argument("--data", nargs="+", required=True)
    parser.add_argument("--json", required=True)
    parser.add_argument("--png", required=True)
    parser.add_argument("--max-positions", type=int, default=50000)
    parser.add_argument("--guess-vocab", type=int, default=CalibrateConfig.guess_vocab)
    args = parser.parse_args()
    conversations = [chat for path in args.data for chat in read_conversations(path)]
    config = CalibrateConfig(max_positions=args.max_positions, guess_vocab=args.guess_vocab)
    results = {}
    for pair in args.heads:
        name, _, heads = pair.partition("=")
        results[name] = measure(heads, conversations, config)
    print(f"{'heads':<24}" + "".join(f"head {k:<4}" for k in range(len(results[name]["top1"])))
          + "".join(f"{n:>4} cand." for n in SIZES))
    for name, r in results.items():
        print(f"{name:<24}" + "".join(f"{a:<9.4f}" for a in r["top1"])
              + "".join(f"{t:>10.3f}" for t in r["tokens_per_step"].values()))
    with open(args.json, "w") as f:
        json.dump({"data": args.data, "max_positions": args.max_positions, "guess_vocab": args.guess_vocab,
                   "results": results}, f, indent=1)
    plot(results, args.png)


if __name__ == "__main__":
    main()
