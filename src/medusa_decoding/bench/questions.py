"""The benchmark's questions: MT-Bench-style JSONL, read, checked and sampled."""

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

UNCATEGORIZED = "uncategorized"


@dataclass(frozen=True)
class Question:
    question_id: str
    category: str
    turns: tuple[str, ...]


def parse_question(line: str, path: Path, number: int) -> Question:
    """One JSONL line -> Question; a clear ValueError naming the file, line and question otherwise."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"questions: {path} line {number} is not JSON: {error}") from None
    record = record if isinstance(record, dict) else {}  # not an object: reported below as a question without turns
    name = record.get("question_id", f"on line {number}")
    turns = record.get("turns")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise ValueError(f"questions: question {name} in {path} has no turns (expected 'turns': [text, ...])")
    return Question(str(name), str(record.get("category") or UNCATEGORIZED), tuple(turns))


def read_questions(paths, categories=None, limit: int | None = None, per_category: int | None = None) -> list[Question]:
    """MT-Bench-style JSONL ({"question_id", "category", "turns": [...]}) from one file or several (in order),
    filtered by category, the first per_category of each category kept (a balanced sample), then cut to limit."""
    paths = [Path(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"questions: {path} does not exist")
    for name, value in (("limit", limit), ("per_category", per_category)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    questions = []
    for path in paths:
        lines = path.read_text(encoding="utf-8").splitlines()
        found = [parse_question(line, path, n) for n, line in enumerate(lines, 1) if line.strip()]
        if not found:
            raise ValueError(f"questions: {path} holds no questions")
        questions += found
    if categories:
        known = sorted({q.category for q in questions})
        unknown = [c for c in categories if c not in known]
        if unknown:
            names = ", ".join(map(str, paths))
            raise ValueError(f"categories: unknown {', '.join(map(repr, unknown))}; {names} hold {', '.join(known)}")
        questions = [q for q in questions if q.category in categories]
    if per_category is not None:
        seen = Counter()
        questions = [q for q in questions if seen.update([q.category]) or seen[q.category] <= per_category]
    return questions[:limit]
