"""How far 8-bit activations (kernels="q8") move the embedded default from its float32 self (kernels="native").

Teacher-forced over held-out conversations (answers no head was trained or calibrated on), in passes of MAX_ROWS
tokens over one cache (a native engine's passes: stock attention above them): how often both give the same top-1
token, the mean log-likelihood of the answer tokens under each, and the mean KL divergence from float32 to q8. Then
greedy plain decoding of MT-Bench first turns (one per category): answers identical or not, and the tokens that
agree before the first difference. Prints a summary, writes JSON.
usage: .venv/bin/python benchmarks/q8_fidelity.py [--data FILE] [--json PATH]
"""

import argparse
import json
import sys
from pathlib import Path

import torch

from medusa_decoding import GenerationConfig, MedusaModel
from medusa_decoding.bench import agreed_prefix, read_questions
from medusa_decoding.cache import allocate
from medusa_decoding.calibrate import device_name
from medusa_decoding.eager import forward
from medusa_decoding.kernels import MAX_ROWS, Q8Linear, load_native
from medusa_decoding.training.data import IGNORE_INDEX, build_examples, read_conversations

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ROOT.parent / "shared" / "data" / "mt_bench_question.jsonl"


def teacher_forced(medusa: MedusaModel, ids: list[int]) -> torch.Tensor:
    """Log-probabilities [T, V] after each token of `ids`, in passes of at most MAX_ROWS tokens over one cache."""
    tokens, cache, out = torch.tensor(ids), allocate(medusa.model, len(ids)), []
    with torch.inference_mode():
        for start in range(0, len(ids), MAX_ROWS):
            out.append(forward(medusa.model, tokens[None, start : start + MAX_ROWS], cache)[0][0].log_softmax(-1))
    return torch.cat(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(ROOT / "data" / "distilled" / "smollm2_chat_heldout.jsonl"))
    parser.add_argument("--conversations", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "q8_fidelity.json"))
    args = parser.parse_args()

    models = {name: MedusaModel.from_pretrained(kernels=name) for name in ("native", "q8")}
    assert any(isinstance(m, Q8Linear) for m in models["q8"].model.modules())
    examples = build_examples(models["native"].tokenizer, read_conversations(args.data)[: args.conversations], 2048)
    agree = positions = 0
    likelihood = {"native": 0.0, "q8": 0.0}
    kl = 0.0
    for number, example in enumerate(examples, 1):
        print(f"teacher-forced {number}/{len(examples)}", file=sys.stderr)
        labels = torch.tensor(example["labels"][1:])
        answer = labels != IGNORE_INDEX  # log-probs after token i predict token i + 1
        logp = {name: teacher_forced(medusa, example["input_ids"])[:-1][answer] for name, medusa in models.items()}
        targets = labels[answer]
        agree += int((logp["native"].argmax(-1) == logp["q8"].argmax(-1)).sum())
        positions += len(targets)
        for name, lp in logp.items():
            likelihood[name] += float(lp.gather(-1, targets[:, None]).sum())
        kl += float((logp["native"].exp() * (logp["native"] - logp["q8"])).sum())
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    greedy = []
    for question in read_questions(QUESTIONS, per_category=1):
        answers = {name: m.generate(question.turns[0], config=config, medusa=False).token_ids
                   for name, m in models.items()}
        a, b = answers["native"], answers["q8"]
        agreed = agreed_prefix(a, b)
        greedy.append({"question_id": question.question_id, "category": question.category, "identical": a == b,
                       "agreed_tokens": agreed, "native_tokens": len(a)})
    record = {
        "device": device_name(torch.device("cpu")), "threads": torch.get_num_threads(),
        "q8_paths": [name for name in load_native().q8_path_names() if name],
        "data": args.data, "conversations": len(examples), "answer_tokens": positions,
        "top1_agreement": agree / positions,
        "mean_log_likelihood": {name: total / positions for name, total in likelihood.items()},
        "mean_kl_native_to_q8": kl / positions,
        "greedy": {"turns": len(greedy), "identical": sum(g["identical"] for g in greedy),
                   "agreed_prefix_fraction": (sum(g["agreed_tokens"] for g in greedy)
                                              / sum(g["native_tokens"] for g in greedy)),
                   "max_new_tokens": args.max_new_tokens, "rows": greedy},
    }
    print(f"q8 against float32 (native), {positions} held-out answer tokens of {len(examples)} conversations:\n"
          f"  top-1 agreement, teacher-forced: {record['top1_agreement']:.2%}\n"
          f"  mean log-likelihood per token: float32 {record['mean_log_likelihood']['native']:.4f}, "
          f"q8 {record['mean_log_likelihood']['q8']:.4f}\n"
          f"  mean KL(float32 || q8): {record['mean_kl_native_to_q8']:.5f} nats\n"
          f"  greedy MT-Bench first turns ({len(greedy)}, {args.max_new_tokens} tokens): "
          f"{record['greedy']['identical']} identical, {record['greedy']['agreed_prefix_fraction']:.1%} of tokens "
          f"before the first difference")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
