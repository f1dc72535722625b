"""THE decoding loop, in call order: prefill -> propose -> verify -> accept -> commit.

Works on any `transformers` causal LM through its own interface: the backbone (`model.base_model`)
takes a 4D attention mask, explicit position ids and a DynamicCache, so the whole tree is verified in
one forward pass with no patched model code. Batch size 1, as in the MEDUSA paper. Which tree a step verifies is
the guard's choice (guard.py) under `--tree auto`, else always the one given.
"""

import time
from collections.abc import Iterator

import torch
from transformers import Cache, PreTrainedModel

from . import cache as kv
from .acceptance import RULES, sample, target_probs
from .config import GenerationConfig
from .guard import Guard, Ladder
from .heads import MedusaHeads
from .kernels import guess_projection
from .tree import Tree, build

PLAIN = build(())  # the root alone: plain one-token-per-step decoding in the same engine


def context_limit(model: PreTrainedModel) -> int:
    """The longest sequence the model attends over correctly (sliding windows are not emulated)."""
    config = model.config.get_text_config()
    limits = [getattr(config, "max_position_embeddings", None), getattr(config, "sliding_window", None)]
    return min(int(n) for n in limits if n)


def check_context(model: PreTrainedModel, prompt_len: int, max_new_tokens: int) -> None:
    if prompt_len < 1:
        raise ValueError("the prompt is empty: nothing to continue")
    limit = context_limit(model)
    if prompt_len + max_new_tokens > limit:
        raise ValueError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = {prompt_len + max_new_tokens} "
            f"exceeds the model's context of {limit} tokens"
        )


def forward(model: PreTrainedModel, tokens, cache, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Backbone + LM head. tokens: [T] -> (logits [T, V], last hidden states [T, H])."""
    out = model.base_model(input_ids=tokens[None], past_key_values=cache, use_cache=True, **kw)
    hidden = out.last_hidden_state[0]
    return model.get_output_embeddings()(hidden), hidden


def first_token(logits: torch.Tensor, config: GenerationConfig, generator) -> int:
    return int(logits.argmax()) if config.temperature == 0 else sample(target_probs(logits, config), generator)


def prefill(model, prompt: torch.Tensor, capacity: int) -> tuple[Cache, torch.Tensor, torch.Tensor]:
    """prompt: [T] -> (a cache of `capacity` positions, logits [V] and hidden [H] at the last position)."""
    cache = kv.allocate(model, capacity)
    logits, hidden = forward(model, prompt, cache)
    return cache, logits[-1], hidden[-1]


def guess(heads: MedusaHeads, lm_head, hidden: torch.Tensor, top_k: int, depth: int) -> torch.Tensor:
    """hidden: [H] -> the first `depth` heads' top-k token ids [depth, top_k]."""
    return heads.guesses(hidden, lm_head, top_k, num_heads=depth)


def propose(guesses: torch.Tensor | None, tree: Tree, device) -> torch.Tensor:
    """guesses [D, k] -> candidate tokens [N] for the non-root nodes: head/rank given by the tree."""
    if tree.num_nodes == 1:
        return torch.empty(0, dtype=torch.long, device=device)
    return guesses[tree.heads, tree.ranks]


def tree_mask(tree: Tree, prefix_len: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[1, 1, N+1, prefix_len+N+1] additive mask: every node sees the prefix and its own ancestors."""
    n = tree.num_nodes
    mask = torch.zeros(n, prefix_len + n, dtype=dtype, device=device)
    mask[:, prefix_len:].masked_fill_(~tree.attention.to(device), torch.finfo(dtype).min)
    return mask[None, None]


def verify(model, cache, tokens: torch.Tensor, tree: Tree, prefix_len: int):
    """One forward pass over all N+1 nodes -> logits [N+1, V], hidden [N+1, H]."""
    device = tokens.device
    positions = (prefix_len + tree.depths.to(device))[None]
    mask = tree_mask(tree, prefix_len, model.dtype, device)
    return forward(model, tokens, cache, position_ids=positions, attention_mask=mask)


def decode(
    model: PreTrainedModel,
    heads: MedusaHeads | None,
    prompt: torch.Tensor,
    config: GenerationConfig,
    trees: Tree | Ladder,
    eos_ids: frozenset[int] = frozenset(),
    generator: torch.Generator | None = None,
) -> Iterator[tuple[list[int], int]]:
    """Yields the tokens of each forward pass and how many candidates it verified: the prefill's one token (0),
    then 1 + accepted per step.

    prompt: [T] token ids. trees: one tree, or a Ladder of trees of which a Guard picks one per step (`--tree
    auto`). Stops after max_new_tokens tokens or at an EOS token (which is yielded).
    """
    check_context(model, prompt.shape[-1], config.max_new_tokens)
    ladder = Ladder.fixed(PLAIN) if not config.medusa else trees if isinstance(trees, Ladder) else Ladder.fixed(trees)
    for tree in ladder.trees:
        if tree.num_nodes > 1:
            tree.check_heads(heads.config.num_heads, heads.config.vocab_size)
    rule = RULES[config.rule]
    lm_head = guess_projection(model)  # the heads' guesses only; the model's logits come from its own LM head
    device = prompt.device
    with torch.inference_mode():
        # the cache holds at most the prompt, every new token but the last, and one tree
        capacity = prompt.shape[-1] + config.max_new_tokens + max(tree.num_nodes for tree in ladder.trees)
        cache, logits, hidden = prefill(model, prompt, capacity)
        root = first_token(logits, config, generator)
        guard = Guard(ladder, root)
        prefix_len, produced = prompt.shape[-1], 1
        yield [root], 0
        while produced < config.max_new_tokens and root not in eos_ids:
            start = time.perf_counter()
            tree, guessing = guard.choose(prefix_len)  # guessing: (top_k, depth) of the heads' guesses, or None
            step_tree = tree.truncated(config.max_new_tokens - produced - 1)  # never guess past the budget
            guesses = guess(heads, lm_head, hidden, *guessing) if guessing else None
            tokens = torch.cat([torch.tensor([root], device=device), propose(guesses, step_tree, device)])  # [N+1]
            logits, hidden_all = verify(model, cache, tokens, step_tree, prefix_len)
            path, root = rule(tokens, logits, step_tree, config, generator)
            kv.commit(cache, prefix_len, path.to(device))
            hidden = hidden_all[path[-1]]
            new = tokens[path[1:]].tolist() + [root]
            for i, token in enumerate(new):
                if token in eos_ids:
                    new, root = new[: i + 1], token
                    break
            # a cut tree is not the ladder's; a seeded run repeats: its guard follows the tokens, not the clock
            seconds = time.perf_counter() - start if step_tree is tree and config.seed is None else None
            guard.record(guesses, new, seconds, prefix_len)
            prefix_len += len(path)
            produced += len(new)
            yield new, step_tree.num_nodes - 1
