"""Calibration: tree search and expected acceptance against brute force; measurements on tiny models; the CLI."""

import itertools
import json
import math
from collections import Counter
from dataclasses import replace

import pytest
import torch
from conftest import EXACT_KERNELS, tiny_tokenizer
from engine_helpers import ORACLE_RANK0, ORACLE_RANK1, OracleHeads, greedy_reference, lively_model, random_heads

from medusa_decoding import MedusaModel, calibrate, decoding, heads_draft
from medusa_decoding.calibrate import (
    answer_positions,
    choose_tree,
    expected_acceptance,
    grow_tree,
    measure_accuracy,
    measure_batch_latency,
    measure_step_latency,
    measure_yields,
    tried_sizes,
)
from medusa_decoding.cli import main
from medusa_decoding.config import CalibrateConfig
from medusa_decoding.conversation import chat_ids
from medusa_decoding.guard import Ladder
from medusa_decoding.heads_draft import guess, guess_confident
from medusa_decoding.kernels import guess_projection
from medusa_decoding.training.data import IGNORE_INDEX, assistant_labels
from medusa_decoding.tree import Tree, build

# K=2 heads, S=3 ranks; path probabilities worked out by hand (no ties):
# (0) .6  (0,0) .3  (1) .25  (0,1) .18  (1,0) .125  (2) .1  (0,2) .09  (1,1) .075
# (2,0) .05  (1,2) .0375  (2,1) .03  (2,2) .015
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


def test_choose_tree_picks_the_argmax_of_predicted_tokens_per_second_at_the_middle_context():
    latencies = [1.0, 1.1, 1.2, 1.3, 1.4, 2.0, 2.5, 3.0]
    short = [1.0] * 8  # at a short context every size costs alike: the largest would win there
    choice = choose_tree(HAND, list(range(8)), [64, 512, 2048], [short, latencies, [2 * t for t in latencies]])
    predicted = [(1 + e) / s for e, s in zip([0.0] + HAND_EXPECTED[:7], latencies)]
    assert choice.tokens_per_s == pytest.approx(predicted)
    assert choice.size == max(range(1, 8), key=predicted.__getitem__) == 4
    assert choice.tree_paths == HAND_ORDER[:4]
    assert choice.contexts == [64, 512, 2048] and choice.latency_s[0] == short
    flat = choose_tree(HAND, list(range(8)), [256], [[1.0] * 8])  # equal step times: the largest tree wins
    assert flat.size == 7


def test_choose_tree_over_sparse_sizes_predicts_each_measured_size():
    sizes, latencies = [0, 1, 3, 7], [1.0, 1.1, 1.25, 3.0]
    choice = choose_tree(HAND, sizes, [256], [latencies])
    assert choice.expected_tokens == pytest.approx([1.0] + [1 + HAND_EXPECTED[n - 1] for n in sizes[1:]])
    assert choice.size == 3 and choice.tree_paths == HAND_ORDER[:3]
    ladder = choice.ladder()  # what the guard chooses from: the chosen tree and the smaller ones, as measured
    assert [t.num_nodes - 1 for t in ladder.trees] == [0, 1, 3] and ladder.tree is ladder.trees[-1]
    assert set(ladder.tree.paths) == set(HAND_ORDER[:3])
    assert list(ladder.expected_tokens) == choice.expected_tokens[:3] and ladder.latency(256) == latencies[:3]


