"""The heads as a source of candidates (a proposers.Proposer, as lookup.LookupDraft is one): each step the tree its
guard picks (guard.py), the heads' tokens over it, and afterwards what the guard learns from the step. The guard's
ladder also prices the step for every proposer (`HeadsDraft.step_cost`) and says whether it can run whole on the
device (`HeadsDraft.fixed_tree`).
"""

from collections.abc import Callable

import torch

from .candidates import candidates
from .guard import Guard
from .heads import MedusaHeads, OwnTokens
from .proposers import Proposal, SoFar, StepStart, step_cost
from .tree import Tree, build, node_index, on_device


def guess(heads: MedusaHeads, lm_head, embed, heads_input: torch.Tensor, root: int, tree: Tree, watched: Tree | None,
          run=candidates, keep: bool = True, own: OwnTokens | None = None
          ) -> tuple[torch.Tensor, torch.Tensor | dict | None]:
    """One row's candidates from its heads: the step's tokens [N+1] (the root, then the candidates of `tree`) and the
    heads' guesses for the guard.

    watched: the tree whose nodes the heads guess for (it holds `tree`'s: the guard watches its ladder's largest);
    None: a plain step that does not guess. MEDUSA heads guess once per head, whatever the path: guesses [D, k],
    each head's top-k, and node (r_1..r_d) is rank r_d of head d-1. Hydra heads guess per node (`candidates`):
    guesses {a node's path: the top-k after it}, and node (r_1..r_d) is rank r_d of head d-1 given its parent's path.
    run: how candidates.candidates runs (the engine's: a graph on the compiled one); keep: False where the guard reads
    no guesses (a fixed tree), which spares hydra heads a read of the device; own: the row's own tokens, guessed
    beside the guess vocabulary.
    """
    root_token = torch.tensor([root], device=heads_input.device)
    if watched is None:
        return root_token, None
    tokens, tops = run(heads, lm_head, embed, heads_input[None], root_token, on_device(watched, heads_input.device),
                       watched.topk_per_head(), own=own)
    tokens, tops = tokens[0], tops[:, 0] if heads.config.kind == "medusa" else [top[0] for top in tops]
    tokens = tokens if tree is watched else tokens[node_index(watched.paths, tree.paths, tokens.device)]
    if heads.config.kind == "medusa" or not keep:
        return tokens, tops if keep else None
    guesses = {(() if node == 0 else watched.paths[node - 1]): top
               for (nodes, *_), level in zip(watched.levels, tops) for node, top in zip(nodes.tolist(), level.tolist())}
    return tokens, guesses


def guess_confident(heads: MedusaHeads, lm_head, embed, heads_input: torch.Tensor, root: int, size: int, watched: int
                      ) -> tuple[Tree, torch.Tensor, tuple[dict, list]]:
    """Confidence-driven trees (EAGLE-2's idea, on draft heads): instead of a fixed shape, the `size` candidates whose
    paths the heads themselves find likeliest (the product of each head's probability of its token along the path),
    for either kind of heads. Level by level, the `watched` (>= size) likeliest nodes of each depth are expanded with
    their `watched` likeliest children: a node among the `watched` likeliest of the whole tree has its parent among
    them too (a child is never likelier than its parent), so nothing likelier is left out, and once no node of a
    depth is likelier than the `watched`-th of the tree so far, the deeper heads are not run at all.

    -> (the tree of `size` candidates, its tokens [size+1], guesses for the guard: ({node path: top-k after it}, the
    `watched` likeliest paths, likeliest first)). Node (r_1..r_d) is rank r_d of head d-1 after its parent, as in any
    tree; greedy output stays plain decoding's and rejection sampling stays exact: only which candidates are verified
    changes.
    """
    depth, device, rows = heads.config.num_heads, heads_input.device, heads.guess_rows(lm_head)
    # MEDUSA heads in one call: their guesses do not depend on the path
    every_head = heads(heads_input, lm_head) if heads.config.kind == "medusa" else None  # [K, V]
    scores = torch.ones(1, device=device)  # the nodes of this depth kept for expanding: their path probabilities
    chains = torch.tensor([[root]], device=device)  # [n, d+1] their tokens, the root first
    paths: list[tuple[int, ...]] = [()]
    tops, kept = {}, []  # kept: (path probabilities [m], paths, tokens [m]) per depth
    for d in range(depth):
        logits = (every_head[d : d + 1] if every_head is not None
                  else heads(heads_input.expand(len(paths), -1), lm_head, d + 1, embed(chains), first=d)[0])
        probs, top = logits.float().softmax(-1).topk(min(watched, logits.shape[-1]), dim=-1)
        probs, top = probs.expand(len(paths), -1), top.expand(len(paths), -1)  # [n, k]: MEDUSA's, for every node
        top = top if rows is None else rows[top]
        tops.update(zip(paths, top.tolist()))
        child = (scores[:, None] * probs).flatten()  # [n * k]
        best = child.topk(min(watched, len(child))).indices  # this depth's likeliest: the only ones that may be kept
        parent, rank = best // probs.shape[1], best % probs.shape[1]
        paths = [paths[p] + (r,) for p, r in zip(parent.tolist(), rank.tolist())]
        tokens = top.flatten()[best]
        chains = torch.cat([chains[parent], tokens[:, None]], dim=1)
        scores = child[best]
        kept.append((scores, paths, tokens))
        every = torch.cat([s for s, _, _ in kept])  # by depth: a stable sort keeps a parent before its tied child
        if len(every) >= watched and scores.max() <= every.topk(watched).values[-1]:
            break  # no child of this depth can pass the watched likeliest: the deeper heads need not run
    tree, tokens, ranked = likeliest(kept, root, size, watched)
    return tree, tokens, (tops, ranked)


