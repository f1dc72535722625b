"""The guard of `--tree auto`: the ladder's latency model; what each tree would have yielded at a step, checked
against real verification; the trees it picks from what a request shows (plain steps where the heads are wrong,
large trees where they are right, the faster tree where one runs slow); output that stays exactly greedy."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from conftest import FAMILIES
from engine_helpers import OracleHeads, decode, greedy_reference, lively_model, random_heads

from medusa_decoding import decoding, heads_draft
from medusa_decoding import guard as guard_module
from medusa_decoding.config import GenerationConfig
from medusa_decoding.decoding import PLAIN
from medusa_decoding.guard import (
    EXPLORE_EVERY,
    PROBE_EVERY,
    SWITCH_MARGIN,
    TIME_CLIP,
    Guard,
    Ladder,
    batch_yields,
    yields,
)
from medusa_decoding.tree import build

PROMPT = torch.tensor([17, 3, 88, 41, 5, 60, 29, 72, 11, 94, 38, 50])
NEW_TOKENS = 96
ORDER = [(0,), (1,), (0, 0), (2,), (0, 1), (0, 0, 0), (1, 0), (0, 0, 0, 0)]  # prefix-closed in every prefix
SIZES = (0, 1, 2, 3, 5, 8)

pytestmark = pytest.mark.usefixtures("one_thread")


def make_ladder(expected=None, latency=None, contexts=(100,)) -> Ladder:
    """The best trees of SIZES along ORDER. Defaults: a tree yields 1 + 0.3 a node, costs 1 + 0.05 a node."""
    trees = tuple(build(tuple(ORDER[:n])) for n in SIZES)
    expected = expected or tuple(1 + 0.3 * n for n in SIZES)
    latency = latency or tuple(tuple(1 + 0.05 * n for n in SIZES) for _ in contexts)
    return Ladder(trees, tuple(expected), tuple(contexts), tuple(latency))


def opened(ladder: Ladder) -> Guard:
    """A guard past its request's opening plain steps, which showed nothing: no guesses, not timed."""
    guard = Guard(ladder, root=0)
    for _ in range(guard.opening):
        assert guard.choose(100) == (ladder.trees[0], guard.watched)
        guard.record(None, [1], None, 100)
    return guard


def sizes_used(model, heads, ladder: Ladder, reference: list[int]) -> list[int]:
    """Decodes with the guard; asserts the output is the greedy reference; returns each step's tree size."""
    steps = list(decode(model, heads, PROMPT, GenerationConfig(lookup=0, max_new_tokens=len(reference)), ladder))
    assert [t for new, _ in steps for t in new] == reference
    return [size for _, size in steps[1:]]


@pytest.fixture(autouse=True)
def calibrated_clock(monkeypatch):
    """Decoding's clock reports each step at its tree's calibrated latency: the guard's picks then depend on the
    heads alone, not on this machine's speed or load (the tests that give the guard other times call it directly)."""
    clock = SimpleNamespace(now=0.0, step=0.0)
    choose = Guard.choose

    def timed_choose(guard, context, batch=1, pooled=None):
        picked = choose(guard, context, batch, pooled)
        clock.step = guard.ladder.latency(context)[guard.choice]
        return picked

    def perf_counter() -> float:  # called as a step starts (before choose) and as it ends
        clock.now, clock.step = clock.now + clock.step, 0.0
        return clock.now

    monkeypatch.setattr(Guard, "choose", timed_choose)
    monkeypatch.setattr(decoding, "time", SimpleNamespace(perf_counter=perf_counter))


@pytest.fixture(scope="module")
def llama():
    model = lively_model("llama")
    reference = greedy_reference(model, PROMPT, NEW_TOKENS)
    return model, reference, OracleHeads(model, torch.cat([PROMPT, torch.tensor(reference)]))


