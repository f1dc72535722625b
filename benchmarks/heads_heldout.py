"""Heads side by side on answers no training saw (issue 71), as decoding guesses on a CPU: each head's top-1 and top-5,
teacher-forced, ranking the heads' guess vocabulary (their calibration's) and the row's own tokens of the moment (its
prompt's and its answer's up to the token before the guess: heads.OwnTokens) - or, with --vocab-only, the guess
vocabulary alone, as before own tokens were guessed. Per category of the held-out files; a table, JSON and a PNG.
usage: .venv/bin/python benchmarks/heads_heldout.py NAME=HEADS_DIR... --heldout NAME=FILE... --questions FILE...
           --json P --png P [--vocab-only]
"""

import argparse
import json
from collections import defaultdict

import torch

from medusa_decoding.calibrate import read_accuracy
from medusa_decoding.heads import run_backbone
from medusa_decoding.model import MedusaModel
from medusa_decoding.training.data import IGNORE_INDEX, build_examples, messages, read_records
from medusa_decoding.training.positions import HEAD_OFFSET, path_embeddings, path_tokens

MAX_LENGTH, TOP = 2048, 5


def conversation_hits(medusa: MedusaModel, vocabulary: torch.Tensor, example: dict, own: bool) -> torch.Tensor:
    """[K, 3]: top-1 hits, top-5 hits, targets, over the answer tokens of one conversation."""
    heads, weight = medusa.heads, medusa.model.get_output_embeddings().weight
    ids = torch.tensor(example["input_ids"])[None]
    labels = torch.tensor(example["labels"])
    num_heads, length = heads.config.num_heads, ids.shape[1]
    hits = torch.zeros(num_heads, 3, dtype=torch.long)
    _, state = run_backbone(medusa.model, heads.config.feature_layers, input_ids=ids)
    embeds = path_embeddings(heads.config, medusa.model.get_input_embeddings(), path_tokens(ids, num_heads))
    states = heads.states(state[0], embeds=None if embeds is None else embeds[0])  # [K, T, H]
    inside = torch.zeros(weight.shape[0], dtype=torch.bool)
    inside[vocabulary] = True
    extra = torch.tensor([t for t in dict.fromkeys(ids[0].tolist()) if not inside[t]] if own else [], dtype=torch.long)
    columns = torch.cat([vocabulary, extra])
    logits = states @ weight[columns].T  # [K, T, V' + E]
    if len(extra):  # a row's own token is guessable once the row has seen it: by the root, token t+1
        first = torch.tensor([int((ids[0] == token).nonzero()[0]) for token in extra.tolist()])
        seen = first[None] <= torch.arange(length)[:, None] + 1  # [T, E]
        logits[..., len(vocabulary):] = logits[..., len(vocabulary):].masked_fill(~seen, float("-inf"))
    top = columns[logits.topk(TOP, dim=-1).indices]  # [K, T, 5]
    for k in range(num_heads):
        offset = k + HEAD_OFFSET
        targets = torch.cat([labels[offset:], labels.new_full((offset,), IGNORE_INDEX)])
        valid = targets != IGNORE_INDEX
        hits[k, 0] += int((top[k, :, 0] == targets)[valid].sum())
        hits[k, 1] += int((top[k] == targets[:, None]).any(-1)[valid].sum())
        hits[k, 2] += int(valid.sum())
    return hits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("heads", nargs="+", help="NAME=HEADS_DIR")
    parser.add_argument("--heldout", nargs="+", required=True, help="NAME=FILE: answers no training saw")
    parser.add_argument("--questions", nargs="*", default=[], help="the questions they answer (their categories)")
    parser.add_argument("--vocab-only", action="store_true", help="rank the guess vocabulary alone")
    parser.add_argument("--json", required=True)
    parser.add_argument("--png", required=True)
    args = parser.parse_args()
    categories = {str(r["question_id"]): r.get("category", "") for path in args.questions for r in read_records(path)}
    report = {}
    for spec in args.heads:
        name, directory = spec.split("=", 1)
        medusa = MedusaModel.from_pretrained(heads=directory, kernels="stock", tree=None)
        vocabulary = read_accuracy(directory).guess_vocab
        per = defaultdict(lambda num_heads=medusa.heads.config.num_heads: torch.zeros(num_heads, 3, dtype=torch.long))
        with torch.inference_mode():
            for heldout in args.heldout:
                label, path = heldout.split("=", 1)
                for record in read_records(path):
                    category = categories.get(str(record["id"]), "")
                    for example in build_examples(medusa.tokenizer, [messages(record)], MAX_LENGTH):
                        per[f"{label}:{category}"] += conversation_hits(medusa, vocabulary, example,
                                                                        not args.vocab_only)
        total = sum(per.values())
        report[name] = {"heads": directory, "guess_vocab": len(vocabulary), "own_tokens": not args.vocab_only,
                        "top1": (total[:, 0] / total[:, 2]).tolist(), "top5": (total[:, 1] / total[:, 2]).tolist(),
                        "per_category": {c: {"top1": (h[:, 0] / h[:, 2]).tolist(), "top5": (h[:, 1] / h[:, 2]).tolist(),
                                             "tokens": h[:, 2].tolist()} for c, h in sorted(per.items())}}
        print(f"{name}: top-1 " + " / ".join(f"{a:.3f}" for a in report[name]["top1"])
              + "   top-5 " + " / ".join(f"{a:.3f}" for a in report[name]["top5"]))
        for category, result in report[name]["per_category"].items():
            print(f"  {category:28s} top-1 " + " / ".join(f"{a:.3f}" for a in result["top1"]))
    with open(args.json, "w") as file:
        json.dump(report, file, indent=1)
    plot(report, args.png)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report)
    categories = list(report[names[0]]["per_category"])
    fig, ax = plt.subplots(figsize=(max(8, len(categories)), 4.5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        values = [report[name]["per_category"][c]["top1"][0] for c in categories]
        ax.bar([n + i * width for n in range(len(categories))], values, width, label=f"{name} (head 0, top-1)")
    ax.axhline(0.40, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks([n + 0.4 - width / 2 for n in range(len(categories))], categories, rotation=30, ha="right",
                  fontsize=8)
    ax.set_ylabel("head 0 top-1, teacher-forced")
    ax.set_title("Heads on held-out answers (dashed: 0.40)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
