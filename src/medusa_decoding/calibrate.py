"""Calibrated sparse trees: the tree that decodes fastest for these heads, this model and this device.

The MEDUSA paper's model: head k's rank-i token is the correct one (the token k+2 ahead) with
probability a_k^(i), independently across heads. A node (r_1, ..., r_d) is accepted when every
token on its path is correct, so a tree accepts on average sum over nodes of prod_j a_{j-1}^(r_j)
candidates per step, plus the one token every step yields. Adding the node of highest path
probability one at a time gives the best tree of every size (a child never beats its parent), and
the size that wins is the one with the most expected tokens per second of measured step time.
"""

import heapq
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .config import CalibrateConfig
from .decoding import PLAIN, context_limit, prefill, propose, verify
from .tree import Tree, build

Path_ = tuple[int, ...]  # a node: the rank taken in each head's top-k, root excluded
ACCURACY_NAME = "accuracy.json"
PLOT_NAMES = {"accuracy": "accuracy.png", "tree": "tree.png", "speed": "tokens_per_s.png"}


def path_probability(path: Path_, accuracy: torch.Tensor) -> float:
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


def grow_tree(accuracy: torch.Tensor, num_nodes: int) -> tuple[list[Path_], list[float]]:
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


@dataclass(frozen=True)
class Calibration:
    """What `medusa calibrate` found; index n of the per-size lists is the tree of n candidates (0: plain)."""

    accuracy: list[list[float]]  # [K, S]
    paths: list[Path_]  # the greedy order: paths[:n] is the best tree of n nodes
    expected_tokens: list[float]  # 1 + expected acceptance, per size
    latency_s: list[float]  # measured seconds per decoding step, per size
    tokens_per_s: list[float]  # predicted: expected_tokens / latency_s
    size: int  # the chosen size, >= 1

    @property
    def tree_paths(self) -> list[Path_]:
        return self.paths[: self.size]


def choose_tree(accuracy: torch.Tensor, latencies: list[float]) -> Calibration:
    """The tree size with the most predicted tokens/s. latencies[n]: step seconds with n candidates (0: plain)."""
    if len(latencies) < 2 or min(latencies) <= 0:
        raise ValueError(f"latencies: need positive step times for sizes 0..N with N >= 1, got {latencies!r}")
    paths, expected = grow_tree(accuracy, len(latencies) - 1)
    if len(paths) < len(latencies) - 1:
        raise ValueError(f"latencies: {len(latencies) - 1} sizes measured, but the heads allow only {len(paths)} nodes")
    tokens = [1.0] + [1.0 + e for e in expected]
    speed = [t / s for t, s in zip(tokens, latencies)]
    size = max(range(1, len(speed)), key=speed.__getitem__)
    return Calibration(accuracy.tolist(), paths, tokens, list(latencies), speed, size)
