"""The CPU kernels: packed oneDNN linears compute what stock ones do, keep MEDUSA lossless, and switch back; so
does a compiled backbone; the heads guess through an int8 copy of the LM head."""

import copy

import pytest
import torch
from conftest import FAMILIES
from engine_helpers import greedy_reference, lively_model, random_heads

from medusa_decoding.config import DEFAULT_TREE, GenerationConfig
from medusa_decoding.decoding import decode
from medusa_decoding.kernels import (Int8Linear, PackedLinear, guess_projection, resolve_kernels, stock_kernels,
                                     use_kernels)
from medusa_decoding.tree import Tree

PROMPT = torch.tensor([17, 3, 88, 41, 5, 60, 29, 72, 11, 94, 38, 50])
NEW_TOKENS = 48

pytestmark = pytest.mark.usefixtures("one_thread")


def packed_copy(model):
    return use_kernels(copy.deepcopy(model), "packed")


def test_packed_model_computes_the_stock_logits_and_keeps_its_state_dict(family):
    model = lively_model(family)
    packed = packed_copy(model)
    assert any(isinstance(m, PackedLinear) for m in packed.modules())
    with torch.no_grad():
        expected, got = model(PROMPT[None]).logits, packed(PROMPT[None]).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    state, packed_state = model.state_dict(), packed.state_dict()
    assert state.keys() == packed_state.keys()  # the packed weights are not saved
    assert all(torch.equal(state[k], packed_state[k]) for k in state)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_medusa_on_packed_kernels_equals_stock_generate(family):
    model = lively_model(family, seed=FAMILIES.index(family))
    reference = greedy_reference(model, PROMPT, NEW_TOKENS)  # stock kernels
    packed = packed_copy(model)
    config = GenerationConfig(max_new_tokens=NEW_TOKENS)
    steps = list(decode(packed, random_heads(packed), PROMPT, config, Tree.from_spec(DEFAULT_TREE)))
    assert [t for step in steps for t in step] == reference


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_greedy_medusa_on_compiled_kernels_equals_stock_generate(family):
    model = lively_model(family, seed=FAMILIES.index(family))
    reference = greedy_reference(model, PROMPT, NEW_TOKENS)
    compiled = use_kernels(copy.deepcopy(model), "compiled")
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    config = GenerationConfig(max_new_tokens=NEW_TOKENS)
    steps = list(decode(compiled, random_heads(compiled), PROMPT, config, Tree.from_spec(DEFAULT_TREE)))
    assert [t for step in steps for t in step] == reference
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= graphs + 3  # prefill, trees, one token
    assert isinstance(guess_projection(compiled), Int8Linear)
    with stock_kernels(compiled):
        assert compiled.base_model._compiled_call_impl is None  # transformers' own eager forward
    assert compiled.base_model._compiled_call_impl is not None


def test_stock_kernels_runs_stock_inside_and_packed_after():
    packed = packed_copy(lively_model("llama"))
    linears = [m for m in packed.modules() if isinstance(m, torch.nn.Linear)]
    with stock_kernels(packed):
        assert all(type(m) is torch.nn.Linear for m in linears)
    assert all(type(m) is PackedLinear for m in linears)


def test_resolve_kernels():
    assert resolve_kernels("auto", torch.device("cpu"), torch.float32) == "packed"
    assert resolve_kernels("auto", torch.device("cpu"), torch.bfloat16) == "stock"
    assert resolve_kernels("stock", torch.device("cpu"), torch.float32) == "stock"
    assert resolve_kernels("compiled", torch.device("cpu"), torch.bfloat16) == "compiled"
    with pytest.raises(ValueError, match="float32 only"):
        resolve_kernels("packed", torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match="kernels must be one of"):
        resolve_kernels("fast", torch.device("cpu"), torch.float32)


def test_packed_linears_run_stock_below_min_rows():
    packed = packed_copy(lively_model("llama"))
    layer = next(m for m in packed.modules() if isinstance(m, PackedLinear))
    layer.min_rows = 3
    x = torch.randn(3, layer.in_features)
    with torch.no_grad():
        assert torch.equal(layer(x[:2]), torch.nn.functional.linear(x[:2], layer.weight, layer.bias))
        expected = torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")
        assert torch.equal(layer(x), expected)


@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_approximates_its_float_layer(bias):
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 1000, bias=bias)
    x = torch.randn(5, 3, 64)
    with torch.no_grad():
        expected, got = layer(x), Int8Linear(layer)(x)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    error = (got - expected).abs().max() / expected.abs().max()
    assert error < 0.02  # 8-bit weights and bfloat16 activations: about 1% of the largest logit
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9


def test_guesses_go_through_an_int8_copy_of_the_lm_head_under_packed_kernels(family):
    model = lively_model(family)
    assert guess_projection(model) is model.get_output_embeddings()
    packed = packed_copy(model)
    guesses = guess_projection(packed)
    assert isinstance(guesses, Int8Linear) and guesses is not packed.get_output_embeddings()
    assert use_kernels(packed, "packed") is packed and guess_projection(packed) is guesses  # made once
    hidden = torch.randn(4, model.config.hidden_size)
    with torch.no_grad():
        exact = packed.get_output_embeddings()(hidden)
        torch.testing.assert_close(exact, model.get_output_embeddings()(hidden), rtol=1e-4, atol=1e-4)  # float32 still
        assert (guesses(hidden).argmax(-1) == exact.argmax(-1)).all()
