"""Sources of candidates behind one small interface (transformers' CandidateGenerator, vLLM's proposers): each step
every Proposer of a row offers a tree of candidates after the root with the tokens it expects them to add; the step
grafts each offer into one tree (`graft`), verifies it in one pass, and tells every proposer what was verified and
accepted. The step never asks what kind of proposer it has: the heads (heads_draft.HeadsDraft), the lookup drafts
(lookup.LookupDraft) and the corpus drafts (corpus.CorpusDraft) are three; a new source of drafts is one more class
with these two calls. The chain sources weigh their chains alike (`ChainRates`).
"""

import functools
import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from .guard import Ladder, interpolate, running
from .tree import Tree, build

DRAFT_RANK = 1 << 16  # a chain's nodes' rank: past any head's top-k, so never one of the heads'
FIXED_NODE_COST = 0.1  # a node's cost, as a share of a step, where the ladder has no measured latencies
CHAIN_PRIOR_WEIGHT = 2  # a chain source's prior chance of a token being right counts as this many tokens (ChainRates)
CHAIN_SMOOTHING = 1 / 16  # a new count's weight once the prior is outweighed: the estimate follows recent chains
APART = 0.5  # a prior's factor for a first token beside the tree's own candidates: right only where they are wrong


@dataclass(frozen=True)
class StepStart:
    """What a row's step starts from, for its proposers."""

    root: int  # the last token produced: every proposal follows it
    heads_input: torch.Tensor  # [S] the heads' input state at the token before the root
    context: int  # the row's cache entries
    budget: int  # no proposal is deeper: the step never guesses past the row's token budget
    batch: int  # rows in the step
    pooled: list[float] | None  # the batch's mean yields per tree of the row's ladder (guard.batch_yields)


@dataclass(frozen=True)
class Proposal:
    """Candidates after the root: a tree (its paths are the proposer's names for its nodes), their tokens [N] in node
    order, the tokens they are expected to add to the step's yield, and the nodes a compiled step keeps for this
    proposer whatever it offers (one graph a size)."""

    tree: Tree
    tokens: torch.Tensor | list[int]
    gained: float
    room: int

    @staticmethod
    def chain(tokens: list[int], gained: float, room: int) -> "Proposal":
        """A chain: each token after the one before it."""
        tree = build(tuple((DRAFT_RANK,) * depth for depth in range(1, len(tokens) + 1)))
        return Proposal(tree, tokens, gained, room)


@dataclass(eq=False)
class SoFar:
    """The step as the proposers before one left it: the tokens it is expected to yield, cost(n) (its time with n
    more nodes, as a share of its time without them: step_cost), and its tree with the tokens [N+1] (the root first),
    from which a chain learns which of its tokens the step verifies already (`places`)."""

    tokens: float
    cost: Callable[[int], float]
    tree: Tree
    tree_tokens: torch.Tensor

    @functools.cached_property
    def _paths(self) -> tuple[set[tuple[int, ...]], set[tuple[int, ...]]]:
        """The tokens along each node's path after the root, and those of the nodes with children."""
        if self.tree.num_nodes == 1:  # the root alone: nothing to read back from the device
            return {()}, set()
        listed = self.tree_tokens.tolist()
        along = {(): ()}
        for path, token in sorted(zip(self.tree.paths, listed[1:]), key=lambda item: len(item[0])):
            along[path] = along[path[:-1]] + (token,)
        return set(along.values()), {along[path[:-1]] for path in self.tree.paths}

    def places(self, chain: Iterable[int]) -> Iterator[tuple[bool, bool]]:
        """Per token of a chain after the root (read as it is needed: a lazy chain stays lazy): whether the tree holds
        it (and every one before it, along a path), and whether it is the first the tree does not hold beside the
        tree's own candidates there (their sibling: right only where they are all wrong)."""
        paths, parents = self._paths
        prefix, held = (), True
        for token in chain:
            if not held:
                yield False, False
                continue
            held = (prefix := prefix + (token,)) in paths
            yield held, not held and prefix[:-1] in parents


class Proposer(Protocol):
    """One row's source of candidates (decoding.Row.proposers)."""

    def propose(self, start: StepStart, step: SoFar) -> Proposal:
        """This step's candidates, given the step as the proposals before this one left it (`worth` weighs what
        more nodes yield against what they cost)."""

    def record(self, nodes: list[int], path: list[int], new: list[int], seconds: float | None) -> None:
        """After the step: its proposal's nodes in the verified tree (in its node order), the accepted `path` (node
        indices, root first), the tokens the step produced and its seconds (None: it verified more than this proposal,
        or other rows too, so the time is not this proposal's)."""


def worth(right: Iterable[tuple[float, bool]], tokens: float, cost: Callable[[int], float]) -> tuple[int, float]:
    """How many tokens of a chain to verify: right holds, per token, its chance of being right given the ones before,
    and whether the step's tree holds it already (SoFar.places: a node verified anyway, whose yield `tokens` counts).
    -> the prefix with the most expected tokens per unit of step time, and the tokens it is expected to add. tokens:
    what the step yields without it; cost as SoFar's, of the chain's own nodes. A token counts only if every one
    before it is accepted, so each adds less than the one before: with a cost linear in nodes none pays after the
    first that does not, and `right` is read no further (a lazy chain is walked only as far as it pays)."""
    gained, chance, length, own, kept, speed = 0.0, 1.0, 0, 0, 0, tokens
    for p, held in right:
        chance, length = chance * p, length + 1
        if held:
            continue
        own += 1
        if (longer := (tokens + gained + chance) / cost(own)) <= speed:
            break
        gained, kept, speed = gained + chance, length, longer
    return kept, gained


