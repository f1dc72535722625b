"""Builds `raw_held_out.jsonl`: raw-text prompts for benchmarking a base model (Gemma 3 270M), of five kinds, none
from the sources its heads were distilled on (data/prompts/raw.py reads data/distilled/smollm2_mix.jsonl.xz):

- qa: MT-Bench's first turns (Apache-2.0), one per category, as "Question: ...\\n\\nAnswer:";
- prose: Spec-Bench dev's shortest summarization articles (CNN/DailyMail), followed by "\\n\\nIn short,";
- code: functions of CPython's standard library (PSF License 2.0), their signature and docstring, to be continued;
- lists: benchmarks/prompts/held_out.jsonl's own writing and qa prompts (written for this project),
  followed by "\\n\\n1.";
- dialogue: MT-Bench's roleplay first turns as "User: ...\\nAssistant:".

usage: python3 benchmarks/prompts/raw_held_out.py  (writes benchmarks/prompts/raw_held_out.jsonl, MT-Bench's format)
"""

import ast
import inspect
import json
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHARED = HERE.parents[2] / "shared" / "data"
CODE = {"textwrap": "dedent", "shlex": "split", "fnmatch": "translate", "difflib": "get_close_matches"}


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def stdlib_function(module: str, name: str) -> str:
    """A standard library function's source up to the end of its docstring."""
    source = inspect.getsource(__import__(module))
    node = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == name)
    lines = source.splitlines()[node.lineno - 1: node.body[0].end_lineno]
    return textwrap.dedent("\n".join(lines)) + "\n"


def main() -> None:
    mt_bench = read(SHARED / "mt_bench_question.jsonl")
    prompts = []
    seen = set()
    for q in mt_bench:
        if q["category"] not in seen and q["category"] != "roleplay":
            seen.add(q["category"])
            prompts.append(("qa", f"Question: {q['turns'][0]}\n\nAnswer:"))
    articles = sorted((q["turns"][0] for q in read(SHARED / "spec_bench_dev.jsonl")
                       if q["category"] == "summarization"), key=len)[:4]
    prompts += [("prose", article.removeprefix("Summarize:").strip() + "\n\nIn short,") for article in articles]
    prompts += [("code", stdlib_function(module, name)) for module, name in CODE.items()]
    own = read(HERE / "held_out.jsonl")
    own = [q for q in own if q["category"] == "own:writing"][:2] + [q for q in own if q["category"] == "own:qa"][:2]
    prompts += [("lists", f"{q['turns'][0]}\n\n1.") for q in own]
    prompts += [("dialogue", f"User: {q['turns'][0]}\nAssistant:") for q in mt_bench if q["category"] == "roleplay"][:4]
    out = HERE / "raw_held_out.jsonl"
    out.write_text("".join(json.dumps({"question_id": f"raw-{kind}-{i}", "category": f"raw:{kind}", "turns": [text]},
                                      ensure_ascii=False) + "\n" for i, (kind, text) in enumerate(prompts)))
    print(f"{len(prompts)} prompts -> {out}")


if __name__ == "__main__":
    main()
