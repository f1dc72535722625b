"""MedusaModel's API: generate / stream / streamers, stop strings, budgets, inputs, loading and saving.

Most tests run tiny random models of each family behind SmolLM2's real tokenizer (random weights emit odd
tokens, partial UTF-8 characters included); the rest use the embedded default (`smollm`).
"""

import random
import threading
from dataclasses import replace

import pytest
import torch
from conftest import needs_compiler, tiny_model
from transformers import TextIteratorStreamer, TextStreamer

import medusa_decoding.text as text_module
from medusa_decoding import GenerationConfig, HeadsConfig, MedusaHeads, MedusaModel, Tree
from medusa_decoding.base import context_limit
from medusa_decoding.corpus import CorpusIndex
from medusa_decoding.formats import TREE_NAME
from medusa_decoding.guard import Ladder

PROMPT = "Write a short story about a dragon who learns to bake bread."
TINY_TREE = ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))
STORY_TOKENS = 16


def random_heads(base, num_heads: int = 3, seed: int = 0) -> MedusaHeads:
    """Heads whose residual blocks are not the zero init, so they guess differently from the base."""
    config = base.config.get_text_config()
    heads = MedusaHeads(HeadsConfig(config.hidden_size, config.vocab_size, num_heads), base.get_output_embeddings())
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.5)
    return heads


@pytest.fixture
def tiny(family, smollm) -> MedusaModel:
    """A tiny random `family` model with SmolLM2's tokenizer and chat template."""
    base = tiny_model(family, vocab_size=len(smollm.tokenizer))
    return MedusaModel(base, smollm.tokenizer, random_heads(base), Tree.from_spec(TINY_TREE))


def collected_text(streamer_cls, medusa: MedusaModel, **kwargs) -> str:
    """The text a transformers streamer received while `generate` ran."""
    if streamer_cls is TextIteratorStreamer:
        streamer = TextIteratorStreamer(medusa.tokenizer, skip_prompt=True, skip_special_tokens=True)
        thread = threading.Thread(target=medusa.generate, kwargs={**kwargs, "streamer": streamer})
        thread.start()
        text = "".join(streamer)
        thread.join()
        return text
    pieces = []

    class Collector(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False):
            pieces.append(text)

    medusa.generate(**kwargs, streamer=Collector(medusa.tokenizer, skip_prompt=True, skip_special_tokens=True))
    return "".join(pieces)


# --- generate, stream and streamers agree ----------------------------------------------------------------


def test_stream_pieces_concatenate_to_generate_text(tiny):
    out = tiny.generate(PROMPT, max_new_tokens=40)
    pieces = list(tiny.stream(PROMPT, max_new_tokens=40))
    assert "".join(pieces) == out.text
    assert all(pieces)
    assert out.text == tiny.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert sum(out.accept_lengths) == len(out.token_ids) and out.steps == len(out.accept_lengths)
    assert out.acceleration_rate == len(out.token_ids) / out.steps


@pytest.fixture(scope="module")
def story(smollm):
    """The embedded default's greedy answer to PROMPT, computed once for the tests below."""
    out = smollm.generate(PROMPT, max_new_tokens=STORY_TOKENS)
    assert len(out.token_ids) == STORY_TOKENS and out.text.strip()
    return out


def test_stream_on_the_embedded_default(smollm, story):
    assert "".join(smollm.stream(PROMPT, max_new_tokens=STORY_TOKENS)) == story.text


@pytest.mark.parametrize("streamer_cls", [TextStreamer, TextIteratorStreamer])
def test_transformers_streamer_receives_the_text(streamer_cls, smollm, story):
    assert collected_text(streamer_cls, smollm, prompt=PROMPT, max_new_tokens=STORY_TOKENS) == story.text


def test_streamer_receives_the_tokens_up_to_a_stop_string(smollm, story):
    stop = stop_string_across_tokens(smollm, story.token_ids, at=3)
    received = collected_text(TextIteratorStreamer, smollm, prompt=PROMPT, max_new_tokens=STORY_TOKENS, stop=(stop,))
    completing = shortest_prefix_containing(smollm, story.token_ids, stop)
    assert received == smollm.decode(completing)  # like transformers' stop_strings: whole tokens, not cut text


# --- stop strings ------------------------------------------------------------------------------------------


