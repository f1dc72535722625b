"""Sampling through the whole engine: rejection sampling draws from exactly the base model's distribution.

On a model with a 6-token vocabulary the joint distribution of the first three generated tokens can be
enumerated; thousands of MEDUSA samples must pass a chi-square goodness-of-fit test against it, and the
same test must fail for deliberately broken verifiers (so it has the power to see a mistake).
"""

import copy

import pytest
import torch
from conftest import FAMILIES, needs_compiler, needs_native
from engine_helpers import OracleHeads, decode, greedy_reference, lively_model, on_compiled_engine, random_heads
from scipy.stats import chisquare

from medusa_decoding import acceptance, device_acceptance
from medusa_decoding.acceptance import sample, target_probs
from medusa_decoding.compiled import Compiled
from medusa_decoding.config import DEFAULT_TREE, GenerationConfig
from medusa_decoding.corpus import CorpusIndex
from medusa_decoding.decoding import PLAIN
from medusa_decoding.guard import Guard, Ladder
from medusa_decoding.kernels import compile_error, set_guess_vocab, use_kernels
from medusa_decoding.tree import Tree

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 6
PROMPT = torch.tensor([1, 4, 2, 5, 3])
MEASURED = 3  # tokens whose joint distribution is tested
SAMPLES = 1500
MIN_EXPECTED = 5  # cells expected fewer times are pooled, as the chi-square approximation needs
WIDE = [3, 2, 2]  # three siblings at depth 1: rejected candidates are common, and so are accepted paths
PASS_P, FAIL_P = 1e-3, 1e-6


def flawed_rejection(accept_scale: float = 1.0, remove_rejected: bool = True):
    """The rejection rule written out again with one mistake, to prove the test can see it."""

    def rule(tokens, logits, tree, config, generator=None):
        probs = target_probs(logits, config)
        node, path, p = 0, [0], probs[0].clone()
        while True:
            for child in tree.children[node]:
                x = int(tokens[child])
                if float(torch.rand((), generator=generator)) < accept_scale * p[x]:
                    node, p = child, probs[child].clone()
                    path.append(child)
                    break
                if remove_rejected:
                    p[x] = 0
                    p = p / p.sum()
            else:
                return torch.tensor(path), sample(p, generator)

    return rule


def filtered_probs(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Temperature-1 probabilities after top-k, then top-p (smallest set reaching top_p), in float64."""
    sorted_probs, order = logits.double().softmax(-1).sort(-1, descending=True)
    if top_k:
        sorted_probs[..., top_k:] = 0
        sorted_probs = sorted_probs / sorted_probs.sum(-1, keepdim=True)
    before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the tokens ranked above
    sorted_probs = sorted_probs.masked_fill(before >= top_p, 0)
    sorted_probs = sorted_probs / sorted_probs.sum(-1, keepdim=True)
    return torch.zeros_like(sorted_probs).scatter(-1, order, sorted_probs)


def exact_joint(model, **filters) -> torch.Tensor:
    """[V, V, V]: the base model's probability of each first three tokens, by enumeration."""
    pairs = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))  # [V^2, 2]: (x1, x2)
    with torch.no_grad():
        logits = model(torch.cat([PROMPT.expand(len(pairs), -1), pairs], 1)).logits  # [V^2, T+2, V]
    t = len(PROMPT)
    first = filtered_probs(logits[0, t - 1], **filters)  # [V]
    second = filtered_probs(logits[:, t], **filters).reshape(VOCAB, VOCAB, VOCAB)[:, 0]  # [x1, x2]
    third = filtered_probs(logits[:, t + 1], **filters).reshape(VOCAB, VOCAB, VOCAB)  # [x1, x2, x3]
    return first[:, None, None] * second[:, :, None] * third


def goodness_of_fit(counts: torch.Tensor, joint: torch.Tensor) -> float:
    """Chi-square p-value of counts against joint; a draw of an impossible outcome gives 0."""
    counts, expected = counts.flatten().double(), joint.flatten() * counts.sum()
    if counts[expected == 0].sum() > 0:
        return 0.0
    small = (expected > 0) & (expected < MIN_EXPECTED)
    large = expected >= MIN_EXPECTED
    observed = torch.cat([counts[large], counts[small].sum()[None]])
    expected = torch.cat([expected[large], expected[small].sum()[None]])
    if not small.any():
        observed, expected = observed[:-1], expected[:-1]
    expected = expected * observed.sum() / expected.sum()  # chisquare wants equal totals to ~1e-8
    return float(chisquare(observed.numpy(), expected.numpy()).pvalue)


