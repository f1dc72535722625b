"""Conversations in and out, and which of their tokens are trained on.

Input records, from a JSON file (a list of records) or JSONL (one record a line):

    seed       {"id", "prompt"}                                              one user turn
    sharegpt   {"id", "conversations": [{"from": "human"|"gpt", "value"}]}   also {"role", "content"}
    mt-bench   {"question_id", "turns": [user turn, ...]}

`medusa distill` writes sharegpt records; `medusa train` reads them.
"""

import json
import lzma
from dataclasses import dataclass
from pathlib import Path

import torch

from ..conversation import chat_ids

IGNORE_INDEX = -100  # the label of a token not trained on (cross_entropy's ignore_index default)
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
         "bard": "assistant", "system": "system"}


@dataclass(frozen=True)
class Prompt:
    """One input record for distillation: the user's turns, answered one after the other."""

    id: str
    turns: tuple[str, ...]


def read_records(path: str | Path) -> list[dict]:
    """All records of a JSON or JSONL file, or of one compressed with xz (`.xz`: how the larger distilled sets ship)."""
    path = Path(path)
    text = lzma.open(path, "rt").read() if path.suffix == ".xz" else path.read_text()
    if not text.strip():
        raise ValueError(f"{path} is empty")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = []
        for number, line in enumerate(text.split("\n"), 1):  # not splitlines: JSON strings may hold U+2028
            try:
                data += [json.loads(line)] if line.strip() else []
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not valid JSON: {error}") from None
    records = data if isinstance(data, list) else [data]
    for number, record in enumerate(records, 1):
        if not isinstance(record, dict):
            raise ValueError(f"{path}: record {number} is a {type(record).__name__}, expected a JSON object")
    return records


def messages(record: dict) -> list[dict]:
    """A record's chat messages [{"role", "content"}], in order."""
    if "conversations" in record or "messages" in record:
        out = []
        for turn in record.get("conversations", record.get("messages")):
            speaker = turn.get("from", turn.get("role"))
            if speaker not in ROLES:
                raise ValueError(f"record {record_id(record)!r}: unknown speaker {speaker!r}, expected one of "
                                 f"{sorted(ROLES)}")
            out.append({"role": ROLES[speaker], "content": str(turn.get("value", turn.get("content", "")))})
        return out
    if "turns" in record:
        return [{"role": "user", "content": str(turn)} for turn in record["turns"]]
    if "prompt" in record:
        return [{"role": "user", "content": str(record["prompt"])}]
    raise ValueError(f"record {record_id(record)!r}: expected a 'prompt', 'conversations' or 'turns' field, "
                     f"found {sorted(record)}")


def record_id(record: dict, default: str = "?") -> str:
    return str(record.get("id", record.get("question_id", default)))


def read_prompts(path: str | Path) -> list[Prompt]:
    """The user turns of each record (ShareGPT: the human turns only); records without any are skipped."""
    prompts, seen = [], set()
    for number, record in enumerate(read_records(path), 1):
        turns = tuple(m["content"] for m in messages(record) if m["role"] == "user" and m["content"].strip())
        if not turns:
            continue  # ShareGPT dumps hold empty conversations
        prompt_id = record_id(record, default=f"record-{number}")
        if prompt_id in seen:
            raise ValueError(f"{path}: id {prompt_id!r} occurs twice; ids must be unique to resume by id")
        seen.add(prompt_id)
        prompts.append(Prompt(prompt_id, turns))
    if not prompts:
        raise ValueError(f"{path}: no record holds a user turn")
    return prompts


def read_conversations(path: str | Path) -> list[list[dict]]:
    """Chat messages of every record; answers before the first user turn are dropped (they answer nothing)."""
    conversations = []
    for record in read_records(path):
        chat = messages(record)
        first_user = next((i for i, m in enumerate(chat) if m["role"] == "user"), len(chat))
        chat = [m for i, m in enumerate(chat) if i >= first_user or m["role"] == "system"]
        if chat:
            conversations.append(chat)
    if not conversations:
        raise ValueError(f"{path}: no conversations")
    return conversations


def assistant_labels(tokenizer, chat: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of a templated conversation and its labels: the ids on assistant answers, IGNORE_INDEX elsewhere.

    Rendered turn by turn, so the assistant spans come from the chat template itself; the template's
    assistant header counts as prompt, the answer and its end-of-turn tokens as answer.
    """
    ids, labels = [], []
    for i, message in enumerate(chat):
        answer = message["role"] == "assistant"
        if answer:
            ids, labels = extend(ids, labels, chat_ids(tokenizer, chat[:i], generation_prompt=True), train=False)
        ids, labels = extend(ids, labels, chat_ids(tokenizer, chat[: i + 1]), train=answer)
    return ids, labels


def extend(ids: list[int], labels: list[int], longer: list[int], train: bool) -> tuple[list[int], list[int]]:
    if longer[: len(ids)] != ids:
        raise ValueError("the chat template renders earlier turns differently once a turn is added, "
                         "so the assistant's tokens cannot be told apart")
    new = longer[len(ids):]
    return longer, labels + (new if train else [IGNORE_INDEX] * len(new))


def build_examples(tokenizer, conversations: list[list[dict]], max_length: int) -> list[dict]:
    """Tokenized conversations cut to max_length; those left without an answer token are dropped."""
    examples = []
    for chat in conversations:
        ids, labels = assistant_labels(tokenizer, chat)
        ids, labels = ids[:max_length], labels[:max_length]
        if any(label != IGNORE_INDEX for label in labels):
            examples.append({"input_ids": ids, "labels": labels})
    if not examples:
        raise ValueError(f"no assistant turns to train on: none of the {len(conversations)} conversations has "
                         f"an assistant answer within the first {max_length} tokens")
    return examples


def answer_vocab(examples: list[dict], vocab_size: int, size: int) -> torch.Tensor:
    """The `size` tokens the examples' answers (labels) use most, most used first (then unused ones by id): what the
    heads guess from on a CPU (kernels.set_guess_vocab), and what training ranks them among (TrainConfig)."""
    labels = torch.tensor([label for example in examples for label in example["labels"] if label != IGNORE_INDEX])
    return torch.bincount(labels, minlength=vocab_size).sort(descending=True, stable=True).indices[:size]


def split(examples: list[dict], fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, held out): a seeded random `fraction` held out, at least one when fraction > 0, never all."""
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    held = min(max(round(len(examples) * fraction), 1), len(examples) - 1) if fraction > 0 else 0
    return [examples[i] for i in order[held:]], [examples[i] for i in order[:held]]


def collate(examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch: input_ids, attention_mask, labels [B, T]; padding is never a target."""
    width = max(len(e["input_ids"]) for e in examples)

    def padded(rows: list[list[int]], value: int) -> torch.Tensor:
        return torch.tensor([row + [value] * (width - len(row)) for row in rows])

    return {
        "input_ids": padded([e["input_ids"] for e in examples], pad_id),
        "attention_mask": padded([[1] * len(e["input_ids"]) for e in examples], 0),
        "labels": padded([e["labels"] for e in examples], IGNORE_INDEX),
    }
