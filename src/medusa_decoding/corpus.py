"""Drafts from the model's own past answers (REST's datastore, SAM-Decoding's static side): an index over the answers
the model gave to many prompts (its self-distilled training data) proposes what followed the text's last few tokens
most often there. A small model says the same things the same way: on answers to prompts it never saw, the index's
most frequent continuation of the longest matching context is the model's next greedy token about as often as the
heads' top guess, and a chain of them costs no model call at all.
"""

from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from .proposers import ChainRates, Proposal, SoFar, StepStart

ORDER = 4  # the longest context matched: more matched rarely and added little on SmolLM2's answers
MIN_SEEN = 4  # contexts seen fewer times are left out: a fraction of the bytes, as many tokens a step
CORPUS_NAME = "corpus.safetensors"  # the index, beside the heads it drafts with
# a chain token's chance of being right, by the share of its context's continuations that it had in the corpus: the
# lower edge of each bin (shares of SHARES[i] up to SHARES[i + 1]) as its prior, then counted as the request goes
SHARES = (0.0, 0.3, 0.5, 0.7, 0.9)


def context_key(tokens: Sequence[int]) -> int:
    """The index's key of a context of 1 to ORDER tokens: each token + 1 in 16 bits, the oldest highest (uint64; no
    token is 0, so contexts of different lengths differ; ids of 65535 and above have no key: `CorpusIndex.build`
    skips answers with them)."""
    key = 0
    for token in tokens:
        key = (key << 16) | (token + 1)
    return key


class CorpusIndex:
    """Contexts of 1 to ORDER tokens -> the token that followed them most often in the corpus and its share of their
    continuations: sorted keys (context_key) [N], tokens [N], shares [N]."""

    def __init__(self, keys: np.ndarray, tokens: np.ndarray, shares: np.ndarray):
        if not (len(keys) == len(tokens) == len(shares)) or (len(keys) > 1 and not (np.diff(keys) > 0).all()):
            raise ValueError("corpus index: as many keys, tokens and shares, the keys increasing")
        self.keys, self.tokens, self.shares = keys, tokens, shares

    @classmethod
    def build(cls, sequences: Iterable[tuple[Sequence[int], Sequence[bool]]], min_seen: int = MIN_SEEN
              ) -> "CorpusIndex":
        """From token sequences (a conversation's ids, and which of them are answer tokens: each is counted as a
        continuation of the tokens before it, the prompt's included). A context is kept where it was seen at least
        `min_seen` times (rarer ones add little: benchmarks/corpus_min_seen.py) and its most frequent continuation had
        a share worth offering (SHARES[1]); sequences with ids of 65535 and above are left out (context_key)."""
        keys, following = [], []
        for ids, answer in sequences:
            ids, answer = np.asarray(ids, dtype=np.uint64), np.asarray(answer, dtype=bool)
            if not len(ids) or ids.max() >= 0xFFFF:
                continue
            for n in range(1, min(ORDER, len(ids) - 1) + 1):
                key = np.zeros(len(ids) - n, dtype=np.uint64)
                for j in range(n):  # context_key of ids[i : i + n], the continuation ids[i + n]
                    key = (key << np.uint64(16)) | (ids[j : len(ids) - n + j] + np.uint64(1))
                keys.append(key[answer[n:]])
                following.append(ids[n:][answer[n:]])
        none = np.zeros(0, dtype=np.uint64)
        keys, following = np.concatenate([none, *keys]), np.concatenate([none, *following])
        if not len(keys):
            raise ValueError("corpus index: no answer tokens to index")
        order = np.lexsort((following, keys))
        keys, following = keys[order], following[order]
        pair = np.flatnonzero(np.r_[True, (keys[1:] != keys[:-1]) | (following[1:] != following[:-1])])
        counts = np.diff(np.r_[pair, len(keys)])
        keys, following = keys[pair], following[pair]
        first = np.r_[True, keys[1:] != keys[:-1]]
        group = np.cumsum(first) - 1
        seen = np.bincount(group, weights=counts)
        best = np.lexsort((-counts, group))
        best = best[np.r_[True, group[best][1:] != group[best][:-1]]]  # each context's most frequent continuation
        shares = counts[best] / (seen + 1)  # one unseen continuation more: a context seen once is a coin toss
        kept = (seen >= min_seen) & (shares >= SHARES[1])
        return cls(keys[best][kept], following[best][kept].astype(np.uint16), shares[kept].astype(np.float16))

    def save(self, directory: str | Path) -> None:
        save_file({"keys": self.keys, "tokens": self.tokens, "shares": self.shares},
                  str(Path(directory) / CORPUS_NAME))

    @classmethod
    def load(cls, directory: str | Path) -> "CorpusIndex | None":
        """The index in `directory`, or None where it has none."""
        path = Path(directory) / CORPUS_NAME
        if not path.is_file():
            return None
        try:
            tensors = load_file(str(path))
            return cls(tensors["keys"], tensors["tokens"], tensors["shares"])
        except (SafetensorError, OSError, KeyError, ValueError) as error:
            raise ValueError(f"corpus index: {path} is corrupt or unreadable: {error}") from None

    def next(self, context: Sequence[int]) -> tuple[int, float] | None:
        """The continuation of the longest of the last 1..ORDER tokens of `context` that the corpus holds, with its
        share there; None where not even the last token is in it."""
        for n in range(min(ORDER, len(context)), 0, -1):
            if max(context[-n:]) >= 0xFFFF:
                return None
            key = np.uint64(context_key(context[-n:]))
            i = int(np.searchsorted(self.keys, key))
            if i < len(self.keys) and self.keys[i] == key:
                return int(self.tokens[i]), float(self.shares[i])
        return None


class CorpusDraft:
    """One row's corpus source (a proposers.Proposer): a chain that follows the index from the row's last tokens, each
    token right as often as the corpus's tokens of its share have been in this request (apart for the first token off
    the step's tree where the tree has candidates of its own there), as much of it as pays for its nodes
    (proposers.worth)."""

    def __init__(self, index: CorpusIndex, tokens: Sequence[int], max_length: int):
        self.index, self.max_length = index, max_length
        self.context = list(tokens[-ORDER:])
        self.rates = ChainRates(SHARES)  # a bin per share

    def propose(self, start: StepStart, step: SoFar) -> Proposal:
        """The index's chain from the row's last tokens, as much of it as pays (Proposer.propose): the index is
        followed one token at a time, as long as `worth` reads on."""
        return self.rates.offer(self.follow(min(self.max_length, start.budget)), step, self.max_length)

    def follow(self, length: int) -> Iterator[tuple[int, int]]:
        """Up to `length` tokens of the index from the row's last ones, one at a time, each with its share's bin."""
        context = list(self.context)
        for _ in range(length):
            if (found := self.index.next(context)) is None:
                return
            token, share = found
            context.append(token)
            yield token, int(np.searchsorted(SHARES, share, side="right")) - 1

    def record(self, nodes: list[int], path: list[int], new: list[int], seconds: float | None) -> None:
        """Counts which chain tokens were right, then moves the context on."""
        self.rates.tally(nodes, path)
        self.context = (self.context + list(new))[-ORDER:]
