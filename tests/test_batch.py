"""Batched decoding: every row of a batch gets the tokens it gets decoded alone, whatever shares its steps.

Rows of different prompt lengths (the shorter ones' cache has a hole their mask hides), different budgets (a row
that finishes leaves, the last row taking its cache slot), EOS, rows joining mid-flight, trees of different sizes
in one pass (padding nodes). On stock kernels a row's logits may round differently in a batch, so outputs are
compared with decisive greedy references (engine_helpers.assert_decisive); on native kernels a row's logits are
bitwise its own, which seeded sampling shows: the same random draws give the same tokens.
"""

import pytest
import torch
from conftest import FAMILIES, needs_native
from engine_helpers import decode, greedy_reference, lively_model, random_heads
from test_kernels import gguf_model

from medusa_decoding import heads_draft
from medusa_decoding.config import DEFAULT_TREE, GenerationConfig
from medusa_decoding.decoding import PLAIN, Batch
from medusa_decoding.kernels import set_guess_vocab, use_kernels
from medusa_decoding.tree import Tree

PROMPTS = [torch.randint(1, 96, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 17, 30, 11)]
BUDGETS = [40, 12, 40, 25]  # the second row leaves early: the last row moves into its cache slot
JOIN_AT = [0, 0, 3, 7]  # the step before which each row joins
TREES = [Tree.from_spec(DEFAULT_TREE), PLAIN, Tree.from_spec([3, 2]), Tree.from_spec(DEFAULT_TREE)]
pytestmark = pytest.mark.usefixtures("one_thread")


def alone(model, heads, prompt, config, tree, eos_ids=frozenset(), generator=None) -> list[int]:
    return [t for new, _ in decode(model, heads, prompt, config, tree, eos_ids, generator) for t in new]


def batched(model, heads, configs, eos_ids=frozenset(), seeds=None) -> list[list[int]]:
    """Every row of PROMPTS through one Batch, each joining at its JOIN_AT step."""
    batch, outs, owner, step = Batch(model, heads), [[] for _ in PROMPTS], {}, 0
    while step <= max(JOIN_AT) or batch.rows:
        for i in (i for i, at in enumerate(JOIN_AT) if at == step):
            generator = None if seeds is None else torch.Generator().manual_seed(seeds[i])
            row = batch.join(PROMPTS[i], configs[i], TREES[i], eos_ids, generator)
            owner[id(row)], outs[i] = i, [row.root]
        if batch.rows:
            for row, new, _ in batch.step():
                outs[owner[id(row)]] += new
        step += 1
    return outs


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_row_of_a_batch_is_its_greedy_decoding_alone(family, kind):
    """Rows join and leave at their own steps; hydra heads read each row's own path."""
    model = lively_model(family, seed=FAMILIES.index(family))
    heads = random_heads(model) if kind == "medusa" else random_heads(model, kind="hydra")
    configs = [GenerationConfig(max_new_tokens=n) for n in BUDGETS]
    outs = batched(model, heads, configs)
    for i, (prompt, config) in enumerate(zip(PROMPTS, configs)):
        assert outs[i] == greedy_reference(model, prompt, config.max_new_tokens), f"row {i}"
        assert outs[i] == alone(model, heads, prompt, config, TREES[i])


def test_a_row_that_meets_eos_leaves_and_the_others_run_on():
    model = lively_model("llama")
    heads = random_heads(model)
    configs = [GenerationConfig(max_new_tokens=n) for n in BUDGETS]
    eos = greedy_reference(model, PROMPTS[0], 40)[9]  # row 0's tenth token ends it (and any other row that meets it)
    outs = batched(model, heads, configs, frozenset({eos}))
    assert outs[0][-1] == eos and len(outs[0]) <= 10
    for i, (prompt, config) in enumerate(zip(PROMPTS, configs)):
        assert outs[i] == alone(model, heads, prompt, config, TREES[i], frozenset({eos})), f"row {i}"