@pytest.fixture(scope="module")
def small_model():
    model = lively_model("llama", vocab_size=VOCAB)
    return model, random_heads(model)


def draw(model, heads, config: GenerationConfig, tree, samples: int = SAMPLES, compiled: bool = False,
         corpus: CorpusIndex | None = None) -> torch.Tensor:
    """Counts [V, V, V] of the first three tokens over `samples` full decode runs (one seeded generator)."""
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(VOCAB, VOCAB, VOCAB, dtype=torch.long)
    for _ in range(samples):
        steps = decode(model, heads, PROMPT, config, tree, generator=generator, compiled=compiled, corpus=corpus)
        tokens = [t for step, _ in steps for t in step]
        counts[tuple(tokens[:MEASURED])] += 1
    return counts


@pytest.mark.parametrize("verifier, filters", [
    ("engine", {}),
    ("engine", {"top_k": 4, "top_p": 0.8}),
    ("engine, trees picked by the sampled tokens", {}),  # what the guard of --tree auto may do: any tree, any step
    ("engine, hydra heads", {}),  # candidates that depend on the path before them
    ("engine, confident trees", {}),  # which candidates: the heads' likeliest, a different tree every step
    pytest.param("engine, compiled", {}, marks=needs_compiler),  # the whole step on the device: its rule in the graph
    pytest.param("engine, compiled", {"top_k": 4, "top_p": 0.8}, marks=needs_compiler),  # and the device's filters
    pytest.param("engine, confident trees, compiled", {}, marks=needs_compiler),  # the device's likeliest nodes
    ("engine, lookup drafts alone", {}),  # candidates copied from the text (lookup.py), on plain steps
    ("engine, corpus drafts alone", {}),  # candidates from an index of other text (corpus.py), on plain steps
    # candidates from a guess vocabulary of one token and the row's own (the prompt's, then the answer's)
    pytest.param("engine, own tokens", {}, marks=needs_native),
    ("keeps-rejected", {}),  # forgets to remove a rejected candidate from the residual distribution
    ("doubles-acceptance", {}),  # accepts with min(1, 2 p) instead of p
    # the device's draws in [0, 0.5): accepts with min(1, 2 p), samples low tokens
    pytest.param("halves-draws, compiled", {}, marks=needs_compiler),
])
def test_rejection_sampling_keeps_the_distribution(small_model, monkeypatch, verifier, filters):
    flawed = {"keeps-rejected": flawed_rejection(remove_rejected=False), "doubles-acceptance": flawed_rejection(2.0)}
    if verifier in flawed:
        monkeypatch.setitem(acceptance.RULES, "rejection", flawed[verifier])
    if verifier.startswith("halves-draws"):
        draws = device_acceptance.uniforms
        monkeypatch.setattr(device_acceptance, "uniforms", lambda *args: draws(*args) / 2)
    model, heads = small_model
    heads = random_heads(model, kind="hydra") if verifier.endswith("hydra heads") else heads
    if verifier.endswith("compiled"):
        model = compiled_copy(model, monkeypatch)
    if verifier.endswith("own tokens"):
        model = use_kernels(copy.deepcopy(model), "native")  # the kernels that give the heads a guess vocabulary
        set_guess_vocab(model, torch.tensor([0]))
    config = GenerationConfig(max_new_tokens=MEASURED + 1, temperature=1.0, acceptance="rejection", **filters)
    tree = Tree.from_spec(WIDE)
    if "confident trees" in verifier:
        tree = Ladder.fixed(tree, confident=True)
    corpus = None
    if verifier.endswith("corpus drafts alone"):  # an index of text that repeats: confident, often wrong chains
        corpus = CorpusIndex.build([([1, 4, 2, 5, 3, 0, 1, 2] * 8, [True] * 64)], min_seen=1)
    if verifier.endswith("drafts alone"):  # every verifier but these has the lookup drafts beside the heads
        tree = PLAIN
        sizes = [size for seed in range(20) for _, size in decode(model, heads, PROMPT, config, tree, corpus=corpus,
                                                                  generator=torch.Generator().manual_seed(seed))]
        assert sum(sizes) >= 10  # the drafts' nodes were verified
    if verifier.endswith("sampled tokens"):
        trees = (PLAIN, Tree.from_spec([[0]]), Tree.from_spec([[0], [1]]), tree)  # each holding the ones before
        tree = Ladder(trees, (1.0,) * 4, (1,), ((1.0,) * 4,))
        monkeypatch.setattr(Guard, "choose", lambda guard, context, batch=1, pooled=None: (
            trees[guard.generated[-1] % len(trees)], guard.watched))
    counts = draw(model, heads, config, tree, compiled=verifier.endswith("compiled"), corpus=corpus)
    p_value = goodness_of_fit(counts, exact_joint(model, **filters))
    if verifier.startswith("engine"):
        assert p_value > PASS_P
    else:
        assert p_value < FAIL_P