def test_confident_trees_get_their_own_fastest_size_and_ladder_from_their_simulated_tokens():
    sizes, latencies = [0, 1, 3, 7], [1.0, 1.1, 1.25, 3.0]
    confident_tokens = [1.0, 1.5, 2.0, 5.0]  # per size; at 7 candidates 5 / 3.0 beats 2.0 / 1.25
    choice = replace(choose_tree(HAND, sizes, [256], [latencies], confident_tokens), batch_sizes=[1, 4],
                     batch_latency_s=[[1.0, 1.1, 1.25, 3.0], [2.0, 2.5, 3.0, 9.0]])  # the trees up to 7: both ladders'
    assert choice.size == 3 and choice.confident_size == 7
    confident, static = choice.ladder(confident=True), choice.ladder()
    assert confident.confident and not static.confident
    assert list(confident.expected_tokens) == confident_tokens and confident.latency(256) == latencies
    assert [t.num_nodes - 1 for t in confident.trees] == sizes and confident.latency(256, 4) == [2.0, 2.5, 3.0, 9.0]
    assert [t.num_nodes - 1 for t in static.trees] == [0, 1, 3] and static.latency(256, 4) == [2.0, 2.5, 3.0]
    unsimulated = choose_tree(HAND, sizes, [256], [latencies]).ladder(confident=True)  # auto's ladder, as it was
    assert not unsimulated.confident and unsimulated.expected_tokens == choice.ladder().expected_tokens


def test_tried_sizes_are_dense_for_small_trees_and_end_at_the_largest():
    assert tried_sizes(5) == [0, 1, 2, 3, 4, 5]
    assert tried_sizes(50) == [0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 50]


@pytest.mark.parametrize("sizes, contexts, latencies", [
    ([0], [1], [[1.0]]), ([0, 1], [1], [[1.0, 0.0]]), (list(range(14)), [1], [[1.0] * 14]),  # 13 candidates, 12 nodes
    ([1, 2], [1], [[1.0, 1.0]]), ([0, 2, 1], [1], [[1.0] * 3]), ([0, 1], [1], [[1.0]]),
    ([0, 1], [1, 2], [[1.0, 1.0]]), ([0, 1], [], []),  # a row per context
])
def test_choose_tree_rejects_missing_or_bad_latencies(sizes, contexts, latencies):
    with pytest.raises(ValueError, match="latencies"):
        choose_tree(HAND, sizes, contexts, latencies)


# --- measurements on tiny models ---

SPECIAL_TOKENS = 7  # the tiny tokenizer's ids below 7: padding, unknown, chat markers, roles
EVERY_POSITION = CalibrateConfig(simulated_positions=10 ** 6)  # more than there are: every position is simulated
ORACLE_CHAT = [
    {"role": "user", "content": " ".join(f"w{i}" for i in range(3, 12))},
    {"role": "assistant", "content": " ".join(f"w{(7 * i) % 80}" for i in range(40))},
]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def oracle(tokenizer, one_thread):
    """A MedusaModel whose heads know ORACLE_CHAT's tokens, and those tokens' answer labels."""
    ids, labels = assistant_labels(tokenizer, ORACLE_CHAT)
    model = lively_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    heads = OracleHeads(model, torch.tensor(ids))
    return MedusaModel(model, tokenizer, heads), torch.tensor(labels)


def test_measured_accuracy_is_the_oracles_planted_luck(oracle):
    medusa, labels = oracle
    table = measure_accuracy(medusa, [ORACLE_CHAT], CalibrateConfig(top_k=4))
    luck = medusa.heads.luck  # [S, K]: below ORACLE_RANK0 the true token is rank 0, below ORACLE_RANK1 rank 1
    expected = torch.zeros(4, 4, dtype=torch.float64)
    for k in range(4):
        targets = torch.cat([labels[k + 2:] != IGNORE_INDEX, torch.zeros(k + 2, dtype=torch.bool)])
        chance = luck[targets, k]
        expected[k, 0] = (chance < ORACLE_RANK0).double().mean()
        expected[k, 1] = ((chance >= ORACLE_RANK0) & (chance < ORACLE_RANK1)).double().mean()
    assert torch.allclose(table, expected)
    assert table[:, 0].mean() > 0.5 and table[:, 2:].sum() == 0


