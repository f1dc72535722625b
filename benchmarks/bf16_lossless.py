"""Why greedy MEDUSA can part from plain greedy decoding in bfloat16 (the H200 run's "lossless: NO"), on a CPU.

Greedy MEDUSA keeps exactly the tokens its own verification pass ranks first. Plain decoding ranks them in one-token
passes; a tree's pass multiplies other matrix shapes, and where the kernels' sums are not batch-invariant (stock
kernels, GPUs) the two round differently. In float32 on this project's native CPU kernels they are batch-invariant
(the tests assert token-for-token equality); in bfloat16 a near-tie between the top two logits can flip. Here: the
embedded default in bfloat16 on stock kernels, the shipped hydra heads with their calibrated 64-candidate tree, the
first turn of MT-Bench's first question per category, greedy, 256 tokens: answers identical or not, where they part,
and the margin there between the top two logits of a one-pass recompute (a few bfloat16 steps, or none, where they
part). Prints a table, writes JSON.
usage: .venv/bin/python benchmarks/bf16_lossless.py [--json benchmarks/results/bf16_lossless.json]
"""

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch

from medusa_decoding import GenerationConfig, MedusaModel
from medusa_decoding.bench import agreed_prefix, read_questions
from medusa_decoding.calibrate import device_name, greedy_trees, read_accuracy
from medusa_decoding.embedded import shipped_heads

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ROOT.parent / "shared" / "data" / "mt_bench_question.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "bf16_lossless.json"))
    parser.add_argument("--questions", default=str(QUESTIONS))
    args = parser.parse_args()
    (tree,) = greedy_trees(read_accuracy(shipped_heads()).accuracy, [64])
    medusa = MedusaModel.from_pretrained(dtype=torch.bfloat16, kernels="stock", tree=tree)
    config = GenerationConfig(max_new_tokens=256)
    rows = []
    for question in read_questions([args.questions], per_category=1):
        ids = medusa.encode(messages=[{"role": "user", "content": question.turns[0]}])
        ours = medusa.generate(ids, config=config).token_ids
        plain = medusa.generate(ids, config=replace(config, medusa=False)).token_ids
        row = {"question_id": question.question_id, "category": question.category, "medusa_tokens": len(ours),
               "plain_tokens": len(plain), "identical": ours == plain, "agreed": agreed_prefix(ours, plain)}
        if not row["identical"] and row["agreed"] < min(len(ours), len(plain)):
            with torch.inference_mode():  # the parting position, recomputed in one pass
                logits = medusa.model(torch.cat([ids, torch.tensor(plain[: row["agreed"]])])[None]).logits[0, -1]
            top = logits.float().topk(2)
            row.update(top2_logits=top.values.tolist(), top2_tokens=top.indices.tolist(),
                       medusa_token=ours[row["agreed"]], plain_token=plain[row["agreed"]])
        rows.append(row)
        print(f"{row['category']:<11} q{row['question_id']}: identical {row['identical']}, agreed {row['agreed']} "
              f"of {row['plain_tokens']} tokens" + (f"; top-2 logits there {row['top2_logits']}, MEDUSA took "
                                                   f"{row['medusa_token']}, plain {row['plain_token']}"
                                                   if "top2_logits" in row else ""), flush=True)
    report = {"device": device_name(medusa.model.device), "dtype": "bfloat16", "kernels": "stock",
              "tree_nodes": tree.num_nodes, "identical": sum(r["identical"] for r in rows), "turns": len(rows),
              "rows": rows}
    print(f"{report['identical']} of {len(rows)} answers identical ({report['device']})")
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
