"""THE decoding loop, in call order: prefill -> propose -> verify -> accept -> commit.

Works on any `transformers` causal LM through its own interface: the backbone (`model.base_model`)
takes a 4D attention mask, explicit position ids and a cache, so every tree is verified in one forward pass with no
patched model code. A Batch decodes several sequences together, one forward pass per step over every row's tree:
rows join (their prefill) and leave at any step, each with its own positions, cache entries, acceptance rule and
random generator; a single request is a batch of one. Which tree a row's step verifies is its guard's choice
(guard.py) under `--tree auto`, else always the one given.
"""

import time
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from . import cache as kv
from .acceptance import RULES, argmax, sample, target_probs
from .base import check_context
from .compiled import Compiled
from .config import GenerationConfig
from .device_acceptance import draw_key
from .eager import Eager, Packed
from .guard import Guard, Ladder, batch_yields
from .heads import MedusaHeads, OwnTokens
from .kernels import guess_projection
from .lookup import LookupDraft
from .proposers import Proposer, drafted, graft, step_cost, worth
from .proposal import candidates
from .tree import Tree, build, node_index, on_device, padded

PLAIN = build(())  # the root alone: plain one-token-per-step decoding in the same engine


def first_token(logits: torch.Tensor, config: GenerationConfig, generator) -> int:
    return int(argmax(logits)) if config.temperature == 0 else sample(target_probs(logits, config), generator)


def propose(heads: MedusaHeads, lm_head, embed, heads_input: torch.Tensor, root: int, tree: Tree, watched: Tree | None,
            run=candidates, keep: bool = True, own: OwnTokens | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | dict | None]:
    """Propose: the step's tokens [N+1] (the root, then the candidates of `tree`) and the heads' guesses for the guard.

    watched: the tree whose nodes the heads guess for (it holds `tree`'s: the guard watches its ladder's largest);
    None: a plain step that does not guess. MEDUSA heads guess once per head, whatever the path: guesses [D, k],
    each head's top-k, and node (r_1..r_d) is rank r_d of head d-1. Hydra heads guess per node (`candidates`):
    guesses {a node's path: the top-k after it}, and node (r_1..r_d) is rank r_d of head d-1 given its parent's path.
    run: how proposal.candidates runs (the engine's: a graph on the compiled one); keep: False where the guard reads
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
               for (nodes, _, _), level in zip(watched.levels, tops) for node, top in zip(nodes.tolist(), level.tolist())}
    return tokens, guesses


def propose_confident(heads: MedusaHeads, lm_head, embed, heads_input: torch.Tensor, root: int, size: int, watched: int
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
    """propose_confident's pick from the nodes `kept` per depth (path probabilities [m], paths, tokens [m]) -> (the
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


@dataclass(eq=False)
class Row:
    """One sequence of a batch: its request, and what its next step starts from."""

    config: GenerationConfig
    guard: Guard
    eos_ids: frozenset[int]
    generator: torch.Generator | None
    root: int  # the last token produced: the root of the next step's tree
    heads_input: torch.Tensor  # [S] the heads' input state at the token before the root, which they guess from
    length: int  # the row's cache entries: the prompt and every token before the root
    produced: int = 1  # tokens produced so far, the root included
    own: OwnTokens | None = None  # its tokens outside the heads' guess vocabulary, guessed beside it
    proposers: list[Proposer] = field(default_factory=list)  # sources of candidates besides the heads (proposers.py)
    drafted: int = 0  # of the last step's tokens, those only a proposer proposed
    key: int = 0  # what a sampled row's draws on the device step depend on, beside its length (device_acceptance)

    @property
    def done(self) -> bool:
        return self.produced >= self.config.max_new_tokens or self.root in self.eos_ids


@dataclass
class Plan:
    """What one row verifies in a step."""

    tree: Tree  # the guard's pick, cut at the token budget
    tokens: torch.Tensor  # [N+1] the root and the candidates
    guesses: torch.Tensor | dict | None  # the heads' guesses, for the guard (propose)
    timed: bool  # whether the step's time tells the guard about its tree
    nodes: int  # the nodes of the guard's pick and room for the proposers: a compiled step's size, whatever is left
    chains: list[list[int]] = field(default_factory=list)  # each proposer's nodes in `tree`


