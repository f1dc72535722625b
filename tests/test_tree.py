"""Tree construction: node order, masks, index tensors, errors, truncation and CLI parsing."""

import json

import pytest
import torch

from medusa_decoding.config import DEFAULT_TREE
from medusa_decoding.tree import PAD, Tree, parse_tree, spec_size

# A small tree written out by hand: nodes 1..6 are (0,) (1,) (0,0) (0,1) (1,0) (0,0,0).
HAND_PATHS = [[1], [0, 0], [0], [0, 1], [1, 0], [0, 0, 0]]  # deliberately out of order
HAND_ATTENTION = [
    [1, 0, 0, 0, 0, 0, 0],
    [1, 1, 0, 0, 0, 0, 0],
    [1, 0, 1, 0, 0, 0, 0],
    [1, 1, 0, 1, 0, 0, 0],
    [1, 1, 0, 0, 1, 0, 0],
    [1, 0, 1, 0, 0, 1, 0],
    [1, 1, 0, 1, 0, 0, 1],
]

SPECS = [
    HAND_PATHS,
    DEFAULT_TREE,
    [1, 1, 1, 1],
    [3, 2, 2],
    [[0], [3], [0, 0], [3, 1], [0, 0, 2], [0, 0, 2, 0]],  # sparse, with gaps in the ranks
]


def test_hand_checked_example():
    tree = Tree.from_spec(HAND_PATHS)
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert tree.num_nodes == 7 and tree.depth == 3 and tree.topk_per_head() == 2
    assert tree.attention.tolist() == [[bool(x) for x in row] for row in HAND_ATTENTION]
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert tree.parents.tolist() == [PAD, 0, 0, 1, 1, 2, 3]
    assert tree.heads.tolist() == [0, 0, 1, 1, 1, 2]
    assert tree.ranks.tolist() == [0, 1, 0, 1, 0, 0]
    assert tree.children == ((1, 2), (3, 4), (5,), (6,), (), (), ())
    assert tree.leaf_paths.tolist() == [[0, 1, 4, -1], [0, 2, 5, -1], [0, 1, 3, 6]]
    assert PAD == -1


def test_cartesian_equals_its_path_list():
    cartesian = Tree.from_spec([2, 3])
    paths = Tree.from_spec([[0], [1], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]])
    assert cartesian.paths == paths.paths
    for name in ("attention", "depths", "parents", "heads", "ranks", "leaf_paths"):
        assert torch.equal(getattr(cartesian, name), getattr(paths, name)), name
    assert cartesian.num_nodes == 1 + 2 + 6 and cartesian.topk_per_head() == 3


@pytest.mark.parametrize("spec", SPECS, ids=["hand", "default", "chain", "3x2x2", "sparse"])
def test_index_tensors_follow_from_the_paths(spec):
    """Every tensor checked against its definition, computed here from the paths alone."""
    tree = Tree.from_spec(spec)
    paths = [()] + list(tree.paths)
    n = len(paths)
    assert sorted(tree.paths, key=lambda p: (len(p), p)) == list(tree.paths)  # by depth, then rank
    if isinstance(spec[0], (list, tuple)):
        assert set(tree.paths) == {tuple(p) for p in spec}
    for i in range(n):
        for j in range(n):
            assert bool(tree.attention[i, j]) == (paths[i][: len(paths[j])] == paths[j]), (i, j)
    assert tree.depths.tolist() == [len(p) for p in paths]
    assert tree.heads.tolist() == [len(p) - 1 for p in paths[1:]]
    assert tree.ranks.tolist() == [p[-1] for p in paths[1:]]
    for i in range(1, n):
        assert paths[int(tree.parents[i])] == paths[i][:-1]
    for i in range(n):
        kids = [j for j in range(1, n) if paths[j][:-1] == paths[i]]
        assert list(tree.children[i]) == sorted(kids, key=lambda j: paths[j][-1])
    leaves = [i for i in range(n) if not tree.children[i]]
    assert tree.leaf_paths.shape == (len(leaves), tree.depth + 1)
    for row, leaf in zip(tree.leaf_paths.tolist(), leaves):
        nodes = [i for i in row if i != PAD]
        assert row == nodes + [PAD] * (len(row) - len(nodes))  # padding only at the end
        assert nodes[0] == 0 and nodes[-1] == leaf
        assert [paths[i] for i in nodes] == [paths[leaf][:d] for d in range(len(paths[leaf]) + 1)]


def test_cartesian_sizes_give_the_product():
    tree = Tree.from_spec([3, 2, 2])
    assert tree.num_nodes == 1 + 3 + 6 + 12 and tree.depth == 3
    assert len(tree.leaf_paths) == 12 and (tree.leaf_paths != PAD).all()


