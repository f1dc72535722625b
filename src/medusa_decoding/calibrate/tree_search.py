"""The best tree of each size for an accuracy table, and the size that decodes fastest given measured step times.

The MEDUSA paper's model: head k's rank-i token is the correct one (the token k+2 ahead) with
probability a_k^(i), independently across heads. A node (r_1, ..., r_d) is accepted when every
token on its path is correct, so a tree accepts on average sum over nodes of prod_j a_{j-1}^(r_j)
candidates per step, plus the one token every step yields. Adding the node of highest path
probability one at a time gives the best tree of every size (a child never beats its parent), and
the size that wins is the one with the most expected tokens per second of measured step time.
"""

import heapq
import math
from dataclasses import dataclass

import torch

from ..config import CalibrateConfig
from ..guard import Ladder
from ..tree import Tree, build

Node = tuple[int, ...]  # a tree node's path: the rank taken in each head's top-k, root excluded
DEFAULTS = CalibrateConfig()
TRIED_SIZES = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128)


def path_probability(path: Node, accuracy: torch.Tensor) -> float:
    """prod_j a_{j-1}^(r_j): the probability that every token on the path is correct."""
    return math.prod(float(accuracy[depth, rank]) for depth, rank in enumerate(path))


def expected_acceptance(paths, accuracy: torch.Tensor) -> float:
    """Expected accepted candidates per step of the tree `paths` under independence (add 1 for tokens/step).

    accuracy: [K, S], a_k^(i) = P(head k's rank-i token is correct).

    >>> expected_acceptance([(0,), (0, 0)], torch.tensor([[0.5, 0.25], [0.5, 0.25]]))
    0.75
    """
    return sum(path_probability(tuple(p), accuracy) for p in paths)


def check_accuracy(accuracy: torch.Tensor) -> None:
    if accuracy.ndim != 2 or accuracy.numel() == 0:
        raise ValueError(f"accuracy must be a non-empty [heads, ranks] table, got shape {list(accuracy.shape)}")
    if accuracy.min() < 0 or accuracy.max() > 1:
        raise ValueError(f"accuracy: probabilities must lie in [0, 1], got {accuracy.min():.3g}..{accuracy.max():.3g}")


def grow_tree(accuracy: torch.Tensor, num_nodes: int) -> tuple[list[Node], list[float]]:
    """Greedy tree search: (paths in the order added, expected acceptance after each addition).

    The first n paths are the best tree of n nodes; fewer than num_nodes come back only when every
    node of depth <= K and rank < S is in. accuracy: [K, S].

    >>> grow_tree(torch.tensor([[0.5, 0.25], [0.5, 0.25]]), 3)   # (1,) ties (0, 0): the shallower first
    ([(0,), (1,), (0, 0)], [0.5, 0.75, 1.0])
    """
    check_accuracy(accuracy)
    if not isinstance(num_nodes, int) or num_nodes < 1:
        raise ValueError(f"num_nodes must be a positive integer, got {num_nodes!r}")
    depth, ranks = accuracy.shape
    # heap entries (-probability, depth, path): on ties the parent (shorter) comes first
    frontier = [(-path_probability((r,), accuracy), 1, (r,)) for r in range(ranks)]
    heapq.heapify(frontier)
    paths, expected = [], []
    while frontier and len(paths) < num_nodes:
        negative, length, path = heapq.heappop(frontier)
        paths.append(path)
        expected.append((expected[-1] if expected else 0.0) - negative)
        if length < depth:
            for r in range(ranks):
                child = path + (r,)
                heapq.heappush(frontier, (-path_probability(child, accuracy), length + 1, child))
    return paths, expected


def greedy_trees(accuracy: torch.Tensor, sizes) -> list[Tree]:
    """The best tree of each size: the first n nodes of the greedy tree search. accuracy: [K, S]"""
    paths, _ = grow_tree(accuracy, max(sizes))
    if len(paths) < max(sizes):
        raise ValueError(f"tree sizes: the heads allow at most {len(paths)} nodes, asked for {max(sizes)}")
    return [build(tuple(paths[:n])) for n in sizes]


def tried_sizes(max_nodes: int) -> list[int]:
    """The tree sizes whose step latency is measured: every size up to 6, then ever sparser (latency is smooth)."""
    return sorted({n for n in TRIED_SIZES if n <= max_nodes} | {max_nodes})


def fit_sizes(accuracy: torch.Tensor, config: CalibrateConfig = DEFAULTS) -> list[int]:
    """The tree sizes a fit measures: up to max_nodes, fewer where the heads allow fewer nodes."""
    return tried_sizes(len(grow_tree(accuracy, config.max_nodes)[0]))


