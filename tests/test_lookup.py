"""The lookup index proposes what a plain search of the stream would: the continuation of the latest earlier
occurrence of the longest recurring suffix."""

import random

import pytest
import torch
from conftest import FAMILIES
from engine_helpers import greedy_reference, lively_model, random_heads

from medusa_decoding.config import GenerationConfig
from medusa_decoding.decoding import PLAIN, Batch
from medusa_decoding.guard import Ladder
from medusa_decoding.lookup import Lookup, LookupDraft
from medusa_decoding.proposers import DRAFT_RANK, FIXED_NODE_COST, Proposal, SoFar, StepStart, graft, step_cost, worth
from medusa_decoding.tree import Tree, build


def brute_force(stream: list[int], length: int, max_ngram: int) -> tuple[list[int], int]:
    """Searches the whole stream, longest suffix first, latest occurrence first (never the suffix itself)."""
    if length == 0:
        return [], 0
    for n in range(max_ngram, 0, -1):
        if n > len(stream):
            continue
        for i in range(len(stream) - 2, n - 2, -1):
            if stream[i - n + 1 : i + 1] == stream[-n:]:
                return stream[i + 1 : i + 1 + length], n
    return [], 0


@pytest.mark.parametrize("max_ngram", [1, 2, 4])
def test_matches_brute_force_on_random_streams(max_ngram):
    rng = random.Random(max_ngram)
    states = matched = longest = 0
    for _ in range(100):
        vocab = rng.randint(3, 8)
        size = rng.randint(1, 300)
        stream = [rng.randrange(vocab) for _ in range(size)]
        prompt = rng.randint(0, size)
        lookup = Lookup(stream[:prompt], max_ngram=max_ngram)
        at = prompt
        while True:
            assert lookup.tokens == stream[:at]
            for length in (0, 1, 3, 8):
                assert lookup.continuation(length) == brute_force(stream[:at], length, max_ngram), (stream[:at], length)
            confidence = brute_force(stream[:at], 1, max_ngram)[1]
            states += 1
            matched += confidence > 0
            longest += confidence == max_ngram
            if at == size:
                break
            chunk = rng.choice([0, 0, 1, 1, 2, 5, 17])  # empty chunks too
            lookup.extend(stream[at : at + chunk])
            at = min(at + chunk, size)
    # the search is only checked where it finds something: most states must have a match, many of full length
    assert states > 1500
    assert matched > states * 3 // 4
    assert longest > states // 10


def test_a_repeated_sentence_proposes_its_continuation():
    sentence = [10, 11, 12, 13, 14, 15]
    lookup = Lookup([1, 2] + sentence + [3] + sentence[:3])
    assert lookup.continuation(3) == ([13, 14, 15], 3)
    lookup.extend([13])
    assert lookup.continuation(8) == ([14, 15, 3, 10, 11, 12, 13], 4)


def test_no_repeat_proposes_nothing():
    assert Lookup([1, 2, 3, 4, 5]).continuation(4) == ([], 0)
    assert Lookup([7]).continuation(4) == ([], 0)
    assert Lookup().continuation(4) == ([], 0)


def test_length_zero_proposes_nothing():
    assert Lookup([1, 2, 1, 2]).continuation(0) == ([], 0)


def test_the_longest_match_wins_over_a_later_shorter_one():
    # "1 2 3" was followed by 7 long ago; "3" alone was followed by 9 more recently
    lookup = Lookup([1, 2, 3, 7, 0, 3, 9, 0, 1, 2, 3])
    assert lookup.continuation(2) == ([7, 0], 3)
    # with bigrams only, "2 3" still beats the later "3"
    assert Lookup([1, 2, 3, 7, 0, 3, 9, 0, 1, 2, 3], max_ngram=2).continuation(1) == ([7], 2)


def test_the_latest_occurrence_wins_and_the_continuation_runs_into_the_suffix():
    lookup = Lookup([5, 1, 5, 2, 5])
    assert lookup.continuation(3) == ([2, 5], 1)  # after the latest earlier 5, cut at the stream's end
    repeating = Lookup([4, 4, 4])
    assert repeating.continuation(5) == ([4], 2)  # "4 4" ended at 1, followed only by the stream's last 4


def test_max_ngram_one_looks_at_the_last_token_only():
    lookup = Lookup([1, 2, 8, 3, 2, 9, 1, 2], max_ngram=1)
    assert lookup.continuation(2) == ([9, 1], 1)  # the latest 2, although "1 2" was followed by 8
    with pytest.raises(ValueError):
        Lookup(max_ngram=0)