def test_hydra_accuracy_is_given_the_true_path(oracle):
    """Hydra oracles know the answer only after its true tokens: teacher-forced, calibration feeds them exactly those,
    so their table is the MEDUSA oracle's (a path shifted by one token would give noise: all zeros)."""
    medusa, _ = oracle
    hydra = OracleHeads(medusa.model, medusa.heads.sequence, kind="hydra")
    table = measure_accuracy(MedusaModel(medusa.model, medusa.tokenizer, hydra), [ORACLE_CHAT],
                             CalibrateConfig(top_k=4))
    assert torch.equal(table, measure_accuracy(medusa, [ORACLE_CHAT], CalibrateConfig(top_k=4)))
    assert table[:, 0].mean() > 0.5


def test_accuracy_is_the_same_when_the_heads_see_the_positions_in_small_chunks(oracle, monkeypatch):
    medusa, _ = oracle
    whole = measure_accuracy(medusa, [ORACLE_CHAT])
    monkeypatch.setattr(calibrate.accuracy, "HEADS_CHUNK", 3)
    assert torch.equal(measure_accuracy(medusa, [ORACLE_CHAT]), whole)


def test_accuracy_stops_after_max_positions(oracle):
    medusa, _ = oracle
    other = [{"role": "user", "content": "w3"}, {"role": "assistant", "content": "w9 w10 w11 w12 w13"}]
    capped = CalibrateConfig(max_positions=1, batch_size=1)
    alone = measure_accuracy(medusa, [other])
    assert torch.equal(measure_accuracy(medusa, [other, ORACLE_CHAT], capped), alone)  # stopped after the first
    assert not torch.equal(measure_accuracy(medusa, [other, ORACLE_CHAT], CalibrateConfig(batch_size=1)), alone)


def accepted(tree: Tree, tokens: torch.Tensor, truth: list[int]) -> int:
    """The depth of the deepest node of `tree` whose candidates (tokens [N+1], the root first) are truth's first."""
    return max((len(path) for i, path in enumerate(tree.paths, 1)
                if tokens[tree.chains[i, 1: len(path) + 1]].tolist() == truth[: len(path)]), default=0)


