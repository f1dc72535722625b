"""MEDUSA heads: untrained heads repeat the base model, save/load round trips, loud errors."""

import json
import re
from dataclasses import asdict, replace

import pytest
import torch
from conftest import FAMILIES, HIDDEN, VOCAB, tiny_model

from medusa_decoding import MedusaModel
from medusa_decoding.config import HeadsConfig
from medusa_decoding.formats import CONFIG_NAME, WEIGHTS_NAME
from medusa_decoding.heads import MedusaHeads, run_backbone
from medusa_decoding.tree import Tree

CONFIG = HeadsConfig(hidden_size=HIDDEN, vocab_size=VOCAB, num_heads=3, num_layers=2, base_model="tiny")


def perturbed(heads: MedusaHeads, seed: int = 0) -> MedusaHeads:
    """Heads whose every weight is random, so a round trip that drops or mixes up one is caught."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in heads.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    return heads


@pytest.mark.parametrize("projection", ["shared", "own"])
@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_untrained_heads_give_the_base_logits_exactly(family, projection, num_layers):
    model = tiny_model(family)
    lm_head = model.get_output_embeddings()
    heads = MedusaHeads(replace(CONFIG, projection=projection, num_layers=num_layers), lm_head)
    hidden = torch.randn(5, HIDDEN)
    with torch.no_grad():
        expected = lm_head(hidden)
        # bitwise where the code guarantees it: zero blocks give back `hidden` itself (h + SiLU(0) = h), and the same
        # projection of the same values in the same shape gives the same bits
        blocks = [head if projection == "shared" else head[:-1] for head in heads.heads]
        assert all(torch.equal(block(hidden), hidden) for block in blocks)
        projections = [lm_head] * 3 if projection == "shared" else [head[-1] for head in heads.heads]
        assert all(torch.equal(p(block(hidden)), expected) for p, block in zip(projections, blocks))
        # all heads in one call project [K, 5, H] at once: another matrix shape, whose rounding BLAS may choose
        # differently (it does on AMD EPYC); the same values up to that rounding
        logits = heads(hidden, lm_head if projection == "shared" else None)
        assert logits.shape == (3, 5, VOCAB)
        one = heads(hidden[0], lm_head)  # one vector, as the decoding loop calls it: [K, V]
        assert one.shape == (3, VOCAB)
        for k in range(3):
            torch.testing.assert_close(logits[k], expected, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(one[k], expected[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("projection", ["shared", "own"])
@pytest.mark.parametrize("family", FAMILIES)
def test_untrained_hydra_heads_give_the_base_logits_whatever_the_tokens(family, projection):
    model = tiny_model(family)
    lm_head = model.get_output_embeddings()
    heads = MedusaHeads(replace(CONFIG, projection=projection, kind="hydra"), lm_head)
    hidden = torch.randn(5, HIDDEN)
    embeds = model.get_input_embeddings()(torch.randint(VOCAB, (5, 3)))  # [5, K, H]: random paths
    with torch.no_grad():
        expected = lm_head(hidden)
        for k, head in enumerate(heads.heads):
            first = head[0]
            assert first.linear.in_features == (k + 2) * HIDDEN  # h and the k+1 tokens before head k's target
            assert torch.equal(first(hidden, embeds[:, : k + 1]), hidden)  # zero blocks give back h itself, bitwise
        logits = heads(hidden, lm_head if projection == "shared" else None, embeds=embeds)
        assert logits.shape == (3, 5, VOCAB)
        for k in range(3):
            torch.testing.assert_close(logits[k], expected, rtol=1e-6, atol=1e-6)
        deeper = heads(hidden, lm_head, embeds=embeds, first=1)  # heads 1.. alone, as one level of a tree asks
        torch.testing.assert_close(deeper, logits[1:], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="hydra heads read the tokens before their guess: pass embeds"):
        heads(hidden, lm_head)


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_untrained_heads_with_feature_layers_give_the_base_logits(kind):
    model = tiny_model("llama")
    lm_head = model.get_output_embeddings()
    heads = MedusaHeads(replace(CONFIG, kind=kind, feature_layers=(1,)), lm_head)
    hidden, layer = torch.randn(5, HIDDEN), torch.randn(5, HIDDEN)
    embeds = model.get_input_embeddings()(torch.randint(VOCAB, (5, 3))) if kind == "hydra" else None
    with torch.no_grad():
        first = heads.heads[0][0]
        assert first.linear.in_features == (3 if kind == "hydra" else 2) * HIDDEN  # h, layer 1, (the root)
        logits = heads(torch.cat([hidden, layer], -1), lm_head, embeds=embeds)
        for k in range(3):
            torch.testing.assert_close(logits[k], lm_head(hidden), rtol=1e-6, atol=1e-6)
        with pytest.raises(ValueError, match=r"these heads read 2 states of 32 \(the last hidden state and feature "
                                             r"layers \[1\]\), got 32 values"):
            heads(hidden, lm_head, embeds=embeds)


def test_feature_layers_are_read_from_the_backbone_rms_normalised(smollm):
    """run_backbone's state: the last hidden state, then each feature layer's output over its RMS."""
    ids = smollm.encode("Hello there")[None]
    with torch.no_grad():  # (a pass autograd records takes stock kernels: other bits)
        hidden, state = run_backbone(smollm.model, (8, 24), input_ids=ids)
        out = smollm.model.base_model(input_ids=ids, output_hidden_states=True)
        alone = run_backbone(smollm.model, (), input_ids=ids)[1]
    assert state.shape == (*hidden.shape[:-1], 3 * 576) and torch.equal(state[..., :576], hidden)
    for i, layer in enumerate((8, 24), 1):
        raw = out.hidden_states[layer]
        torch.testing.assert_close(state[..., 576 * i: 576 * (i + 1)], raw / raw.pow(2).mean(-1, keepdim=True).sqrt(),
                                   rtol=1e-4, atol=1e-5)
    assert torch.equal(alone, hidden)


@pytest.mark.parametrize("layers", [[0], [1, 1], ["8"], 8])
def test_feature_layers_must_be_distinct_layer_numbers(layers):
    with pytest.raises(ValueError, match="feature_layers must be distinct layer numbers >= 1"):
        replace(CONFIG, feature_layers=layers)


def test_shared_heads_need_the_lm_head():
    with pytest.raises(ValueError, match="pass lm_head"):
        MedusaHeads(CONFIG)(torch.zeros(HIDDEN))


@pytest.mark.parametrize("projection, kind, layers", [("shared", "medusa", ()), ("own", "medusa", ()),
                                                     ("shared", "hydra", ()), ("shared", "hydra", (1,))])
def test_save_and_load_round_trip_bit_identical(tmp_path, projection, kind, layers):
    config = replace(CONFIG, projection=projection, kind=kind, feature_layers=layers)
    heads = perturbed(MedusaHeads(config))
    heads.save_pretrained(tmp_path / "heads")
    assert sorted(p.name for p in (tmp_path / "heads").iterdir()) == sorted([CONFIG_NAME, WEIGHTS_NAME])
    saved = json.loads((tmp_path / "heads" / CONFIG_NAME).read_text())
    assert saved == {
        "base_model": "tiny", "hidden_size": HIDDEN, "vocab_size": VOCAB, "num_heads": 3, "num_layers": 2,
        "projection": projection, "kind": kind, "feature_layers": list(layers),
    }
    loaded = MedusaHeads.from_pretrained(tmp_path / "heads")
    assert loaded.config == config
    mine, theirs = heads.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), name
    lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    hidden, embeds = torch.randn(2, (1 + len(layers)) * HIDDEN), torch.randn(2, 3, HIDDEN)
    with torch.no_grad():
        assert torch.equal(heads(hidden, lm_head, embeds=embeds), loaded(hidden, lm_head, embeds=embeds))
    assert (MedusaHeads.from_pretrained(tmp_path / "heads", dtype=torch.bfloat16).heads[0][0].linear.weight.dtype
            == torch.bfloat16)


@pytest.fixture
def saved(tmp_path):
    MedusaHeads(CONFIG).save_pretrained(tmp_path)
    return tmp_path


def test_missing_directory_or_file(tmp_path, saved):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        MedusaHeads.from_pretrained(tmp_path / "nowhere")
    (saved / WEIGHTS_NAME).unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(str(saved))):
        MedusaHeads.from_pretrained(saved)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_corrupt_weights_file(saved, damage):
    weights = saved / WEIGHTS_NAME
    data = weights.read_bytes()
    weights.write_bytes({"garbage": b"\x07not safetensors" * 8, "truncated": data[: len(data) // 2],
                         "empty": b""}[damage])
    with pytest.raises(ValueError, match=f"{re.escape(str(weights))} is corrupt or unreadable"):
        MedusaHeads.from_pretrained(saved)


@pytest.mark.parametrize("text, message", [
    ("{not json", "is not a valid heads config"),
    ('{"hidden_size": 32, "vocab_size": 96, "colour": "red"}', "is not a valid heads config"),
    ('{"hidden_size": 32}', "is not a valid heads config"),
    ('{"hidden_size": 32, "vocab_size": 96, "projection": "both"}', "projection must be one of"),
    ('{"hidden_size": "32", "vocab_size": 96}', "hidden_size must be a positive integer"),
    ('{"hidden_size": 32, "vocab_size": 96, "kind": "eagle"}', "kind must be one of"),
    ('{"hidden_size": 32, "vocab_size": 96, "kind": "hydra", "prefix_layer": {"num_attention_heads": 4}}',
     "prefix_layer: heads with a prefix layer are not supported"),
])
def test_bad_config_file(saved, text, message):
    (saved / CONFIG_NAME).write_text(text)
    with pytest.raises(ValueError, match=message):
        MedusaHeads.from_pretrained(saved)


def test_heads_saved_with_prefix_layer_null_load(saved):
    """Heads saved while hydra heads could have a prefix layer hold "prefix_layer": null: they have none."""
    config = json.loads((saved / CONFIG_NAME).read_text())
    (saved / CONFIG_NAME).write_text(json.dumps({**config, "prefix_layer": None}))
    assert MedusaHeads.from_pretrained(saved).config == CONFIG


OWN, HYDRA = {"projection": "own"}, {"kind": "hydra"}


@pytest.mark.parametrize("saved_as, written", [
    ({}, {"num_heads": 4}),
    ({}, {"num_layers": 1}),
    ({}, {"hidden_size": 16}),
    ({}, OWN),
    (OWN, {}),
    (OWN, {**OWN, "vocab_size": 95}),  # shared heads hold no vocab-sized tensor: check_compatible's job
    ({}, HYDRA),  # a hydra head's first block reads more than h
    (HYDRA, {}),
    ({}, {"feature_layers": [1]}),  # so does a head that reads a layer
])
def test_config_that_does_not_match_the_weights(tmp_path, saved_as, written):
    MedusaHeads(replace(CONFIG, **saved_as)).save_pretrained(tmp_path)
    (tmp_path / CONFIG_NAME).write_text(json.dumps(asdict(replace(CONFIG, **written))))
    with pytest.raises(ValueError, match=f"MEDUSA heads: .*{re.escape(str(tmp_path))}.* config"):
        MedusaHeads.from_pretrained(tmp_path)


def test_check_compatible_names_what_differs():
    heads = MedusaHeads(CONFIG)
    heads.check_compatible(HIDDEN, VOCAB)
    with pytest.raises(ValueError, match=r"built for hidden_size=32, vocab_size=96 .*'tiny'"
                                         r".*other has hidden_size=64, vocab_size=96"):
        heads.check_compatible(64, VOCAB, "other")
    with pytest.raises(ValueError, match=r"built for hidden_size=32, vocab_size=96"
                                         r" .*has hidden_size=32, vocab_size=100"):
        heads.check_compatible(HIDDEN, 100)
    fused = MedusaHeads(replace(CONFIG, feature_layers=(1, 8)))
    fused.check_compatible(HIDDEN, VOCAB, "other", num_layers=9)
    with pytest.raises(ValueError, match=r"read the outputs of layers \[1, 8\], but other has 8 layers"):
        fused.check_compatible(HIDDEN, VOCAB, "other", num_layers=8)


def test_medusa_model_refuses_heads_of_another_model(smollm):
    with pytest.raises(ValueError, match=r"built for hidden_size=32, vocab_size=96"
                                         r" .* has hidden_size=576, vocab_size=49152"):
        MedusaModel(smollm.model, smollm.tokenizer, MedusaHeads(CONFIG))
    config = smollm.heads.config
    with pytest.raises(ValueError, match="vocab_size=49151"):
        MedusaModel(smollm.model, smollm.tokenizer, MedusaHeads(replace(config, vocab_size=config.vocab_size - 1)))
    with pytest.raises(ValueError, match=r"read the outputs of layers \[30\], but .* has 30 layers"):
        MedusaModel(smollm.model, smollm.tokenizer, MedusaHeads(replace(config, feature_layers=(30,))))
    with pytest.raises(ValueError, match="depth 3 needs 3 heads, but only 2 exist"):
        MedusaModel(smollm.model, smollm.tokenizer, MedusaHeads(replace(config, num_heads=2)),
                    Tree.from_spec([1, 1, 1]))
