"""THE decoding loop, in call order: prefill -> propose -> verify -> accept -> commit.

Works on any `transformers` causal LM through its own interface: the backbone (`model.base_model`)
takes a 4D attention mask, explicit position ids and a cache, so every tree is verified in one forward pass with no
patched model code. A Batch decodes several sequences together, one forward pass per step over every row's tree:
rows join (their prefill) and leave at any step, each with its own positions, cache entries, acceptance rule and
random generator; a single request is a batch of one. Which tree a row's step verifies is its guard's choice
(guard.py) under `--tree auto`, else always the one given.
"""

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_map
from transformers import Cache, PreTrainedModel

from . import cache as kv
from . import compiled as engine
from .acceptance import RULES, argmax, sample, target_probs
from .config import GenerationConfig
from .guard import Guard, Ladder, batch_yields
from .heads import MedusaHeads, run_backbone
from .kernels import guess_projection
from .proposal import candidates
from .tree import Tree, build, node_index, on_device, padded

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


def forward(model: PreTrainedModel, tokens: torch.Tensor, cache, last: bool = False, layers: tuple[int, ...] = (),
            **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Backbone + LM head. tokens: [B, T] -> (logits [B, T, V], the heads' input states [B, T, (1 + L) H]: the last
    hidden states, and the outputs of the heads' feature `layers`: heads.run_backbone); `last`: the last position's
    logits only (a prefill: the LM head over every prompt token would be a fifth of SmolLM2's prefill)."""
    hidden, state = run_backbone(model, layers, input_ids=tokens, past_key_values=cache, use_cache=True, **kw)
    return model.get_output_embeddings()(hidden[:, -1:] if last else hidden), state


def first_token(logits: torch.Tensor, config: GenerationConfig, generator) -> int:
    return int(argmax(logits)) if config.temperature == 0 else sample(target_probs(logits, config), generator)


def prefill(model, prompt: torch.Tensor, capacity: int, layers: tuple[int, ...] = ()
            ) -> tuple[Cache, torch.Tensor, torch.Tensor]:
    """prompt: [T] -> (a one-row cache of `capacity` positions, logits [V] at the last position and the heads' input
    states [T, S] at every one)."""
    cache = kv.allocate(model, capacity)
    logits, states = forward(model, prompt[None], cache, last=True, layers=layers)
    return cache, logits[0, -1], states[0]


def propose(heads: MedusaHeads, lm_head, embed, hidden: torch.Tensor, root: int, tree: Tree, watched: Tree | None,
            compiled: bool = False, keep: bool = True) -> tuple[torch.Tensor, torch.Tensor | dict | None]:
    """Propose: the step's tokens [N+1] (the root, then the candidates of `tree`) and the heads' guesses for the guard.

    watched: the tree whose nodes the heads guess for (it holds `tree`'s: the guard watches its ladder's largest);
    None: a plain step that does not guess. MEDUSA heads guess once per head, whatever the path: guesses [D, k],
    each head's top-k, and node (r_1..r_d) is rank r_d of head d-1. Hydra heads guess per node (`candidates`):
    guesses {a node's path: the top-k after it}, and node (r_1..r_d) is rank r_d of head d-1 given its parent's path.
    compiled: through the compiled engine's proposal graph (one per heads and tree); keep: False where the guard
    reads no guesses (a fixed tree), which spares hydra heads a read of the device.
    """
    root_token = torch.tensor([root], device=hidden.device)
    if watched is None:
        return root_token, None
    args = (heads, lm_head, embed, hidden[None], root_token, on_device(watched, hidden.device), watched.topk_per_head())
    if compiled:  # copies: a CUDA graph's outputs live until its next replay
        tokens, tops = tree_map(torch.clone, engine.graph(candidates, hidden.device.type)(*args))
    else:
        tokens, tops = candidates(*args)
    tokens, tops = tokens[0], tops[:, 0] if heads.config.kind == "medusa" else [top[0] for top in tops]
    tokens = tokens if tree is watched else tokens[node_index(watched.paths, tree.paths, tokens.device)]
    if heads.config.kind == "medusa" or not keep:
        return tokens, tops if keep else None
    guesses = {(() if node == 0 else watched.paths[node - 1]): top
               for (nodes, _, _), level in zip(watched.levels, tops) for node, top in zip(nodes.tolist(), level.tolist())}
    return tokens, guesses


def propose_confident(heads: MedusaHeads, lm_head, embed, hidden: torch.Tensor, root: int, size: int, watched: int
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
    depth, device, rows = heads.config.num_heads, hidden.device, heads.guess_rows(lm_head)
    # MEDUSA heads in one call: their guesses do not depend on the path
    every_head = heads(hidden, lm_head) if heads.config.kind == "medusa" else None  # [K, V]
    scores = torch.ones(1, device=device)  # the nodes of this depth kept for expanding: their path probabilities
    chains = torch.tensor([[root]], device=device)  # [n, d+1] their tokens, the root first
    paths: list[tuple[int, ...]] = [()]
    tops, kept = {}, []  # kept: (path probabilities [m], paths, tokens [m]) per depth
    for d in range(depth):
        logits = (every_head[d : d + 1] if every_head is not None
                  else heads(hidden.expand(len(paths), -1), lm_head, d + 1, embed(chains), first=d)[0])
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
    order = every.sort(descending=True, stable=True).indices.tolist()
    all_paths = [p for _, ps, _ in kept for p in ps]
    all_tokens = torch.cat([t for _, _, t in kept])
    ranked = [all_paths[i] for i in order[:watched]]
    chosen = set(ranked[:size])
    chosen = {p for p in chosen if all(p[:j] in chosen for j in range(1, len(p)))}  # ties across depths aside
    tree = build(tuple(chosen))
    index = {p: i for i, p in enumerate(all_paths)}
    tokens = torch.cat([torch.tensor([root], device=device), all_tokens[[index[p] for p in tree.paths]]])
    return tree, tokens, (tops, ranked)


def tree_mask(tree: Tree, prefix_len: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[1, 1, N+1, prefix_len+N+1] additive mask: every node sees the prefix and its own ancestors."""
    return kv.step_mask(torch.tensor([prefix_len], device=device), tree.attention[None].to(device),
                        prefix_len + tree.num_nodes, dtype)


def verify(model, cache, tokens: torch.Tensor, tree: Tree, prefix_len: int, layers: tuple[int, ...] = ()):
    """One row's forward pass over all N+1 nodes -> logits [N+1, V], the heads' input states [N+1, (1 + L) H]."""
    positions = (prefix_len + tree.depths.to(tokens.device))[None]
    mask = tree_mask(tree, prefix_len, model.dtype, tokens.device)
    logits, hidden = forward(model, tokens[None], cache, position_ids=positions, attention_mask=mask, layers=layers)
    return logits[0], hidden[0]


@dataclass(eq=False)
class Row:
    """One sequence of a batch: its request, and what its next step starts from."""

    config: GenerationConfig
    guard: Guard
    eos_ids: frozenset[int]
    generator: torch.Generator | None
    root: int  # the last token produced: the root of the next step's tree
    hidden: torch.Tensor  # [S] the heads' input state before the root (Batch.looked), which they guess from
    length: int  # the row's cache entries: the prompt and every token before the root
    produced: int = 1  # tokens produced so far, the root included
    prefix: tuple[torch.Tensor, torch.Tensor] | None = None  # the heads' prefix layer's keys and values (heads.py)

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
    nodes: int  # the nodes of the guard's pick: a compiled step's size, whatever the budget or confidence leaves


class Batch:
    """Sequences decoded together: `join` prefills one, `step` runs one forward pass for every row and returns what
    each produced; a row leaves by itself when done (budget, EOS), or by `leave` (a stop string, a cancelled
    request). The cache's rows follow `rows`."""

    def __init__(self, model: PreTrainedModel, heads: MedusaHeads | None, compiled: bool = False):
        self.model, self.heads, self.lm_head = model, heads, guess_projection(model)  # the guesses' projection
        self.embed = model.get_input_embeddings()  # what hydra heads read of the tokens before their guess
        self.layers = heads.config.feature_layers if heads is not None else ()  # what they read of earlier layers
        self.compiled = compiled  # compiled.py's fixed-shape steps, else eager ones
        self.cache = engine.cache_for(self, model) if compiled else kv.allocate(model, 0)
        self.rows: list[Row] = []
        self.on_device: engine.DeviceRows | None = None  # the rows as the compiled engine's device step left them

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
            cache, logits, states = prefill(self.model, prompt, prompt.shape[-1], self.layers)
            root = first_token(logits, config, generator)
            length, prefix, hidden = prompt.shape[-1], None, states[-1]
            if config.medusa and self.heads is not None and self.heads.prefix is not None:
                prefix = self.heads.prefix.buffers_for(length + config.max_new_tokens, states)
                hidden = self.looked(prefix, states, torch.cat([prompt[1:], prompt.new_tensor([root])]), length)
            row = Row(config, Guard(ladder, root), eos_ids, generator, root, hidden, length, prefix=prefix)
            if not row.done:
                # the row holds at most its prompt, every new token but the last, and one tree
                kv.insert(self.cache, cache, row.length + config.max_new_tokens + max(t.num_nodes for t in ladder.trees))
                self.rows.append(row)
        return row

    def looked(self, prefix: tuple[torch.Tensor, torch.Tensor], states: torch.Tensor, following: torch.Tensor,
               length: int) -> torch.Tensor:
        """The heads' input state at a row's last position where the heads have a prefix layer (`prefix`: the row's
        keys and values), from `states` [n, S] of its n newest positions (the prefill's or a step's committed path,
        the last n of `length`) whose next tokens are `following` [n]: the last one's, and the layer's output there
        after it has read the n positions."""
        start, size = length - len(states), self.heads.config.hidden_size
        looked = self.heads.prefix(states[None, :, :size], self.embed(following)[None], *prefix, start)
        return torch.cat([states[-1], looked[0, -1]])

    def plan(self, row: Row, pooled: list[float] | None) -> Plan:
        """Propose: the row's tree for this step (its guard weighs it at this batch's size, with the batch's mean
        yields `pooled`) and its candidates."""
        tree, watched = row.guard.choose(row.length, len(self.rows), pooled)  # watched: the tree guessed for, or None
        budget, nodes = row.config.max_new_tokens - row.produced - 1, tree.num_nodes  # never guess past the budget
        if row.guard.ladder.confident and watched is not None:  # the tree: the likeliest nodes of this step
            tree, tokens, guesses = propose_confident(self.heads, self.lm_head, self.embed, row.hidden, row.root,
                                                      tree.num_nodes - 1, watched.num_nodes - 1)
            step_tree = tree.truncated(budget)
            tokens = tokens if step_tree is tree else tokens[node_index(tree.paths, step_tree.paths, tokens.device)]
        else:
            step_tree = tree.truncated(budget)
            tokens, guesses = propose(self.heads, self.lm_head, self.embed, row.hidden, row.root, step_tree, watched,
                                      compiled=self.compiled, keep=row.guard.watching)
        # a cut tree is not the ladder's; a seeded run repeats: its guard follows the tokens, not the clock
        return Plan(step_tree, tokens, guesses, step_tree is tree and row.config.seed is None, nodes)

    def device_tree(self) -> Tree | None:
        """The tree of a step that can run whole on the device (compiled.DeviceRows), else None: on the compiled
        engine, every row greedy under the same fixed tree, heads without a prefix layer (which reads each accepted
        path apart), positions within the model's context."""
        trees = {id(row.guard.ladder.tree): row.guard.ladder.tree for row in self.rows}
        if not self.compiled or len(trees) != 1:
            return None
        tree, = trees.values()
        own = tree.num_nodes == 1 or self.heads.prefix is None
        fixed = all(row.config.temperature == 0 and not row.guard.watching and not row.guard.ladder.confident
                    for row in self.rows)
        within = max(row.length for row in self.rows) + tree.depth < context_limit(self.model)
        return tree if own and fixed and within else None

    def step(self) -> list[tuple[Row, list[int], int]]:
        """One forward pass over every row's tree -> (row, the tokens it produced, the candidates it verified) per
        row, in the order of `rows` before the step."""
        if (tree := self.device_tree()) is not None:
            return self.step_on_device(tree)
        if self.on_device is not None:  # the cache's views as the rows stand
            self.on_device = None
            kv.settle(self.cache, [row.length for row in self.rows], [[] for _ in self.rows])
        start_time = time.perf_counter()
        rows, start = list(self.rows), kv.width(self.cache)
        lengths = [row.length for row in rows]
        with torch.inference_mode():
            plans = [self.plan(row, mean) for row, mean in zip(rows, batch_yields([row.guard for row in rows]))]
            nodes = max(plan.nodes if self.compiled else plan.tree.num_nodes for plan in plans)
            device = plans[0].tokens.device
            tokens = torch.zeros(len(rows), nodes, dtype=torch.long, device=device)  # [B, T], padding 0
            for b, plan in enumerate(plans):
                tokens[b, : plan.tree.num_nodes] = plan.tokens
            trees = [padded(plan.tree, nodes, device) for plan in plans]  # (depths, parents, attention, chains) each
            lengths_t = torch.tensor(lengths, device=device)
            width = self.heads.config.num_heads + 1 if self.compiled and nodes > 1 else 1  # the longest path
            kv.reserve(self.cache, len(rows), start + max(nodes, width))
            kv.place(self.cache, lengths, nodes)
            if self.compiled:  # greedy acceptance comes with the pass
                logits, hidden, greedy = engine.verify(self.model, self.cache, tokens, lengths_t, trees, self.layers)
            else:
                depths, attention = torch.stack([t[0] for t in trees]), torch.stack([t[2] for t in trees])
                mask = kv.step_mask(lengths_t, attention, start + nodes, self.model.dtype)
                logits, hidden = forward(self.model, tokens, self.cache, position_ids=lengths_t[:, None] + depths,
                                         attention_mask=mask, layers=self.layers)
            accepted = [greedy[b] if self.compiled and row.config.temperature == 0
                        else RULES[row.config.rule](plan.tokens, logits[b, : plan.tree.num_nodes], plan.tree,
                                                    row.config, row.generator)
                        for b, (row, plan) in enumerate(zip(rows, plans))]
            paths = [torch.as_tensor(path).tolist() for path, _ in accepted]
            if width > 1:
                engine.commit(self.cache, lengths, paths, width, lengths_t)
            else:  # eager, or a plain compiled step, whose token is in place already
                kv.commit(self.cache, lengths, paths)
            for b, (row, plan, path, (_, root)) in enumerate(zip(rows, plans, paths, accepted)):
                if row.prefix is None:
                    row.hidden = hidden[b, path[-1]]
                else:
                    following = torch.cat([plan.tokens[path[1:]], plan.tokens.new_tensor([root])])
                    row.hidden = self.looked(row.prefix, hidden[b, path], following, row.length + len(path))
        seconds = time.perf_counter() - start_time
        events = []
        for b, (row, plan, path, (_, root)) in enumerate(zip(rows, plans, paths, accepted)):
            new = until_eos(plan.tokens[path[1:]].tolist() + [root], row.eos_ids)
            # a batch's step time is shared: only a batch of one times its tree
            row.guard.record(plan.guesses, new, seconds if plan.timed and len(rows) == 1 else None, row.length)
            row.root, row.length = new[-1], row.length + len(path)
            row.produced += len(new)
            events.append((row, new, plan.tree.num_nodes - 1))
        return self.done(events)

    def step_on_device(self, tree: Tree) -> list[tuple[Row, list[int], int]]:
        """Batch.step as one compiled graph on the device and one read of it (compiled.device_graph)."""
        rows = list(self.rows)
        with torch.inference_mode():
            if self.on_device is None or not self.on_device.holds(rows, tree, self.cache):
                # each row's first tree through the proposal graph of one row: one graph whatever the batch size
                tokens = torch.stack([propose(self.heads, self.lm_head, self.embed, row.hidden, row.root, tree,
                                              tree if tree.num_nodes > 1 else None, compiled=True, keep=False)[0]
                                      for row in rows])
                self.on_device = engine.DeviceRows(rows, tree, self.heads, tokens, self.cache)
            produced = self.on_device.step(self.model, self.lm_head, self.embed, self.cache, self.layers)
        events = []
        for row, new in zip(rows, produced):  # a row that passes its budget or an EOS leaves: its cache is dropped
            row.length += len(new)
            new = until_eos(new, row.eos_ids)[: row.config.max_new_tokens - row.produced]
            row.root, row.produced = new[-1], row.produced + len(new)
            events.append((row, new, tree.num_nodes - 1))
        self.on_device.settled()
        return self.done(events)

    def done(self, events: list[tuple[Row, list[int], int]]) -> list[tuple[Row, list[int], int]]:
        """The rows done (budget, EOS) leave; `events` as they were."""
        for row, _, _ in events:
            if row.done:
                self.leave(row)
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


def decode(
    model: PreTrainedModel,
    heads: MedusaHeads | None,
    prompt: torch.Tensor,
    config: GenerationConfig,
    trees: Tree | Ladder,
    eos_ids: frozenset[int] = frozenset(),
    generator: torch.Generator | None = None,
    compiled: bool = False,
) -> Iterator[tuple[list[int], int]]:
    """One request, a batch of one. Yields the tokens of each forward pass and how many candidates it verified: the
    prefill's one token (0), then 1 + accepted per step. Stops after max_new_tokens tokens or at an EOS token (which
    is yielded).

    prompt: [T] token ids. trees: one tree, or a Ladder of trees of which a Guard picks one per step (`--tree auto`).
    compiled: on the compiled engine (compiled.py), else the eager one.
    """
    batch = Batch(model, heads, compiled)
    row = batch.join(prompt, config, trees, eos_ids, generator)
    yield [row.root], 0
    while batch.rows:
        (_, new, size), = batch.step()
        yield new, size
