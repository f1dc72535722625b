"""What a step asks of the engine that runs it (`Engine`), and the engine a batch gets (`engine_for`).

`decoding.Batch` plans and accepts; its engine builds each pass's inputs, verifies and commits, and where it can, runs
the whole step on the device. Two engines answer the same calls: eager.Eager, op by op over the cache's columns in
use, and compiled.Compiled, every step of a fixed shape through compiled graphs. The step never asks which it has.
"""

from typing import NamedTuple, Protocol

import torch
from transformers import Cache, PreTrainedModel

from .compiled import Compiled
from .eager import Eager
from .heads import MedusaHeads, OwnTokens
from .tree import Tree


class Packed(NamedTuple):
    """A step's rows packed for one pass: tokens [B, T] (each row's tree, padded), the rows' cache entries (on the
    host, and on the device [B]) and the trees' padded tensors (depths, parents [B, T], attention, chains [B, T, T]:
    tree.padded)."""

    tokens: torch.Tensor
    lengths: list[int]
    on_device: torch.Tensor
    trees: tuple[torch.Tensor, ...]


class Engine(Protocol):
    """The calls decoding.Batch makes of its engine, in the order a row and a step make them."""

    # whether a row's heads guess its own tokens beside their guess vocabulary (heads.OwnTokens): their number changes
    # every step, which an engine of fixed shapes cannot take
    guesses_own_tokens: bool

    def cache(self, batch) -> Cache:
        """An empty cache for `batch`'s rows."""

    def prefill(self, prompt: torch.Tensor) -> tuple[Cache, torch.Tensor, torch.Tensor]:
        """prompt [T] -> (its one-row cache, logits [V] and the heads' input state [S] at its last position)."""

    def candidates(self, heads: MedusaHeads, lm_head, embed, hidden: torch.Tensor, root: torch.Tensor, tree: Tree,
                   k: int, own: OwnTokens | None = None) -> tuple[torch.Tensor, torch.Tensor | list[torch.Tensor]]:
        """candidates.candidates as this engine runs it (heads_draft.HeadsDraft's `run`)."""

    def device_tree(self, rows: list) -> tuple[Tree, bool] | None:
        """Whether the rows' next step can run whole on the device: (its tree, whether its nodes are chosen anew each
        step), else None."""

    def device_step(self, batch) -> tuple[Tree, list[list[int]]] | None:
        """The step run whole on the device -> (its tree, the tokens each row produced, EOS and budget not applied);
        None: the step needs the host (plan, verify, accept, commit)."""

    def nodes(self, plans: list) -> int:
        """The width of a step on the host over these plans (decoding.Plan)."""

    def verify(self, cache: Cache, packed: Packed
               ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[list[int], int]] | None]:
        """One pass over every row's tree -> (logits [B, T, V], the heads' input states [B, T, S], each row's greedy
        (accepted path, next token) where the engine accepts on the way, else None)."""

    def commit(self, cache: Cache, packed: Packed, paths: list[list[int]]) -> None:
        """Each row keeps its accepted path (node indices, root first) right after its entries."""


def engine_for(model: PreTrainedModel, heads: MedusaHeads | None, compiled: bool) -> Engine:
    """The engine of a batch on `model` with `heads`: compiled.Compiled where `compiled`, else eager.Eager."""
    return (Compiled if compiled else Eager)(model, heads)
