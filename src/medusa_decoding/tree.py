"""The candidate tree: which head/rank feeds each node, and who may attend to whom.

Node 0 is the root: the token already chosen from the base model's last distribution. Node i > 0 is
given by its path (r_1, ..., r_d): it holds the rank-r_d token of head d-1 (head d-1 guesses the token
d places after the root). Nodes are ordered by depth, so parents come before children.
"""

import itertools
import json
import os
from dataclasses import dataclass, fields, replace
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import torch

PAD = -1  # fills leaf paths shorter than the deepest one; never a node, never a token
MODES = ("auto", "confident")  # trees picked once the heads' calibration is read (Mode)
EXPECTED = ("tree: expected 'auto', 'confident' or 'confident:N' (N candidates), or paths or Cartesian sizes (a list, "
            "or JSON inline or in a file)")


@dataclass(frozen=True)
class Tree:
    """All index tensors of a tree, built once and reused every step.

    >>> tree = Tree.from_spec([[0], [1], [0, 0]])
    >>> tree.leaf_paths.tolist()   # node indices from the root, PAD-filled
    [[0, 1, 3], [0, 2, -1]]
    """

    paths: tuple[tuple[int, ...], ...]  # [N] paths of the non-root nodes, in node order 1..N
    attention: torch.Tensor  # [N+1, N+1] bool: node i may attend to node j (j is i or an ancestor)
    depths: torch.Tensor  # [N+1] 0 for the root
    parents: torch.Tensor  # [N+1] PAD for the root
    heads: torch.Tensor  # [N] which head proposes node i+1
    ranks: torch.Tensor  # [N] which rank of that head's top-k
    leaf_paths: torch.Tensor  # [L, D+1] root-to-leaf node indices, PAD-filled
    children: tuple[tuple[int, ...], ...]  # [N+1] each node's children, by rank
    chains: torch.Tensor  # [N+1, D+1] root-to-node indices of every node, PAD-filled
    # per depth d < D: (the nodes at d that have children [n], their children [m], each child's parent among those n
    # [m], those n nodes' chains [n, d+1], each child's rank [m]): what one head call per depth expands
    # (candidates.candidates)
    levels: tuple[tuple[torch.Tensor, ...], ...]

    @property
    def num_nodes(self) -> int:
        return len(self.paths) + 1

    @property
    def depth(self) -> int:
        return self.chains.shape[1] - 1  # from a shape, not the paths: compiled graphs read it without a break

    def topk_per_head(self) -> int:
        return max((p[-1] for p in self.paths), default=-1) + 1

    @staticmethod
    def from_spec(spec) -> "Tree":
        """A list of paths ([[0], [0, 0], [1], ...]) or Cartesian sizes ([s1, ..., sK])."""
        if isinstance(spec, (list, tuple)) and spec and all(isinstance(s, int) for s in spec):
            return cartesian(tuple(spec))
        if not isinstance(spec, (list, tuple)) or not all(isinstance(p, (list, tuple)) for p in spec):
            raise ValueError(f"tree: expected a list of paths or a list of sizes, got {spec!r}")
        return build(tuple(tuple(p) for p in spec))

    def truncated(self, max_depth: int) -> "Tree":
        """The same tree without nodes deeper than max_depth (used near the token budget's end)."""
        if max_depth >= self.depth:
            return self
        return build(tuple(p for p in self.paths if len(p) <= max_depth))

    def check_heads(self, num_heads: int, vocab_size: int | None = None) -> None:
        """The heads must reach the tree's depth, and every rank must exist in the vocabulary."""
        if self.depth > num_heads:
            raise ValueError(f"tree: depth {self.depth} needs {self.depth} heads, but only {num_heads} exist")
        if vocab_size is not None and self.topk_per_head() > vocab_size:
            raise ValueError(f"tree: rank {self.topk_per_head() - 1} needs a top-{self.topk_per_head()},"
                             f" but the vocabulary has {vocab_size} tokens")


