"""The heads' candidates for a tree's nodes: every node's token, for a batch of rows at once, in fixed shapes per tree
(the compiled engine runs them inside its step's graph)."""

import torch

from .heads import OwnTokens
from .tree import Tree, from_parents


def candidates(heads, lm_head, embed, hidden: torch.Tensor, root: torch.Tensor, tree: Tree, k: int,
               own: OwnTokens | None = None) -> tuple[torch.Tensor, torch.Tensor | list[torch.Tensor]]:
    """hidden [B, S] (the heads' input states), root [B] -> the tokens of every node of `tree` per row [B, N+1] (the
    root first) and the heads' top-`k` behind them. MEDUSA heads: one call, [D, B, k]. Hydra heads, level by level:
    the children of the nodes at depth d are head d's top-k given each node's path (the root and the candidates after
    it), one head call per depth; per depth the top-k of each node expanded there ([B, n_d, k], in the order of
    tree.levels). Eagerly on a GPU a level costs more in launches than in arithmetic: the compiled engine runs this
    as a graph. own: one row's own tokens, guessed beside the guess vocabulary."""
    if heads.config.kind == "medusa":
        guesses = heads.guesses(hidden, lm_head, k, tree.depth, own=own)
        return torch.cat([root[:, None], guesses[tree.heads, :, tree.ranks].T], 1), guesses
    tokens = torch.cat([root[:, None], root.new_zeros(len(root), tree.num_nodes - 1)], 1)
    tops = []
    for depth, (parents, children, rows, chains, ranks) in enumerate(tree.levels):
        paths = tokens[:, chains]  # [B, n, depth+1]
        expanded = hidden[:, None].expand(-1, len(parents), -1)
        top = heads.guesses(expanded, lm_head, k, depth + 1, embed(paths), first=depth, own=own)[0]  # [B, n, k]
        tokens[:, children] = top[:, rows, ranks]
        tops.append(top)
    return tokens, tops


def confident_tree(heads, lm_head, embed, hidden: torch.Tensor, root: torch.Tensor, size: int
                   ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """heads_draft.guess_confident in fixed shapes, for a batch (what a compiled step runs in its graph): hidden
    [B, S], root [B] -> each row's tree of its `size` likeliest candidates: tokens [B, size + 1] (the root first) and
    tree.padded's tensors per row (tree.from_parents). Every depth keeps its `size` likeliest nodes, each expanded
    with its `size` likeliest children; a tie across depths that leaves a chosen node without its parent makes it
    padding."""
    medusa, rows = heads.config.kind == "medusa", heads.guess_rows(lm_head)
    every_head = heads(hidden, lm_head) if medusa else None  # [K, B, V]: MEDUSA's guesses do not depend on the path
    scores, paths = torch.ones_like(hidden[:, :1], dtype=torch.float), root[:, None, None]  # [B, n], [B, n, d + 1]
    kept = []  # per depth: path probabilities, parents among the depth before, tokens [B, n]
    for d in range(heads.config.num_heads):
        logits = (every_head[d][:, None] if medusa else
                  heads(hidden[:, None].expand(-1, paths.shape[1], -1), lm_head, d + 1, embed(paths), first=d)[0])
        probs, top = logits.float().softmax(-1).topk(min(size, logits.shape[-1]), dim=-1)  # [B, n or 1, k]
        top = (top if rows is None else rows[top]).expand(-1, paths.shape[1], -1).flatten(1)
        scores, best = (scores[:, :, None] * probs).flatten(1).topk(min(size, top.shape[1]), dim=-1)
        parent, tokens = best // probs.shape[-1], top.gather(1, best)
        paths = torch.cat([paths.gather(1, parent[:, :, None].expand(-1, -1, d + 1)), tokens[:, :, None]], dim=2)
        kept.append((scores, parent, tokens))
    # nodes numbered as kept, depth by depth, after the root (0)
    start = [1 + sum(s.shape[1] for s, _, _ in kept[:d]) for d in range(len(kept))]
    parents = torch.cat([root.new_zeros(len(root), 1)] + [p + (start[d - 1] if d else 0) for d, (_, p, _) in
                                                          enumerate(kept)], dim=1)  # [B, M + 1]
    every = torch.cat([s for s, _, _ in kept], dim=1)  # [B, M], by depth: a stable sort keeps a parent before its tie
    chosen = torch.zeros_like(every, dtype=torch.bool).scatter(
        1, every.sort(dim=-1, descending=True, stable=True).indices[:, :size], True)
    chosen = torch.cat([chosen.new_ones(len(root), 1), chosen], dim=1)
    for _ in kept:  # ties aside, a node's parent is as likely: the closure changes nothing
        chosen = chosen & chosen.gather(1, parents)
    order = torch.arange(every.shape[1] + 1, device=root.device)
    picked = (order + (~chosen) * len(order)).sort(dim=-1).indices[:, : size + 1]  # the root, then the chosen in order
    real = chosen.gather(1, picked)
    renumber = torch.zeros_like(parents).scatter(1, picked, order[: size + 1].expand(len(root), -1))
    depths = torch.cat([torch.zeros_like(root[:, None])] + [torch.full_like(p, d + 1) for d, (_, p, _) in
                                                             enumerate(kept)], dim=1)
    every_token = torch.cat([root[:, None]] + [t for _, _, t in kept], dim=1)
    tokens = every_token.gather(1, picked) * real
    depths, parents = depths.gather(1, picked) * real, renumber.gather(1, parents.gather(1, picked)) * real
    return tokens, from_parents(depths, parents, len(kept))
