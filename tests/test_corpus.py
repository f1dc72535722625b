"""Corpus drafts (corpus.py): the index against a brute-force count, its file, the chains it offers, and greedy
decoding with them, which stays plain decoding's."""

import random
from collections import Counter

import pytest
import torch
from conftest import FAMILIES
from engine_helpers import decode, greedy_reference, lively_model, random_heads

from medusa_decoding.config import GenerationConfig
from medusa_decoding.corpus import CORPUS_NAME, ORDER, SHARES, CorpusDraft, CorpusIndex
from medusa_decoding.decoding import PLAIN
from medusa_decoding.proposers import SoFar, StepStart
from medusa_decoding.tree import Tree


def brute_force(sequences, context: list[int], min_seen: int) -> tuple[int, float] | None:
    """What the index should say of `context`: for its longest suffix (up to ORDER tokens) seen at least min_seen
    times before a counted token with a share worth offering, the most frequent continuation (the smallest id among
    ties) and its share, one unseen continuation added."""
    for n in range(min(ORDER, len(context)), 0, -1):
        suffix = tuple(context[-n:])
        following = Counter(ids[i + n] for ids, counted in sequences for i in range(len(ids) - n)
                            if counted[i + n] and tuple(ids[i : i + n]) == suffix)
        seen = sum(following.values())
        if seen:
            token, count = min(following.items(), key=lambda item: (-item[1], item[0]))
            if seen >= min_seen and count / (seen + 1) >= SHARES[1]:
                return token, count / (seen + 1)
    return None


@pytest.mark.parametrize("min_seen", [1, 3])
def test_the_index_is_the_most_frequent_continuation_of_the_longest_context(min_seen):
    rng = random.Random(min_seen)
    sequences = []
    for _ in range(30):
        ids = [rng.randrange(5) for _ in range(rng.randrange(2, 25))]
        sequences.append((ids, [rng.random() < 0.7 for _ in ids]))  # a prompt's tokens are context, never counted
    index = CorpusIndex.build(sequences, min_seen)
    for _ in range(300):
        context = [rng.randrange(6) for _ in range(rng.randrange(1, 7))]  # 5: never in the corpus
        want, got = brute_force(sequences, context, min_seen), index.next(context)
        assert (got is None) == (want is None), context
        if want is not None:
            assert got[0] == want[0] and got[1] == pytest.approx(want[1], abs=1e-3), context


def test_a_sequence_with_an_id_too_wide_for_a_key_is_left_out():
    index = CorpusIndex.build([([1, 2, 3] * 4, [True] * 12), ([1, 2, 70000, 9] * 4, [True] * 16)], min_seen=1)
    assert index.next([1, 2]) == (3, pytest.approx(4 / 5, abs=1e-3))  # 3 followed "1 2" 4 times of 4
    assert index.next([70000]) is None
    with pytest.raises(ValueError, match="no answer tokens"):
        CorpusIndex.build([([1, 2, 3], [False] * 3)])


def test_the_index_file_round_trips_and_a_corrupt_one_is_a_clear_error(tmp_path):
    index = CorpusIndex.build([([4, 5, 6, 4, 5, 7, 4, 5, 6], [True] * 9)], min_seen=1)
    assert CorpusIndex.load(tmp_path) is None  # heads without an index
    index.save(tmp_path)
    loaded = CorpusIndex.load(tmp_path)
    assert [loaded.next(c) for c in ([4, 5], [9, 4], [6])] == [index.next(c) for c in ([4, 5], [9, 4], [6])]
    (tmp_path / CORPUS_NAME).write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="corrupt"):
        CorpusIndex.load(tmp_path)


def offered(draft: CorpusDraft, budget: int, cost) -> list[int]:
    step = SoFar(1.0, cost, PLAIN, torch.tensor([0]))
    return list(draft.propose(StepStart(0, torch.zeros(1), 0, budget, 1, None), step).tokens)


def test_a_chain_follows_the_index_as_far_as_it_pays_and_misses_shorten_the_next():
    index = CorpusIndex.build([([1, 2, 3, 4, 5, 6, 7, 8] * 4, [True] * 32)], min_seen=1)
    cheap, dear = (lambda n: 1 + 0.01 * n), (lambda n: 1 + 10 * n)
    draft = CorpusDraft(index, [9, 1, 2], max_length=5)
    assert offered(draft, 8, cheap) == [3, 4, 5, 6, 7]  # each followed its context 4 times of 4: 0.8, cheap
    assert offered(draft, 2, cheap) == [3, 4]  # never past the budget
    assert offered(draft, 8, dear) == []
    for _ in range(20):
        chain = offered(draft, 8, cheap)
        draft.record(list(range(1, len(chain) + 1)), [0], [9], None)  # none of it accepted; the text went on with 9
        draft.context = [9, 1, 2]  # the same place again
    assert draft.rates.right[3] < 0.1 and len(offered(draft, 8, cheap)) < 3  # the bin of shares 0.7-0.9 missed
    draft.record([1, 2], [0, 1, 2], [3, 4, 5], None)  # both right: the context moves past the accepted tokens
    assert draft.context == [1, 2, 3, 4, 5][-ORDER:]


@pytest.mark.parametrize("heads", ["medusa", "hydra", "none"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_decoding_with_corpus_drafts_is_plain_decoding(family, heads):
    """The index holds the model's own greedy text for one prompt and random text: its chains are right there and
    wrong elsewhere; either way every token is plain greedy decoding's."""
    model = lively_model(family, seed=FAMILIES.index(family))
    heads = None if heads == "none" else random_heads(model, kind=heads)
    tree = PLAIN if heads is None else Tree.from_spec([2, 1])
    known, other = torch.tensor([5, 9, 12, 30, 7]), torch.tensor([3, 8, 21, 2])
    answer = greedy_reference(model, known, 40)
    rng = random.Random(0)
    noise = [[rng.randrange(40) for _ in range(30)] for _ in range(20)]
    index = CorpusIndex.build([(known.tolist() + answer, [False] * 5 + [True] * 40)]
                              + [(ids, [True] * 30) for ids in noise], min_seen=1)
    config = GenerationConfig(max_new_tokens=40, lookup=0, corpus=6)
    for prompt in (known, other):
        steps = list(decode(model, heads, prompt, config, tree, corpus=index))
        assert [t for new, _ in steps for t in new] == greedy_reference(model, prompt, 40)
        if prompt is known:
            assert len(steps) < 20  # the chains were accepted, several tokens a step