def test_latency_is_linear_between_the_measured_contexts_and_flat_beyond():
    ladder = make_ladder(contexts=(100, 300), latency=((1.0,) * 6, tuple(2.0 + n for n in SIZES)))
    assert ladder.latency(50) == ladder.latency(100) == [1.0] * 6
    assert ladder.latency(200) == pytest.approx([1.5 + n / 2 for n in SIZES])
    assert ladder.latency(1000) == [2.0 + n for n in SIZES]
    assert Ladder.fixed(build(ORDER[:3])).trees == (build(ORDER[:3]),)


@pytest.mark.parametrize("change, message", [
    ({"trees": (build(ORDER[:2]), build(((0,), (2,)))) * 3}, "hold the nodes"),
    ({"expected_tokens": (1.0, 1.3)}, "expected yields"),
    ({"contexts": (300, 100), "latency_s": ((1.0,) * 6,) * 2}, "contexts must increase"),
    ({"contexts": (100, 300)}, "one latency row each"),
    ({"latency_s": ((1.0, 1.0, 0.0, 1.0, 1.0, 1.0),)}, "positive step latency"),
])
def test_a_malformed_ladder_is_refused(change, message):
    good = make_ladder()
    fields = {name: getattr(good, name) for name in ("trees", "expected_tokens", "contexts", "latency_s")}
    with pytest.raises(ValueError, match=message):
        Ladder(**{**fields, **change})


def test_yields_by_hand():
    first = {path: i for i, path in enumerate(ORDER)}  # tree i holds ORDER[: i + 1]
    guesses = [[7, 8, 9], [5, 6, 4], [3, 2, 1], [1, 1, 1]]
    assert yields(guesses, [7, 5, 3, 1], first, 8) == [2, 2, 3, 3, 3, 4, 4, 5]  # (0,), (0,0), (0,0,0), (0,0,0,0)
    assert yields(guesses, [8, 5, 3, 1], first, 8) == [1, 2, 2, 2, 2, 2, 3, 3]  # (1,), then (1,0); (1,0,0) in none
    assert yields(guesses, [9, 6, 0, 0], first, 8) == [1, 1, 1, 2, 2, 2, 2, 2]  # (2,); (2,1) in none
    assert yields(guesses, [0, 5, 3, 1], first, 8) == [1] * 8  # head 0 wrong: nothing, whatever follows
    assert yields(guesses, [7, 5], first, 8) == [2, 2, 3, 3, 3, 3, 3, 3]  # the end of the answer


@pytest.mark.parametrize("kind, confident", [("medusa", False), ("hydra", False), ("medusa", True), ("hydra", True)])
def test_what_each_tree_would_have_yielded_is_what_verifying_it_accepts(llama, monkeypatch, kind, confident):
    """For every step the guard watched, decode again from the prompt up to that step's root with each tree of the
    ladder: the tokens its first verification yields are the ones the guard counted for that tree (hydra heads: from
    the guesses of each node of the ladder's largest tree, path by path)."""
    model, reference, oracle = llama
    oracle = OracleHeads(model, oracle.sequence, kind=kind)
    ladder = replace(make_ladder(), confident=confident)  # confident: each size's likeliest nodes, step by step
    seen = []
    count = Guard.count_tokens

    def watched(guard, start, guesses, first=None):
        seen.append((start, yields(guesses, guard.generated[start:], first or guard.first, len(ladder.trees))))
        count(guard, start, guesses, first)

    monkeypatch.setattr(Guard, "count_tokens", watched)
    sizes_used(model, oracle, ladder, reference)
    assert len(seen) > 20 and any(len(set(ys)) > 2 for _, ys in seen)  # trees that differ in what they yield
    config = GenerationConfig(lookup=0, max_new_tokens=oracle.config.num_heads + 2)  # no tree cut at the budget
    for start, ys in seen[::3]:
        prompt = torch.cat([PROMPT, torch.tensor(reference[: start - 1], dtype=torch.long)])  # root: reference[start-1]
        for tree, expected in zip(ladder.trees, ys):
            (root, _), (step, size), *_ = decode(model, oracle, prompt, config, Ladder.fixed(tree, confident))
            assert root == reference[start - 1:start] and size == tree.num_nodes - 1
            assert len(step) == expected, (start, tree.paths)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("heads", ["random", "oracle", "hydra-random", "hydra-oracle"])
