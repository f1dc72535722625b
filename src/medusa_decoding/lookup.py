"""Drafts from the text itself (prompt lookup decoding): what followed the stream's current suffix last time.

Code, quotes and edits repeat their own context, so the tokens that followed the latest earlier occurrence of
the stream's last few tokens are a cheap guess at what comes next, with no model at all.
"""

from collections.abc import Sequence

from .guard import Ladder
from .tree import Tree, build


class Lookup:
    """An index over a token stream (the prompt, then the accepted tokens) that proposes continuations.

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

    def propose(self, length: int) -> tuple[list[int], int]:
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


LOOKUP_RANK = 1 << 16  # a lookup node's rank in a merged tree: past any head's top-k, so never one of the heads'
PRIOR, PRIOR_WEIGHT = 0.5, 2  # a chain token's chance of being right before any is counted, worth this many counts
SMOOTHING = 1 / 16  # the weight of a new count once PRIOR_WEIGHT is outweighed: the estimate follows recent chains
FIXED_NODE_COST = 0.1  # a node's cost, as a share of a step, where the ladder has no measured latencies


def graft(tree: Tree, tokens: list[int], chain: list[int]) -> tuple[Tree, list[int], list[int]]:
    """The heads' tree with its tokens [N+1] (the root first) and a lookup chain after the root -> the merged tree,
    its tokens, and the chain's nodes in it. Where the chain's tokens are the heads' along a path it follows that path
    (one node, verified once); from its first other token on it hangs its own nodes there (rank LOOKUP_RANK)."""
    token_of = {(): tokens[0]} | dict(zip(tree.paths, tokens[1:]))
    child = {(path[:-1], token_of[path]): path for path in tree.paths}
    node, added, nodes = (), [], []
    for token in chain:
        node = child.get((node, token)) or node + (LOOKUP_RANK,)
        if node not in token_of:
            token_of[node] = token
            added.append(node)
        nodes.append(node)
    merged = build(tree.paths + tuple(added))
    index = {path: i + 1 for i, path in enumerate(merged.paths)}
    return merged, [tokens[0]] + [token_of[path] for path in merged.paths], [index[path] for path in nodes]


class LookupDraft:
    """One row's lookup source: the index over its prompt and answer, and how often its chain tokens were right
    (given the one before was), per match length. Each step it offers the chain length with the most expected tokens
    per unit of step time: a chain token is accepted only if every one before it was, and on a CPU every node
    verified costs time, so a long chain is worth it only where matches have been right."""

    def __init__(self, prompt: Sequence[int], max_length: int, max_ngram: int = 4):
        self.index, self.max_length = Lookup(prompt, max_ngram), max_length
        self.right = [PRIOR] * max_ngram  # per match length: P(a chain token is right | the one before was)
        self.counted = [0] * max_ngram
        self.match = 0  # the match length of the last chain offered

    def chain(self, budget: int, tokens: float, cost) -> list[int]:
        """The chain to verify this step: at most `budget` tokens; `tokens`: what the step yields without it;
        cost(n): the step time with n more nodes, as a share of the step without them."""
        proposal, match = self.index.propose(min(self.max_length, budget))
        if not proposal:
            return []
        right, gained, best, best_speed = self.right[match - 1], 0.0, 0, tokens
        for length in range(1, len(proposal) + 1):
            gained += right ** length
            if (speed := (tokens + gained) / cost(length)) > best_speed:
                best, best_speed = length, speed
        self.match = match
        return proposal[:best]

    def record(self, nodes: list[int], path: list[int], new: list[int]) -> None:
        """After the step: the chain's `nodes` in the verified tree, the accepted `path` (node indices) and the tokens
        produced. Counts which chain tokens were right, then extends the index."""
        match = self.match
        for depth, node in enumerate(nodes, start=1):
            right = depth < len(path) and path[depth] == node
            self.counted[match - 1] += 1
            weight = max(1 / (PRIOR_WEIGHT + self.counted[match - 1]), SMOOTHING)
            self.right[match - 1] += weight * (right - self.right[match - 1])
            if not right:
                break
        self.index.extend(new)


def drafted(tree: Tree, path: list[int], produced: int) -> int:
    """Of the `produced` tokens of a step that accepted `path` (node indices) in `tree`, those only a draft
    proposed: its own nodes (past an EOS, none)."""
    return sum(LOOKUP_RANK in tree.paths[node - 1] for node in path[1:produced])


def step_cost(ladder: Ladder, context: int, batch: int, nodes: int):
    """cost(n) for LookupDraft.chain: the time of a step of `nodes` + n nodes as a share of one of `nodes`, from the
    ladder's calibrated step latencies per tree size at this context and batch size (linear between sizes, and on
    past the largest along its last segment); FIXED_NODE_COST a node where the ladder measured none."""
    if len(ladder.trees) == 1:
        return lambda more: 1 + FIXED_NODE_COST * more
    sizes, seconds = [tree.num_nodes for tree in ladder.trees], ladder.latency(context, batch)

    def at(n: int) -> float:
        i = next((i for i in range(1, len(sizes) - 1) if sizes[i] >= n), len(sizes) - 1)
        return seconds[i - 1] + (n - sizes[i - 1]) * (seconds[i] - seconds[i - 1]) / (sizes[i] - sizes[i - 1])

    base = at(nodes)
    return lambda more: at(nodes + more) / base
