"""Requests as text: rows of a decoding.Batch that carry their answers, cut at stop strings, and the pieces of those
answers that are safe to show. MedusaModel.generate/stream, the server's scheduler and distillation decode through it.

>>> requests = Requests(medusa)                  # a MedusaModel
>>> requests.add("a", medusa.encode("Hi"), GenerationConfig(stop=("\\n",)))   # its prefill -> [("a", Step)]
>>> requests.step()                              # one forward pass for every request running
"""

from collections import deque
from typing import NamedTuple

import torch

from .config import GenerationConfig
from .decoding import Batch, Row


class Step(NamedTuple):
    """One forward pass of one request, as `Requests.add` and `Requests.step` give it."""

    tokens: list[int]  # the tokens it produced (stop strings applied)
    text: str  # the whole answer so far
    tree_size: int  # the candidates it verified (0: a plain step, or the prefill)
    # why the request ended at this step, as OpenAI's finish_reason: "stop" (EOS or a stop string) or "length" (its
    # token budget); None while it runs
    finish: str | None = None
    drafted: int = 0  # of `tokens`, those only a draft proposed (lookup.py, corpus.py)

    @property
    def done(self) -> bool:
        """The request's last step."""
        return self.finish is not None


class Requests:
    """Requests decoded together, as text: a Batch whose rows carry their answers so far. Each request joins with
    `add` (its prefill) and leaves when done: EOS, its token budget, or a stop string (cut where the string starts,
    the token that completes it kept). `add` and `step` return (key, Step) per request that moved; `Step.finish`:
    why it ended, at its last."""

    def __init__(self, medusa):
        """medusa: the MedusaModel whose weights, heads and engine every request shares."""
        self.medusa, self.batch = medusa, Batch(medusa.model, medusa.heads, medusa.compiled)
        self.by_row: dict[Row, tuple[object, GenerationConfig, Answer]] = {}  # row -> (key, config, answer)

    def __len__(self) -> int:
        return len(self.by_row)

    def add(self, key, ids: torch.Tensor, config: GenerationConfig, tree=None) -> list[tuple[object, Step]]:
        """Prefills ids [T]; tree: this request's own, any form MedusaModel.trees_for takes (None: the model's)."""
        medusa = self.medusa
        row = self.batch.join(ids, config, medusa.trees_for(tree), medusa.eos_ids, medusa.generator(config),
                              medusa.corpus)
        self.by_row[row] = (key, config, Answer(medusa.decode))
        return [self.advance(row, [row.root], 0)]

    def step(self) -> list[tuple[object, Step]]:
        """One forward pass for every request running."""
        return [self.advance(row, new, size) for row, new, size in self.batch.step()] if self.batch.rows else []

    def drop(self, key) -> None:
        """Ends a request before it is done (its client went away)."""
        row = next(row for row, request in self.by_row.items() if request[0] == key)
        self.finish(row)

    def advance(self, row: Row, new: list[int], tree_size: int) -> tuple[object, Step]:
        key, config, answer = self.by_row[row]
        start, generated = len(answer.tokens), answer.tokens
        text = answer.add(new)
        stop_at = first_stop(text, config.stop)
        if stop_at is not None:  # keep the tokens up to the one that completes the stop string
            end = next(n for n in range(start + 1, len(generated) + 1)
                       if first_stop(self.medusa.decode(generated[:n]), config.stop) is not None)
            new, text = new[: end - start], text[:stop_at]
            del generated[end:]
        finish = None
        if stop_at is not None or row.done:
            finish = "stop" if stop_at is not None or generated[-1] in self.medusa.eos_ids else "length"
            self.finish(row)
            text = text if stop_at is not None else self.medusa.decode(generated)  # the whole answer, once
        return key, Step(new, text, tree_size, finish, min(row.drafted, len(new)))

    def finish(self, row: Row) -> None:
        del self.by_row[row]
        if row in self.batch.rows:
            self.batch.leave(row)


def check_text(text: str) -> None:
    """Text a tokenizer can take: a lone UTF-16 surrogate ("\\ud800" in JSON) is a Python string but no Unicode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"the prompt is not valid Unicode text: {error.reason} at character {error.start} "
                         f"({text[error.start]!r})") from None


def check_max_batch(max_batch: int) -> None:
    if not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch must be a positive integer, got {max_batch!r}")


def admit(waiting: deque, running: int, max_batch: int) -> list:
    """Takes from the front of `waiting` what may join `running` requests in a batch of at most `max_batch`: how both
    MedusaModel.run_batch and the server's Scheduler admit requests."""
    check_max_batch(max_batch)
    return [waiting.popleft() for _ in range(min(len(waiting), max_batch - running))]


class Answer:
    """An answer's tokens and its text as they come: each step decodes only its last few tokens after a window of
    earlier ones (vLLM's incremental detokenizing; decoding the whole answer at every step grows with it), and holds
    back a piece that ends inside a character until the tokens that complete it arrive."""

    def __init__(self, decode):
        self.decode, self.tokens, self.text = decode, [], ""
        self.window = self.read = 0  # tokens[window:read] decode to the end of `text`; tokens[read:] are not in it

    def add(self, new: list[int]) -> str:
        """Appends `new` -> the text so far."""
        self.tokens += new
        before = self.decode(self.tokens[self.window : self.read])
        after = self.decode(self.tokens[self.window :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self.window, self.read = self.read, len(self.tokens)
        return self.text


class TextPieces:
    """What of an answer's text is safe to show: not an incomplete character nor what may turn into a stop string,
    until the answer is done."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops, self.sent = stops, 0

    def add(self, text: str, done: bool = False) -> str:
        """The answer so far -> the new text safe to show (all of the rest when done)."""
        ready = len(text) if done else max(len(text) - held_back(text, self.stops), self.sent)
        piece, self.sent = text[self.sent : ready], ready
        return piece


def first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Where the earliest of `stops` starts in `text`, if any does."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters may still turn into a stop string or a whole character."""
    if text.endswith("\ufffd"):
        return 1
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
