"""Drafts from the text itself (prompt lookup decoding): what followed the stream's current suffix last time.

Code, quotes and edits repeat their own context, so the tokens that followed the latest earlier occurrence of
the stream's last few tokens are a cheap guess at what comes next, with no model at all.
"""

from collections.abc import Sequence

from .proposers import ChainRates, Proposal, SoFar, StepStart


class Lookup:
    """An index over a token stream (the prompt, then the accepted tokens) that finds continuations.

    For n = 1..max_ngram, `_ends[n - 1]` maps an n-gram to the latest position where it ended and was followed by
    a token; the stream's own end has no continuation yet, so it is entered only once the next token arrives.
    """

    def __init__(self, tokens: Sequence[int] = (), max_ngram: int = 4):
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be at least 1, not {max_ngram}")
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self._ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram)]
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Appends tokens; each one lets the n-grams ending just before it in, O(max_ngram) per token."""
        stream = self.tokens
        for token in tokens:
            end = len(stream) - 1  # the n-grams ending here are followed by `token` from now on
            for n in range(1, min(self.max_ngram, end + 1) + 1):
                self._ends[n - 1][tuple(stream[end - n + 1 : end + 1])] = end
            stream.append(token)

    def continuation(self, length: int) -> tuple[list[int], int]:
        """Up to `length` tokens after the latest earlier occurrence of the stream's longest recurring suffix,
        and that suffix's length as confidence; ([], 0) where no suffix recurs.

        The continuation may run into the suffix itself (a repeating pattern), and stops at the stream's end.
        """
        stream = self.tokens
        if length <= 0:
            return [], 0
        for n in range(min(self.max_ngram, len(stream)), 0, -1):
            end = self._ends[n - 1].get(tuple(stream[-n:]))
            if end is not None:
                return stream[end + 1 : end + 1 + length], n
        return [], 0


PRIOR = 0.5  # a chain token's chance of being right before any is counted (proposers.ChainRates)


class LookupDraft:
    """One row's lookup source (a proposers.Proposer): the index over its prompt and answer, and how often its chain
    tokens were right (given the one before was), per match length, apart for the first token off the step's tree
    where the tree has candidates of its own there: the confidence it offers them with. On a CPU every node verified
    costs time, so the step keeps a long chain only where matches have been right (proposers.worth)."""

    def __init__(self, prompt: Sequence[int], max_length: int, max_ngram: int = 4):
        self.index, self.max_length = Lookup(prompt, max_ngram), max_length
        self.rates = ChainRates([PRIOR] * max_ngram)  # a bin per match length

    def propose(self, start: StepStart, step: SoFar) -> Proposal:
        """The continuation of the stream's longest recurring suffix, each token right as often as this match
        length's have been, as much of it as pays for its nodes (proposers.worth)."""
        chain, match = self.index.continuation(min(self.max_length, start.budget))
        return self.rates.offer(((token, match - 1) for token in chain), step, self.max_length)

    def record(self, nodes: list[int], path: list[int], new: list[int], seconds: float | None) -> None:
        """Counts which chain tokens were right, then extends the index."""
        self.rates.tally(nodes, path)
        self.index.extend(new)