class ChainRates:
    """A chain source's chances and the walk of its chains (lookup.LookupDraft, corpus.CorpusDraft): per bin (what the
    source was as sure of a token: a match length, a share), the running chance of a chain token being right given
    the one before was; then per the same bin for a first token beside the step tree's own candidates (SoFar.places:
    right only where they are all wrong), bin + the number of bins."""

    def __init__(self, priors: Iterable[float]):
        """priors: each bin's chance before any is counted; beside the tree's candidates, APART as sure."""
        priors = list(priors)
        self.right = priors + [p * APART for p in priors]
        self.counted = [0] * len(self.right)
        self.bins: list[int] = []  # the bins of the last chain offered

    def offer(self, chain: Iterable[tuple[int, int]], step: SoFar, room: int) -> Proposal:
        """A chain of (token, its bin), read one pair at a time and only as far as its tokens pay for their nodes
        (`worth`: a lazy chain stays lazy) -> the proposal of that prefix, keeping `room` nodes."""
        tokens, kinds, self.bins = [], [], []

        def read():
            for token, kind in chain:
                tokens.append(token)
                kinds.append(kind)
                yield token

        def chances():
            for held, apart in step.places(read()):
                self.bins.append(kinds[len(self.bins)] + len(self.right) // 2 * apart)
                yield self.right[self.bins[-1]], held

        keep, gained = worth(chances(), step.tokens, step.cost)
        self.bins = self.bins[:keep]
        return Proposal.chain(tokens[:keep], gained, room)

    def tally(self, nodes: list[int], path: list[int]) -> None:
        """After a step that verified the last chain's `nodes` (node indices in its tree, in chain order), each of its
        tokens up to the first one not accepted on `path` moves its bin's chance toward what happened (guard.running,
        CHAIN_PRIOR_WEIGHT, CHAIN_SMOOTHING)."""
        for depth, (node, b) in enumerate(zip(nodes, self.bins), start=1):
            hit = depth < len(path) and path[depth] == node
            self.counted[b] += 1
            self.right[b] = running(self.right[b], hit, self.counted[b], CHAIN_PRIOR_WEIGHT, CHAIN_SMOOTHING)
            if not hit:
                break


def graft(tree: Tree, tokens: torch.Tensor, proposal: Proposal) -> tuple[Tree, torch.Tensor, list[int]]:
    """The step's tree so far with its tokens [N+1] (the root first) and a proposal -> the merged tree, its tokens,
    and the proposal's nodes in it. The first proposal is the tree as it stands. A later one follows the tree where
    its tokens are the tree's along a path (one node, verified once); from its first other token on it hangs its own
    nodes there, under its own ranks (the next free one where taken)."""
    if proposal.tree.num_nodes == 1:  # nothing offered
        return tree, tokens, []
    if tree.num_nodes == 1:
        added = proposal.tokens if torch.is_tensor(proposal.tokens) else tokens.new_tensor(proposal.tokens)
        return proposal.tree, torch.cat([tokens, added]), list(range(1, proposal.tree.num_nodes))
    listed = tokens.tolist()
    token_of = {(): listed[0]} | dict(zip(tree.paths, listed[1:]))
    child = {(path[:-1], token_of[path]): path for path in tree.paths}
    where = {(): ()}  # the proposal's node -> the merged tree's
    added = proposal.tokens.tolist() if torch.is_tensor(proposal.tokens) else proposal.tokens
    for path, token in zip(proposal.tree.paths, added):
        parent = where[path[:-1]]
        if (node := child.get((parent, token))) is None:
            rank = path[-1]
            while parent + (rank,) in token_of:
                rank += 1
            node = parent + (rank,)
            token_of[node], child[parent, token] = token, node
        where[path] = node
    merged = build(tuple(token_of)[1:])
    index = {path: i + 1 for i, path in enumerate(merged.paths)}
    return (merged, tokens.new_tensor([listed[0]] + [token_of[path] for path in merged.paths]),
            [index[where[path]] for path in proposal.tree.paths])


def drafted(tree: Tree, path: list[int], produced: int) -> int:
    """Of the `produced` tokens of a step that accepted `path` (node indices) in `tree`, those only a chain proposed
    (its own nodes; past an EOS, none)."""
    return sum(max(tree.paths[node - 1]) >= DRAFT_RANK for node in path[1:produced])


def step_cost(ladder: Ladder, context: int, batch: int, nodes: int) -> Callable[[int], float]:
    """cost(n) for `worth`: the time of a step of `nodes` + n nodes as a share of one of `nodes`, from the ladder's
    calibrated step latencies per tree size at this context and batch size (linear between sizes, and on past the
    largest at the steeper of its last segment and the whole ladder's slope); FIXED_NODE_COST a node where the ladder
    measured none. More nodes never cost less: a fit's few timed steps can put a larger tree below a smaller one, and
    a flat or falling last segment would price every draft node at nothing (run 16 of
    benchmarks/results/model_card_log.md)."""
    if len(ladder.trees) == 1:
        return lambda more: 1 + FIXED_NODE_COST * more
    sizes = [tree.num_nodes for tree in ladder.trees]
    seconds = list(itertools.accumulate(ladder.latency(context, batch), max))
    beyond = max((seconds[-1] - seconds[-2]) / (sizes[-1] - sizes[-2]),
                 (seconds[-1] - seconds[0]) / (sizes[-1] - sizes[0]))
    rows = [(s,) for s in seconds]  # interpolate's rows: one value a size

    def at(n: int) -> float:
        if n >= sizes[-1]:
            return seconds[-1] + (n - sizes[-1]) * beyond
        return interpolate(sizes, rows, n)[0]

    base = at(nodes)
    return lambda more: at(nodes + more) / base