def compiled_copy(model, monkeypatch):
    """The model on the compiled engine, whose every step (fixed trees) must then run whole on the device."""
    if compile_error("cpu") is not None:
        pytest.skip(f"torch.compile: {compile_error('cpu')}")
    monkeypatch.setattr(Compiled, "verify", None)  # the host's step: not taken
    return on_compiled_engine(copy.deepcopy(model))


def test_filters_change_the_distribution(small_model):
    """Otherwise the top-k/top-p case above would test nothing the plain case does not."""
    model, _ = small_model
    assert (exact_joint(model, top_k=4, top_p=0.8) == 0).sum() > (exact_joint(model) == 0).sum()


@pytest.mark.parametrize("rule", ["typical", "rejection"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_sampling_rules_at_temperature_zero_are_greedy(family, rule):
    model = lively_model(family, seed=FAMILIES.index(family))
    prompt = torch.tensor([3, 14, 15, 92, 65])
    reference = greedy_reference(model, prompt, 40)
    heads = OracleHeads(model, torch.cat([prompt, torch.tensor(reference)]))
    config = GenerationConfig(max_new_tokens=40, temperature=0, acceptance=rule)
    steps = [new for new, _ in decode(model, heads, prompt, config, Tree.from_spec(DEFAULT_TREE),
                                      generator=torch.Generator())]
    assert [t for step in steps for t in step] == reference
    assert len(steps) < 30  # paths were accepted, not just one token per step


def sampled(model, heads, tree, seed: int = 0, compiled: bool = False, **fields) -> list[list[int]]:
    config = GenerationConfig(temperature=1.0, **fields)
    generator = torch.Generator().manual_seed(seed)
    return [new for new, _ in decode(model, heads, PROMPT, config, tree, generator=generator, compiled=compiled)]


@pytest.fixture(params=["eager", pytest.param("compiled", marks=needs_compiler)])
def engine_model(request, small_model, monkeypatch):
    """(model, heads, sampled()'s keywords): small_model on either engine (compiled: every step whole on the
    device)."""
    model, heads = small_model
    compiled = request.param == "compiled"
    return compiled_copy(model, monkeypatch) if compiled else model, heads, {"compiled": compiled}


@pytest.mark.parametrize("rule", ["typical", "rejection"])
def test_sampling_respects_the_budget_and_the_seed(engine_model, rule):
    model, heads, engine = engine_model
    tree = Tree.from_spec(WIDE)
    for budget in (1, 2, 5, 17):
        for seed in range(3):
            steps = sampled(model, heads, tree, seed, max_new_tokens=budget, acceptance=rule, **engine)
            assert sum(map(len, steps)) == budget
            assert steps == sampled(model, heads, tree, seed, max_new_tokens=budget, acceptance=rule, **engine)


def test_typical_with_unreachable_thresholds_is_plain_sampling(engine_model):
    """p(x) > min(epsilon, delta * exp(-H)) never holds when epsilon > 1 and delta * exp(-H) > 1: nothing is
    accepted, and each step draws its one token from p as plain sampling does, from the same random stream."""
    model, heads, engine = engine_model
    tree = Tree.from_spec(WIDE)
    typical = sampled(model, heads, tree, max_new_tokens=40, acceptance="typical", typical_epsilon=2.0,
                      typical_delta=1e9, **engine)
    plain = sampled(model, heads, tree, max_new_tokens=40, medusa=False, **engine)
    assert typical == plain and all(len(step) == 1 for step in typical)


def test_typical_with_zero_thresholds_accepts_every_path_to_the_full_depth(engine_model):
    model, heads, engine = engine_model
    steps = sampled(model, heads, Tree.from_spec(WIDE), max_new_tokens=33, acceptance="typical", typical_epsilon=0.0,
                    **engine)
    assert [len(step) for step in steps] == [1] + [len(WIDE) + 1] * 8
