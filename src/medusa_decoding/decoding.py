"""THE decoding loop, in call order: prefill -> propose -> verify -> accept -> commit.

Works on any `transformers` causal LM through its own interface: the backbone (`model.base_model`)
takes a 4D attention mask, explicit position ids and a cache, so every tree is verified in one forward pass with no
patched model code. A Batch decodes several sequences together, one forward pass per step over every row's tree:
rows join (their prefill) and leave at any step, each with its own positions, cache entries, acceptance rule and
random generator; a single request is a batch of one. A row's step verifies what its proposers offer (proposers.py):
first its heads, the tree its guard picks (guard.py) under `--tree auto`, else always the one given; then its lookup
and corpus drafts, grafted onto it. The batch's engine (engine.py: eager or compiled) runs the passes, and where it
can, the whole step on the device.
"""

import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from . import cache as kv
from .acceptance import RULES, argmax, sample, target_probs
from .base import check_context
from .config import GenerationConfig
from .corpus import CorpusDraft, CorpusIndex
from .device_acceptance import draw_key
from .engine import Engine, Packed, engine_for
from .guard import Guard, Ladder, batch_yields
from .heads import MedusaHeads, OwnTokens
from .heads_draft import HeadsDraft
from .kernels import guess_projection
from .lookup import LookupDraft
from .proposers import Proposer, SoFar, StepStart, drafted, graft
from .tree import Tree, build, padded

PLAIN = build(())  # the root alone: plain one-token-per-step decoding in the same engine


def first_token(logits: torch.Tensor, config: GenerationConfig, generator) -> int:
    return int(argmax(logits)) if config.temperature == 0 else sample(target_probs(logits, config), generator)


@dataclass(eq=False)
class Row:
    """One sequence of a batch: its request, and what its next step starts from."""

    config: GenerationConfig
    eos_ids: frozenset[int]
    generator: torch.Generator | None
    root: int  # the last token produced: the root of the next step's tree
    heads_input: torch.Tensor  # [S] the heads' input state at the token before the root, which they guess from
    length: int  # the row's cache entries: the prompt and every token before the root
    heads_draft: HeadsDraft  # the heads' candidates: their guard prices every step, and the device step runs them
    drafts: list[Proposer]  # the other sources of candidates, grafted onto the heads' tree in turn (proposers.py)
    produced: int = 1  # tokens produced so far, the root included
    drafted: int = 0  # of the last step's tokens, those only a chain proposed
    key: int = 0  # what a sampled row's draws on the device step depend on, beside its length (device_acceptance)

    @property
    def proposers(self) -> list[Proposer]:
        """Every source of candidates, in the order they propose: the heads' draft, then the others."""
        return [self.heads_draft, *self.drafts]

    @property
    def done(self) -> bool:
        return self.produced >= self.config.max_new_tokens or self.root in self.eos_ids


@dataclass
class Plan:
    """What one row verifies in a step."""

    tree: Tree  # every proposal, grafted
    tokens: torch.Tensor  # [N+1] the root and the candidates
    nodes: int  # the root and the proposers' room: a compiled step's size, whatever they offer
    chains: list[list[int]]  # each proposer's nodes in `tree`