def likeliest(kept: list[tuple[torch.Tensor, list, torch.Tensor]], root: int, size: int, watched: int
              ) -> tuple[Tree, torch.Tensor, list[tuple[int, ...]]]:
    """guess_confident's pick from the nodes `kept` per depth (path probabilities [m], paths, tokens [m]) -> (the
    tree of the `size` likeliest, its tokens [size+1], the `watched` likeliest paths, likeliest first)."""
    every = torch.cat([s for s, _, _ in kept])  # by depth: a stable sort keeps a parent before its tied child
    order = every.sort(descending=True, stable=True).indices.tolist()
    all_paths = [p for _, ps, _ in kept for p in ps]
    ranked = [all_paths[i] for i in order[:watched]]
    chosen = set(ranked[:size])
    chosen = {p for p in chosen if all(p[:j] in chosen for j in range(1, len(p)))}  # ties across depths aside
    tree = build(tuple(chosen))
    index = {p: i for i, p in enumerate(all_paths)}
    all_tokens = torch.cat([t for _, _, t in kept])
    return tree, torch.cat([all_tokens.new_tensor([root]), all_tokens[[index[p] for p in tree.paths]]]), ranked


class HeadsDraft:
    """One row's heads: each step the tree its guard picks for this context and batch, and the heads' tokens over it
    (cut at the token budget); it offers the tokens the guard expects that tree to yield. Afterwards the guard hears
    the step: the heads' guesses against the tokens produced, and its time where the heads' tree was all the step
    verified, uncut. A row without heads, or decoding plainly, has one whose guard picks the root alone."""

    def __init__(self, heads: MedusaHeads | None, lm_head, embed, run, guard: Guard, own: OwnTokens | None,
                 timed: bool):
        """run: how candidates.candidates runs (the engine's); own: the row's own tokens, guessed beside the guess
        vocabulary; timed: whether step times may steer the guard (not in a seeded run: it must repeat)."""
        self.heads, self.lm_head, self.embed, self.run = heads, lm_head, embed, run
        self.guard, self.own, self.timed = guard, own, timed
        self.guesses = None  # the last step's guesses, for the guard
        self.uncut = False  # whether the last step's tree was the guard's pick as it stands
        self.context = 0  # the last step's context

    def propose(self, start: StepStart, step: SoFar) -> Proposal:
        """The guard's tree (its own weighing of yields against calibrated step times: `step` is not needed)."""
        picked, watched = self.guard.choose(start.context, start.batch, start.pooled)  # watched: guessed for, or None
        room = picked.num_nodes - 1
        if self.guard.ladder.confident and watched is not None:  # the tree: the likeliest nodes of this step
            picked, every, self.guesses = guess_confident(self.heads, self.lm_head, self.embed, start.heads_input,
                                                          start.root, room, watched.num_nodes - 1)
            tree = picked.truncated(start.budget)
            every = every if tree is picked else every[node_index(picked.paths, tree.paths, every.device)]
        else:
            tree = picked.truncated(start.budget)
            every, self.guesses = guess(self.heads, self.lm_head, self.embed, start.heads_input, start.root, tree,
                                        watched, run=self.run, keep=self.guard.watching, own=self.own)
        self.uncut, self.context = tree is picked, start.context
        return Proposal(tree, every[1:], self.guard.expected() - 1, room)

    def step_cost(self, context: int, batch: int, nodes: int) -> Callable[[int], float]:
        """What more nodes cost a step of `nodes` at `context` in a batch of `batch` rows, as the guard's ladder prices
        it (proposers.step_cost): SoFar.cost for every proposer of the row."""
        return step_cost(self.guard.ladder, context, batch, nodes)

    def fixed_tree(self) -> tuple[Tree, bool] | None:
        """(the tree every step takes, whether it stands for its size's likeliest nodes: a confident ladder) where no
        guard watches the steps, so that one can run whole on the device (compiled.Compiled.device_tree); else None."""
        return None if self.guard.watching else (self.guard.ladder.tree, self.guard.ladder.confident)

    def record(self, nodes: list[int], path: list[int], new: list[int], seconds: float | None) -> None:
        self.guard.record(self.guesses, new, seconds if self.uncut and self.timed else None, self.context)
        self.guesses, self.uncut = None, False
        if self.own is not None:
            self.own.extend(new)