def test_a_chain_follows_the_heads_path_where_they_agree_then_hangs_its_own_nodes():
    tree = Tree.from_spec([[0], [1], [0, 0]])  # nodes: 1 (0,), 2 (1,), 3 (0, 0)
    tokens = torch.tensor([10, 20, 21, 30])  # the root, then the heads' tokens of nodes 1..3
    chain = Proposal.chain([20, 30, 40, 50], 1.0, 4)  # (0,) and (0, 0) agree, then its own
    merged, merged_tokens, nodes = graft(tree, tokens, chain)
    merged_tokens = merged_tokens.tolist()
    token_of = dict(zip(merged.paths, merged_tokens[1:]))
    assert merged.num_nodes == tree.num_nodes + 2 and merged_tokens[0] == 10
    # the heads' as they were
    assert all(token_of[path] == token for path, token in zip(tree.paths, tokens[1:].tolist()))
    own = (0, 0, DRAFT_RANK)
    assert [merged.paths[node - 1] for node in nodes] == [(0,), (0, 0), own, own + (DRAFT_RANK,)]
    assert [merged_tokens[node] for node in nodes] == [20, 30, 40, 50]
    assert [int(merged.parents[node]) for node in nodes] == [0] + nodes[:-1]  # one root path

    other, other_tokens, other_nodes = graft(tree, tokens, Proposal.chain([99, 20], 0.5, 4))  # its own branch at once
    assert [other.paths[n - 1] for n in other_nodes] == [(DRAFT_RANK,), (DRAFT_RANK, DRAFT_RANK)]
    assert [other_tokens[n] for n in other_nodes] == [99, 20]
    same, same_tokens, none = graft(tree, tokens, Proposal.chain([], 0.0, 4))
    assert same is tree and same_tokens.tolist() == tokens.tolist() and none == []


def test_the_first_proposal_is_the_tree_and_a_later_tree_joins_it_under_its_own_ranks():
    """Proposals of any shape: the first, onto the root alone, is the step's tree as it stands (the heads' ranks
    kept: the guard reads them); a later tree merges node by node, a taken rank moving to the next free one."""
    heads = Proposal(Tree.from_spec([[0], [1], [0, 0]]), torch.tensor([20, 21, 30]), 1.2, 3)
    root = torch.tensor([10])
    tree, tokens, nodes = graft(build(()), root, heads)
    assert tree is heads.tree and tokens.tolist() == [10, 20, 21, 30] and nodes == [1, 2, 3]
    second = Proposal(Tree.from_spec([[0], [1], [1, 0]]), [21, 22, 31], 0.5, 3)  # 21 is the heads' (1,): shared
    merged, merged_tokens, nodes = graft(tree, tokens, second)
    token_of = dict(zip(merged.paths, merged_tokens[1:].tolist()))
    assert [merged.paths[n - 1] for n in nodes] == [(1,), (2,), (2, 0)]  # rank 1 was taken: its 22 moves to rank 2
    assert [token_of[merged.paths[n - 1]] for n in nodes] == [21, 22, 31]
    assert all(token_of[path] == token for path, token in zip(tree.paths, [20, 21, 30]))


def kept(draft: LookupDraft, budget: int, tokens: float, cost, tree: Tree = PLAIN, tree_tokens=(0,)) -> list[int]:
    """The chain the draft offers a step (decoding.Batch.plan) with `budget` tokens left, after `tree` (its tokens,
    the root first)."""
    step = SoFar(tokens, cost, tree, torch.tensor(tree_tokens))
    return draft.propose(StepStart(tree_tokens[0], torch.zeros(1), 0, budget, 1, None), step).tokens


def test_the_chain_is_as_long_as_its_expected_tokens_pay_for():
    draft = LookupDraft([1, 2, 3, 4, 5, 6, 1, 2, 3], max_length=8)  # "1 2 3" recurs: 4 5 6 1 2 3 follows
    free, dear = (lambda n: 1.0), (lambda n: 1 + 10 * n)
    assert kept(draft, budget=8, tokens=1.0, cost=free) == [4, 5, 6, 1, 2, 3]
    assert kept(draft, budget=2, tokens=1.0, cost=free) == [4, 5]  # never past the budget
    assert kept(draft, budget=8, tokens=1.0, cost=dear) == []
    assert kept(LookupDraft([1, 2, 3], max_length=8), 8, 1.0, free) == []  # nothing recurs


def test_worth_keeps_the_prefix_with_the_most_tokens_per_unit_of_time():
    cost = lambda n: 1 + 0.25 * n
    own = lambda *chances: [(p, False) for p in chances]
    assert worth(own(1.0, 1.0, 1.0), 1.0, cost) == (3, 3.0)  # sure tokens: (1 + 3) / 1.75 beats the rest
    assert worth(own(0.9, 0.1, 0.9), 1.0, cost) == (1, 0.9)  # the second is unlikely: nothing after it
    assert worth(own(0.2, 0.2), 1.0, cost) == (0, 0.0)  # not worth a node
    assert worth([], 1.0, cost) == (0, 0.0)
    read = []

    def chances():  # a lazy chain: read no further than the first token that does not pay
        for p in (0.9, 0.1, 0.9, 0.9):
            read.append(p)
            yield p, False

    assert worth(chances(), 1.0, cost) == (1, 0.9) and read == [0.9, 0.1]