def test_calibration_reads_the_feature_layers_that_the_heads_read(oracle):
    """Heads with feature_layers are calibrated on what decoding gives them (heads.run_backbone): the last hidden
    state, then layer 1's output over its RMS."""
    medusa, _ = oracle
    size = medusa.model.config.hidden_size
    fused = MedusaModel(medusa.model, medusa.tokenizer, random_heads(medusa.model, kind="hydra", feature_layers=(1,)))
    with torch.inference_mode():
        (plain, *_), = answer_positions(medusa, [ORACLE_CHAT])
        (state, targets, embeds, _), = answer_positions(fused, [ORACLE_CHAT])
    assert state.shape == (len(plain), 2 * size) and torch.equal(state[:, :size], plain)
    layer = state[:, size:]
    torch.testing.assert_close(layer.pow(2).mean(-1), torch.ones(len(layer)), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(layer, torch.nn.functional.rms_norm(plain, (size,)), atol=1e-2)  # not the last layer
    assert measure_accuracy(fused, [ORACLE_CHAT], CalibrateConfig(top_k=2)).shape == (4, 2)


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_simulated_yields_are_what_each_trees_candidates_match_of_the_answer(oracle, kind):
    """measure_yields counts with the guard's bookkeeping (first_sizes, yields over the largest tree's guesses); here
    every size's static and confident tree is proposed on its own and its candidates matched against the answer."""
    medusa, _ = oracle
    medusa = MedusaModel(medusa.model, medusa.tokenizer, OracleHeads(medusa.model, medusa.heads.sequence, kind=kind))
    paths, _ = grow_tree(measure_accuracy(medusa, [ORACLE_CHAT], CalibrateConfig(top_k=4)), 12)
    sizes = [0, 1, 2, 5, 12]
    static, confident = measure_yields(medusa, [ORACLE_CHAT], paths, sizes, EVERY_POSITION)
    heads, lm_head, embed = medusa.heads, guess_projection(medusa.model), medusa.model.get_input_embeddings()
    counts, seen = torch.zeros(2, len(sizes)), 0
    with torch.inference_mode():
        for hidden, targets, _, roots in answer_positions(medusa, [ORACLE_CHAT]):
            for h, truth, root in zip(hidden, targets.T.tolist(), roots.tolist()):
                truth = truth[: truth.index(IGNORE_INDEX)] if IGNORE_INDEX in truth else truth
                for i, n in enumerate(sizes):
                    tree = build(tuple(paths[:n]))
                    counts[0, i] += 1 + accepted(tree, guess(heads, lm_head, embed, h, root, tree, tree)[0], truth)
                    if n:
                        tree, tokens, _ = guess_confident(heads, lm_head, embed, h, root, n, sizes[-1])
                    counts[1, i] += 1 + accepted(tree, tokens, truth) if n else 1
                seen += 1
    assert static == pytest.approx((counts[0] / seen).tolist())
    assert confident == pytest.approx((counts[1] / seen).tolist())
    assert static[0] == confident[0] == 1 and static[-1] > 2 and confident[-1] > 2  # long paths were counted


def test_simulation_stops_after_simulated_positions(oracle):
    medusa, _ = oracle
    paths, _ = grow_tree(HAND, 4)
    one = measure_yields(medusa, [ORACLE_CHAT], paths, [0, 4], CalibrateConfig(simulated_positions=1))
    assert one[0][1] in (1, 2, 3) and one != measure_yields(medusa, [ORACLE_CHAT], paths, [0, 4])


def test_step_latency_is_one_positive_time_per_tree(oracle, monkeypatch):
    medusa, _ = oracle
    paths, _ = grow_tree(HAND, 6)
    trees = [build(())] + [build(tuple(paths[:n])) for n in (1, 3, 6)]
    contexts, latencies = measure_step_latency(medusa, trees, CalibrateConfig(latency_contexts=(32, 2000, 8),
                                                                              latency_repeats=3))
    # increasing, cut to the context that the largest tree (7 nodes, depth 2) and two steps after it leave
    assert contexts == [8, 32, 1024 - (7 + 2 * (2 + 1) + 2)]
    assert len(latencies) == 3 and all(len(row) == 4 and min(row) > 0 for row in latencies)
    chosen = []  # confident trees' steps are timed as they decode: choosing their nodes included
    monkeypatch.setattr(heads_draft, "guess_confident", lambda *args: chosen.append(args[-2]) or guess_confident(*args))
    measure_step_latency(medusa, trees[1:], CalibrateConfig(latency_contexts=(32,), latency_repeats=1), confident=True)
    assert sorted(set(chosen)) == [1, 3, 6]


def test_step_latency_times_each_tree_alone_whatever_the_text_repeats(oracle, monkeypatch):
    """The timed row goes back to its prefix after every step, so its text repeats: lookup drafts, which copy what
    followed before, would graft chains onto the tree and time wider steps than the tree's (a 'plain' step over 9
    tokens). Every step timed verifies its tree's nodes and no more, on a row that stays."""
    medusa, _ = oracle
    paths, _ = grow_tree(HAND, 6)
    trees = [build(())] + [build(tuple(paths[:n])) for n in (1, 3)]
    widths, pack = [], decoding.Batch.pack
    monkeypatch.setattr(decoding.Batch, "pack", lambda self, rows, plans: widths.append(
        [plan.tree.num_nodes for plan in plans]) or pack(self, rows, plans))
    for measure in (measure_step_latency, measure_batch_latency):
        widths.clear()
        measure(medusa, trees, CalibrateConfig(latency_contexts=(32,), latency_repeats=6, batch_sizes=(1,)))
        assert widths == [[tree.num_nodes] for _ in range(7) for tree in trees], measure.__name__


@pytest.mark.parametrize("vocab_data", [False, True], ids=["vocab from the data", "vocab from --vocab-data"])
def test_cli_writes_a_loadable_tree_the_table_and_plots(tokenizer, tmp_path, one_thread, capsys, vocab_data):
    model = lively_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    random_heads(model, num_heads=2).save_pretrained(tmp_path / "heads")
    records = [json.dumps({"id": str(i), "conversations": [
        {"from": "human", "value": ORACLE_CHAT[0]["content"]},
        {"from": "gpt", "value": " ".join(f"w{(i + 5 * j) % 80}" for j in range(30))}]}) + "\n" for i in range(3)]
    data = [tmp_path / "distilled.jsonl", tmp_path / "more.jsonl"]  # several files, read in order
    data[0].write_text("".join(records[:2]))
    data[1].write_text(records[2])
    main(["calibrate", "--data", *map(str, data), "--heads", str(tmp_path / "heads"), "--model", str(tmp_path / "base"),
          "--max-nodes", "5", "--output", str(tmp_path / "out"), "--guess-vocab", "20", "--kernels", EXACT_KERNELS,
          *(["--vocab-data", str(data[1])] if vocab_data else [])])  # the vocabulary of one answer's tokens alone
    record = json.loads((tmp_path / "out" / "accuracy.json").read_text())
    counted = records[2:] if vocab_data else records
    chats = [[ORACLE_CHAT[0], {"role": "assistant", "content": json.loads(r)["conversations"][1]["value"]}]
             for r in counted]
    answers = Counter(t for chat in chats for t in assistant_labels(tokenizer, chat)[1] if t != IGNORE_INDEX)
    assert record["guess_vocab"] == sorted(range(len(tokenizer)), key=lambda t: (-answers[t], t))[:20]  # most used
    assert len(record["accuracy"]) == 2 and len(record["tokens_per_s"]) == 6
    # the longest context leaves room for the largest tree (6 nodes, depth 1) and two steps after it
    assert record["contexts"] == [128, 512, 1024 - (6 + 2 * (1 + 1) + 2)]
    assert [len(row) for row in record["latency_s"]] == [6] * 3
    assert record["sizes"] == [0, 1, 2, 3, 4, 5]
    for simulated in (record["simulated_tokens"], record["confident_tokens"]):  # random heads: rarely right
        assert len(simulated) == 6 and simulated[0] == 1 and all(1 <= n < 2 for n in simulated)
    threads = torch.get_num_threads()  # 1 (one_thread), or MEDUSA_TEST_THREADS
    assert record["setup"].endswith(f", {threads} thread{'s' * (threads > 1)}, float32, {EXACT_KERNELS} kernels")
    assert 1 <= record["size"] <= 5 and record["size"] == max(range(1, 6), key=record["tokens_per_s"].__getitem__)
    tree = Tree.from_spec(json.loads((tmp_path / "out" / "tree.json").read_text()))
    assert tree.num_nodes == record["size"] + 1
    for name in ("accuracy.png", "tree.png", "tokens_per_s.png", "yields.png"):
        assert (tmp_path / "out" / name).stat().st_size > 1000
    assert "<- chosen" in capsys.readouterr().out
    (tmp_path / "out" / "model.safetensors").symlink_to(tmp_path / "heads" / "model.safetensors")
    (tmp_path / "out" / "config.json").symlink_to(tmp_path / "heads" / "config.json")
    loaded = MedusaModel.from_pretrained(tmp_path / "base", tmp_path / "out", kernels=EXACT_KERNELS)
    assert loaded.tree is tree
    if loaded.kernels == "native":  # the vocabulary lives in the LM head's int8 copy; stock kernels guess from all
        assert guess_projection(loaded.model).rows.tolist() == record["guess_vocab"]


@pytest.fixture
def base_and_heads(tokenizer, tmp_path, monkeypatch, one_thread):
    """A saved tiny model and two-head directory whose accuracy.json was calibrated elsewhere."""
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    model = lively_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    random_heads(model, num_heads=2).save_pretrained(tmp_path / "heads")
    record = {"accuracy": HAND.tolist(), "setup": "another machine"}
    (tmp_path / "heads" / "accuracy.json").write_text(json.dumps(record))
    (tmp_path / "heads" / "tree.json").write_text("[[0], [1], [2]]")  # that machine's choice
    return tmp_path / "base", tmp_path / "heads"


def test_auto_tree_is_fitted_to_this_device_once_then_cached(base_and_heads, monkeypatch, capsys):
    base, heads = base_and_heads  # kernels given: auto's choice is timed and cached apart (test_kernels)
    tree = MedusaModel.from_pretrained(base, heads, kernels=EXACT_KERNELS).tree
    assert "fitting the tree" in capsys.readouterr().err
    sizes = tried_sizes(len(HAND_ORDER))
    assert tree.num_nodes - 1 in sizes and set(tree.paths) == set(HAND_ORDER[: tree.num_nodes - 1])
    (cached,) = (base.parent / "cache" / "trees").iterdir()
    assert json.loads(cached.read_text())["sizes"] == sizes

    record = json.loads(cached.read_text())
    plain = record["latency_s"][0][0]  # the check of a cached fit times the plain step: here, as the fit did

    def measure_again(medusa, trees, config):
        if len(trees) > 1:
            raise AssertionError("the cached fit must be used")
        return list(config.latency_contexts), [[plain]]

    monkeypatch.setattr(calibrate.latency, "measure_step_latency", measure_again)  # a refit's timing
    monkeypatch.setattr(calibrate.persistence, "measure_step_latency", measure_again)  # the check of a cached fit
    auto = MedusaModel.from_pretrained(base, heads, kernels=EXACT_KERNELS).trees
    assert auto.tree is tree and not auto.confident
    for factor, refit in ((0.3, False), (3.0, True)):  # a fit faster than now stands; one 3x slower was timed loaded
        cached.write_text(json.dumps(record | {"latency_s": [[s * factor for s in row]
                                                             for row in record["latency_s"]]}))
        if refit:
            with pytest.raises(AssertionError, match="the cached fit must be used"):
                MedusaModel.from_pretrained(base, heads, kernels=EXACT_KERNELS)
        else:
            kept = MedusaModel.from_pretrained(base, heads, kernels=EXACT_KERNELS).trees
            assert kept.latency_s[0][0] < record["latency_s"][0][0]
    cached.write_text(json.dumps(record))
    # the same sizes, each step's likeliest
    confident = MedusaModel.from_pretrained(base, heads, kernels=EXACT_KERNELS, tree="confident").trees
    assert confident.confident and confident.trees == auto.trees
    fixed = MedusaModel.from_pretrained(base, heads, kernels=EXACT_KERNELS, tree="confident:5").trees
    assert fixed.confident and [t.num_nodes for t in fixed.trees] == [6]
    for bad in ("confident:0", "confident:x", "auto:3", "likeliest"):
        with pytest.raises(ValueError, match="tree: expected 'auto', 'confident' or 'confident:N'"):
            MedusaModel.from_pretrained(base, heads, kernels=EXACT_KERNELS, tree=bad)
    given = MedusaModel.from_pretrained(base, heads, kernels=EXACT_KERNELS, tree=None).tree
    assert given == Tree.from_spec([[0], [1], [2]])
    # latencies timed on other code: refit
    monkeypatch.setattr(calibrate.persistence, "code_digest", lambda: "other kernels")
    with pytest.raises(AssertionError, match="the cached fit must be used"):
        MedusaModel.from_pretrained(base, heads, kernels=EXACT_KERNELS)
    fixed = MedusaModel.from_pretrained(base, heads, kernels=EXACT_KERNELS, tree="confident:5").trees  # nothing timed
    assert fixed.confident and [t.num_nodes for t in fixed.trees] == [6]


def test_a_forced_instruction_set_is_a_setup_of_its_own(oracle, monkeypatch):
    """The AVX2 build forced on an AVX-512 machine stands for an AVX2 machine: a fit timed on the native build (the
    calibration's, or a cached one) is not its fit."""
    medusa, _ = oracle
    monkeypatch.setattr(calibrate.latency, "cpu_variants", lambda: ["avx512", "avx2", "baseline"])
    monkeypatch.setattr(calibrate.latency, "variant", lambda: "avx512")
    native = calibrate.setup(medusa)
    monkeypatch.setattr(calibrate.latency, "variant", lambda: "avx2")
    assert calibrate.setup(medusa) == native + ", avx2 build" and "build" not in native


def test_confident_trees_refitted_here_keep_their_simulated_tokens_where_the_sizes_match(base_and_heads, monkeypatch):
    base, heads = base_and_heads
    # every load below reads the first one's fit: a tiny model's millisecond steps can look "timed under load" to the
    # next load, whose refit then follows other timings (a CI run failed so)
    monkeypatch.setattr(calibrate.persistence, "timed_under_load", lambda *args: False)
    sizes = tried_sizes(len(HAND_ORDER))  # what a fit here measures
    simulated = [1 + 0.2 * n for n in sizes]
    record = {"accuracy": HAND.tolist(), "setup": "another machine", "sizes": sizes, "contexts": [512],
              "latency_s": [[1.0] * len(sizes)], "size": 1, "confident_tokens": simulated}
    (heads / "accuracy.json").write_text(json.dumps(record))
    confident, auto = (MedusaModel.from_pretrained(base, heads, tree=tree).trees for tree in ("confident", "auto"))
    assert confident.confident and list(confident.expected_tokens) == simulated[: len(confident.trees)]
    assert not auto.confident and list(auto.expected_tokens) != simulated[: len(auto.trees)]
    between, beyond = (sizes[-2] + sizes[-1]) / 2, sizes[-1] + 1  # N candidates each step: the simulation's yield
    for n, tokens in ((sizes[2], simulated[2]), (int(between), 1 + 0.2 * int(between)),
                      (beyond, 1 + grow_tree(HAND, beyond)[1][-1])):  # past the simulation: the static tree's, a floor
        fixed = MedusaModel.from_pretrained(base, heads, tree=f"confident:{n}").trees
        assert fixed.confident and fixed.expected_tokens == pytest.approx((tokens,))
    record.update(sizes=sizes[:-1], latency_s=[[1.0] * (len(sizes) - 1)], confident_tokens=simulated[:-1])
    (heads / "accuracy.json").write_text(json.dumps(record))  # simulated over other sizes: auto's ladder, confident
    confident, auto = (MedusaModel.from_pretrained(base, heads, tree=tree).trees for tree in ("confident", "auto"))
    assert confident.confident and confident.expected_tokens == auto.expected_tokens


def test_confident_n_without_a_latency_fit_takes_the_static_floor(base_and_heads):
    """Simulated yields with no sizes to read them by (a record without its latency fit): the static tree's."""
    base, heads = base_and_heads
    (heads / "accuracy.json").write_text(json.dumps({"accuracy": HAND.tolist(), "confident_tokens": [1.0, 1.5]}))
    fixed = MedusaModel.from_pretrained(base, heads, tree="confident:3").trees
    assert fixed.expected_tokens == pytest.approx((1 + grow_tree(HAND, 3)[1][-1],))


def test_auto_tree_rejects_a_corrupt_accuracy_table(base_and_heads):
    base, heads = base_and_heads
    (heads / "accuracy.json").write_text('{"accuracy": [[0.5, "x"]]}')
    with pytest.raises(ValueError, match="not a valid accuracy table"):
        MedusaModel.from_pretrained(base, heads)


def test_cli_names_a_missing_data_file_before_loading_a_model(tmp_path, capsys):
    present = tmp_path / "present.jsonl"
    present.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"},
                                                     {"from": "gpt", "value": "hello"}]}))
    with pytest.raises(SystemExit):
        main(["calibrate", "--data", str(present), str(tmp_path / "missing.jsonl"),
              "--heads", str(tmp_path / "no-heads")])
    assert "missing.jsonl" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--max-nodes", "0"), ("--max-positions", "-1"), ("--limit", "0"),
                                         ("--guess-vocab", "5")])  # fewer tokens than the 10 ranks measured