@dataclass(frozen=True)
class Calibration:
    """What calibration found; the per-size lists follow `sizes`, whose 0 is plain decoding."""

    accuracy: list[list[float]]  # [K, S]
    paths: list[Node]  # the greedy order: paths[:n] is the best tree of n nodes
    sizes: list[int]  # tree sizes measured (candidates, root not counted), 0 first
    expected_tokens: list[float]  # 1 + expected acceptance, per size
    contexts: list[int]  # [C] context lengths the step latency was measured at, increasing
    latency_s: list[list[float]]  # [C][sizes] measured seconds per decoding step
    tokens_per_s: list[float]  # predicted at the middle context, contexts[C // 2]: expected_tokens / latency_s
    size: int  # the chosen size, >= 1: the fastest predicted at the middle context
    guess_vocab: list[int] | None = None  # the tokens the heads guess from (kernels.set_guess_vocab); None: all
    batch_sizes: list[int] = (1,)  # batches the ladder's step latency was measured at
    batch_latency_s: list[list[float]] | None = None  # [batch_sizes][ladder trees] a batch's step seconds
    # tokens per step measured by simulating each size's tree on the data (measure_yields): the static tree (paths[:n])
    # and the confident one (each step's likeliest n); None where calibrated before they were
    simulated_tokens: list[float] | None = None
    confident_tokens: list[float] | None = None
    confident_size: int | None = None  # the size confident trees decode fastest at (their tokens, the same latency)

    @property
    def tree_paths(self) -> list[Node]:
        return self.paths[: self.size]

    def ladder(self, confident: bool = False) -> Ladder:
        """The trees `--tree auto` chooses among at run time (guard.py): the chosen one and every smaller size
        (confident: `--tree confident`'s sizes, each step's likeliest nodes)."""
        return ladder(torch.tensor(self.accuracy, dtype=torch.float64), self.sizes, self.contexts, self.latency_s,
                      self.size, self.batch_sizes, self.batch_latency_s, self.confident_size,
                      self.confident_tokens if confident else None)


def ladder(accuracy: torch.Tensor, sizes: list[int], contexts: list[int], latency_s: list[list[float]],
           size: int, batch_sizes=(1,), batch_latency_s: list[list[float]] | None = None,
           confident_size: int | None = None, confident_tokens: list[float] | None = None) -> Ladder:
    """The best tree of each of `sizes` up to the chosen `size` (accuracy [K, S]), their expected tokens per step and
    step latency. Larger trees are left out: on this calibration they are predicted slower, and whether one beats
    the chosen tree on a prompt hinges on margins that per-request estimates cannot resolve.

    confident_tokens (measure_yields' per size): the ladder of confident trees instead, up to confident_size, with
    those tokens per step; its trees stand for their sizes. batch_latency_s covers the trees up to the larger size.
    """
    confident = confident_tokens is not None and confident_size is not None
    top = confident_size if confident else size
    paths, expected = grow_tree(accuracy, top)
    kept = [i for i, n in enumerate(sizes) if n <= top]
    tokens = [confident_tokens[i] if confident else 1.0 + (expected[sizes[i] - 1] if sizes[i] else 0.0) for i in kept]
    return Ladder(trees=tuple(build(tuple(paths[: sizes[i]])) for i in kept), expected_tokens=tuple(tokens),
                  contexts=tuple(contexts), latency_s=tuple(tuple(row[i] for i in kept) for row in latency_s),
                  batch_sizes=tuple(batch_sizes), batch_latency_s=None if batch_latency_s is None
                  else tuple(tuple(row[: len(kept)]) for row in batch_latency_s),
                  confident=confident)


def choose_tree(accuracy: torch.Tensor, sizes: list[int], contexts: list[int], latencies: list[list[float]],
                confident_tokens: list[float] | None = None) -> Calibration:
    """The tree size with the most predicted tokens/s at the middle context. latencies[c][i]: step seconds with
    sizes[i] candidates at contexts[c] tokens. confident_tokens: confident trees' tokens per step per size
    (measure_yields), whose fastest size is chosen too: they verify as many nodes as a static tree, at its cost."""
    if len(sizes) < 2 or sizes[0] != 0 or sorted(set(sizes)) != sizes:
        raise ValueError(f"latencies: need step times for sizes 0 < n1 < n2 < ..., got sizes {sizes!r}")
    if not contexts or len(latencies) != len(contexts) or any(len(row) != len(sizes) for row in latencies):
        raise ValueError(f"latencies: need one step time per size at each of the contexts {contexts!r}")
    if min(map(min, latencies)) <= 0:
        raise ValueError(f"latencies: step times must be positive, got {latencies!r}")
    assert confident_tokens is None or len(confident_tokens) == len(sizes), "confident tokens: one per size"
    paths, expected = grow_tree(accuracy, sizes[-1])
    if len(paths) < sizes[-1]:
        raise ValueError(f"latencies: size {sizes[-1]} measured, but the heads allow only {len(paths)} nodes")
    tokens = [1.0 + (expected[n - 1] if n else 0.0) for n in sizes]
    middle = latencies[len(contexts) // 2]
    speed = [t / s for t, s in zip(tokens, middle)]
    best = max(range(1, len(sizes)), key=speed.__getitem__)
    confident = None if confident_tokens is None else max(range(1, len(sizes)),
                                                          key=lambda i: confident_tokens[i] / middle[i])
    return Calibration(accuracy.tolist(), paths, list(sizes), tokens, list(contexts), [list(r) for r in latencies],
                       speed, sizes[best], confident_tokens=confident_tokens,
                       confident_size=None if confident is None else sizes[confident])
