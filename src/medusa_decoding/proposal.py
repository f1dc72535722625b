"""The heads' proposal over a tree: every node's token, for a batch of rows at once, in fixed shapes per tree (the
compiled engine runs it inside its step's graph)."""

import torch

from .tree import Tree


def candidates(heads, lm_head, embed, hidden: torch.Tensor, root: torch.Tensor, tree: Tree, k: int
               ) -> tuple[torch.Tensor, torch.Tensor | list[torch.Tensor]]:
    """hidden [B, S] (the heads' input states), root [B] -> the tokens of every node of `tree` per row [B, N+1] (the
    root first) and the heads' top-`k` behind them. MEDUSA heads: one call, [D, B, k]. Hydra heads, level by level:
    the children of the nodes at depth d are head d's top-k given each node's path (the root and the candidates after
    it), one head call per depth; per depth the top-k of each node expanded there ([B, n_d, k], in the order of
    tree.levels). Eagerly on a GPU a level costs more in launches than in arithmetic: the compiled engine runs this
    as a graph."""
    if heads.config.kind == "medusa":
        guesses = heads.guesses(hidden, lm_head, k, tree.depth)
        return torch.cat([root[:, None], guesses[tree.heads, :, tree.ranks].T], 1), guesses
    tokens = torch.cat([root[:, None], root.new_zeros(len(root), tree.num_nodes - 1)], 1)
    tops = []
    for depth, (parents, children, rows) in enumerate(tree.levels):
        paths = tokens[:, tree.chains[parents, : depth + 1]]  # [B, n, depth+1]
        expanded = hidden[:, None].expand(-1, len(parents), -1)
        top = heads.guesses(expanded, lm_head, k, depth + 1, embed(paths), first=depth)[0]  # [B, n, k]
        tokens[:, children] = top[:, rows, tree.ranks[children - 1]]
        tops.append(top)
    return tokens, tops
