"""Which guess vocabulary covers the answers (issue 71): the share of answer tokens of held-out conversations that
heads guessing from it could guess at all, per category, for the frequent sets of a few sizes (counted on the training
answers), and the vocabularies calibrated heads guess from (--calibrated), each alone and with the row's own tokens
(its prompt and its conversation so far) added. Prints a table, writes JSON and a PNG.
usage: .venv/bin/python benchmarks/guess_vocab_coverage.py --train FILE... --heldout NAME=FILE... [--questions FILE...]
           [--calibrated NAME=HEADS_DIR...] [--model MODEL] --json P --png P
"""

import argparse
import json
from collections import defaultdict

from medusa_decoding.base import load_base
from medusa_decoding.calibrate import read_accuracy
from medusa_decoding.config import DEFAULT_MODEL
from medusa_decoding.training.data import (
    IGNORE_INDEX,
    answer_vocab,
    build_examples,
    messages,
    read_conversations,
    read_records,
)

SIZES = (4096, 8192, 16384)
MAX_LENGTH = 4096


def coverage(examples: list[dict], vocab: set[int], own: bool) -> tuple[int, int]:
    """(answer tokens inside the vocabulary, with the tokens before them in their conversation where `own`; all)."""
    inside = total = 0
    for example in examples:
        seen: set[int] = set()
        for token, label in zip(example["input_ids"], example["labels"]):
            if label != IGNORE_INDEX:
                inside += label in vocab or (own and label in seen)
                total += 1
            seen.add(token)
    return inside, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train", nargs="+", required=True)
    parser.add_argument("--heldout", nargs="+", required=True, help="NAME=FILE: answers no training saw")
    parser.add_argument("--questions", nargs="*", default=[], help="the questions they answer (their categories)")
    parser.add_argument("--calibrated", nargs="*", default=[], help="NAME=HEADS_DIR: their calibration's vocabulary")
    parser.add_argument("--model", help="whose tokens (default: the embedded default)")
    parser.add_argument("--json", required=True)
    parser.add_argument("--png", required=True)
    args = parser.parse_args()
    model, tokenizer = load_base(args.model)
    vocab_size = model.get_output_embeddings().weight.shape[0]
    train = build_examples(tokenizer, [c for path in args.train for c in read_conversations(path)], MAX_LENGTH)
    frequent = answer_vocab(train, vocab_size, max(SIZES)).tolist()
    categories = {str(r["question_id"]): r.get("category", "") for path in args.questions for r in read_records(path)}
    heldout = defaultdict(list)  # "name:category" -> examples (distilled answers keep their question's id, not its
    for spec in args.heldout:   # category)
        name, path = spec.split("=", 1)
        for record in read_records(path):
            category = categories.get(str(record["id"]), "")
            heldout[f"{name}:{category}" if category else name] += build_examples(tokenizer, [messages(record)],
                                                                                  MAX_LENGTH)
    vocabularies = [(f"{size} most frequent", set(frequent[:size])) for size in SIZES]
    for spec in args.calibrated:
        name, directory = spec.split("=", 1)
        vocabularies.append((f"{name}'s calibrated", set(read_accuracy(directory).guess_vocab.tolist())))
    rows = []
    for label, vocab in vocabularies:
        for own in (False, True):
            shares = {}
            for category, examples in sorted(heldout.items()):
                inside, total = coverage(examples, vocab, own)
                shares[category] = (inside, total)
            inside, total = (sum(v[i] for v in shares.values()) for i in (0, 1))
            rows.append({"vocabulary": label, "size": len(vocab), "own_tokens": own, "coverage": inside / total,
                         "tokens": total,
                         "per_category": {c: i / t for c, (i, t) in shares.items()}})
    trained_on = sum(label != IGNORE_INDEX for e in train for label in e["labels"])
    report = {"model": args.model or DEFAULT_MODEL.name, "train_files": args.train, "train_answer_tokens": trained_on,
              "heldout": {c: len(e) for c, e in heldout.items()}, "rows": rows,
              "id_threshold_16384": coverage([e for es in heldout.values() for e in es], set(range(16384)), False)}
    print(f"{'vocabulary':>28} {'+ own':>6} {'all':>7}  " + "  ".join(f"{c[-14:]:>14}" for c in sorted(heldout)))
    for row in rows:
        print(f"{row['vocabulary']:>28} {row['own_tokens']!s:>6} {row['coverage']:7.3f}  "
              + "  ".join(f"{row['per_category'][c]:14.3f}" for c in sorted(heldout)))
    with open(args.json, "w") as file:
        json.dump(report, file, indent=1)
    plot(rows, sorted(heldout), args.png, report["model"])


def plot(rows: list[dict], names: list[str], path: str, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(8, len(names) * 0.9) + 3, 4.5))
    width = 0.8 / len(rows)
    for i, row in enumerate(rows):
        label = row["vocabulary"] + (" + the row's own tokens" if row["own_tokens"] else "")
        ax.bar([n + i * width for n in range(len(names))], [row["per_category"][c] for c in names], width, label=label)
    ax.axhline(0.97, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks([n + 0.4 - width / 2 for n in range(len(names))], names, rotation=30, ha="right", fontsize=8)
    ax.set_ylim(0.6, 1.0)
    ax.set_ylabel("answer tokens the heads could guess")
    ax.set_title(f"Guess vocabulary coverage on {model}'s held-out answers (dashed: 0.97)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
