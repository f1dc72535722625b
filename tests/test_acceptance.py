"""Acceptance rules on hand-made logits: which path each rule accepts, and which token follows it."""

import math

import pytest
import torch

from medusa_decoding.acceptance import (
    ARGMAX_CHUNK,
    argmax,
    greedy,
    longest_accepted_path,
    rejection,
    target_probs,
    typical,
)
from medusa_decoding.config import GenerationConfig
from medusa_decoding.tree import Tree

V = 10
GREEDY = GenerationConfig(temperature=0)
SAMPLED = GenerationConfig(temperature=1.0, acceptance="typical")


def logits_with_argmax(argmax: list[int], vocab_size: int = V) -> torch.Tensor:
    """[N+1, V] logits whose row i peaks at argmax[i] (the base model's choice after node i)."""
    logits = torch.randn(len(argmax), vocab_size, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 10.0
    return logits


def test_greedy_takes_the_longest_matching_path():
    # nodes 1 (0,)  2 (1,)  3 (0,0)  4 (1,0)  5 (1,0,0); node i holds token i, the root token 0
    tree = Tree.from_spec([[0], [1], [0, 0], [1, 0], [1, 0, 0]])
    tokens = torch.arange(6)
    # after the root the model picks 2 (node 1 is wrong); node 3 would match after node 1, but node 1 was rejected
    path, token = greedy(tokens, logits_with_argmax([2, 3, 4, 9, 5, 7]), tree, GREEDY)
    assert path.tolist() == [0, 2, 4, 5] and token == 7
    path, token = greedy(tokens, logits_with_argmax([1, 3, 4, 8, 5, 7]), tree, GREEDY)
    assert path.tolist() == [0, 1, 3] and token == 8
    path, token = greedy(tokens, logits_with_argmax([6, 3, 4, 9, 5, 7]), tree, GREEDY)
    assert path.tolist() == [0] and token == 6  # nothing accepted: the base model's own next token


def test_argmax_is_the_first_largest_logit_within_and_across_chunks():
    logits = torch.randn(6, 4 * ARGMAX_CHUNK, generator=torch.Generator().manual_seed(0))
    logits[1, [ARGMAX_CHUNK + 6, 3 * ARGMAX_CHUNK]] = 9  # a tie across chunks
    logits[2, [ARGMAX_CHUNK + 1, ARGMAX_CHUNK + 2]] = 9  # a tie within one
    logits[3, -1], logits[4, 0] = 9, 9  # the last logit, the first
    logits[5] = 0  # all tied
    expected = [int(logits[0].argmax()), ARGMAX_CHUNK + 6, ARGMAX_CHUNK + 1, 4 * ARGMAX_CHUNK - 1, 0, 0]
    assert argmax(logits).tolist() == expected
    assert argmax(logits[:, :-1]).tolist() == logits[:, :-1].max(-1).indices.tolist()  # not whole chunks
    assert argmax(logits[1]).tolist() == ARGMAX_CHUNK + 6  # one row


def test_greedy_takes_the_longer_path_where_siblings_hold_the_same_token():
    tree = Tree.from_spec([[0], [1], [1, 0]])  # nodes 1 (0,)  2 (1,)  3 (1, 0)
    tokens = torch.tensor([0, 5, 5, 6])  # nodes 1 and 2 both hold 5 (drafts that were not merged)
    path, token = greedy(tokens, logits_with_argmax([5, 1, 6, 8]), tree, GREEDY)
    assert path.tolist() == [0, 2, 3] and token == 8


def test_padding_is_never_accepted():
    """Leaf 2's path is [0, 2, PAD, PAD]; PAD must not stand for the root, even when the root 'matches'."""
    tree = Tree.from_spec([[0], [1], [0, 0], [0, 0, 0]])
    assert tree.leaf_paths.tolist() == [[0, 2, -1, -1], [0, 1, 3, 4]]
    accepted = torch.tensor([True, False, True, True, True])
    assert longest_accepted_path(accepted, tree).tolist() == [0, 2]
    tokens = torch.tensor([7, 1, 7, 3, 4])  # the root token equals the argmax after the root, like node 2
    path, token = greedy(tokens, logits_with_argmax([7, 3, 5, 4, 0]), tree, GREEDY)
    assert path.tolist() == [0, 2] and token == 5


@pytest.mark.parametrize("accepted, expected", [
    ([1, 1, 1, 1, 1], [0, 1, 3, 4]),
    ([1, 0, 0, 0, 0], [0]),
    ([0, 0, 0, 0, 0], [0]),  # the root is always kept: it was chosen last step
    ([1, 1, 0, 0, 1], [0, 1]),  # node 3 rejected cuts node 4 too
])
def test_longest_accepted_path(accepted, expected):
    tree = Tree.from_spec([[0], [1], [0, 0], [0, 0, 0]])
    assert longest_accepted_path(torch.tensor(accepted, dtype=torch.bool), tree).tolist() == expected


P = [0.5, 0.3, 0.2]
ENTROPY = -sum(p * math.log(p) for p in P)  # 1.0297: exp(-H) = 0.3571


@pytest.mark.parametrize("epsilon, delta, accepted", [
    (0.09, 0.3, {0, 1, 2}),  # threshold min(0.09, 0.107) = 0.09
    (0.25, 0.3, {0, 1, 2}),  # min(0.25, 0.107): delta * exp(-H) binds
    (0.25, 0.6, {0, 1}),  # min(0.25, 0.214) = 0.214 > p(2) = 0.2
    (0.35, 1.0, {0}),  # min(0.35, 0.357) = 0.35
    (0.6, 2.0, set()),  # min(0.6, 0.714) = 0.6 > every p
])
def test_typical_threshold(epsilon, delta, accepted):
    assert math.isclose(math.exp(-ENTROPY), 0.3571, abs_tol=1e-4)
    config = GenerationConfig(temperature=1.0, acceptance="typical", typical_epsilon=epsilon, typical_delta=delta)
    tree = Tree.from_spec([[0]])
    logits = torch.tensor([P, P]).log()
    for x in range(3):
        path, _ = typical(torch.tensor([0, x]), logits, tree, config)
        assert (len(path) == 2) == (x in accepted), x


def test_typical_needs_the_parent_and_samples_after_the_last_accepted_node():
    tree = Tree.from_spec([[0], [0, 0]])
    logits = torch.full((3, 4), -math.inf)
    logits[0, 1] = logits[1, 2] = logits[2, 3] = 0.0  # each node's distribution is certain
    path, token = typical(torch.tensor([0, 1, 2]), logits, tree, SAMPLED)
    assert path.tolist() == [0, 1, 2] and token == 3
    path, token = typical(torch.tensor([0, 1, 0]), logits, tree, SAMPLED)
    assert path.tolist() == [0, 1] and token == 2
    path, token = typical(torch.tensor([0, 3, 2]), logits, tree, SAMPLED)  # node 2 is right but its parent is not
    assert path.tolist() == [0] and token == 1


@pytest.mark.parametrize("rule", [typical, rejection])
def test_every_rule_is_greedy_at_temperature_zero(rule):
    tree = Tree.from_spec([3, 2])  # nodes 1-3 at depth 1, 4-9 at depth 2 (4, 5 under 1; 6, 7 under 2; 8, 9 under 3)
    generator = torch.Generator().manual_seed(0)
    for trial in range(30):
        tokens = torch.randint(0, 4, (tree.num_nodes,), generator=generator)
        for _parent, children in enumerate(tree.children):  # siblings differ, as a head's top-k tokens do
            tokens[list(children)] = torch.randperm(4, generator=generator)[: len(children)]
        logits = torch.randn(tree.num_nodes, 4, generator=generator)
        config = GenerationConfig(temperature=0, acceptance="typical") if rule is typical else GREEDY
        path, token = rule(tokens, logits, tree, config, generator)
        expected_path, expected_token = greedy(tokens, logits, tree, GREEDY)
        assert path.tolist() == expected_path.tolist() and token == expected_token, trial


def test_rejection_with_one_hot_p_accepts_exactly_the_argmax_child():
    tree = Tree.from_spec([3, 1])  # nodes 1, 2, 3 (ranks 0-2) at depth 1; 4, 5, 6 under them
    tokens = torch.tensor([0, 5, 6, 7, 1, 2, 3])
    for argmax_after_root, expected in [(5, [0, 1, 4]), (6, [0, 2, 5]), (7, [0, 3, 6]), (8, [0])]:
        argmax = [argmax_after_root, 1, 2, 3, 9, 9, 9]
        for seed in range(10):
            path, token = rejection(tokens, logits_with_argmax(argmax), tree, GREEDY,
                                    torch.Generator().manual_seed(seed))
            assert path.tolist() == expected and token == argmax[expected[-1]]


def test_target_probs_filters():
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()

    def probs(**kw):
        return target_probs(logits, GenerationConfig(**kw)).tolist()

    assert probs(temperature=0) == [1, 0, 0, 0]
    assert probs(temperature=1.0) == pytest.approx([0.4, 0.3, 0.2, 0.1])
    roots = [math.sqrt(p) for p in (0.4, 0.3, 0.2, 0.1)]  # temperature 2: p ** (1/2), renormalised
    assert probs(temperature=2.0) == pytest.approx([r / sum(roots) for r in roots])
    assert probs(temperature=1.0, top_k=2) == pytest.approx([4 / 7, 3 / 7, 0, 0])
    assert probs(temperature=1.0, top_p=0.65) == pytest.approx([4 / 7, 3 / 7, 0, 0])
    assert probs(temperature=1.0, top_p=0.75) == pytest.approx([4 / 9, 3 / 9, 2 / 9, 0])
    assert probs(temperature=1.0, top_p=0.1) == pytest.approx([1, 0, 0, 0])  # the top token always stays
    assert probs(temperature=1.0, top_k=2, top_p=0.5) == pytest.approx([1, 0, 0, 0])  # top-k first, then top-p