@needs_native
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_on_native_kernels_a_seeded_sampled_row_draws_what_it_draws_alone(family):
    """Bitwise logits per row: rejection sampling over the same trees, from the same seed, takes the same tokens."""
    model = use_kernels(gguf_model(family), "native")
    heads = random_heads(model)
    configs = [GenerationConfig(max_new_tokens=n, temperature=0.9, seed=i) for i, n in enumerate(BUDGETS)]
    outs = batched(model, heads, configs, seeds=range(len(PROMPTS)))
    for i, (prompt, config) in enumerate(zip(PROMPTS, configs)):
        generator = torch.Generator().manual_seed(i)
        assert outs[i] == alone(model, heads, prompt, config, TREES[i], generator=generator), f"row {i}"
    assert len({tuple(out) for out in outs}) == len(outs)


def test_smollm_generates_a_list_of_prompts_as_each_alone(smollm):
    """The public API: a list of prompts -> one output per prompt, at most max_batch decoded together (the third
    joins when one of the first two is done), stop strings per row; and the same through stream."""
    prompts = ["Name three colours.", "What is the capital of France?", "Write a haiku about rain."]
    config = GenerationConfig(max_new_tokens=40, stop=("Paris",))
    outs = smollm.generate(prompts, config=config, max_batch=2)
    for prompt, out in zip(prompts, outs):
        expected = smollm.generate(prompt, config=config)
        assert out.token_ids == expected.token_ids and out.text == expected.text, prompt
    assert "Paris" not in outs[1].text and len(outs[1].token_ids) < 40  # the stop string ended it
    assert all(0 < out.first_token_seconds < out.seconds and out.tokens_per_s > 0 for out in outs)
    pieces = ["", "", ""]
    for index, piece in smollm.stream(prompts, config=config):
        pieces[index] += piece
    assert pieces == [out.text for out in outs]
    messages = [[{"role": "user", "content": p}] for p in prompts]
    assert [o.token_ids for o in smollm.generate(messages=messages, config=config)] == [o.token_ids for o in outs]


def test_a_list_of_prompts_with_a_streamer_or_a_bad_batch_size_is_refused(smollm):
    with pytest.raises(ValueError, match="streamer"):
        smollm.generate(["a", "b"], streamer=object())
    with pytest.raises(ValueError, match="max_batch"):
        smollm.generate(["a", "b"], max_batch=0)


FREQUENT = torch.arange(8)  # a guess vocabulary far smaller than the tokens the rows use: their own tokens matter


@needs_native
@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_rows_guess_their_own_tokens_beside_the_guess_vocabulary_and_stay_lossless(kind, monkeypatch):
    """Each row guesses from the guess vocabulary and its own tokens (its prompt's, then its answer's as they come):
    other per row, growing as it decodes. Every row is still its greedy decoding, in a batch and alone, and every
    candidate lies in its row's vocabulary of the moment, its own tokens among them."""
    model = use_kernels(lively_model("llama"), "native")
    set_guess_vocab(model, FREQUENT)
    heads = random_heads(model, kind=kind)
    proposed = []  # (the candidates, the row's vocabulary then)
    real = heads_draft.guess

    def watching(*args, own=None, **kwargs):
        tokens, guesses = real(*args, own=own, **kwargs)
        proposed.append((tokens[1:].tolist(), set(own.columns.tolist())))
        return tokens, guesses

    monkeypatch.setattr(heads_draft, "guess", watching)
    configs = [GenerationConfig(max_new_tokens=n, lookup=0) for n in BUDGETS]
    outs = batched(model, heads, configs)
    for i, (prompt, config) in enumerate(zip(PROMPTS, configs)):
        assert outs[i] == greedy_reference(model, prompt, config.max_new_tokens), f"row {i}"
        assert outs[i] == alone(model, heads, prompt, config, TREES[i])
    assert all(set(tokens) <= vocabulary for tokens, vocabulary in proposed)
    assert sum(token not in FREQUENT for tokens, _ in proposed for token in tokens) > len(proposed)
    assert len({len(vocabulary) for _, vocabulary in proposed}) > 4  # the vocabularies differ and grow
