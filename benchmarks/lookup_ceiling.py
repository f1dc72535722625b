"""What the text itself offers: the tokens a step that lookup drafts alone would give if verifying them cost nothing.

Each question's first turn is answered by plain greedy decoding (the embedded default, its default engine). Then the
answer is replayed: at every step the drafter (lookup.Lookup over the prompt and the answer so far) proposes up to L
tokens, the step keeps those that match the answer and adds the model's own next token, as a greedy step verifying
the chain would. Per category: tokens a step for each L, how often the first drafted token is right by the length
of the match behind it, the prefill's share of plain decoding's time, and the end-to-end speed-up over plain decoding
that drafts of up to 8 tokens would give if verifying them were free (the prefill as it is, the decode divided by
L=8's tokens a step). A bound on what the drafts can add beside the heads: on a CPU every verified node costs step
time, so `medusa bench` measures less (issue 50 asks >= 1.8x plain on summarization and rag).
Prints a table, writes JSON and a PNG.
usage: .venv/bin/python benchmarks/lookup_ceiling.py [--questions FILE ...] [--per-category N] [--out PREFIX]
"""

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from medusa_decoding import GenerationConfig, MedusaModel
from medusa_decoding.bench import read_questions
from medusa_decoding.calibrate import device_name
from medusa_decoding.lookup import Lookup

LENGTHS = (1, 2, 4, 8)  # drafted tokens a step
MATCHES = 4  # Lookup's longest n-gram


def replay(prompt: list[int], answer: list[int], length: int) -> int:
    """The steps a greedy decode of `answer` takes when each step verifies the lookup chain of up to `length` tokens
    for free: the first token comes from the prefill, each step yields the chain's right prefix and one token more."""
    index, done, steps = Lookup(prompt + answer[:1], MATCHES), 1, 0
    while done < len(answer):
        chain, _ = index.continuation(length)
        right = 0
        while right < len(chain) and done + right < len(answer) and chain[right] == answer[done + right]:
            right += 1
        new = answer[done : done + right + 1]
        index.extend(new)
        done, steps = done + len(new), steps + 1
    return steps


def first_hits(prompt: list[int], answer: list[int]) -> list[tuple[int, bool]]:
    """(match length, whether the first drafted token was the answer's) at every position where a suffix recurs."""
    index, hits = Lookup(prompt + answer[:1], MATCHES), []
    for token in answer[1:]:
        chain, match = index.continuation(1)
        if chain:
            hits.append((match, chain[0] == token))
        index.extend([token])
    return hits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", nargs="+", default=["../shared/data/spec_bench_dev.jsonl",
                                                            "../shared/data/mt_bench_question.jsonl"])
    parser.add_argument("--per-category", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default="benchmarks/results/lookup_ceiling")
    args = parser.parse_args()
    medusa = MedusaModel.from_pretrained(tree=None)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=0.0, lookup=0)
    tokens, steps, seconds = defaultdict(int), defaultdict(lambda: defaultdict(int)), defaultdict(lambda: [0.0, 0.0])
    hits = defaultdict(lambda: defaultdict(lambda: [0, 0]))  # category -> match length -> [right, drafted]
    questions = read_questions(args.questions, per_category=args.per_category)
    for question in tqdm(questions, desc="plain answers", unit="turn"):
        ids = medusa.encode(messages=[{"role": "user", "content": question.turns[0]}])
        out = medusa.generate(ids, config=config, medusa=False)
        prompt, answer, category = ids.tolist(), out.token_ids, question.category
        seconds[category][0] += out.first_token_seconds  # the prefill
        seconds[category][1] += out.seconds
        tokens[category] += len(answer) - 1  # after the prefill's token
        for length in LENGTHS:
            steps[category][length] += replay(prompt, answer, length)
        for match, right in first_hits(prompt, answer):
            hits[category][match][0] += right
            hits[category][match][1] += 1
    record = {"device": device_name(torch.device("cpu")), "model": Path(medusa.model.name_or_path).name,
              "questions": args.questions, "per_category": args.per_category, "max_new_tokens": args.max_new_tokens,
              "categories": {c: {"turns": sum(q.category == c for q in questions), "tokens": tokens[c],
                                 "tokens_per_step": {L: tokens[c] / steps[c][L] for L in LENGTHS},
                                 "prefill_share": seconds[c][0] / seconds[c][1],
                                 "speedup_ceiling": seconds[c][1] / (seconds[c][0] + (seconds[c][1] - seconds[c][0])
                                                                     * steps[c][LENGTHS[-1]] / tokens[c]),
                                 "first_token_right": {m: {"rate": r / n, "drafted": n}
                                                       for m, (r, n) in sorted(hits[c].items())}}
                             for c in tokens}}
    print(f"lookup alone, verification free: tokens a step of {record['model']}'s greedy answers "
          f"({args.max_new_tokens} tokens, first turns)")
    print(f"{'category':>16}{'turns':>7}" + "".join(f"{f'L={L}':>8}" for L in LENGTHS)
          + f"{'prefill':>9}{'ceiling':>9}   first drafted token right, by match length (rate, drafted)")
    for name, c in record["categories"].items():
        rates = "  ".join(f"{m}: {h['rate']:.2f} ({h['drafted']})" for m, h in c["first_token_right"].items())
        print(f"{name:>16}{c['turns']:>7}" + "".join(f"{c['tokens_per_step'][L]:>8.2f}" for L in LENGTHS)
              + f"{c['prefill_share']:>8.0%}{c['speedup_ceiling']:>8.2f}x   {rates}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(record, indent=1) + "\n")
    plot(record, f"{args.out}.png")


def plot(record: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(record["categories"])
    figure, (ceiling, rates) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": (3, 2)})
    width = 0.8 / len(LENGTHS)
    for i, length in enumerate(LENGTHS):
        values = [record["categories"][c]["tokens_per_step"][length] for c in names]
        ceiling.bar([k + i * width for k in range(len(names))], values, width, label=f"up to {length} drafted")
    middle = [k + width * (len(LENGTHS) - 1) / 2 for k in range(len(names))]
    ceiling.scatter(middle, [record["categories"][c]["speedup_ceiling"] for c in names], marker="D", color="black",
                    zorder=3, label="x plain, end to end (L=8, the prefill as it is)")
    ceiling.axhline(1.8, color="grey", linestyle=":", linewidth=1)
    ceiling.set_xticks(middle, names, rotation=35, ha="right", fontsize=8)
    ceiling.set_ylim(1.0, None)
    ceiling.set_ylabel("tokens a step, verification free (dotted: 1.8)")
    ceiling.set_title(f"Lookup drafts alone, {record['model']}\n{record['device']}", fontsize=10)
    ceiling.legend(fontsize=8)
    colors = plt.get_cmap("tab20")
    for i, name in enumerate(names):
        found = record["categories"][name]["first_token_right"]
        rates.plot([int(m) for m in found], [h["rate"] for h in found.values()], marker="o", label=name,
                   color=colors(i % 20))
    rates.set_xticks(range(1, MATCHES + 1))
    rates.set_xlabel("length of the recurring suffix behind the draft (tokens)")
    rates.set_ylabel("first drafted token right")
    rates.set_ylim(0, 1)
    rates.set_title("How far a match is to be trusted", fontsize=10)
    rates.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


if __name__ == "__main__":
    main()