def test_cli_rejects_bad_sizes_before_loading_a_model(tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit):
        main(["calibrate", "--data", str(tmp_path / "none.jsonl"), "--heads", str(tmp_path), flag, value])
    assert flag.lstrip("-").replace("-", "_") in capsys.readouterr().err


@pytest.fixture(scope="module")
def own_answer(tokenizer, one_thread):
    """Oracle heads over a model's own greedy answer to ORACLE_CHAT's question: (MedusaModel, the question as
    messages, the answer's tokens, the whole chat)."""
    model = lively_model("llama", vocab_size=len(tokenizer))
    with torch.no_grad():
        model.lm_head.weight[: SPECIAL_TOKENS] = 0  # the answer must survive detokenize -> retokenize
    user = [ORACLE_CHAT[0]]
    prompt = torch.tensor(chat_ids(tokenizer, user, generation_prompt=True))
    answer = greedy_reference(model, prompt, 240)
    assert min(answer) >= SPECIAL_TOKENS
    medusa = MedusaModel(model, tokenizer, OracleHeads(model, torch.tensor(prompt.tolist() + answer)))
    return medusa, user, answer, [user + [{"role": "assistant", "content": tokenizer.decode(answer)}]]


def test_predicted_tokens_per_step_match_decoding_with_oracle_heads(own_answer):
    """The independence model's 1 + expected acceptance, from the measured table, is what the engine
    achieves: oracle heads over the model's own greedy answer, decoded with the greedy trees."""
    medusa, user, answer, chat = own_answer
    table = measure_accuracy(medusa, chat)
    for size in (1, 10, 30):
        paths, expected = grow_tree(table, size)
        medusa.tree = Tree.from_spec(paths)
        out = medusa.generate(messages=user, max_new_tokens=len(answer) - 10)
        assert out.token_ids == answer[: len(out.token_ids)]
        measured = (len(out.token_ids) - 1) / (out.steps - 1)  # per verification step; the prefill yields 1
        assert measured == pytest.approx(1 + expected[-1], rel=0.1), size


def test_simulated_tokens_per_step_match_decoding_with_oracle_heads(own_answer):
    """measure_yields' tokens per step, static and confident trees, are what the engine achieves: oracle heads over
    the model's own greedy answer, decoded with each tree (confident: each step's likeliest nodes)."""
    medusa, user, answer, chat = own_answer
    paths, _ = grow_tree(measure_accuracy(medusa, chat), 30)
    sizes = [0, 1, 10, 30]
    static, confident = measure_yields(medusa, chat, paths, sizes, EVERY_POSITION)
    for i, size in enumerate(sizes[1:], 1):
        for trees, simulated in ((Tree.from_spec(paths[:size]), static),
                                 (Ladder.fixed(Tree.from_spec([size]), confident=True), confident)):
            medusa.trees = trees if isinstance(trees, Ladder) else Ladder.fixed(trees)
            out = medusa.generate(messages=user, max_new_tokens=len(answer) - 10)
            assert out.token_ids == answer[: len(out.token_ids)]
            measured = (len(out.token_ids) - 1) / (out.steps - 1)  # per verification step; the prefill yields 1
            assert measured == pytest.approx(simulated[i], rel=0.1), (size, trees)
