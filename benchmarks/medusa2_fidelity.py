"""How far a MEDUSA-2 model has moved from the original, and what its heads give, on MT-Bench first turns.

MEDUSA-2 fine-tunes the backbone, so its greedy answers may differ from the original model's. For each question:
the original model's greedy answer and the MEDUSA-2 model's (plain decoding, same settings); whether they are
identical and how many tokens agree before the first difference; and the MEDUSA-2 model's tokens per step with
its own heads (MEDUSA decoding, greedy, lossless with respect to the MEDUSA-2 model itself).
Prints a summary, writes JSON.   usage: .venv/bin/python benchmarks/medusa2_fidelity.py OUT_DIR [--limit 10]
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from medusa_decoding import GenerationConfig, MedusaModel
from medusa_decoding.bench import agreed_prefix, read_questions
from medusa_decoding.calibrate import device_name

QUESTIONS = Path(__file__).resolve().parents[2] / "shared" / "data" / "mt_bench_question.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("medusa2", help="a `medusa train --mode medusa2` output directory")
    parser.add_argument("--model", help="the base model it was trained from (default: the embedded default)")
    parser.add_argument("--questions", default=str(QUESTIONS))
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--json", default="benchmarks/results/medusa2_fidelity.json")
    args = parser.parse_args()

    original = MedusaModel.from_pretrained(args.model, heads=None)
    tuned = MedusaModel.from_pretrained(args.model, heads=args.medusa2)
    questions = read_questions(args.questions, per_category=args.per_category)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    rows = []
    for number, question in enumerate(questions, 1):
        print(f"question {number}/{len(questions)}", file=sys.stderr)
        reference = original.generate(question.turns[0], config=config, medusa=False).token_ids
        plain = tuned.generate(question.turns[0], config=config, medusa=False).token_ids
        fast = tuned.generate(question.turns[0], config=config)
        agreed = agreed_prefix(reference, plain)
        rows.append({"question_id": question.question_id, "category": question.category,
                     "identical": reference == plain, "agreed_tokens": agreed, "original_tokens": len(reference),
                     "medusa_lossless": fast.token_ids == plain, "medusa_tokens": len(fast.token_ids),
                     "medusa_steps": fast.steps})
    record = {
        "device": device_name(torch.device("cpu")), "medusa2": args.medusa2, "questions": len(rows),
        "max_new_tokens": args.max_new_tokens,
        "greedy_identical_rate": statistics.mean(r["identical"] for r in rows),
        "agreed_prefix_fraction": sum(r["agreed_tokens"] for r in rows) / sum(r["original_tokens"] for r in rows),
        "acceleration_rate": sum(r["medusa_tokens"] for r in rows) / sum(r["medusa_steps"] for r in rows),
        "medusa_lossless": all(r["medusa_lossless"] for r in rows),
        "tree_size": tuned.tree.num_nodes - 1, "rows": rows,
    }
    print(f"MEDUSA-2 {args.medusa2} on {len(rows)} MT-Bench first turns, greedy, {args.max_new_tokens} tokens:\n"
          f"  greedy answer identical to the original model's: {record['greedy_identical_rate']:.0%}\n"
          f"  tokens agreeing before the first difference: {record['agreed_prefix_fraction']:.1%}\n"
          f"  MEDUSA tokens per step with its own heads (tree of {record['tree_size']}):"
          f" {record['acceleration_rate']:.2f}"
          f" (lossless w.r.t. the MEDUSA-2 model: {record['medusa_lossless']})")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