def test_tokens_the_tree_holds_cost_no_node_and_add_no_yield():
    """A chain's first tokens that the step's tree holds already (the heads guessed them too) are verified anyway:
    they take no node and the step's yield counts them; the chain pays only with the tokens after them."""
    cost = lambda n: 1 + 0.25 * n
    assert worth([(0.9, True), (0.9, False)], 1.5, cost) == (2, 0.9 * 0.9)  # (1.5 + 0.81) / 1.25 beats 1.5
    assert worth([(1.0, True), (1.0, True)], 1.0, cost) == (0, 0.0)  # the tree holds it whole: nothing to add
    assert worth([(0.5, True), (0.5, False)], 1.5, cost) == (0, 0.0)  # 0.25 a node is not worth it


def test_the_step_so_far_tells_a_chain_what_its_tree_holds():
    tree, tokens = Tree.from_spec([[0], [1], [0, 0]]), torch.tensor([10, 20, 21, 30])  # 20 then 30, or 21
    step = SoFar(1.5, lambda n: 1.0, tree, tokens)
    held, apart, off = (True, False), (False, True), (False, False)  # (held, first off the tree beside its own)
    assert list(step.places([20, 30, 5])) == [held, held, off]  # (0, 0) has no children: 5 stands alone
    assert list(step.places([21, 9])) == [held, off]
    assert list(step.places([20, 7, 20])) == [held, apart, off]  # beside 30; past the tree nothing is held again
    assert list(step.places([5])) == [apart] and list(step.places([30])) == [apart]  # beside 20 and 21
    assert list(step.places([])) == []
    root = SoFar(1.0, lambda n: 1.0, PLAIN, torch.tensor([10]))
    assert list(root.places([20, 30])) == [off, off]


def test_a_chain_is_priced_by_the_tokens_it_adds_to_the_tree():
    """The heads guessed the chain's first token: the lookup offers it again (one node, verified once) but counts
    only the tokens after it. Where they guessed another token, the chain's first is their sibling, counted apart
    (right only where theirs is wrong)."""
    draft, free = LookupDraft([1, 2, 3, 4, 5, 6, 1, 2, 3], max_length=3), (lambda n: 1.0)  # "1 2 3": 4 5 6 follows
    alone = draft.propose(StepStart(3, torch.zeros(1), 0, 8, 1, None), SoFar(1.0, free, PLAIN, torch.tensor([3])))
    assert alone.tokens == [4, 5, 6] and draft.rates.bins == [2, 2, 2]  # a 3-token match
    agreed = draft.propose(StepStart(3, torch.zeros(1), 0, 8, 1, None),
                           SoFar(1.5, free, Tree.from_spec([[0]]), torch.tensor([3, 4])))
    assert agreed.tokens == [4, 5, 6] and draft.rates.bins == [2, 2, 2]
    assert agreed.gained == pytest.approx(alone.gained - draft.rates.right[2])  # the first token is the tree's yield
    apart = draft.propose(StepStart(3, torch.zeros(1), 0, 8, 1, None),
                          SoFar(1.5, free, Tree.from_spec([[0]]), torch.tensor([3, 7])))
    assert apart.tokens == [4, 5, 6] and draft.rates.bins == [2 + 4, 2, 2]  # beside the heads' 7: its own bin
    assert draft.rates.right[6] < draft.rates.right[2]  # and a lower prior
    merged, _, nodes = graft(Tree.from_spec([[0]]), torch.tensor([3, 4]), agreed)
    assert merged.num_nodes == 4 and nodes == [1, 2, 3]  # the shared token: one node


def test_chains_that_miss_make_the_next_ones_shorter():
    draft = LookupDraft([1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], max_length=8)
    cost = lambda n: 1 + 0.1 * n
    before = len(kept(draft, 8, 1.0, cost))
    for _ in range(20):
        chain = kept(draft, 8, 1.0, cost)
        draft.record(list(range(1, len(chain) + 1)), [0], [], None)  # nothing of it accepted
    after = len(kept(draft, 8, 1.0, cost))
    assert before == 2 and after == 0 and draft.rates.right[2] < 0.15  # the 3-token match missed
    draft.record([1, 2], [0, 1, 2], [4, 5, 6], None)  # both right: counted, and the answer extends the index
    assert draft.index.tokens[-3:] == [4, 5, 6]


