"""How large a corpus index pays: indexes of the same answers kept at several `min_seen` (corpus.CorpusIndex.build),
each decoding the same prompts greedily beside the heads (lossless checked against plain decoding), against none.
Tokens a step are what an index buys, its bytes what it costs to ship; speed is `medusa bench`'s to report.
Prints a table, writes JSON and a PNG.
usage: .venv/bin/python benchmarks/corpus_min_seen.py --data FILES... --questions FILE [--per-category N]
           [--min-seen 1 2 4 8] [--json P] [--png P]
"""

import argparse
import json
import tempfile
from pathlib import Path

from medusa_decoding.bench import read_questions
from medusa_decoding.calibrate import device_name
from medusa_decoding.config import CalibrateConfig, GenerationConfig
from medusa_decoding.corpus import CORPUS_NAME, CorpusIndex
from medusa_decoding.model import MedusaModel
from medusa_decoding.training.data import IGNORE_INDEX, build_examples, read_conversations

TOKENS = 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", nargs="+", required=True, help="the answers to index (never a benchmark's)")
    parser.add_argument("--questions", required=True, help="prompts: their first turns are decoded")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--min-seen", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--json", default="benchmarks/results/corpus_min_seen.json")
    parser.add_argument("--png", default="benchmarks/results/corpus_min_seen.png")
    args = parser.parse_args()
    medusa = MedusaModel.from_pretrained()
    examples = build_examples(medusa.tokenizer, [c for path in args.data for c in read_conversations(path)],
                              CalibrateConfig().max_length)
    sequences = [(e["input_ids"], [label != IGNORE_INDEX for label in e["labels"]]) for e in examples]
    prompts = [medusa.encode(q.turns[0]) for q in read_questions(args.questions, per_category=args.per_category)]
    plain = [medusa.generate(ids, max_new_tokens=TOKENS, medusa=False).token_ids for ids in prompts]
    rows = []
    for min_seen in [None, *args.min_seen]:
        medusa.corpus = None if min_seen is None else CorpusIndex.build(sequences, min_seen)
        size = 0
        if medusa.corpus is not None:
            with tempfile.TemporaryDirectory() as directory:
                medusa.corpus.save(directory)
                size = (Path(directory) / CORPUS_NAME).stat().st_size
        outs = [medusa.generate(ids, config=GenerationConfig(max_new_tokens=TOKENS)) for ids in prompts]
        tokens, steps = sum(len(o.token_ids) for o in outs), sum(o.steps for o in outs)
        rows.append({"min_seen": min_seen, "contexts": 0 if medusa.corpus is None else len(medusa.corpus.keys),
                     "megabytes": size / 1e6, "tokens_per_step": tokens / steps,
                     "drafted_per_step": sum(sum(o.drafted) for o in outs) / steps,
                     "lossless": [o.token_ids for o in outs] == plain})
    report = {"setup": device_name(medusa.model.device), "prompts": len(prompts), "max_new_tokens": TOKENS,
              "questions": args.questions, "conversations_indexed": len(examples), "rows": rows}
    print(f"{len(prompts)} first turns of {args.questions}, {TOKENS} greedy tokens, on {report['setup']}")
    print(f"{'min_seen':>8} {'contexts':>9} {'MB':>6} {'tokens/step':>11} {'drafted':>8} {'lossless':>8}")
    for r in rows:
        print(f"{r['min_seen'] or 'none'!s:>8} {r['contexts']:>9} {r['megabytes']:>6.1f} "
              f"{r['tokens_per_step']:>11.3f} {r['drafted_per_step']:>8.3f} {r['lossless']!s:>8}")
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    plot(rows, args.png, report)


def plot(rows: list[dict], path: str, report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    indexed = [r for r in rows if r["min_seen"]]
    figure, axis = plt.subplots(figsize=(6, 4))
    axis.plot([r["megabytes"] for r in indexed], [r["tokens_per_step"] for r in indexed], "o-")
    for r in indexed:
        axis.annotate(f"min_seen {r['min_seen']}", (r["megabytes"], r["tokens_per_step"]), fontsize=8)
    axis.axhline(rows[0]["tokens_per_step"], color="grey", linestyle="--", label="no corpus index")
    axis.set(xlabel="index size (MB)", ylabel="tokens per step", xscale="log",
             title=f"Corpus drafts: {report['prompts']} prompts, {report['max_new_tokens']} greedy tokens")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
