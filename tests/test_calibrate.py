"""Calibration: tree search and expected acceptance against brute force; measurements on tiny models; the CLI."""

import itertools
import math

import pytest
import torch

from medusa_decoding.calibrate import choose_tree, expected_acceptance, grow_tree

# K=2 heads, S=3 ranks; path probabilities worked out by hand (no ties):
# (0) .6  (0,0) .3  (1) .25  (0,1) .18  (1,0) .125  (2) .1  (0,2) .09  (1,1) .075  (2,0) .05  (1,2) .0375  (2,1) .03  (2,2) .015
HAND = torch.tensor([[0.6, 0.25, 0.1], [0.5, 0.3, 0.15]], dtype=torch.float64)
HAND_ORDER = [(0,), (0, 0), (1,), (0, 1), (1, 0), (2,), (0, 2), (1, 1), (2, 0), (1, 2), (2, 1), (2, 2)]
HAND_EXPECTED = [0.6, 0.9, 1.15, 1.33, 1.455, 1.555, 1.645, 1.72, 1.77, 1.8075, 1.8375, 1.8525]


def all_nodes(heads: int, ranks: int) -> list[tuple[int, ...]]:
    return [p for d in range(1, heads + 1) for p in itertools.product(range(ranks), repeat=d)]


def prefix_closed_trees(heads: int, ranks: int, size: int):
    for paths in itertools.combinations(all_nodes(heads, ranks), size):
        known = set(paths)
        if all(len(p) == 1 or p[:-1] in known for p in paths):
            yield paths


def enumerated_acceptance(paths, accuracy: torch.Tensor) -> float:
    """The expectation over every outcome "head k's correct token is at rank c_k (or in none)" of the
    candidates accepted on the tree: follow the correct ranks from the root while the tree has them."""
    heads, ranks = accuracy.shape
    tree, total = set(paths), 0.0
    for outcome in itertools.product(range(ranks + 1), repeat=heads):  # rank `ranks`: no rank is correct
        probability = math.prod(
            float(accuracy[k, c]) if c < ranks else 1 - float(accuracy[k].sum()) for k, c in enumerate(outcome)
        )
        accepted = 0
        while accepted < heads and outcome[: accepted + 1] in tree:
            accepted += 1
        total += probability * accepted
    return total


def random_table(heads: int, ranks: int, seed: int) -> torch.Tensor:
    """Per head, random probabilities over its ranks and "none": rows sum below 1, ranks in no order."""
    generator = torch.Generator().manual_seed(seed)
    weights = torch.rand(heads, ranks + 1, generator=generator, dtype=torch.float64)
    return (weights / weights.sum(-1, keepdim=True))[:, :ranks]


def test_greedy_reproduces_the_hand_computed_order_and_sums():
    paths, expected = grow_tree(HAND, 12)
    assert paths == HAND_ORDER
    assert expected == pytest.approx(HAND_EXPECTED, abs=1e-12)


@pytest.mark.parametrize("table", [HAND, random_table(2, 3, 1), random_table(3, 2, 2)], ids=["hand", "2x3", "3x2"])
def test_greedy_tree_of_every_size_is_the_brute_force_optimum(table):
    heads, ranks = table.shape
    paths, expected = grow_tree(table, len(all_nodes(heads, ranks)))
    for size in range(1, len(paths) + 1):
        best = max(expected_acceptance(tree, table) for tree in prefix_closed_trees(heads, ranks, size))
        assert expected[size - 1] == pytest.approx(best, abs=1e-12), size
        assert expected_acceptance(paths[:size], table) == pytest.approx(best, abs=1e-12)


def test_greedy_trees_are_prefix_closed_even_when_a_lower_rank_is_likelier():
    table = torch.tensor([[0.1, 0.7], [0.05, 0.9]], dtype=torch.float64)  # rank 1 beats rank 0
    paths, _ = grow_tree(table, 6)
    assert paths[:3] == [(1,), (1, 1), (0,)]
    for size in range(1, 7):
        assert all(len(p) == 1 or p[:-1] in paths[:size] for p in paths[:size])


def test_the_search_stops_when_every_node_is_in():
    paths, expected = grow_tree(HAND, 100)
    assert len(paths) == len(expected) == 12


@pytest.mark.parametrize("seed", range(4))
def test_expected_acceptance_equals_the_enumerated_expectation(seed):
    table = random_table(3, 3, seed)
    trees = [all_nodes(3, 3), grow_tree(table, 7)[0], [(0,), (1,), (0, 0), (0, 0, 0), (1, 2), (1, 2, 1)], [(2,)]]
    for tree in trees:
        assert expected_acceptance(tree, table) == pytest.approx(enumerated_acceptance(tree, table), abs=1e-12)


def test_expected_acceptance_of_the_hand_table_by_hand():
    assert expected_acceptance([(0,), (1,), (0, 0)], HAND) == pytest.approx(0.6 + 0.25 + 0.3)
    assert expected_acceptance([], HAND) == 0


@pytest.mark.parametrize("table, nodes, field", [
    (HAND, 0, "num_nodes"), (torch.tensor([0.5, 0.2]), 3, "accuracy"), (torch.tensor([[1.5, 0.2]]), 3, "accuracy"),
])
def test_bad_input_is_a_value_error_naming_the_field(table, nodes, field):
    with pytest.raises(ValueError, match=field):
        grow_tree(table, nodes)


def test_choose_tree_picks_the_argmax_of_predicted_tokens_per_second():
    latencies = [1.0, 1.1, 1.2, 1.3, 1.4, 2.0, 2.5, 3.0]  # sizes 0..7
    choice = choose_tree(HAND, latencies)
    predicted = [(1 + e) / s for e, s in zip([0.0] + HAND_EXPECTED[:7], latencies)]
    assert choice.tokens_per_s == pytest.approx(predicted)
    assert choice.size == max(range(1, 8), key=predicted.__getitem__) == 4
    assert choice.tree_paths == HAND_ORDER[:4]
    flat = choose_tree(HAND, [1.0] * 8)  # equal step times: the largest tree wins
    assert flat.size == 7


def test_choose_tree_rejects_missing_or_bad_latencies():
    with pytest.raises(ValueError, match="latencies"):
        choose_tree(HAND, [1.0])
    with pytest.raises(ValueError, match="latencies"):
        choose_tree(HAND, [1.0, 0.0])
    with pytest.raises(ValueError, match="latencies"):
        choose_tree(HAND, [1.0] * 14)  # 13 sizes, only 12 nodes exist
