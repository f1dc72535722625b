"""Builds raw-text prompts for distilling a base model (no chat template: it continues text), from the conversations
SmolLM2 answered in `data/distilled/smollm2_mix.jsonl.xz` (their prompts' sources and licences: data/README.md;
SmolLM2's answers: Apache-2.0). Each record becomes one of three texts, the kind chosen by a hash of its id:

- qa: "Question: <prompt>\\n\\nAnswer:", a question and answer in text form;
- document: the prompt, a blank line and the first part of the answer (prose, code, lists as SmolLM2 wrote them),
  cut at a word: the model goes on with the document;
- dialogue: "User: <prompt>\\nAssistant: <the answer's first sentence>", a transcript.

usage: python3 data/prompts/raw.py --out raw_prompts.jsonl [--limit N]
Writes seed records {"id", "source", "prompt"} (`medusa distill --raw` reads them). None is a benchmark's: the check
build.py applied to the conversations' prompts is applied again to the whole text, SmolLM2's words included (a
generic phrase of an answer can run 10 words along a benchmark's turn).
"""

import argparse
import hashlib
import json
import lzma
from pathlib import Path

from build import benchmark_shingles, shingles

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "data" / "distilled" / "smollm2_mix.jsonl.xz"
KINDS = ("qa", "document", "dialogue")
MAX_CHARS = 1500  # a prompt's characters at most (about 400 tokens): long prefills would be most of the run's cost
ANSWER_SHARE = 0.4  # of the answer's words, what a document prompt keeps


def raw_prompt(kind: str, prompt: str, answer: str) -> str | None:
    prompt, answer = prompt.strip()[:MAX_CHARS], answer.strip()
    if kind == "qa":
        return f"Question: {prompt}\n\nAnswer:"
    words = answer.split(" ")
    if len(words) < 12:
        return None  # too short an answer to cut: the record is skipped
    if kind == "document":
        return f"{prompt}\n\n{' '.join(words[: int(len(words) * ANSWER_SHARE)])}"
    first = answer.split(". ")[0]
    return f"User: {prompt}\nAssistant: {first}." if len(first) < len(answer) else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--limit", type=int)
    args = parser.parse_args()
    records, banned, dropped = [], benchmark_shingles(), 0
    with lzma.open(SOURCE, "rt", encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            turns = record["conversations"]
            if len(turns) < 2 or turns[0]["from"] != "human":
                continue
            kind = KINDS[int(hashlib.sha256(record["id"].encode()).hexdigest(), 16) % len(KINDS)]
            if (text := raw_prompt(kind, turns[0]["value"], turns[1]["value"])) is None:
                continue
            if shingles(text) & banned:
                dropped += 1
                continue
            records.append({"id": f"raw-{record['id']}", "source": f"raw:{kind}", "prompt": text})
    records.sort(key=lambda r: hashlib.sha256(r["id"].encode()).hexdigest())  # the sources' prompts mixed
    records = records[: args.limit]
    Path(args.out).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    counts = {kind: sum(r["source"] == f"raw:{kind}" for r in records) for kind in KINDS}
    print(f"{len(records)} raw prompts -> {args.out} ({counts}); {dropped} dropped for sharing words with a benchmark")


if __name__ == "__main__":
    main()