def test_a_chain_costs_what_the_calibrated_latencies_say_of_a_larger_step():
    trees = tuple(Tree.from_spec([[i] for i in range(n)]) for n in (0, 1, 2, 4))  # 1, 2, 3 and 5 nodes
    ladder = Ladder(trees, (1.0, 1.3, 1.5, 1.7), (100,), ((10.0, 11.0, 12.0, 14.0),))
    assert [round(step_cost(ladder, 100, 1, 1)(n), 6) for n in range(5)] == [1.0, 1.1, 1.2, 1.3, 1.4]
    assert round(step_cost(ladder, 100, 1, 5)(1), 6) == round(15 / 14, 6)  # past the largest: its last segment
    assert step_cost(Ladder.fixed(trees[1]), 100, 1, 2)(3) == 1 + 3 * FIXED_NODE_COST


def test_a_noisy_fit_never_prices_more_nodes_below_fewer():
    """A fit whose 3-node tree timed below its 2-node one (run 16's): the larger tree costs what the smaller does,
    and past it each node costs the whole ladder's slope, not the falling last segment's nothing."""
    trees = tuple(Tree.from_spec([[i] for i in range(n)]) for n in (0, 1, 2, 3))  # 1, 2, 3 and 4 nodes
    ladder = Ladder(trees, (1.0, 1.4, 1.6, 1.7), (100,), ((12.0, 15.0, 18.0, 17.0),))
    cost = step_cost(ladder, 100, 1, 3)
    assert [round(cost(n), 6) for n in range(4)] == [1.0, 1.0, round(20 / 18, 6), round(22 / 18, 6)]


REPEATING = torch.tensor([5, 9, 12, 30, 7, 5, 9, 12, 30, 7, 5, 9])  # its continuation is in it
NEVER = torch.arange(10, 22)  # no token twice


@pytest.mark.parametrize("heads", ["medusa", "hydra", "none"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_decoding_with_lookup_drafts_is_plain_decoding(family, heads):
    """Every row of a batch, prompts that repeat and prompts that never do, gets transformers' greedy tokens, with
    the drafts' chains verified beside the heads' candidates (or alone, without heads) at many steps."""
    model = lively_model(family, seed=FAMILIES.index(family))
    heads = None if heads == "none" else random_heads(model, kind=heads)
    tree = PLAIN if heads is None else Tree.from_spec([2, 1])  # without heads, plain steps plus the drafts
    prompts, budgets = (REPEATING, NEVER, REPEATING[:7]), (40, 33, 25)
    batch = Batch(model, heads)
    rows = [batch.join(p, GenerationConfig(max_new_tokens=n, lookup=6), tree) for p, n in zip(prompts, budgets)]
    produced, grafted = {id(row): [row.root] for row in rows}, 0
    while batch.rows:
        for row, new, size in batch.step():
            produced[id(row)] += new
            grafted += size > tree.num_nodes - 1
    assert [produced[id(row)] for row in rows] == [greedy_reference(model, p, n) for p, n in zip(prompts, budgets)]
    assert grafted >= 8  # chains were verified (random models seldom repeat: few are right, and then offered less)


class FixedChain:
    """A proposer written in this test, not the engine: it offers a chain it was given (the model's own greedy
    continuation, as sure of each token as can be), one position at a time, and hears what was accepted."""

    max_length = 4

    def __init__(self, continuation: list[int]):
        self.continuation, self.at, self.heard = continuation, 1, []  # the root (continuation[0]) is produced

    def propose(self, start: StepStart, step: SoFar) -> Proposal:
        chain = self.continuation[self.at : self.at + min(self.max_length, start.budget)]
        return Proposal.chain(chain, len(chain), self.max_length)

    def record(self, nodes: list[int], path: list[int], new: list[int], seconds: float | None) -> None:
        self.heard.append((nodes, len(path) - 1))
        self.at += len(new)


@pytest.mark.parametrize("heads", ["medusa", "none"])
def test_a_proposer_added_to_a_row_joins_its_tree_without_a_change_to_the_step(heads):
    """A new source of drafts is one class: appended to a row's drafts, its chains are verified beside the heads'
    candidates (or alone), accepted where right, the output stays plain greedy decoding's."""
    model = lively_model("llama")
    heads = None if heads == "none" else random_heads(model)
    tree, prompt, budget = (PLAIN if heads is None else Tree.from_spec([2, 1])), NEVER, 30
    want = greedy_reference(model, prompt, budget)
    batch = Batch(model, heads)
    row = batch.join(prompt, GenerationConfig(max_new_tokens=budget, lookup=0), tree)
    fixed = FixedChain(want)
    row.drafts.append(fixed)
    produced, taken = [row.root], 0
    while batch.rows:
        for _, new, _ in batch.step():
            produced += new
            taken += 1
    assert produced == want
    assert taken <= budget // (fixed.max_length + 1) + 1  # every chain was accepted whole
    assert all(nodes and accepted >= len(nodes) for nodes, accepted in fixed.heard[:-1])
