"""THE lossless tests: greedy MEDUSA decoding reproduces `transformers`' own greedy output token for token.

Every family, both attention implementations, random heads (mostly wrong guesses) and oracle heads (mostly
right, so long paths are committed), several trees, EOS inside an accepted path, the token budget's end,
the context limit; then the embedded SmolLM2 through the public API. `cache.commit` is checked here too,
against the cache of the accepted tokens run one by one.
"""

import functools
from dataclasses import dataclass

import pytest
import torch
from conftest import FAMILIES, needs_compiler, needs_native, tiny_model
from engine_helpers import (
    SMOLLM_ARGMAX_MARGIN,
    OracleHeads,
    assert_decisive,
    decode,
    engine_prefill,
    greedy_reference,
    lively_model,
    random_heads,
    verify,
)
from transformers import DynamicCache

from medusa_decoding import MedusaModel, decoding, heads_draft
from medusa_decoding.base import check_context, context_limit
from medusa_decoding.cache import allocate, commit
from medusa_decoding.compiled import Compiled
from medusa_decoding.config import DEFAULT_TREE, GenerationConfig
from medusa_decoding.eager import Eager
from medusa_decoding.engine import Engine
from medusa_decoding.guard import Ladder
from medusa_decoding.kernels import Q8Linear, native_build, reads_blocks, stock_kernels
from medusa_decoding.tree import Tree

ATTENTION = ("sdpa", "eager")
WIDE_SPARSE = [[r] for r in range(8)] + [[0, 0], [0, 3], [2, 0], [7, 0], [0, 0, 0], [0, 0, 1], [0, 3, 0], [0, 0, 0, 0]]
TREES = {"chain": [1, 1, 1, 1], "3x2x2": [3, 2, 2], "default": DEFAULT_TREE, "wide-sparse": WIDE_SPARSE, "plain": []}
NEW_TOKENS = 64
LONG = 320
PROMPT = torch.tensor([17, 3, 88, 41, 5, 60, 29, 72, 11, 94, 38, 50])
MIN_TOKENS_PER_STEP = 2.0  # oracle heads must make MEDUSA accept long paths, or the test proves little
SMOL_PROMPT = "Explain what a hash table is in two sentences."

pytestmark = pytest.mark.usefixtures("one_thread")


@dataclass(frozen=True)
class Case:
    model: torch.nn.Module
    reference: list[int]  # transformers' greedy continuation of PROMPT
    oracle: OracleHeads
    hydra_oracle: OracleHeads  # right on the true path only

    def heads(self, name: str):
        """random / oracle, MEDUSA's or (hydra-...) hydra's; fused-random: hydra heads that read layer 1 too."""
        kind = "medusa" if name in ("random", "oracle") else "hydra"
        if name.endswith("oracle"):
            return self.hydra_oracle if kind == "hydra" else self.oracle
        return random_heads(self.model, kind=kind, feature_layers=(1,) if name.startswith("fused") else ())


@functools.cache
def case(family: str, attention: str = "sdpa", new_tokens: int = NEW_TOKENS) -> Case:
    seed = FAMILIES.index(family)  # else llama, qwen2 and mistral would get the very same weights
    model = lively_model(family, attention, seed)
    reference = greedy_reference(model, PROMPT, new_tokens)
    sequence = torch.cat([PROMPT, torch.tensor(reference)])
    return Case(model, reference, OracleHeads(model, sequence, seed=seed),
                OracleHeads(model, sequence, seed=seed, kind="hydra"))


def run(model, heads, tree, max_new_tokens=NEW_TOKENS, prompt=PROMPT, eos_ids=frozenset(), medusa=True):
    """The tokens of each forward pass, as decode yields them."""
    config = GenerationConfig(max_new_tokens=max_new_tokens, medusa=medusa)
    return [new for new, _ in decode(model, heads, prompt, config, Tree.from_spec(tree), frozenset(eos_ids))]


def flat(steps: list[list[int]]) -> list[int]:
    return [token for step in steps for token in step]


def tokens_per_step(steps: list[list[int]]) -> float:
    """Mean tokens per verification pass (the prefill's single token left out)."""
    return (len(flat(steps)) - 1) / (len(steps) - 1)