class Batch:
    """Sequences decoded together: `join` prefills one, `step` runs one forward pass for every row and returns what
    each produced; a row leaves by itself when done (budget, EOS), or by `leave` (a stop string, a cancelled
    request). The cache's rows follow `rows`. compiled: whether the engine that runs the steps is the compiled one
    (engine.engine_for)."""

    def __init__(self, model: PreTrainedModel, heads: MedusaHeads | None, compiled: bool = False):
        self.model, self.heads, self.lm_head = model, heads, guess_projection(model)  # the guesses' projection
        self.embed = model.get_input_embeddings()  # what hydra heads read of the tokens before their guess
        self.engine: Engine = engine_for(model, heads, compiled)
        self.cache = self.engine.cache(self)
        self.rows: list[Row] = []

    def join(self, prompt: torch.Tensor, config: GenerationConfig, trees: Tree | Ladder,
             eos_ids: frozenset[int] = frozenset(), generator: torch.Generator | None = None,
             corpus: CorpusIndex | None = None) -> Row:
        """Prefills prompt [T] and returns its row, whose root is the first token; a row done already (EOS, a budget
        of one) is not added. corpus: the index its corpus drafts follow (the heads', where they have one)."""
        check_context(self.model, prompt.shape[-1], config.max_new_tokens)
        ladder = (Ladder.fixed(PLAIN) if not config.medusa else trees if isinstance(trees, Ladder)
                  else Ladder.fixed(trees))
        for tree in ladder.trees:
            if tree.num_nodes > 1:
                tree.check_heads(self.heads.config.num_heads, self.heads.config.vocab_size)
        with torch.inference_mode():
            cache, logits, state = self.engine.prefill(prompt)
            root = first_token(logits, config, generator)
            seen = prompt.tolist() + [root]
            heads_draft = HeadsDraft(self.heads, self.lm_head, self.embed, self.engine.candidates, Guard(ladder, root),
                                     self.own_tokens(seen) if config.medusa else None, timed=config.seed is None)
            drafts = [LookupDraft(seen, config.lookup)] if config.medusa and config.lookup else []
            if config.medusa and config.corpus and corpus is not None:
                drafts.append(CorpusDraft(corpus, seen, config.corpus))
            row = Row(config, eos_ids, generator, root, state, prompt.shape[-1], heads_draft, drafts,
                      key=draw_key(generator) if config.temperature > 0 else 0)
            if not row.done:
                # the row holds at most its prompt, every new token but the last, and one tree
                largest = max(tree.num_nodes for tree in ladder.trees)
                kv.insert(self.cache, cache, row.length + config.max_new_tokens + largest)
                self.rows.append(row)
        return row

    def own_tokens(self, tokens: list[int]) -> OwnTokens | None:
        """A row's own tokens beside the heads' guess vocabulary, where they guess from part of it and the engine takes
        them (Engine.guesses_own_tokens)."""
        vocabulary = (None if self.heads is None or not self.engine.guesses_own_tokens
                      else self.heads.guess_rows(self.lm_head))
        if vocabulary is None:
            return None
        return OwnTokens(vocabulary, self.model.get_output_embeddings(), tokens)

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
        plans = [self.plan(row, mean) for row, mean in zip(rows, batch_yields([row.heads_draft.guard for row in rows]))]
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
        """Propose: every proposer's candidates, grafted into one tree, each offered the step as it stands (SoFar: what
        it yields with the proposals before, the cost of more nodes from the calibrated latencies per tree size, and
        the tree)."""
        start = StepStart(row.root, row.heads_input, row.length, row.config.max_new_tokens - row.produced - 1,
                          len(self.rows), pooled)
        tree, tokens, yields, room, chains = PLAIN, torch.tensor([row.root], device=row.heads_input.device), 1.0, 0, []
        for proposer in row.proposers:
            cost = row.heads_draft.step_cost(row.length, len(self.rows), tree.num_nodes)
            proposal = proposer.propose(start, SoFar(yields, cost, tree, tokens))
            tree, tokens, nodes = graft(tree, tokens, proposal)
            yields, room = yields + proposal.gained, room + proposal.room
            chains.append(nodes)
        return Plan(tree, tokens, 1 + room, chains)

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
        seconds = seconds if len(self.rows) == 1 else None  # a batch's step time is every row's
        for proposer, nodes in zip(row.proposers, plan.chains):  # the step's time is a proposal's where it was all
            proposer.record(nodes, path, new, seconds if len(nodes) == plan.tree.num_nodes - 1 else None)
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
            for proposer in row.proposers:  # the device step's tree is the heads', never the host's proposals
                proposer.record([], [0], new, None)
            events.append((row, new, tree.num_nodes - 1))
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