def spec_size(spec) -> tuple[int, int]:
    """(candidates, depth) of a tree given as Cartesian sizes or paths, counted without building it: a limit checked
    before anything is allocated ([5000, 5000] is 25 million candidates). Malformed specs count as they are; building
    them says what is wrong."""
    if isinstance(spec, (list, tuple)) and all(isinstance(s, int) for s in spec):
        nodes, width = 0, 1
        for size in spec:
            width *= max(size, 0)
            nodes += width
        return nodes, len(spec)
    if isinstance(spec, (list, tuple)):
        return len(spec), max((len(p) for p in spec if isinstance(p, (list, tuple))), default=0)
    return 0, 0


class Mode(NamedTuple):
    """A tree picked once the heads' calibration is read: "auto" (the trees fitted to this device, among which a guard
    picks each step) or "confident" (each step's likeliest candidates: `size` of them, else auto's sizes)."""

    name: str
    size: int | None = None


def parse_tree(spec) -> Tree | Mode | None:
    """A tree in any form it is given (MedusaModel, `--tree`, `--rival NAME=@TREE`, a request's `medusa.tree`) -> a
    Tree, a Mode, or None (the heads' own tree.json, else the default): a Tree, Mode or None as it is; a list of paths
    or Cartesian sizes; the text "auto", "confident" or "confident:N"; other text: paths or sizes as JSON, inline or
    in a file."""
    if spec is None or isinstance(spec, (Tree, Mode)):
        return spec
    if not isinstance(spec, str):
        return Tree.from_spec(spec)
    name, _, size = spec.partition(":")
    if name in MODES:
        if size and (name == "auto" or not size.isdigit() or int(size) < 1):
            raise ValueError(f"{EXPECTED}, got {spec!r}")
        return Mode(name, int(size) if size else None)
    try:  # os.path.isfile, unlike Path.is_file, is False for a text too long to be a file name
        return Tree.from_spec(json.loads(Path(spec).read_text() if os.path.isfile(spec) else spec))
    except json.JSONDecodeError as error:
        raise ValueError(f"{EXPECTED}; {spec!r} is neither a JSON file nor inline JSON ({error})") from None


def cartesian(sizes: tuple[int, ...]) -> Tree:
    if any(s < 1 for s in sizes):
        raise ValueError(f"tree: Cartesian sizes must be positive, got {list(sizes)}")
    paths = [p for d in range(1, len(sizes) + 1) for p in itertools.product(*(range(s) for s in sizes[:d]))]
    return build(tuple(paths))


def build(paths: tuple[tuple[int, ...], ...]) -> Tree:
    """Checks the paths, then builds (cached: the loop asks for the same trees every step)."""
    for path in paths:
        if not path or not all(isinstance(r, int) and not isinstance(r, bool) for r in path):
            raise ValueError(f"tree: each path must be a non-empty list of integer ranks, got {list(path)}")
        if any(r < 0 for r in path):
            raise ValueError(f"tree: negative rank in path {list(path)}")
    if len(set(paths)) != len(paths):
        raise ValueError("tree: duplicate paths")
    known = set(paths)
    for path in paths:
        if len(path) > 1 and path[:-1] not in known:
            raise ValueError(f"tree: not prefix-closed: {list(path)} has no parent {list(path[:-1])}")
    return _build(tuple(sorted(paths, key=lambda p: (len(p), p))))


@lru_cache(maxsize=256)
def node_index(paths: tuple[tuple[int, ...], ...], sub: tuple[tuple[int, ...], ...], device: torch.device
               ) -> torch.Tensor:
    """[M+1] the index in the tree of `paths` of each node of its subtree `sub` (root first), on `device` (where the
    tokens it picks lie: cached there, not copied over at every step)."""
    index = {p: i + 1 for i, p in enumerate(paths)}
    return torch.tensor([0] + [index[p] for p in sub], device=device)