def stop_string_across_tokens(medusa: MedusaModel, ids: list[int], at: int) -> str:
    """The text of tokens at and at+1: a stop string that only the second of them completes."""
    before, after = medusa.decode(ids[:at]), medusa.decode(ids[: at + 2])
    assert after.startswith(before) and len(after) > len(before) + 1
    return after[len(before):]


def shortest_prefix_containing(medusa: MedusaModel, ids: list[int], stop: str) -> list[int]:
    return next(ids[:n] for n in range(1, len(ids) + 1) if stop in medusa.decode(ids[:n]))


@pytest.mark.parametrize("at", [0, 9])
def test_stop_string_cuts_text_tokens_and_stream(smollm, story, at):
    stop = stop_string_across_tokens(smollm, story.token_ids, at)
    out = smollm.generate(PROMPT, max_new_tokens=STORY_TOKENS, stop=("never appears \x00", stop))
    assert out.text == story.text[: story.text.index(stop)]  # cut before the earliest stop string
    assert out.token_ids == shortest_prefix_containing(smollm, story.token_ids, stop)  # up to the completing token
    pieces = list(smollm.stream(PROMPT, max_new_tokens=STORY_TOKENS, stop=(stop,)))
    assert "".join(pieces) == out.text  # never a part of the stop string, even the one held back at the end


def scripted(steps: list[tuple[list[int], int]]):
    """A stand-in for decoding.Batch whose one row produces `steps` (tokens, candidates verified): the prefill's
    first, then one a step, done after the last."""

    class Row:
        done, drafted = len(steps) == 1, 0

    class Scripted:
        def __init__(self, model, heads, compiled=False):
            self.rows, self.left = [], list(steps[1:])

        def join(self, ids, config, trees, eos_ids, generator, corpus):
            row = Row()
            row.root, self.rows = steps[0][0][0], [row]
            return row

        def step(self):
            row = self.rows[0]
            new, size = self.left.pop(0)
            row.done = not self.left
            return [(row, new, size)]

        def leave(self, row):
            self.rows.remove(row)

    return Scripted


def test_stop_string_cuts_a_multi_token_step(smollm, monkeypatch):
    """A stop string completed mid-step keeps the step's tokens up to the completing one, not the rest."""
    ids = smollm.tokenizer(" one two three four five six")["input_ids"]
    steps = [(ids[:1], 0), (ids[1:5], 3), (ids[5:], 3)]  # (tokens, candidates verified)
    monkeypatch.setattr(text_module, "Batch", scripted(steps))
    out = smollm.generate("hi", stop=("two thr",))
    assert out.text == " one "
    assert out.token_ids == ids[:3] and out.accept_lengths == [1, 2] and out.tree_sizes == [0, 3]
    assert "".join(smollm.stream("hi", stop=("two thr",))) == " one "


def test_stop_strings_hold_back_a_possible_start(smollm, monkeypatch):
    ids = smollm.tokenizer(" one two three")["input_ids"]
    monkeypatch.setattr(text_module, "Batch", scripted([([t], 0) for t in ids]))
    pieces = list(smollm.stream("hi", stop=(" two four",)))  # " two" could start it; " three" rules it out
    assert pieces == [" one", " two three"]


# --- a tree for one call ---------------------------------------------------------------------------------


def test_a_tree_for_one_call_decodes_as_a_model_built_with_it_and_leaves_the_models_own(tiny):
    """generate/stream(tree=...): the call verifies that tree (what the server does for a request's `medusa.tree`),
    exactly as a MedusaModel built with it would, greedy output stays lossless, and the model keeps its own trees."""
    tree, own = [[0], [0, 0]], tiny.trees
    out = tiny.generate(PROMPT, max_new_tokens=24, tree=tree, lookup=0)
    built = MedusaModel(tiny.model, tiny.tokenizer, tiny.heads, Tree.from_spec(tree)).generate(
        PROMPT, max_new_tokens=24, lookup=0)
    assert (out.token_ids, out.tree_sizes) == (built.token_ids, built.tree_sizes)
    assert max(out.tree_sizes) == 2  # the call's two candidates (fewer where the budget's end cuts the tree)
    assert out.token_ids == tiny.generate(PROMPT, max_new_tokens=24, medusa=False).token_ids
    assert "".join(tiny.stream(PROMPT, max_new_tokens=24, tree=tree, lookup=0)) == out.text
    [batched] = tiny.generate([PROMPT], max_new_tokens=24, tree=tree, lookup=0)
    assert batched.tree_sizes == out.tree_sizes
    assert tiny.trees is own
    with pytest.raises(ValueError, match="depth 4 needs 4 heads"):
        tiny.generate(PROMPT, max_new_tokens=4, tree=[1, 1, 1, 1])