def test_greedy_output_is_exact_whatever_the_guard_picks(family, heads):
    model = lively_model(family, seed=FAMILIES.index(family))
    reference = greedy_reference(model, PROMPT, NEW_TOKENS)
    kind = "hydra" if heads.startswith("hydra") else "medusa"
    draft = (random_heads(model, kind=kind) if heads.endswith("random")
             else OracleHeads(model, torch.cat([PROMPT, torch.tensor(reference)]), kind=kind))
    used = sizes_used(model, draft, make_ladder(), reference)
    assert len(set(used)) > 1  # the guard moved between trees


def test_wrong_heads_send_the_guard_to_plain_steps_that_keep_probing(llama, monkeypatch):
    """Heads that never propose the right token, under a calibration that promised a lot: plain steps soon (every
    tree yields one token then, and costs more), the heads still guessing every PROBE_EVERY-th of them."""
    model, reference, oracle = llama
    wrong = OracleHeads(model, oracle.sequence)
    wrong.luck.fill_(1.0)  # luck past ORACLE_RANK1: the true token is pushed to the bottom of every head's ranking
    guess, choose, guessed, chosen, guards = heads_draft.guess, Guard.choose, [], [], set()
    monkeypatch.setattr(heads_draft, "guess", lambda *args, **kw: (args[-1] is not None and guessed.append(1))
                        or guess(*args, **kw))
    monkeypatch.setattr(Guard, "choose", lambda guard, context, batch=1, pooled=None: guards.add(guard)
                        or chosen.append(choose(guard, context, batch, pooled)) or chosen[-1])
    promised = make_ladder(expected=tuple(1 + 0.5 * n for n in SIZES))  # 1 + 0.5 a node: the largest tree wins
    used = sizes_used(model, wrong, promised, reference)
    late = used[len(used) // 2:]
    assert late.count(0) / len(late) > 0.8
    (guard,) = guards
    assert all(guessing == guard.watched for _, guessing in chosen[:guard.opening])  # the opening: plain, guessing
    probes = [guessing for tree, guessing in chosen[guard.opening:] if tree.num_nodes == 1 and guessing]
    assert len(probes) == guard.plain_steps // PROBE_EVERY - guard.opening // PROBE_EVERY
    assert all(g == guard.watched for g in probes)
    assert all(guessing for tree, guessing in chosen if tree.num_nodes > 1)  # a tree's own, or the whole ladder's
    assert len(guessed) == sum(guessing is not None for _, guessing in chosen)


def test_right_heads_grow_the_tree_a_pessimistic_calibration_started_small(llama):
    model, reference, oracle = llama
    doubtful = make_ladder(expected=(1.0,) * len(SIZES))  # calibrated: the heads never help
    used = sizes_used(model, oracle, doubtful, reference)
    assert used[0] == 0 and sum(used[len(used) // 2:]) / len(used[len(used) // 2:]) >= 3
    assert len(reference) / (len(used) + 1) > 1.5  # tokens per forward pass


def test_trees_that_run_slower_than_calibrated_lose_to_plain_steps_timed_beside_them():
    """Calibrated, the trees win by a little (1 + 0.06 tokens a node at 1 + 0.05 a node); this machine runs them 1.6x
    slower than that, and plain steps as calibrated. Timing the plain steps it takes between trees, the guard turns
    to plain."""
    ladder = make_ladder(expected=tuple(1 + 0.06 * n for n in SIZES))
    guard = opened(ladder)
    picks = []
    for _ in range(400):
        tree, _ = guard.choose(100)
        picks.append(tree.num_nodes - 1)
        seconds = ladder.latency(100)[guard.choice] * (1.0 if tree.num_nodes == 1 else 1.6)
        guard.record(None, [1], seconds, 100)  # no guesses: the yields stay the calibrated ones
    assert picks[0] == 8 and picks[EXPLORE_EVERY - 1] == 0  # the largest tree, then a plain step to time plain
    assert picks[-200:].count(0) > 150  # mostly plain; a tree now and then, as what was seen of it fades
    assert guard.time_factor[0] == pytest.approx(1.0, abs=0.02) and max(f for f in guard.time_factor if f) <= 1.6 + 1e-9


def test_trees_timed_as_calibrated_keep_running():
    ladder = make_ladder()
    guard = opened(ladder)
    for _ in range(200):
        tree, _ = guard.choose(100)
        guard.record(None, [1], ladder.latency(100)[guard.choice] * 1.3, 100)  # a slower machine: all alike
    assert guard.choice == len(SIZES) - 1


def test_one_preempted_step_moves_the_estimate_by_at_most_a_bounded_factor():
    guard = opened(make_ladder())
    guard.choose(100)
    calibrated = guard.ladder.latency(100)[guard.choice]
    guard.record(None, [1], calibrated, 100)  # as calibrated
    guard.record(None, [1], 1000 * calibrated, 100)  # a step the OS preempted, early: a running mean's weight
    assert guard.time_factor[guard.choice] == pytest.approx(1 + (TIME_CLIP - 1) / (guard_module.PRIOR_WEIGHT + 2))
    for _ in range(40):
        guard.record(None, [1], calibrated, 100)
    before = guard.time_factor[guard.choice]
    guard.record(None, [1], 1000 * calibrated, 100)  # later: the smoothed estimate's weight
    assert guard.time_factor[guard.choice] - before == pytest.approx(
        guard_module.SMOOTHING * (TIME_CLIP * before - before))


def test_neither_a_requests_first_step_nor_a_plain_step_that_guesses_is_timed():
    """The first step carries one-off costs, and a guess in a plain step would make plain steps seem dearer."""
    ladder = make_ladder()
    guard = Guard(ladder, root=0)
    top_k, depth = guard.watched.topk_per_head(), guard.watched.depth
    plain = ladder.latency(100)[0]
    assert guard.choose(100) == (ladder.trees[0], guard.watched)
    guard.record(torch.zeros(depth, top_k, dtype=torch.long), [1], 5 * plain, 100)
    assert guard.time_factor == [None] * len(SIZES)
    guard.choose(100)
    guard.record(torch.zeros(depth, top_k, dtype=torch.long), [1], 5 * plain, 100)
    assert guard.time_factor == [None] * len(SIZES)
    guard.choose(100)
    guard.record(None, [1], 1.5 * plain, 100)  # plain alone: timed
    assert guard.time_factor[0] == pytest.approx(1.5)


def test_a_fixed_ladder_always_gives_its_tree_and_watches_nothing():
    tree = build(ORDER[:3])
    guard = Guard(Ladder.fixed(tree), root=0)
    for _ in range(5):
        assert guard.choose(100) == (tree, tree)  # the heads guess what the tree needs
        guard.record(torch.zeros(2, 2, dtype=torch.long), [1, 2], 0.5, 100)
    assert not guard.pending and guard.generated == [0] and Guard(Ladder.fixed(PLAIN), 0).choose(5) == (PLAIN, None)


def test_a_tree_predicted_a_little_faster_is_not_worth_a_switch():
    ladder = make_ladder(expected=(1.0, 1.2, 1.3, 1.4, 1.6, 2.0), latency=((1.0, 1.2, 1.3, 1.4, 1.6, 2.0),))
    guard = opened(ladder)  # every tree predicts the same speed: plain steps stay
    assert all(guard.choose(100)[0] is ladder.trees[0] for _ in range(5))
    guard.tokens[4] = 1.6 * (1 + (SWITCH_MARGIN - 1) / 2)  # faster by half the margin: within the noise
    assert guard.choose(100)[0] is ladder.trees[0]
    guard.tokens[4] = 1.6 * (1 + (SWITCH_MARGIN - 1) * 2)
    assert guard.choose(100)[0] is ladder.trees[4]


def test_a_seeded_sampled_run_repeats_however_long_its_steps_take(llama, monkeypatch):
    """Rejection sampling draws differently over different trees, and the guard's picks follow step times: a run
    with a seed must not, or --seed would not repeat it."""
    model, _, oracle = llama
    config = GenerationConfig(lookup=0, max_new_tokens=64, temperature=1.0, seed=5)

    def sample(clock_seed: int) -> list[int]:
        jitter = torch.Generator().manual_seed(clock_seed)
        now = iter(torch.rand(10_000, generator=jitter).mul(10).cumsum(0).tolist())  # steps of 0 to 10 s
        monkeypatch.setattr(decoding, "time", SimpleNamespace(perf_counter=lambda: next(now)))
        generator = torch.Generator().manual_seed(config.seed)
        return [t for new, _ in decode(model, oracle, PROMPT, config, make_ladder(), generator=generator) for t in new]

    assert sample(0) == sample(1)


def test_the_ladder_weighs_trees_at_the_batch_size_and_large_batches_go_plain():
    """A batch's step with a tree costs more rows than with plain steps: measured per batch size (calibrate), the
    one-row latency scaled by it, linear between batch sizes, flat beyond."""
    batch_latency = (tuple(1 + 0.05 * n for n in SIZES), tuple(2 + 0.6 * n for n in SIZES))  # batches of 1 and 8
    base = make_ladder()
    ladder = Ladder(base.trees, base.expected_tokens, base.contexts, base.latency_s, (1, 8), batch_latency)
    assert ladder.latency(100, 1) == pytest.approx(base.latency(100))
    assert ladder.latency(100, 8) == pytest.approx(batch_latency[1])
    assert ladder.latency(100, 16) == pytest.approx(batch_latency[1])
    assert ladder.latency(100, 4.5) == pytest.approx([(a + b) / 2 for a, b in zip(*batch_latency)])
    alone, crowded = opened(ladder), opened(ladder)
    assert alone.choose(100, 1)[0] is ladder.tree  # 1 + 0.3 n tokens for 1 + 0.05 n: the largest tree
    assert crowded.choose(100, 8)[0] is ladder.trees[0]  # for 2 + 0.6 n in a batch of 8: plain steps
    with pytest.raises(ValueError, match="batch"):
        Ladder(base.trees, base.expected_tokens, base.contexts, base.latency_s, (1, 8), batch_latency[:1])


def test_a_batch_picks_one_tree_for_its_rows_from_their_mean_yields():
    """A batch's step is padded to its largest tree, so one row's tree costs every row: the rows under one ladder
    weigh the trees by their mean yield and all take the same one, which may be neither row's own pick."""
    batch_latency = (tuple(1 + 0.05 * n for n in SIZES), tuple(2 + 0.6 * n for n in SIZES))  # batches of 1 and 8
    base = make_ladder()
    ladder = Ladder(base.trees, base.expected_tokens, base.contexts, base.latency_s, (1, 8), batch_latency)
    good, bad, fixed = opened(ladder), opened(ladder), Guard(Ladder.fixed(ladder.tree), root=0)
    good.tokens, bad.tokens = [1 + 0.5 * n for n in SIZES], [1.0] * len(SIZES)  # 1 + 0.25 a node between them
    assert batch_yields([good]) == [None] and batch_yields([fixed, good]) == [None, None]  # alone on its ladder
    shared = batch_yields([good, fixed, bad])
    assert shared[0] == shared[2] == pytest.approx([1 + 0.25 * n for n in SIZES]) and shared[1] is None
    assert good.choose(100, 2)[0] is ladder.tree and bad.choose(100, 2)[0] is ladder.trees[0]  # alone
    assert good.choose(100, 2, shared[0])[0] is bad.choose(100, 2, shared[2])[0] is ladder.tree  # together
    assert good.choose(100, 8)[0] is ladder.tree  # (1 + 0.5 n) / (2 + 0.6 n): its own yields pay at 8 rows ...
    assert good.choose(100, 8, shared[0])[0] is bad.choose(100, 8, shared[2])[0] is ladder.trees[0]  # the mean not