@pytest.mark.parametrize("tree", TREES.values(), ids=TREES)
@pytest.mark.parametrize("heads", ["random", "oracle", "hydra-random", "hydra-oracle", "fused-random"])
@pytest.mark.parametrize("attention", ATTENTION)
def test_greedy_medusa_equals_generate(family, attention, heads, tree):
    c = case(family, attention)
    steps = run(c.model, c.heads(heads), tree)
    assert steps[0] == c.reference[:1]
    assert flat(steps) == c.reference
    assert all(1 <= len(step) <= max(Tree.from_spec(tree).depth, GenerationConfig().lookup) + 1 for step in steps)
    if heads.endswith("oracle") and tree:
        assert tokens_per_step(steps) > MIN_TOKENS_PER_STEP


@pytest.mark.parametrize("heads", ["random", "oracle"])
def test_long_generation(heads):
    c = case("qwen2", "sdpa", LONG)
    steps = run(c.model, c.oracle if heads == "oracle" else random_heads(c.model), DEFAULT_TREE, LONG)
    assert len(c.reference) == LONG and flat(steps) == c.reference


def test_plain_mode_is_one_token_per_step(family):
    c = case(family)
    for heads in (c.oracle, None):
        steps = run(c.model, heads, DEFAULT_TREE, medusa=False)
        assert flat(steps) == c.reference
        assert [len(step) for step in steps] == [1] * NEW_TOKENS


def first_eos_inside_a_path(steps: list[list[int]]) -> tuple[int, int]:
    """A token first seen between two other tokens of one step -> (token, its index in the output)."""
    seen, index = set(), 0
    for step in steps:
        for i, token in enumerate(step):
            if 0 < i < len(step) - 1 and token not in seen:
                return token, index
            seen.add(token)
            index += 1
    raise AssertionError("no step accepted a path with a new token inside it: pick another prompt")


@pytest.mark.parametrize("tree", ["chain", "default"])
def test_eos_inside_an_accepted_path(family, tree):
    c = case(family)
    free = run(c.model, c.oracle, TREES[tree])
    eos, index = first_eos_inside_a_path(free)
    expected = greedy_reference(c.model, PROMPT, NEW_TOKENS, eos=eos)
    assert expected == c.reference[: index + 1]  # generate stops right after that EOS
    steps = run(c.model, c.oracle, TREES[tree], eos_ids={eos})
    assert flat(steps) == expected
    last = len(steps) - 1
    assert steps[:last] == free[:last] and steps[last][-1] == eos
    assert 1 < len(steps[last]) < len(free[last])  # accepted tokens before it kept, after it dropped


def test_eos_as_the_first_token():
    c = case("llama")
    assert run(c.model, c.oracle, DEFAULT_TREE, eos_ids={c.reference[0]}) == [c.reference[:1]]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_max_new_tokens_is_exact(family, monkeypatch):
    """Every budget gives exactly that many tokens, and no pass verifies a node past the budget."""
    c = case(family)
    passes = []

    eager_verify = Eager.verify

    def spy(self, cache, packed):
        passes.append(packed.lengths[0] + int(packed.trees[0].max()) + 1)  # tokens known after it, at most
        return eager_verify(self, cache, packed)

    monkeypatch.setattr(Eager, "verify", spy)
    long_last_steps = verified = 0
    for budget in range(1, 16):
        passes.clear()
        steps = run(c.model, c.oracle, [1, 1, 1, 1], budget)
        assert flat(steps) == c.reference[:budget]
        assert all(known <= len(PROMPT) + budget for known in passes)
        long_last_steps += len(steps[-1]) > 1
        verified += len(passes)
    assert long_last_steps >= 5  # paths were accepted right up to the budget's end
    assert verified >= 15 * 2  # the spy saw the passes


def test_context_limit_reached_exactly():
    """gpt2 has absolute positions: a node placed past the context would fail to embed."""
    model = lively_model("gpt2")
    limit = context_limit(model)
    prompt = torch.randint(0, 96, (limit - 20,), generator=torch.Generator().manual_seed(0))
    reference = greedy_reference(model, prompt, 20)
    oracle = OracleHeads(model, torch.cat([prompt, torch.tensor(reference)]))
    assert flat(run(model, oracle, [3, 2, 2], 20, prompt)) == reference


