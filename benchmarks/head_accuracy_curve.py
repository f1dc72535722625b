"""Held-out top-1 accuracy of each head against the answer tokens training has seen, from `medusa train` runs
(each run's last checkpoints/*/trainer_state.json); runs given in order continue one another (--init-heads).
Reference heads (their head_accuracy.json) are drawn as dashed levels. Writes a PNG and prints the points.
usage: .venv/bin/python benchmarks/head_accuracy_curve.py RUN [RUN ...] --data FILE [FILE ...] --png PATH
           [--reference NAME=HEADS_DIR]
"""

import argparse
import json
from pathlib import Path

from medusa_decoding.base import load_base
from medusa_decoding.training.data import IGNORE_INDEX, build_examples, read_conversations, split
from medusa_decoding.training.train import last_checkpoint


def answer_tokens(tokenizer, conversations, config: dict) -> int:
    """Answer tokens in a run's training split (its seed and eval fraction)."""
    examples = build_examples(tokenizer, conversations, config["max_length"])
    train, _ = split(examples, config["eval_fraction"], config["seed"])
    return sum(label != IGNORE_INDEX for example in train for label in example["labels"])


def points(run: Path, tokens_per_epoch: int, offset: int) -> dict[int, list[tuple[int, float]]]:
    """head -> [(answer tokens seen, held-out top-1)] of the run's evaluations."""
    state = json.loads((last_checkpoint(run / "checkpoints") / "trainer_state.json").read_text())
    curves: dict[int, list[tuple[int, float]]] = {}
    for entry in state["log_history"]:
        for key, value in entry.items():
            if key.startswith("eval_head") and key.endswith("_top1"):
                head = int(key.removeprefix("eval_head").removesuffix("_top1"))
                curves.setdefault(head, []).append((offset + round(entry["epoch"] * tokens_per_epoch), value))
    return curves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--data", nargs="+", required=True)
    parser.add_argument("--png", required=True)
    parser.add_argument("--reference", action="append", default=[], metavar="NAME=HEADS_DIR")
    args = parser.parse_args()
    _, tokenizer = load_base(None)
    conversations = [chat for path in args.data for chat in read_conversations(path)]
    curves: dict[int, list[tuple[int, float]]] = {}
    offset, boundaries = 0, []
    for run in args.runs:
        config = json.loads((run / "train_config.json").read_text())
        per_epoch = answer_tokens(tokenizer, conversations, config)
        for head, line in points(run, per_epoch, offset).items():
            curves.setdefault(head, []).extend(line)
        offset = max(seen for line in curves.values() for seen, _ in line)
        boundaries.append(offset)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    colors = plt.cm.tab10.colors
    for head, line in sorted(curves.items()):
        axes.plot([seen / 1e3 for seen, _ in line], [a for _, a in line], marker="o", color=colors[head],
                  label=f"head {head} (t+{head + 2})")
        print(f"head {head}: " + ", ".join(f"{seen / 1e3:.0f}k: {a:.3f}" for seen, a in line))
    for name, directory in (spec.split("=", 1) for spec in args.reference):
        for head in json.loads((Path(directory) / "head_accuracy.json").read_text())["heads"]:
            axes.axhline(head["top1"], color=colors[head["head"]], ls="--", lw=1)
        axes.plot([], [], color="grey", ls="--", label=f"{name} (end of its training)")
    for seen in boundaries[:-1]:
        axes.axvline(seen / 1e3, color="grey", lw=0.5)
    axes.set_xlabel("answer tokens seen in training (thousands)")
    axes.set_ylabel("held-out top-1 accuracy (teacher-forced)")
    axes.set_title(", ".join(run.name for run in args.runs))
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(args.png, dpi=100)


if __name__ == "__main__":
    main()