@pytest.mark.parametrize("spec", [[3, 2, 2], [1], [[0], [1], [0, 0], [0, 0, 0]], [[0]], []])
def test_spec_size_counts_what_the_tree_holds_without_building_it(spec):
    tree = Tree.from_spec(spec)
    assert spec_size(spec) == (tree.num_nodes - 1, tree.depth)


def test_spec_size_of_a_huge_cartesian_tree_is_counted_not_built():
    assert spec_size([5000, 5000]) == (5000 + 5000**2, 2)


def test_empty_spec_is_the_plain_tree():
    tree = Tree.from_spec([])
    assert tree.num_nodes == 1 and tree.depth == 0 and tree.leaf_paths.tolist() == [[0]]
    assert tree.attention.tolist() == [[True]]


@pytest.mark.parametrize(
    "spec, message",
    [
        ([[0, 0]], r"not prefix-closed: \[0, 0\] has no parent \[0\]"),
        ([[0], [1, 2]], r"not prefix-closed: \[1, 2\] has no parent \[1\]"),
        ([[0], [-1]], r"negative rank in path \[-1\]"),
        ([[0], [0, -2]], r"negative rank in path \[0, -2\]"),
        ([[0], [0.5]], r"integer ranks, got \[0.5\]"),
        ([[0], ["1"]], r"integer ranks, got \['1'\]"),
        ([[True]], r"integer ranks, got \[True\]"),
        ([[0], []], r"non-empty list of integer ranks, got \[\]"),
        ([[0], [1], [0]], "duplicate paths"),
        ("[[0], [1]]", "expected a list of paths or a list of sizes"),
        ({"paths": [[0]]}, "expected a list of paths or a list of sizes"),
        (None, "expected a list of paths or a list of sizes"),
        ([[0], 1], "expected a list of paths or a list of sizes"),
        ([2, [0]], "expected a list of paths or a list of sizes"),
        ([[0], [[1]]], r"integer ranks, got \[\[1\]\]"),
        ([2.5, 2], "expected a list of paths or a list of sizes"),
        ([2, 0], r"Cartesian sizes must be positive, got \[2, 0\]"),
        ([3, -1], r"Cartesian sizes must be positive, got \[3, -1\]"),
    ],
)
def test_bad_specs_are_rejected_with_the_reason(spec, message):
    with pytest.raises(ValueError, match=message):
        Tree.from_spec(spec)


def test_check_heads():
    tree = Tree.from_spec([[0], [0, 0], [0, 0, 0]])
    tree.check_heads(3)
    tree.check_heads(5)
    with pytest.raises(ValueError, match="depth 3 needs 3 heads, but only 2 exist"):
        tree.check_heads(2)
    Tree.from_spec([]).check_heads(0)
    Tree.from_spec([[0], [7]]).check_heads(1, vocab_size=8)
    with pytest.raises(ValueError, match="rank 8 needs a top-9, but the vocabulary has 8 tokens"):
        Tree.from_spec([[0], [8]]).check_heads(1, vocab_size=8)


def test_truncated():
    tree = Tree.from_spec(DEFAULT_TREE)
    assert tree.truncated(tree.depth) is tree and tree.truncated(99) is tree
    for depth in range(tree.depth):
        short = tree.truncated(depth)
        assert short.depth == depth
        assert short.paths == tuple(p for p in tree.paths if len(p) <= depth)
        # the kept nodes keep their indices (nodes are ordered by depth), so masks agree on them
        assert torch.equal(short.attention, tree.attention[: short.num_nodes, : short.num_nodes])
    assert tree.truncated(0).num_nodes == 1


@pytest.mark.parametrize("text, paths", [
    ("[[0], [1], [0, 0]]", ((0,), (1,), (0, 0))),
    ("[2, 1]", ((0,), (1,), (0, 0), (1, 0))),
    ("[]", ()),
])
def test_parse_tree_inline(text, paths):
    assert parse_tree(text).paths == paths


def test_parse_tree_file(tmp_path):
    file = tmp_path / "tree.json"
    file.write_text(json.dumps([list(p) for p in DEFAULT_TREE]))
    assert parse_tree(str(file)).paths == Tree.from_spec(DEFAULT_TREE).paths
    file.write_text("[[0], [0, 0, 0]]")
    with pytest.raises(ValueError, match="not prefix-closed"):
        parse_tree(str(file))


def test_parse_tree_long_inline_json():
    """A big tree typed inline is longer than any file name may be: still inline JSON, not an OSError."""
    paths = [list(p) for p in Tree.from_spec([4, 4, 3]).paths]
    text = json.dumps(paths)
    assert len(text) > 300
    assert parse_tree(text).paths == Tree.from_spec([4, 4, 3]).paths


@pytest.mark.parametrize("text", ["not json", "missing.json", "[[0], [1]"])
def test_parse_tree_rejects_text_that_is_neither(text, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="neither a JSON file nor inline JSON"):
        parse_tree(text)