class Batch:
    """Sequences decoded together: `join` prefills one, `step` runs one forward pass for every row and returns what
    each produced; a row leaves by itself when done (budget, EOS), or by `leave` (a stop string, a cancelled
    request). The cache's rows follow `rows`. compiled: the engine that runs the steps, compiled.Compiled, else
    eager.Eager."""

    def __init__(self, model: PreTrainedModel, heads: MedusaHeads | None, compiled: bool = False):
        self.model, self.heads, self.lm_head = model, heads, guess_projection(model)  # the guesses' projection
        self.embed = model.get_input_embeddings()  # what hydra heads read of the tokens before their guess
        self.engine = (Compiled if compiled else Eager)(model, heads)
        self.cache = self.engine.cache(self)
        self.rows: list[Row] = []

    def join(self, prompt: torch.Tensor, config: GenerationConfig, trees: Tree | Ladder,
             eos_ids: frozenset[int] = frozenset(), generator: torch.Generator | None = None) -> Row:
        """Prefills prompt [T] and returns its row, whose root is the first token; a row done already (EOS, a budget
        of one) is not added."""
        check_context(self.model, prompt.shape[-1], config.max_new_tokens)
        ladder = Ladder.fixed(PLAIN) if not config.medusa else trees if isinstance(trees, Ladder) else Ladder.fixed(trees)
        for tree in ladder.trees:
            if tree.num_nodes > 1:
                tree.check_heads(self.heads.config.num_heads, self.heads.config.vocab_size)
        with torch.inference_mode():
            cache, logits, state = self.engine.prefill(prompt)
            root = first_token(logits, config, generator)
            seen = prompt.tolist() + [root]
            proposers = [LookupDraft(seen, config.lookup)] if config.medusa and config.lookup else []
            row = Row(config, Guard(ladder, root), eos_ids, generator, root, state, prompt.shape[-1],
                      own=self.own_tokens(seen) if config.medusa else None, proposers=proposers,
                      key=draw_key(generator) if config.temperature > 0 else 0)
            if not row.done:
                # the row holds at most its prompt, every new token but the last, and one tree
                kv.insert(self.cache, cache, row.length + config.max_new_tokens + max(t.num_nodes for t in ladder.trees))
                self.rows.append(row)
        return row

    def own_tokens(self, tokens: list[int]) -> OwnTokens | None:
        """A row's own tokens beside the heads' guess vocabulary, where they guess from part of it (not on the
        compiled engine: its graphs take fixed shapes)."""
        vocabulary = None if self.heads is None or isinstance(self.engine, Compiled) else self.heads.guess_rows(self.lm_head)
        if vocabulary is None:
            return None
        return OwnTokens(vocabulary, self.model.get_output_embeddings().weight.detach(), tokens)

    def step(self) -> list[tuple[Row, list[int], int]]:
        """One forward pass over every row's tree -> (row, the tokens it produced, the candidates it verified) per
        row, in the order of `rows` before the step. Where the engine can, the whole step runs on the device."""
        with torch.inference_mode():
            on_device = self.engine.device_step(self)
            events = self.step_on_host() if on_device is None else self.advance_on_device(*on_device)
        for row, _, _ in events:
            if row.done:
                self.leave(row)
        return events

    def step_on_host(self) -> list[tuple[Row, list[int], int]]:
        """plan -> pack -> verify -> accept -> commit -> advance."""
        start, rows = time.perf_counter(), list(self.rows)
        plans = [self.plan(row, mean) for row, mean in zip(rows, batch_yields([row.guard for row in rows]))]
        packed = self.pack(rows, plans)
        logits, states, greedy = self.engine.verify(self.cache, packed)
        accepted = [greedy[b] if greedy is not None and row.config.temperature == 0
                    else RULES[row.config.rule](plan.tokens, logits[b, : plan.tree.num_nodes], plan.tree, row.config,
                                                row.generator)
                    for b, (row, plan) in enumerate(zip(rows, plans))]
        paths = [torch.as_tensor(path).tolist() for path, _ in accepted]
        self.engine.commit(self.cache, packed, paths)
        for b, (row, path) in enumerate(zip(rows, paths)):
            row.heads_input = states[b, path[-1]]
        seconds = time.perf_counter() - start
        return [self.advance(row, plan, path, root, seconds)
                for row, plan, path, (_, root) in zip(rows, plans, paths, accepted)]

    def plan(self, row: Row, pooled: list[float] | None) -> Plan:
        """Propose: the row's tree for this step (its guard weighs it at this batch's size, with the batch's mean
        yields `pooled`) and its candidates."""
        tree, watched = row.guard.choose(row.length, len(self.rows), pooled)  # watched: the tree guessed for, or None
        budget, nodes = row.config.max_new_tokens - row.produced - 1, tree.num_nodes  # never guess past the budget
        if row.guard.ladder.confident and watched is not None:  # the tree: the likeliest nodes of this step
            tree, tokens, guesses = propose_confident(self.heads, self.lm_head, self.embed, row.heads_input, row.root,
                                                      tree.num_nodes - 1, watched.num_nodes - 1)
            step_tree = tree.truncated(budget)
            tokens = tokens if step_tree is tree else tokens[node_index(tree.paths, step_tree.paths, tokens.device)]
        else:
            step_tree = tree.truncated(budget)
            tokens, guesses = propose(self.heads, self.lm_head, self.embed, row.heads_input, row.root, step_tree,
                                      watched, run=self.engine.candidates, keep=row.guard.watching, own=row.own)
        # a cut or grafted tree is not the ladder's; a seeded run repeats: its guard follows the tokens, not the clock
        plan = Plan(step_tree, tokens, guesses, False, nodes + sum(p.max_length for p in row.proposers))
        self.graft(row, plan, budget)
        plan.timed = plan.tree is tree and row.config.seed is None
        return plan

    def graft(self, row: Row, plan: Plan, budget: int) -> None:
        """Each proposer's chain joins the plan's tree, as many of its tokens as their expected yield pays for at
        this step's cost (proposers.worth and step_cost: from the ladder's calibrated latencies)."""
        for proposer in row.proposers:
            cost = step_cost(row.guard.ladder, row.length, len(self.rows), plan.tree.num_nodes)
            proposal = proposer.propose(budget)
            if chain := proposal.tokens[: worth(proposal, row.guard.expected(), cost)]:
                plan.tree, tokens, nodes = graft(plan.tree, plan.tokens.tolist(), chain)
                plan.tokens, plan.chains = plan.tokens.new_tensor(tokens), plan.chains + [nodes]
            else:
                plan.chains.append([])

    def pack(self, rows: list[Row], plans: list[Plan]) -> Packed:
        """The rows' trees as one pass's inputs, each padded to the engine's step width."""
        nodes, device = self.engine.nodes(plans), plans[0].tokens.device
        tokens = torch.zeros(len(rows), nodes, dtype=torch.long, device=device)  # [B, T], padding 0
        for b, plan in enumerate(plans):
            tokens[b, : plan.tree.num_nodes] = plan.tokens
        trees = tuple(torch.stack(t) for t in zip(*(padded(plan.tree, nodes, device) for plan in plans)))
        lengths = [row.length for row in rows]
        return Packed(tokens, lengths, torch.tensor(lengths, device=device), trees)

    def advance(self, row: Row, plan: Plan, path: list[int], root: int, seconds: float
                ) -> tuple[Row, list[int], int]:
        """The row moves past its accepted path -> (row, the tokens it produced, the candidates it verified)."""
        new = until_eos(plan.tokens[path[1:]].tolist() + [root], row.eos_ids)
        # a batch's step time is shared: only a batch of one times its tree
        row.guard.record(plan.guesses, new, seconds if plan.timed and len(self.rows) == 1 else None, row.length)
        for proposer, nodes in zip(row.proposers, plan.chains):
            proposer.record(nodes, path, new)
        if row.own is not None:
            row.own.extend(new)
        row.drafted = drafted(plan.tree, path, len(new))
        row.root, row.length, row.produced = new[-1], row.length + len(path), row.produced + len(new)
        return row, new, plan.tree.num_nodes - 1

    def advance_on_device(self, tree: Tree, produced: list[list[int]]) -> list[tuple[Row, list[int], int]]:
        """The rows move past what the device step produced; a row that passes its budget or an EOS leaves (its
        cache entries past them are dropped with it)."""
        events = []
        for row, new in zip(self.rows, produced):
            row.length += len(new)
            new = until_eos(new, row.eos_ids)[: row.config.max_new_tokens - row.produced]
            row.root, row.produced = new[-1], row.produced + len(new)
            for proposer in row.proposers:  # the device step verifies the heads' tree alone
                proposer.record([], [0], new)
            if row.own is not None:
                row.own.extend(new)
            events.append((row, new, tree.num_nodes - 1))
        self.engine.settled()
        return events

    def leave(self, row: Row) -> None:
        """Drops `row` from the batch (its cache row too)."""
        index = self.rows.index(row)
        self.rows[index] = self.rows[-1]
        self.rows.pop()
        with torch.inference_mode():
            kv.remove(self.cache, index, max((r.length for r in self.rows), default=0))


def until_eos(tokens: list[int], eos_ids: frozenset[int]) -> list[int]:
    """A step's tokens up to (and with) the first EOS token among them."""
    return next((tokens[: i + 1] for i, token in enumerate(tokens) if token in eos_ids), tokens)