@lru_cache(maxsize=64)
def _build(paths: tuple[tuple[int, ...], ...]) -> Tree:
    paths = tuple(sorted(paths, key=lambda p: (len(p), p)))
    index = {p: i + 1 for i, p in enumerate(paths)}
    index[()] = 0
    n = len(paths) + 1
    parents = [-1] + [index[p[:-1]] for p in paths]
    attention = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        attention[i] |= attention[parents[i]]
    children = [[] for _ in range(n)]
    for i in range(1, n):
        children[parents[i]].append(i)  # paths are sorted, so siblings come by rank
    depth = max((len(p) for p in paths), default=0)
    chains = torch.full((n, depth + 1), PAD, dtype=torch.long)
    for node in range(n):
        chain = [node]
        while chain[-1] != 0:
            chain.append(parents[chain[-1]])
        chains[node, : len(chain)] = torch.tensor(chain[::-1])
    depths = [0] + [len(p) for p in paths]
    ranks = torch.tensor([p[-1] for p in paths], dtype=torch.long)
    levels = []
    for d in range(depth):
        expanded = [i for i in range(n) if depths[i] == d and children[i]]
        kids = [c for i in expanded for c in children[i]]
        levels.append((torch.tensor(expanded), torch.tensor(kids),
                       torch.tensor([row for row, i in enumerate(expanded) for _ in children[i]]),
                       chains[expanded, : d + 1], ranks[[c - 1 for c in kids]]))
    return Tree(
        paths=paths,
        attention=attention,
        depths=torch.tensor(depths),
        parents=torch.tensor(parents),
        heads=torch.tensor([len(p) - 1 for p in paths], dtype=torch.long),
        ranks=ranks,
        leaf_paths=chains[[i for i in range(n) if not children[i]]],
        children=tuple(tuple(c) for c in children),
        chains=chains,
        levels=tuple(levels),
    )


@lru_cache(maxsize=256)
def on_device(tree: Tree, device: torch.device) -> Tree:
    """The tree with its index tensors on `device`, where the proposal indexes the heads' guesses with them (indices
    on the host would be copied over at every use)."""
    if device.type == "cpu":
        return tree
    moved = {f.name: getattr(tree, f.name).to(device) for f in fields(tree) if f.type is torch.Tensor}
    return replace(tree, **moved, levels=tuple(tuple(t.to(device) for t in level) for level in tree.levels))


@lru_cache(maxsize=256)
def padded(tree: Tree, nodes: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The tree's tensors for a step of `nodes` >= N+1 nodes (a batch's largest tree, or a compiled step's fixed
    size), on `device`: depths [T], parents [T] (the root's and padding's: 0), attention [T, T] (a padding node sees
    itself) and chains [T, T] (node i's path, then j itself at column j past its end: a path that moves nothing
    there, cache.gather_paths)."""
    depths, parents = torch.zeros(nodes, dtype=torch.long), torch.zeros(nodes, dtype=torch.long)
    depths[: tree.num_nodes], parents[: tree.num_nodes] = tree.depths, tree.parents.clamp_min(0)
    return tuple(t[0].to(device) for t in from_parents(depths[None], parents[None], tree.depth))


def from_parents(depths: torch.Tensor, parents: torch.Tensor, depth: int) -> tuple[torch.Tensor, ...]:
    """`padded`'s tensors for a batch of trees given by their nodes' depths and parents [B, T] (parents before
    children; the root's and padding's parent and depth 0; no node deeper than `depth`), in tensor ops (inside a
    graph) -> depths, parents [B, T], attention and chains [B, T, T]."""
    index, depth = torch.arange(parents.shape[1], device=parents.device), min(depth, parents.shape[1] - 1)
    ancestors = [index.expand_as(parents)]  # the k-th ancestor of every node (the root's is the root)
    for _ in range(depth):
        ancestors.append(parents.gather(1, ancestors[-1]))
    ancestors = torch.stack(ancestors, dim=-1)  # [B, T, depth + 1]
    on_path = index[: depth + 1] <= depths[..., None]  # [B, T, depth + 1]
    attention = ((ancestors[..., None] == index) & on_path[..., None]).any(2)
    # column c of a node's chain: its ancestor at depth c, then c itself past its depth (and on padding)
    to = depths[..., None] - index  # [B, T, T]: how many steps up column c lies
    chains = torch.where((to >= 0) & (depths[..., None] > 0), ancestors.gather(2, to.clamp(0, depth)), index)
    return depths, parents, attention, chains


def spanning(size: int, depth: int) -> Tree:
    """A tree of `size` candidates as deep as any within `depth` (a chain, then siblings of its first node): the shape
    of a step whose nodes are chosen at each step (candidates.confident_tree)."""
    deep = min(size, depth)
    return build(tuple((0,) * d for d in range(1, deep + 1)) + tuple((r,) for r in range(1, size - deep + 1)))
