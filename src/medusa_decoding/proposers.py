"""Sources of candidates beside the heads' tree, behind one small interface (transformers' CandidateGenerator, vLLM's
proposers): each step a Proposer offers a chain of tokens after the root with each token's chance of being accepted
given the ones before it; the step keeps the prefix that pays for its verification (`worth`, at the step's
calibrated cost), grafts it into the tree (`graft`) and afterwards tells the proposer what was verified and accepted.
The step never asks what kind of proposer it has: a new source of drafts is a class with these two calls (lookup.py's
LookupDraft is one).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from .guard import Ladder
from .tree import Tree, build

DRAFT_RANK = 1 << 16  # a proposer's node's rank in a merged tree: past any head's top-k, so never one of the heads'
FIXED_NODE_COST = 0.1  # a node's cost, as a share of a step, where the ladder has no measured latencies


@dataclass(frozen=True)
class Proposal:
    """A chain of candidate tokens after the root, and each one's chance of being accepted given the ones before."""

    tokens: list[int]
    right: list[float]


class Proposer(Protocol):
    """One row's source of candidates beside the heads (decoding.Row.proposers)."""

    max_length: int  # the most tokens it proposes a step: room a compiled step keeps for it

    def propose(self, budget: int) -> Proposal:
        """Up to `budget` tokens to follow the row's last token (none: an empty proposal)."""

    def record(self, nodes: list[int], path: list[int], new: list[int]) -> None:
        """After the step: its kept tokens' `nodes` in the verified tree (a prefix of its proposal; none kept: []),
        the accepted `path` (node indices, root first) and the tokens the step produced."""


def worth(proposal: Proposal, tokens: float, cost: Callable[[int], float]) -> int:
    """How many of the proposal's tokens to verify: the prefix with the most expected tokens per unit of step time.
    tokens: what the step yields without them; cost(n): the step's time with n more nodes, as a share of it without
    them. A token counts only if every one before it is accepted."""
    gained, chance, best, best_speed = 0.0, 1.0, 0, tokens
    for length, right in enumerate(proposal.right, start=1):
        chance *= right
        gained += chance
        if (speed := (tokens + gained) / cost(length)) > best_speed:
            best, best_speed = length, speed
    return best


def graft(tree: Tree, tokens: list[int], chain: list[int]) -> tuple[Tree, list[int], list[int]]:
    """The heads' tree with its tokens [N+1] (the root first) and a chain after the root -> the merged tree, its
    tokens, and the chain's nodes in it. Where the chain's tokens are the heads' along a path it follows that path
    (one node, verified once); from its first other token on it hangs its own nodes there (rank DRAFT_RANK)."""
    token_of = {(): tokens[0]} | dict(zip(tree.paths, tokens[1:]))
    child = {(path[:-1], token_of[path]): path for path in tree.paths}
    node, added, nodes = (), [], []
    for token in chain:
        node = child.get((node, token)) or node + (DRAFT_RANK,)
        if node not in token_of:
            token_of[node] = token
            added.append(node)
        nodes.append(node)
    merged = build(tree.paths + tuple(added))
    index = {path: i + 1 for i, path in enumerate(merged.paths)}
    return merged, [tokens[0]] + [token_of[path] for path in merged.paths], [index[path] for path in nodes]


def drafted(tree: Tree, path: list[int], produced: int) -> int:
    """Of the `produced` tokens of a step that accepted `path` (node indices) in `tree`, those only a proposer
    proposed: its own nodes (past an EOS, none)."""
    return sum(DRAFT_RANK in tree.paths[node - 1] for node in path[1:produced])


def step_cost(ladder: Ladder, context: int, batch: int, nodes: int) -> Callable[[int], float]:
    """cost(n) for `worth`: the time of a step of `nodes` + n nodes as a share of one of `nodes`, from the ladder's
    calibrated step latencies per tree size at this context and batch size (linear between sizes, and on past the
    largest along its last segment); FIXED_NODE_COST a node where the ladder measured none."""
    if len(ladder.trees) == 1:
        return lambda more: 1 + FIXED_NODE_COST * more
    sizes, seconds = [tree.num_nodes for tree in ladder.trees], ladder.latency(context, batch)

    def at(n: int) -> float:
        i = next((i for i in range(1, len(sizes) - 1) if sizes[i] >= n), len(sizes) - 1)
        return seconds[i - 1] + (n - sizes[i - 1]) * (seconds[i] - seconds[i - 1]) / (sizes[i] - sizes[i - 1])

    base = at(nodes)
    return lambda more: at(nodes + more) / base