# --- budgets and inputs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("medusa_on", [True, False])
def test_max_new_tokens_is_exact(tiny, medusa_on):
    for budget in (1, 2, 3, 7, 33):
        out = tiny.generate(PROMPT, max_new_tokens=budget, medusa=medusa_on)
        assert len(out.token_ids) == budget


def test_max_new_tokens_exact_on_the_embedded_default(smollm):
    for budget in (1, 5):
        assert len(smollm.generate(PROMPT, max_new_tokens=budget).token_ids) == budget


def test_sampling_with_a_seed_repeats(tiny):
    """temperature as an override: acceptance "auto" must resolve to a sampling rule, not stay greedy."""
    first = tiny.generate(PROMPT, max_new_tokens=16, temperature=0.9, seed=7)
    assert first.token_ids == tiny.generate(
        PROMPT, config=GenerationConfig(max_new_tokens=16, temperature=0.9, seed=7)).token_ids
    assert first.token_ids != tiny.generate(PROMPT, max_new_tokens=16).token_ids  # sampled, not greedy


def test_chat_messages_go_through_the_chat_template(smollm):
    messages = [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Name a colour."},
    ]
    expected = smollm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert smollm.encode(messages=messages).tolist() == expected
    single = [{"role": "user", "content": PROMPT}]
    assert smollm.encode(messages=single).tolist() == smollm.encode(PROMPT).tolist()  # a string is one user turn
    assert smollm.encode(PROMPT, raw=True).tolist() == smollm.tokenizer(PROMPT)["input_ids"]
    by_messages = smollm.generate(messages=messages, max_new_tokens=8)
    assert by_messages.token_ids == smollm.generate(expected, max_new_tokens=8).token_ids  # token ids as prompt


@pytest.mark.parametrize(
    "kwargs",
    [{"prompt": ""}, {"prompt": "", "raw": True}, {"messages": []}, {"messages": [{"role": "user", "content": " "}]},
     {"prompt": []}],
    ids=["empty string", "empty raw string", "no messages", "blank message", "no token ids"],
)
def test_empty_prompt_is_a_clear_error(smollm, kwargs):
    with pytest.raises(ValueError, match="prompt is empty"):
        smollm.generate(**kwargs, max_new_tokens=4)


def test_prompt_longer_than_the_context_is_a_clear_error(tiny):
    limit = context_limit(tiny.model)
    with pytest.raises(ValueError, match=f"exceeds the model's context of {limit} tokens"):
        tiny.generate(list(range(3, limit + 4)), max_new_tokens=1)
    with pytest.raises(ValueError, match=rf"prompt \({limit - 10} tokens\) \+ max_new_tokens \(11\)"):
        tiny.generate(list(range(3, limit - 7)), max_new_tokens=11)


# --- loading and saving ------------------------------------------------------------------------------------


def test_missing_model_path_names_it(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        MedusaModel.from_pretrained(missing)


def test_heads_for_another_model_are_refused(tmp_path):
    MedusaHeads(HeadsConfig(hidden_size=32, vocab_size=96, base_model="tiny")).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"built for hidden_size=32, vocab_size=96"
                                         r" .* has hidden_size=576, vocab_size=49152"):
        MedusaModel.from_pretrained(heads=tmp_path)


def test_corrupt_heads_checkpoint_is_refused(tmp_path, smollm):
    random_heads(smollm.model).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated, as by an interrupted copy
    with pytest.raises(ValueError, match="corrupt"):
        MedusaModel.from_pretrained(heads=tmp_path)


def test_save_and_load_restore_heads_and_tree(tmp_path, smollm):
    tree = Tree.from_spec([2, 2])
    saved = MedusaModel(smollm.model, smollm.tokenizer, random_heads(smollm.model, num_heads=2), tree)
    saved.save_pretrained(tmp_path)
    assert (tmp_path / TREE_NAME).is_file()
    loaded = MedusaModel.from_pretrained(heads=tmp_path)
    assert loaded.tree.paths == tree.paths
    assert loaded.heads.config == saved.heads.config
    expected = saved.heads.state_dict()
    assert all(torch.equal(value, expected[name]) for name, value in loaded.heads.state_dict().items())
    assert loaded.generate(PROMPT, max_new_tokens=8).token_ids == saved.generate(PROMPT, max_new_tokens=8).token_ids


