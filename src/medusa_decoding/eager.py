"""The eager engine (an engine.Engine): a step run op by op as `transformers` runs any model, over the cache's columns
in use.
"""

import torch
from transformers import Cache, PreTrainedModel

from . import cache as kv
from . import native_layers
from .base import sliding_window
from .candidates import candidates
from .heads import MedusaHeads, run_backbone


def forward(model: PreTrainedModel, tokens: torch.Tensor, cache, last: bool = False, layers: tuple[int, ...] = (),
            **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Backbone + LM head. tokens: [B, T] -> (logits [B, T, V], the heads' input states [B, T, (1 + L) H]: the last
    hidden states, and the outputs of the heads' feature `layers`: heads.run_backbone); `last`: the last position's
    logits only (a prefill: the LM head over every prompt token is a large share of a small model's prefill)."""
    hidden, state = run_backbone(model, layers, input_ids=tokens, past_key_values=cache, use_cache=True, **kw)
    return model.get_output_embeddings()(hidden[:, -1:] if last else hidden), state


def prefill(model, prompt: torch.Tensor, capacity: int, layers: tuple[int, ...] = ()
            ) -> tuple[Cache, torch.Tensor, torch.Tensor]:
    """prompt: [T] -> (a one-row cache of `capacity` positions, logits [V] and the heads' input state [S] at the last
    position)."""
    cache = kv.allocate(model, capacity)
    logits, states = forward(model, prompt[None], cache, last=True, layers=layers)
    return cache, logits[0, -1], states[0, -1]


def step_forward(model: PreTrainedModel, weights: list | None, tokens: torch.Tensor, cache, lengths: torch.Tensor,
                 positions: torch.Tensor, mask: torch.Tensor, layers: tuple[int, ...] = ()
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's pass over tokens [B, T], written at columns lengths[b].. of the cache, at `positions` [B, T] under
    `mask` [B, 1, T, S] (cache.step_inputs): native_layers.forward where the model's layers run natively
    (`weights`: native_layers.weights), else forward. The cache's views are commit's to set after it."""
    if weights is not None:
        return native_layers.forward(model, weights, tokens, cache, lengths, positions, mask, layers)
    return forward(model, tokens, cache, position_ids=positions, attention_mask=mask, layers=layers)


class Eager:
    """Steps as wide as the rows' largest tree, over the columns in use; nothing compiled; on q8 kernels a
    Llama-shaped model's layers run one native call each (native_layers.py)."""

    guesses_own_tokens = True  # its steps take any shape

    def __init__(self, model: PreTrainedModel, heads: MedusaHeads | None):
        self.model, self.layers = model, heads.config.feature_layers if heads is not None else ()
        self.native = native_layers.weights(model)  # None: transformers' forward runs the steps
        self.window = sliding_window(model)

    def cache(self, batch) -> Cache:
        return kv.allocate(self.model, 0, dtype=native_layers.CACHE if self.native is not None else None)

    def prefill(self, prompt: torch.Tensor) -> tuple[Cache, torch.Tensor, torch.Tensor]:
        """prompt [T] -> (its one-row cache, logits [V] and the heads' input state [S] at its last position)."""
        return prefill(self.model, prompt, prompt.shape[-1], self.layers)

    def nodes(self, plans: list) -> int:
        """The step's width: the largest tree to verify."""
        return max(plan.tree.num_nodes for plan in plans)

    def candidates(self, *args, own=None):
        """candidates.candidates, run as it is, the rows' own tokens guessed beside the guess vocabulary."""
        return candidates(*args, own=own)

    def verify(self, cache: Cache, packed) -> tuple[torch.Tensor, torch.Tensor, None]:
        """One pass over every row's tree (engine.Packed) -> (logits [B, T, V], the heads' input states [B, T, S],
        None: no greedy acceptance done on the way)."""
        rows, nodes = packed.tokens.shape
        columns = kv.width(cache) + nodes
        kv.reserve(cache, rows, columns)
        kv.place(cache, packed.lengths, nodes)
        depths, _, attention, _ = packed.trees
        positions, mask = kv.step_inputs(packed.on_device, depths, attention, columns, self.model.dtype,
                                           self.window)
        logits, states = step_forward(self.model, self.native, packed.tokens, cache, packed.on_device, positions, mask,
                                      self.layers)
        return logits, states, None

    def commit(self, cache: Cache, packed, paths: list[list[int]]) -> None:
        """Each row keeps its accepted path (node indices, root first) right after its entries."""
        kv.commit(cache, packed.lengths, paths)

    def device_tree(self, rows: list) -> None:
        """No step runs whole on the device here (compiled.Compiled.device_tree)."""
        return

    def device_step(self, batch) -> None:
        """Every step runs on the host."""
        return