def test_prompt_over_the_context_fails_before_any_work():
    model = tiny_model("llama")
    calls = []
    model.base_model.register_forward_pre_hook(lambda *args: calls.append(1))
    prompt = torch.zeros(1000, dtype=torch.long)
    message = r"prompt \(1000 tokens\) \+ max_new_tokens \(25\) = 1025 exceeds the model's context of 1024 tokens"
    with pytest.raises(ValueError, match=message):
        run(model, random_heads(model), DEFAULT_TREE, 25, prompt)
    assert calls == []


def test_sliding_window_bounds_the_context():
    model = tiny_model("mistral")
    model.config.sliding_window = 64
    assert context_limit(model) == 64
    check_context(model, 60, 4)
    with pytest.raises(ValueError, match="context of 64 tokens"):
        check_context(model, 60, 5)


def test_empty_prompt():
    model = tiny_model("qwen2")
    with pytest.raises(ValueError, match="the prompt is empty"):
        run(model, random_heads(model), DEFAULT_TREE, prompt=torch.zeros(0, dtype=torch.long))


# DEFAULT_TREE's nodes: 1 (0,)  2 (1,)  3 (2,)  4 (0,0)  5 (0,1)  6 (1,0)  7 (0,0,0)  8 (0,0,0,0)
@pytest.mark.parametrize("path", [[0], [0, 1], [0, 3], [0, 2, 6], [0, 1, 5], [0, 1, 4, 7, 8]])
def test_commit_matches_the_accepted_tokens_run_in_order(family, path):
    model = lively_model(family)
    tree = Tree.from_spec(DEFAULT_TREE)
    tokens = torch.randint(0, 96, (tree.num_nodes,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache, _, _ = engine_prefill(model, PROMPT, len(PROMPT) + tree.num_nodes)  # a batch's cache: stacked
        verify(model, cache, tokens, tree, len(PROMPT))
        commit(cache, [len(PROMPT)], [path])
        reference = DynamicCache()
        model.base_model(input_ids=torch.cat([PROMPT, tokens[path]])[None], past_key_values=reference, use_cache=True)
    assert cache.get_seq_length() == reference.get_seq_length() == len(PROMPT) + len(path)
    for mine, theirs in zip(cache.layers, reference.layers, strict=True):
        torch.testing.assert_close(mine.keys, theirs.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mine.values, theirs.values, rtol=1e-5, atol=1e-5)


def test_preallocated_cache_appends_in_place(family):
    model = lively_model(family)
    cache = allocate(model, len(PROMPT))
    reference = DynamicCache()
    with torch.no_grad():
        for chunk in PROMPT.split(5):  # three appends, the last one filling the cache exactly
            model.base_model(input_ids=chunk[None], past_key_values=cache, use_cache=True)
        model.base_model(input_ids=PROMPT[None], past_key_values=reference, use_cache=True)
    for mine, theirs in zip(cache.layers, reference.layers, strict=True):
        assert mine.keys.data_ptr() == mine.key_buffer.data_ptr()  # a view of the buffer, not a copy
        assert mine.values.data_ptr() == mine.value_buffer.data_ptr()
        torch.testing.assert_close(mine.keys, theirs.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mine.values, theirs.values, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def smol_reference(smollm):
    ids = smollm.encode(SMOL_PROMPT)
    # the CPU default, reading the GGUF's own blocks where the native kernel builds; the reference runs what
    # transformers alone runs
    assert smollm.kernels == ("stock" if native_build() else "native")
    assert reads_blocks(smollm.model) == (smollm.kernels == "native")
    with torch.no_grad(), stock_kernels(smollm.model):
        out = smollm.model.generate(ids[None], attention_mask=torch.ones_like(ids)[None], do_sample=False,
                                    max_new_tokens=NEW_TOKENS, output_scores=True, return_dict_in_generate=True)
    assert_decisive(torch.stack(out.scores)[:, 0], SMOLLM_ARGMAX_MARGIN)
    return ids, out.sequences[0, len(ids):].tolist()


@pytest.mark.parametrize("heads", ["default", "oracle", "hydra-random", "hydra-oracle", "fused-random"])
def test_smollm_medusa_equals_generate(smollm, smol_reference, heads):
    ids, expected = smol_reference
    medusa = smollm
    if heads != "default":
        kind = "medusa" if heads == "oracle" else "hydra"
        draft = (OracleHeads(smollm.model, torch.cat([ids, torch.tensor(expected)]), kind=kind)
                 if heads.endswith("oracle") else
                 random_heads(smollm.model, kind=kind, feature_layers=(8, 16, 24) if heads.startswith("fused") else ()))
        medusa = MedusaModel(smollm.model, smollm.tokenizer, draft, Tree.from_spec(DEFAULT_TREE))  # deep enough for 2+
    out = medusa.generate(SMOL_PROMPT, max_new_tokens=NEW_TOKENS)
    assert out.token_ids == expected
    assert sum(out.accept_lengths) == len(expected)
    if heads.endswith("oracle"):
        assert out.acceleration_rate > MIN_TOKENS_PER_STEP


@needs_compiler
def test_smollm_compiled_engine_equals_generate(smollm, smol_reference):
    ids, expected = smol_reference
    draft = OracleHeads(smollm.model, torch.cat([ids, torch.tensor(expected)]))
    out = MedusaModel(smollm.model, smollm.tokenizer, draft, Tree.from_spec(DEFAULT_TREE), engine="compiled").generate(
        SMOL_PROMPT, max_new_tokens=NEW_TOKENS)
    assert out.token_ids == expected
    assert out.acceleration_rate > MIN_TOKENS_PER_STEP


@needs_native
def test_smollm_on_q8_kernels_medusa_is_plain_decoding_to_the_token():
    """8-bit activations round differently from float32, so q8 answers are not transformers'; but each tree node
    gets what a one-token pass gives its token (test_kernels), so MEDUSA stays lossless against plain decoding in the
    same engine, with the shipped heads and a wide tree."""
    q8 = MedusaModel.from_pretrained(kernels="q8", tree=WIDE_SPARSE)
    assert q8.kernels == "q8" and reads_blocks(q8.model)
    tree, ids = Tree.from_spec(WIDE_SPARSE), q8.encode(SMOL_PROMPT)
    tokens = torch.randint(q8.heads.config.vocab_size, (tree.num_nodes,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():  # each node's logits: bitwise those of its token in one-token steps along its path
        cache, _, _ = engine_prefill(q8.model, ids, len(ids) + tree.num_nodes)
        logits = verify(q8.model, cache, tokens, tree, len(ids))[0]
        for path in ([0, 1, 9, 13, 16], [0, 3, 11]):  # two of the tree's root-to-leaf paths
            cache, _, _ = engine_prefill(q8.model, ids, len(ids) + len(path))
            for depth, node in enumerate(path):
                one = verify(q8.model, cache, tokens[node : node + 1], decoding.PLAIN, len(ids) + depth)[0]
                assert torch.equal(one[0], logits[node])
    accepted = 0
    for prompt in (SMOL_PROMPT, "Write a Python function that reverses a string.", "What is 17 * 24? Show the steps."):
        medusa, plain = (q8.generate(prompt, max_new_tokens=NEW_TOKENS, medusa=on) for on in (True, False))
        assert medusa.token_ids == plain.token_ids and plain.steps == len(plain.token_ids)
        accepted += len(medusa.token_ids) - medusa.steps
    assert accepted > NEW_TOKENS // 2  # the heads' guesses were taken: trees were verified, not plain steps


@needs_native
@needs_compiler
def test_smollm_on_the_compiled_q8_engine_medusa_is_plain_decoding_to_the_token():
    """The fast CPU path (compiled engine, 8-bit activations): lossless against plain decoding on the same engine, with
    the shipped heads taken often, and near the float32 model's own greedy answer."""
    fast = MedusaModel.from_pretrained(kernels="q8", engine="compiled", tree=WIDE_SPARSE)
    assert fast.compiled and any(isinstance(m, Q8Linear) for m in fast.model.modules())
    medusa, plain = (fast.generate(SMOL_PROMPT, max_new_tokens=NEW_TOKENS, medusa=on) for on in (True, False))
    assert medusa.token_ids == plain.token_ids and plain.steps == len(plain.token_ids)
    assert len(medusa.token_ids) - medusa.steps > NEW_TOKENS // 8  # trees were verified, guesses taken


def test_smollm_rejects_bad_prompts_before_any_work(smollm):
    with pytest.raises(ValueError, match="the prompt is empty"):
        smollm.generate("", raw=True)
    with pytest.raises(ValueError, match="exceeds the model's context of 8192 tokens"):
        smollm.generate(list(range(8000)), max_new_tokens=200)


@pytest.mark.parametrize("tree", ["3x2x2", "wide-sparse"])
def test_hydra_proposal_ranks_each_nodes_children_given_its_own_path(tree):
    """expand, level by level, against one head call per node: node (r_1..r_d) holds rank r_d of head d-1 given the
    tokens of its parent's path (the root first); and a subtree's tokens are the same nodes' tokens."""
    c = case("llama")
    heads, lm_head, embed = (random_heads(c.model, kind="hydra"), c.model.get_output_embeddings(),
                             c.model.get_input_embeddings())
    tree = Tree.from_spec(TREES[tree])
    hidden, root = torch.randn(c.model.config.hidden_size), 7
    with torch.no_grad():
        tokens, guesses = heads_draft.guess(heads, lm_head, embed, hidden, root, tree, tree)
        assert tokens[0] == root
        for node, path in enumerate(tree.paths, 1):
            parent = tree.chains[node, : len(path)]  # the root .. the parent
            logits = heads(hidden, lm_head, len(path), embed(tokens[parent]), first=len(path) - 1)[0]
            assert tokens[node] == logits.topk(path[-1] + 1).indices[-1]
            assert guesses[path[:-1]][path[-1]] == tokens[node]
        small = tree.truncated(1)
        sub, _ = heads_draft.guess(heads, lm_head, embed, hidden, root, small, tree)
        assert sub.tolist() == [root] + [int(tokens[tree.paths.index(p) + 1]) for p in small.paths]
    assert len({tuple(guesses[path]) for path in tree.paths if len(path) == 1 and path in guesses}) > 1  # paths matter


@pytest.mark.parametrize("size", [3, 8])
@pytest.mark.parametrize("heads", ["random", "oracle", "hydra-random", "hydra-oracle"])
def test_confident_trees_are_lossless(family, heads, size):
    c = case(family)
    ladder = Ladder.fixed(Tree.from_spec([size]), confident=True)
    config = GenerationConfig(max_new_tokens=NEW_TOKENS)
    steps = [new for new, _ in decode(c.model, c.heads(heads), PROMPT, config, ladder)]
    assert flat(steps) == c.reference
    if heads.endswith("oracle"):  # the oracle is sure of its right guesses: the likeliest nodes run deep
        assert tokens_per_step(steps) > MIN_TOKENS_PER_STEP


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_confident_tree_holds_the_likeliest_paths(kind):
    """Against brute force: every path of up to 3 heads' top-4 tokens, scored by the product of the heads'
    probabilities along it (a hydra head's given the path before it); the tree holds the 4 best."""
    c = case("llama")
    heads = random_heads(c.model, num_heads=3, kind=kind)
    lm_head, embed = c.model.get_output_embeddings(), c.model.get_input_embeddings()
    hidden, root, size = torch.randn(c.model.config.hidden_size), 7, 4
    scores = {}
    with torch.no_grad():
        tree, tokens, (tops, ranked) = heads_draft.guess_confident(heads, lm_head, embed, hidden, root, size, size)

        def walk(path, chain, score):
            if len(path) == 3:
                return
            probs = heads(hidden[None], lm_head, len(path) + 1, embed(torch.tensor(chain))[None], first=len(path))[0, 0]
            probs = probs.softmax(-1)
            for rank, token in enumerate(probs.topk(size).indices.tolist()):
                scores[path + (rank,)] = (score * float(probs[token]), chain + [token])
                walk(path + (rank,), chain + [token], scores[path + (rank,)][0])

        walk((), [root], 1.0)
    best = sorted(scores, key=lambda p: -scores[p][0])[:size]
    assert set(tree.paths) == set(best) and ranked == best
    assert tokens.tolist() == [root] + [scores[p][1][-1] for p in tree.paths]


def test_both_engines_answer_every_call_of_the_engine_interface():
    """The step never asks which engine it has: the eager and the compiled one answer every call of engine.Engine."""
    calls = {name for name in vars(Engine) if not name.startswith("_")} | set(Engine.__annotations__)
    assert {"verify", "commit", "device_step", "guesses_own_tokens"} <= calls
    for engine in (Eager, Compiled):
        assert all(hasattr(engine, name) for name in calls), engine