def test_the_corpus_index_is_saved_and_loaded_with_the_heads_and_kept_by_views(tmp_path, smollm):
    saved = MedusaModel(smollm.model, smollm.tokenizer, random_heads(smollm.model, num_heads=2), Tree.from_spec([2]))
    saved.corpus = CorpusIndex.build([(list(range(100, 140)) * 3, [True] * 120)], min_seen=1)
    saved.save_pretrained(tmp_path)
    loaded = MedusaModel.from_pretrained(heads=tmp_path)
    assert loaded.corpus.next([101, 102]) == saved.corpus.next([101, 102]) == (103, pytest.approx(3 / 4, abs=1e-3))
    assert loaded.with_heads(loaded.heads, [[0]]).corpus is loaded.corpus  # a view with another tree keeps the index
    out = loaded.generate("Count from 100 up.", max_new_tokens=12)
    assert out.token_ids == loaded.generate("Count from 100 up.", max_new_tokens=12, corpus=0).token_ids


def test_an_answer_decoded_piece_by_piece_is_the_whole_decode(smollm):
    """Answer (incremental decoding) on the embedded tokenizer: after every step its text is a prefix of the whole
    answer's decoding and never ends inside a character, and once all tokens are in it is the whole decoding; the
    tokens split at random places, emoji and accents split across tokens."""
    from medusa_decoding.text import Answer

    text = "Voilà: 🤖 paints ☕ at 10:30 — naïve, déjà vu. 你好，世界！\n  def f(x):\n\treturn x ** 2"
    tokens = smollm.tokenizer.encode(text, add_special_tokens=False)
    whole = smollm.decode(tokens)
    cuts = random.Random(0)
    for _ in range(5):
        answer, at = Answer(smollm.decode), 0
        while at < len(tokens):
            step = tokens[at : at + cuts.randint(1, 4)]
            at += len(step)
            so_far = answer.add(step)
            assert whole.startswith(so_far) and not so_far.endswith("\ufffd")
        assert so_far == whole


def test_a_confident_ladder_from_plain_up_warms_up_and_decodes(smollm):
    """`--tree confident` on calibrated heads: confident trees from plain decoding up, which warm_up runs one at a time
    under a guard (the plain one guesses for no node: a confident proposal over it asked the heads for none and
    failed, so `medusa bench --tree confident` did)."""
    base = tiny_model("llama", vocab_size=len(smollm.tokenizer))
    ladder = Ladder((Tree.from_spec([]), Tree.from_spec([[0]]), Tree.from_spec(TINY_TREE)), (1.0, 1.2, 1.5), (0,),
                    ((1.0, 1.1, 1.2),), confident=True)
    medusa = MedusaModel(base, smollm.tokenizer, random_heads(base), ladder, kernels="stock")
    medusa.warm_up("Hello there", GenerationConfig())
    config = GenerationConfig(max_new_tokens=16)
    plain = medusa.generate("Why?", config=config, medusa=False)
    assert medusa.generate("Why?", config=config).token_ids == plain.token_ids


@needs_compiler
@pytest.mark.parametrize("ladder, fields", [
    (Ladder((Tree.from_spec([[0]]), Tree.from_spec(TINY_TREE)), (1.2, 1.5), (0,), ((1.0, 1.2),)), {}),
    (Ladder.fixed(Tree.from_spec(TINY_TREE)), {"temperature": 0.7, "top_k": 50}),
    (Ladder.fixed(Tree.from_spec(TINY_TREE), confident=True), {}),
], ids=["the guard's ladder", "a fixed tree, sampled", "a confident tree"])
def test_a_warm_up_compiles_what_its_requests_then_run(smollm, ladder, fields):
    """On the compiled engine: after warm_up, requests of another prompt and length decoded as the warm-up's config
    says compile nothing (the guard's picks on the host's path, fixed and confident trees on the device step)."""
    base = tiny_model("llama", vocab_size=len(smollm.tokenizer))
    medusa = MedusaModel(base, smollm.tokenizer, random_heads(base), ladder, engine="compiled")
    config = GenerationConfig(max_new_tokens=24, **fields)
    medusa.warm_up("Hello there", config)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for prompt in ("Tell me a story about a dragon who", "Why?"):
        medusa.generate(prompt, config=config)
        medusa.generate(prompt, config=replace(config, medusa=False))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
