"""The CPU kernels: native linears compute what stock ones do, row by row whatever the batch, keep MEDUSA lossless,
and switch back; weights dequantized from GGUF blocks are read as those blocks (packed side by side from a large
page), to the same bits, or with 8-bit activations (q8: every instruction path the same bits); native attention gives
a tree node what a one-token pass gives its token, so a tree pass is bitwise a run of one-token passes (the compiled
engine: test_compiled); grouped-query attention over a tree reads the keys in place; the heads guess through a copy of
the LM head's rows (its GGUF blocks, else int8); on q8 kernels a Llama-shaped model's step runs each layer in one
native call, as `transformers` runs it; where a C++ compiler is, the kernels build (else every test that needs them
would skip)."""

import contextlib
import copy
import json
import math
import mmap
import os
import shutil
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import FAMILIES, needs_compiler, needs_native, tiny_tokenizer
from engine_helpers import decode, engine_prefill, greedy_reference, lively_model, random_heads, tree_mask, verify
from gguf_helpers import SCALES, random_blocks

from medusa_decoding import MedusaModel, gguf_file, kernels, native_layers
from medusa_decoding.config import DEFAULT_TREE, GenerationConfig
from medusa_decoding.decoding import PLAIN
from medusa_decoding.eager import prefill, step_forward
from medusa_decoding.kernels import (
    GROUPED_ATTENTION,
    GROUPED_SDPA,
    INVARIANT_ATTENTION,
    LARGE_PAGE,
    MAX_ROWS,
    Q8_PATHS,
    BlockRows,
    Int8Linear,
    NativeLinear,
    Q8Linear,
    block_codes,
    compile_error,
    guess_projection,
    load_native,
    native_build,
    native_linears,
    q8_pack,
    reads_blocks,
    reset_kernels,
    resolve_engine,
    resolve_kernels,
    set_guess_vocab,
    stock_kernels,
    use_kernels,
)
from medusa_decoding.tree import Tree

PROMPT = torch.tensor([17, 3, 88, 41, 5, 60, 29, 72, 11, 94, 38, 50])
NEW_TOKENS = 48

pytestmark = pytest.mark.usefixtures("one_thread")


def q8_paths() -> list[str]:
    """The instruction paths of medusa::linear_q8 this CPU runs (all give the same bits), slowest first."""
    return [name for name in load_native().q8_path_names() if name]


def native_copy(model):
    return use_kernels(copy.deepcopy(model), "native")


@needs_native
@pytest.mark.parametrize(("rows", "in_features", "out_features"), [(1, 64, 96), (7, 40, 7), (130, 576, 33)])
def test_native_linear_is_batch_invariant_and_computes_x_wt(rows, in_features, out_features):
    load_native()
    torch.manual_seed(rows)
    x, w = torch.randn(rows, in_features), torch.randn(out_features, in_features)
    out = kernels.native_ops().linear(x, w)  # any K (tails of 16 lanes), any N (tails of 4 rows)
    torch.testing.assert_close(out, x @ w.T, rtol=1e-5, atol=1e-4)
    for m in range(rows):  # every row exactly as computed alone, and within any batch
        assert torch.equal(kernels.native_ops().linear(x[m : m + 1], w), out[m : m + 1])
    assert torch.equal(kernels.native_ops().linear(x[rows // 2 :], w), out[rows // 2 :])
    assert torch.equal(kernels.native_ops().linear(x.T.contiguous().T, w), out)  # strided input


@needs_native
def test_torch_compile_traces_the_engines_ops_without_a_graph_break():
    """native_ops() is a constant to torch.compile (engine_variant): its graphs call the engine's variant's ops."""
    linear = native_linears(torch.nn.Linear(64, 32))[0]
    x = torch.randn(4, 64)
    with torch.no_grad():
        assert torch.equal(torch.compile(linear, backend="eager", fullgraph=True)(x), linear(x))


def gguf_exact(weight: torch.Tensor, qtype: str) -> torch.Tensor:
    """The weight as a GGUF file of `qtype` holds it: quantized and dequantized by the `gguf` package itself."""
    from gguf import GGMLQuantizationType, quants

    kind = GGMLQuantizationType[qtype]
    return torch.from_numpy(quants.dequantize(quants.quantize(weight.detach().numpy(), kind), kind))


def gguf_model(family: str):
    """A lively model whose weights are what a GGUF file holds, as the embedded default's: linears Q4_1, the
    (tied) embedding Q8_0."""
    model = lively_model(family, seed=FAMILIES.index(family))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.ndim == 2:
                parameter.copy_(gguf_exact(parameter, "Q8_0" if "embed" in name else "Q4_1"))
    return model


@needs_native
@pytest.mark.parametrize(("qtype", "bits"), [("Q4_1", 4), ("Q8_0", 8)])
def test_gguf_blocks_are_read_to_the_same_bits(qtype, bits):
    load_native()
    torch.manual_seed(bits)
    weight = torch.randn(37, 96)  # 37 rows: a tail tile
    weight[3] = 0  # blocks of zeros (d = 0) and a constant block
    weight[5, 32:64] = 0.25
    weight = gguf_exact(weight, qtype)
    codes, scales = block_codes(weight)
    assert codes.dtype == torch.uint8 and codes.shape == (37, 96 * bits // 8) and scales.shape == (37, 3, 2)
    for rows in range(10):  # none; up to 8 tokens the blocks are decoded in registers, above into a buffer
        x = torch.randn(rows, 96)
        ops = kernels.native_ops()
        assert torch.equal(ops.linear_blocks(x, codes, scales, bits), ops.linear(x, weight))


def test_weights_that_are_not_exact_blocks_keep_float32():
    weight = gguf_exact(torch.randn(8, 64), "Q4_1")
    assert block_codes(weight) is not None
    weight[5, 17] = torch.nextafter(weight[5, 17], torch.tensor(1.0))  # one weight an ulp off its block's grid
    assert block_codes(weight) is None
    assert block_codes(torch.randn(8, 64)) is None  # weights never quantized
    assert block_codes(gguf_exact(torch.randn(8, 64), "Q8_0").bfloat16()) is None  # float32 only
    assert block_codes(torch.zeros(8, 48)) is None  # rows not made of whole blocks


@needs_native
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_model_dequantized_from_gguf_runs_on_its_blocks_with_the_same_bits(family):
    model = gguf_model(family)
    reference = greedy_reference(model, PROMPT, NEW_TOKENS)
    native = native_copy(model)
    linears = [m for m in native.modules() if isinstance(m, NativeLinear)]
    assert linears and all(hasattr(m, "codes") for m in linears) and reads_blocks(native) and not reads_blocks(model)
    assert native.state_dict().keys() == model.state_dict().keys()  # the codes are not saved
    steps = list(decode(native, random_heads(native), PROMPT, GenerationConfig(max_new_tokens=NEW_TOKENS),
                        Tree.from_spec(DEFAULT_TREE)))
    assert [t for step, _ in steps for t in step] == reference
    tree = Tree.from_spec(DEFAULT_TREE)
    tokens = torch.arange(tree.num_nodes) * 7 + 3

    def tree_logits(medusa_model) -> torch.Tensor:
        with torch.inference_mode():
            cache, _, _ = prefill(medusa_model, PROMPT, len(PROMPT) + tree.num_nodes)
            return verify(medusa_model, cache, tokens, tree, len(PROMPT))[0]

    on_blocks = tree_logits(native)
    for module in linears:
        del module.codes, module.scales
    assert torch.equal(on_blocks, tree_logits(native))  # float32 weights: the very same bits


@needs_native
@pytest.mark.parametrize("kernels_name", ["native", "q8"])
def test_a_switched_models_blocks_lie_side_by_side_from_a_large_page_as_packed(kernels_name):
    model = use_kernels(gguf_model("llama"), kernels_name)
    on_blocks = [m for m in model.modules() if "codes" in m._buffers]
    blocks = [t for m in on_blocks for t in (m._buffers["codes"], m._buffers["scales"])]
    starts = sorted({(t.data_ptr(), t.data_ptr() + t.nbytes) for t in blocks})  # the LM head's guess copy shares
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux: one buffer from a 2 MB boundary, each block on its own cache lines
        assert len({t.untyped_storage().data_ptr() for t in blocks}) == 1 and len(starts) > 8
        assert starts[0][0] % LARGE_PAGE == 0 and all(start % 64 == 0 for start, _ in starts)
        assert all(end <= start for (_, end), (start, _) in zip(starts, starts[1:]))
    else:  # where pages cannot be asked for, the blocks stay where packing left them
        assert len({t.untyped_storage().data_ptr() for t in blocks}) == len(starts)
    for module in on_blocks:
        if hasattr(module, "weight"):  # not the guess copy, which shares the LM head's
            packed = block_codes(module.weight)
            packed = q8_pack(*packed) if type(module) is Q8Linear else packed
            assert torch.equal(module.codes, packed[0]) and torch.equal(module.scales, packed[1])


@needs_native
def test_native_model_computes_the_stock_logits_and_keeps_its_state_dict(family):
    model = lively_model(family)
    native = native_copy(model)
    assert any(isinstance(m, NativeLinear) for m in native.modules())
    with torch.no_grad():
        expected, got = model(PROMPT[None]).logits, native(PROMPT[None]).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    state, native_state = model.state_dict(), native.state_dict()
    assert state.keys() == native_state.keys()
    assert all(torch.equal(state[k], native_state[k]) for k in state)


@needs_native
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_medusa_on_native_kernels_equals_stock_generate(family):
    model = lively_model(family, seed=FAMILIES.index(family))
    reference = greedy_reference(model, PROMPT, NEW_TOKENS)  # stock kernels
    native = native_copy(model)
    config = GenerationConfig(max_new_tokens=NEW_TOKENS)
    steps = list(decode(native, random_heads(native), PROMPT, config, Tree.from_spec(DEFAULT_TREE)))
    assert [t for step, _ in steps for t in step] == reference


@needs_native
def test_stock_kernels_runs_stock_inside_and_native_after():
    native = native_copy(lively_model("llama"))
    linears = [m for m in native.modules() if isinstance(m, torch.nn.Linear)]
    assert native.config._attn_implementation == INVARIANT_ATTENTION
    with stock_kernels(native):
        assert all(type(m) is torch.nn.Linear for m in linears)
        assert native.config._attn_implementation == "sdpa"
    assert all(type(m) is NativeLinear for m in linears)
    assert native.config._attn_implementation == INVARIANT_ATTENTION
    assert use_kernels(lively_model("llama", attn="eager"), "native").config._attn_implementation == "eager"


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # 4 query heads sharing 2 key/value heads
@pytest.mark.parametrize("attention", [GROUPED_SDPA, GROUPED_ATTENTION])  # the second: the compiled engine's on a GPU
def test_grouped_attention_verifies_a_tree_as_sdpa_does_without_copying_keys(family, attention, monkeypatch):
    model, tree = lively_model(family), Tree.from_spec(DEFAULT_TREE)
    tokens = torch.arange(tree.num_nodes) * 7 + 3  # root + candidates
    fallbacks, transformers_sdpa = [], kernels.attention.sdpa_attention_forward

    def counted(module, query, *args, **kwargs):  # the query lengths grouped_sdpa hands to transformers
        fallbacks.append(query.shape[2])
        return transformers_sdpa(module, query, *args, **kwargs)

    monkeypatch.setattr(kernels.attention, "sdpa_attention_forward", counted)

    def tree_logits(attention: str) -> torch.Tensor:
        model.set_attn_implementation(attention)
        with torch.inference_mode():
            cache, _, _ = prefill(model, PROMPT, len(PROMPT) + tree.num_nodes)
            return verify(model, cache, tokens, tree, len(PROMPT))[0]

    grouped = tree_logits(attention)
    assert tree.num_nodes not in fallbacks  # the tree pass took the grouped path, every layer
    torch.testing.assert_close(grouped, tree_logits("sdpa"), rtol=1e-5, atol=1e-5)


@needs_native
def test_every_variant_this_cpu_runs_gives_the_same_bits_and_each_is_batch_invariant():
    """csrc/simd.h: each instruction-set variant (AVX-512, AVX2, baseline) does the same lane operations in the same
    order, so linears (float32, GGUF blocks, q8) and attention agree to the bit across variants, row by row."""
    variants = kernels.cpu_variants()
    assert variants[-1] == "baseline" and kernels.variant() in variants
    ops = {name: kernels.load_native(name) for name in variants}
    assert [o.variant() for o in ops.values()] == variants
    torch.manual_seed(0)
    for rows, in_features, out_features in [(1, 64, 96), (7, 40, 7), (5, 576, 37), (9, 96, 20), (130, 64, 5)]:
        x, weight = torch.randn(rows, in_features), torch.randn(out_features, in_features)
        weights = [(weight, None)]
        if in_features % 32 == 0:
            weights += [(gguf_exact(weight, qtype), qtype) for qtype in ("Q4_1", "Q8_0")]
        for w, qtype in weights:
            calls = [lambda o, x, w=w: o.linear(x, w)]  # each binds this iteration's weights
            if qtype is not None:
                codes, scales = block_codes(w)
                packed, bits = q8_pack(codes, scales), 8 * codes.shape[1] // in_features
                calls += [
                    lambda o, x, codes=codes, scales=scales, bits=bits: o.linear_blocks(x, codes, scales, bits),
                    lambda o, x, packed=packed, out_features=out_features: o.linear_q8(x, *packed, out_features, -1),
                ]
            for call in calls:
                outs = {name: call(o, x) for name, o in ops.items()}
                for name, out in outs.items():
                    assert torch.equal(out, outs["baseline"]), (name, rows, in_features, qtype)
                    for m in range(0, rows, 3):  # each row as computed alone
                        assert torch.equal(call(ops[name], x[m : m + 1]), out[m : m + 1]), (name, rows, qtype)
    tree = Tree.from_spec(DEFAULT_TREE)
    for heads, kv_heads, head_dim, prefix in [(9, 3, 64, 150), (4, 2, 8, 37)]:
        n, keys = tree.num_nodes, prefix + tree.num_nodes
        q, k, v = torch.randn(1, heads, n, head_dim), *torch.randn(2, 1, kv_heads, keys, head_dim)
        mask = torch.zeros(1, n, keys)
        mask[:, :, prefix:] = torch.where(tree.attention, 0.0, torch.finfo(torch.float32).min)
        for cache in ((k, v), (k.half(), v.half())):  # a float16 cache (the q8 engine's) widened alike
            outs = {name: o.attention(q, *cache, mask, 0.125) for name, o in ops.items()}
            assert all(torch.equal(out, outs["baseline"]) for out in outs.values())
    model = use_kernels(gguf_model("llama"), "q8")  # a native layer: its keys, values and output
    config, (*weights, eps, scale) = model.config, native_layers.weights(model)[0]
    x, cos, sin = torch.randn(2, tree.num_nodes, config.hidden_size), *torch.randn(2, 2, tree.num_nodes, 8)
    columns = torch.tensor([[len(PROMPT)], [3]]) + torch.arange(tree.num_nodes)
    mask = tree_mask(tree, len(PROMPT), torch.float32, "cpu")[:, 0].expand(2, -1, -1)
    layers = {}
    for name, o in ops.items():
        cache = [torch.zeros(2, config.num_key_value_heads, 32, 8, dtype=native_layers.CACHE) for _ in range(2)]
        layers[name] = o.layer_q8(x, *weights, *cache, columns, cos, sin, mask, eps, scale), *cache
    assert all(all(map(torch.equal, out, layers["baseline"])) for out in layers.values())


@needs_native
@pytest.mark.parametrize("qtype", [name for name in gguf_file.TENSOR_TYPES if name in SCALES])
def test_gguf_blocks_of_every_type_give_the_gguf_packages_weights_on_every_variant(qtype):
    """medusa::linear_gguf reads a GGUF file's blocks as they lie: identity rows read back bitwise the weights the
    `gguf` package's dequantize gives; any x gets bitwise medusa::linear over those weights, on every variant this CPU
    runs, each row as it gets alone."""
    from gguf import GGMLQuantizationType, quants

    kind = GGMLQuantizationType[qtype]
    raw = random_blocks(np.random.default_rng(int(kind)), 37, 512, qtype)  # 37 rows: a tail tile
    weight = torch.from_numpy(quants.dequantize(raw, kind))
    blocks = torch.from_numpy(raw)
    for name in kernels.cpu_variants():
        ops = kernels.load_native(name)
        assert torch.equal(ops.linear_gguf(torch.eye(512), blocks, int(kind)).T, weight), name
        for rows in (0, 1, 3, 8, 9, 130):
            x = torch.randn(rows, 512)
            out = ops.linear_gguf(x, blocks, int(kind))
            assert torch.equal(out, ops.linear(x, weight)), (name, rows)
            assert all(torch.equal(ops.linear_gguf(x[m : m + 1], blocks, int(kind)), out[m : m + 1])
                       for m in range(0, rows, 4))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q8_0"])
def test_gguf_codes_decode_to_the_gguf_packages_weights(qtype):
    """The codes q8 kernels read from a GGUF linear's blocks (Q4_0 and Q5_0 as Q8_0's signed codes): code * d + m is
    bitwise the `gguf` package's weight, each product exact."""
    from gguf import GGMLQuantizationType, quants

    kind = GGMLQuantizationType[qtype]
    raw = random_blocks(np.random.default_rng(int(kind)), 37, 512, qtype)
    linear = torch.nn.Linear(512, 37, bias=False)
    linear.register_buffer("blocks", torch.from_numpy(raw))
    linear.kind = int(kind)
    assert (kernels.gguf_codes(linear) is None) == (qtype in ("Q4_0", "Q5_0"))  # float kernels: their own blocks
    codes, scales = kernels.gguf_codes(linear, signed=True)
    d, m = scales.reshape(37, 16, 1, 2).unbind(-1)
    bits = 4 if qtype == "Q4_1" else 8
    if bits == 4:  # byte j: weight j's code in the low nibble, weight j + 16's in the high one
        codes = codes.reshape(37, 16, 16)
        codes = torch.cat([codes & 15, codes >> 4], -1)
    weight = (codes.reshape(37, 16, 32).double() * d.double() + m.double()).float().reshape(37, 512)
    assert torch.equal(weight, torch.from_numpy(quants.dequantize(raw, kind)))
    assert kernels.q8_pack(*kernels.gguf_codes(linear, signed=True)) is not None  # float16 scales: q8 reads them


def q8k_reference(x: torch.Tensor, raw: np.ndarray, qtype: str) -> torch.Tensor:
    """linear_k's arithmetic in float64, written from llama.cpp's: x per 256 to Q8_K (codes min(127, round(-127 / max
    * x)), max the value of largest magnitude, ties to even; d = 1 / (-127 / max)), each weight as the integers and
    scales of its block (gguf's dequantize divided back), every product summed exactly."""
    from gguf import GGMLQuantizationType, quants

    blocks = x.reshape(x.shape[0], -1, 256).double()
    where = blocks.abs().argmax(-1, keepdim=True)
    iscale = (-127.0 / blocks.gather(-1, where).float()).double()  # float32, as llama.cpp computes it
    q = torch.where(iscale.isfinite(), (blocks.float() * iscale.float()).double().round().clamp(max=127), 0)
    d = torch.where(iscale.isfinite(), (1 / iscale.float()).double(), 0)
    weight = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[qtype]).astype(np.float64))
    return torch.einsum("mbj,nbj->mn", q * d, weight.reshape(weight.shape[0], -1, 256))


@needs_native
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_k_quant_linear_paths_give_the_same_bits_llama_cpps_arithmetic_and_nearly_float32(qtype):
    """medusa::linear_k (q8 kernels on Q4_K and Q6_K blocks): the scalar and AVX2 paths, on every variant
    this CPU runs, give the same bits; each token its own whatever the tokens beside it; llama.cpp's arithmetic (Q8_K
    activations, integer sums), and near the float32 product."""
    from gguf import GGMLQuantizationType

    kind = int(GGMLQuantizationType[qtype])
    raw = random_blocks(np.random.default_rng(kind), 21, 512, qtype)
    blocks = torch.from_numpy(raw)
    torch.manual_seed(kind)
    x = torch.randn(11, 512)
    x[0, :256] = 0  # a block of zero activations
    x[1, 7] = 40.0  # a block whose largest value is positive (its codes' signs flip)
    out = kernels.load_native().linear_k(x, blocks, kind, -1)
    ran = set()
    for name in kernels.cpu_variants():
        ops = kernels.load_native(name)
        for path in (0, 1):  # scalar, AVX2
            with contextlib.suppress(RuntimeError):  # a path this build or CPU does not run
                assert torch.equal(ops.linear_k(x, blocks, kind, path), out), (name, path)
                ran.add(path)
    assert {0, 1} <= ran or "avx2" not in kernels.cpu_variants()
    for size in (1, 3, 8, 9):
        for at in (0, size - 1):
            batch = torch.randn(size, 512)
            batch[at] = x[4]
            assert torch.equal(kernels.native_ops().linear_k(batch, blocks, kind, -1)[at], out[4])
    torch.testing.assert_close(out.double(), q8k_reference(x, raw, qtype), rtol=1e-5, atol=1e-4)
    exact = x @ kernels.native_ops().dequantize_gguf(blocks, kind).T
    usual = [m for m in range(len(x)) if m != 1]  # the outlier's block rounds coarsely, as it does in llama.cpp
    assert float((out - exact)[usual].norm() / exact[usual].norm()) < Q8_TOLERANCE


@needs_native
def test_gguf_linear_refuses_a_type_it_does_not_read_and_rows_of_part_blocks():
    ops = load_native()
    with pytest.raises(RuntimeError, match="GGUF type 10 is not one it reads"):  # Q2_K
        ops.linear_gguf(torch.randn(1, 256), torch.zeros(4, 84, dtype=torch.uint8), 10)
    with pytest.raises(RuntimeError, match="whole blocks of 34 bytes"):
        ops.linear_gguf(torch.randn(1, 32), torch.zeros(4, 35, dtype=torch.uint8), 8)


def test_medusa_isa_forces_a_variant_and_refuses_one_this_cpu_lacks():
    import subprocess
    import sys

    def engine_variant(value: str) -> subprocess.CompletedProcess:
        code = "from medusa_decoding import kernels; print(kernels.variant())"
        return subprocess.run([sys.executable, "-c", code], env={**os.environ, kernels.VARIANT_ENV: value},
                              capture_output=True, text=True)

    assert engine_variant("baseline").stdout.strip() == "baseline"
    missing = next((name for name in kernels.VARIANTS if name not in kernels.cpu_variants()), "sse9")
    refused = engine_variant(missing)
    assert refused.returncode != 0 and f"MEDUSA_ISA={missing!r}: this CPU runs the variants" in refused.stderr


def test_the_native_kernels_build_wherever_a_compiler_is():
    from torch.utils.cpp_extension import get_cxx_compiler

    if shutil.which(get_cxx_compiler()) is None:
        assert native_build().startswith("no C++ compiler")
    else:  # a failing build is a bug in csrc/, not a machine without kernels
        assert native_build() is None, native_build()


@needs_native
def test_a_build_killed_midway_does_not_hang_the_next_process():
    """torch's build lock, left behind by a process killed while building, made every later process wait for ever;
    the build's own lock (flock) dies with its process, and under it the stale one is cleared."""
    stale = kernels.build.build_directory(kernels.variant()) / "lock"
    stale.touch()
    loaded = subprocess.run([sys.executable, "-c", "from medusa_decoding import kernels; kernels.load_native()"],
                            capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr
    assert not stale.exists()


@needs_native
def test_auto_kernels_take_the_fastest_measured_never_slower_than_stock_and_measure_once(tmp_path, monkeypatch,
                                                                                         capsys):
    from medusa_decoding import calibrate

    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path))
    model = gguf_model("llama")  # GGUF blocks: q8 is a candidate too
    heads = random_heads(model)
    medusa = MedusaModel.assemble(model, tiny_tokenizer(), heads, None, "auto")  # from_pretrained times "auto"
    record = json.loads(next((tmp_path / "kernels").glob("auto-*.json")).read_text())
    timed = {name: sum(ms) for name, ms in record["latency_ms"].items()}
    assert set(timed) == {"stock", "native", "q8"} and medusa.kernels == record["kernels"] == min(timed, key=timed.get)
    assert timed[medusa.kernels] <= timed["stock"]
    assert f"medusa: kernels auto -> {medusa.kernels}: the fastest here" in capsys.readouterr().err
    assert reads_blocks(model) == (medusa.kernels != "stock")  # switched to the pick after the others were undone
    monkeypatch.setattr(calibrate.latency, "measure_step_latency", None)  # cached: nothing is timed again
    again = gguf_model("llama")
    assert MedusaModel.assemble(again, tiny_tokenizer(), random_heads(again), None, "auto").kernels == medusa.kernels


def test_auto_kernels_without_a_compiler_are_stock_with_one_line_saying_why(monkeypatch, capsys):
    monkeypatch.setattr(kernels.build, "build_variant", lambda isa: "no C++ compiler: 'c++' is not on PATH")
    kernels.native_available.cache_clear()  # it says why once a process
    try:
        model = lively_model("llama")
        assert MedusaModel(model, tiny_tokenizer(), random_heads(model), kernels="auto").kernels == "stock"
    finally:
        kernels.native_available.cache_clear()
    assert "running PyTorch's stock kernels: no C++ compiler" in capsys.readouterr().err


def test_resolve_kernels():
    assert resolve_kernels("auto", torch.device("cpu"), torch.float32) == ("stock" if native_build() else "native")
    assert resolve_kernels("auto", torch.device("cpu"), torch.bfloat16) == "stock"
    assert resolve_kernels("stock", torch.device("cpu"), torch.float32) == "stock"
    if compile_error("cpu") is None:
        assert resolve_engine("compiled", torch.device("cpu"))
    else:
        with pytest.raises(ValueError, match="engine='compiled' cannot run here: no C.. compiler"):
            resolve_engine("compiled", torch.device("cpu"))
    assert not resolve_engine("auto", torch.device("cpu")) and not resolve_engine("eager", torch.device("cpu"))
    with pytest.raises(ValueError, match="kernels must be one of .*, got 'compiled'"):
        resolve_kernels("compiled", torch.device("cpu"), torch.float32)  # an engine, not kernels
    with pytest.raises(ValueError, match="engine must be one of .*, got 'native'"):
        resolve_engine("native", torch.device("cpu"))
    if native_build() is not None:
        with pytest.raises(ValueError, match="kernels='native' cannot run here: .*compiler"):
            resolve_kernels("native", torch.device("cpu"), torch.float32)
    for name in ("native", "q8"):
        with pytest.raises(ValueError, match="float32 only"):
            resolve_kernels(name, torch.device("cpu"), torch.bfloat16)
        if native_build() is None:
            assert resolve_kernels(name, torch.device("cpu"), torch.float32) == name
    with pytest.raises(ValueError, match="kernels must be one of"):
        resolve_kernels("fast", torch.device("cpu"), torch.float32)


@needs_native
@pytest.mark.parametrize("bias", [False, True])
def test_native_linears_run_stock_above_max_rows(bias):
    load_native()
    layer = NativeLinear(48, 20, bias=bias)
    x = torch.randn(MAX_ROWS + 1, 48)
    with torch.no_grad():
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))  # a prefill
        expected = kernels.native_ops().linear(x[:MAX_ROWS], layer.weight) + (layer.bias if bias else 0)
        assert torch.equal(layer(x[:MAX_ROWS].reshape(2, MAX_ROWS // 2, 48)).reshape(MAX_ROWS, 20), expected)


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


@needs_native
def test_a_guess_vocabulary_ranks_its_tokens_only_and_decoding_stays_lossless(family):
    model = lively_model(family, seed=FAMILIES.index(family))
    reference = greedy_reference(model, PROMPT, NEW_TOKENS)
    native, vocab_size = native_copy(model), model.get_output_embeddings().out_features
    heads, vocab = random_heads(native), torch.randperm(vocab_size, generator=torch.Generator().manual_seed(0))[:24]
    hidden = torch.randn(5, model.config.hidden_size)
    with torch.no_grad():
        everything = heads(hidden, guess_projection(native))  # [K, 5, V]
        set_guess_vocab(native, vocab)
        some = heads(hidden, guess_projection(native))  # [K, 5, 24]
        torch.testing.assert_close(some, everything[..., vocab], rtol=1e-6, atol=1e-6)  # the same rows, quantized alike
        outside = torch.ones(vocab_size, dtype=torch.bool)
        outside[vocab] = False
        best = everything.masked_fill(outside, float("-inf")).topk(3, dim=-1).values
        guesses = heads.guesses(hidden, guess_projection(native), 3)  # [K, 5, 3] token ids
        assert not outside[guesses].any() and torch.equal(everything.gather(-1, guesses), best)  # ties in any order
    steps = list(decode(native, heads, PROMPT, GenerationConfig(max_new_tokens=NEW_TOKENS),
                        Tree.from_spec(DEFAULT_TREE)))
    assert [t for step, _ in steps for t in step] == reference
    set_guess_vocab(native, None)
    assert guess_projection(native).rows is None and guess_projection(native).weight.shape[0] == vocab_size
    for bad in (torch.tensor([0, vocab_size]), torch.tensor([3, 3, 4]), torch.tensor([], dtype=torch.long)):
        with pytest.raises(ValueError, match="guess vocabulary"):
            set_guess_vocab(native, bad)
    set_guess_vocab(model, vocab)  # stock kernels: no int8 copy, the guesses stay on the whole vocabulary
    assert guess_projection(model) is model.get_output_embeddings()


@needs_native
def test_guesses_go_through_an_int8_copy_of_the_lm_head_under_native_kernels(family):
    model = lively_model(family)
    assert guess_projection(model) is model.get_output_embeddings()
    native = native_copy(model)
    guesses = guess_projection(native)
    assert isinstance(guesses, Int8Linear) and guesses is not native.get_output_embeddings()
    assert use_kernels(native, "native") is native and guess_projection(native) is guesses  # made once
    hidden = torch.randn(4, model.config.hidden_size)
    with torch.no_grad():
        exact = native.get_output_embeddings()(hidden)
        torch.testing.assert_close(exact, model.get_output_embeddings()(hidden), rtol=1e-4, atol=1e-4)  # float32 still
        assert (guesses(hidden).argmax(-1) == exact.argmax(-1)).all()


# --- 8-bit activations, batch-invariant attention --------------------------------------------------------------------

Q8_TOLERANCE = 0.015  # |q8 - float32| / |float32| over a layer's outputs: 8-bit activations (measured 0.5-0.6%)


@needs_native
@pytest.mark.parametrize("kernels_", ["native", "q8"])
def test_guesses_read_the_lm_heads_gguf_blocks_where_it_has_them_to_the_same_bits(kernels_):
    native = use_kernels(gguf_model("llama"), kernels_)
    lm_head = native.get_output_embeddings()
    vocab = torch.tensor([5, 0, 17, 3, 40, *range(60, 80)])  # q8: more rows than a group of 16, out of order
    hidden = torch.randn(3, native.config.hidden_size)
    with torch.no_grad():
        guesses = guess_projection(native)
        assert isinstance(guesses, BlockRows) and guesses.codes is lm_head.codes  # all rows: shared, not copied
        assert torch.equal(guesses(hidden), lm_head(hidden))
        set_guess_vocab(native, vocab)
        assert torch.equal(guess_projection(native)(hidden), lm_head(hidden)[:, vocab])


@needs_native
@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_under_q8_kernels_the_heads_layers_read_their_weights_rounded_to_q8_blocks(kind):
    model = gguf_model("llama")
    heads = random_heads(model, kind=kind)
    exact = copy.deepcopy(heads)
    MedusaModel(model, tiny_tokenizer(), heads, kernels="q8")
    linears = [m for m in heads.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is Q8Linear for m in linears)
    assert all(torch.equal(a, b) for a, b in zip(heads.state_dict().values(), exact.state_dict().values()))
    for linear in linears:  # GGUF's Q8_0 of the weight: per block of 32, round(w / d) * d, d = amax / 127 in float16
        blocks = linear.weight.detach().reshape(linear.out_features, -1, 32)
        d = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()
        rounded = ((blocks / d).round() * d).flatten(1) + 0.0  # no -0.0: GGUF's code * d + m never gives one
        assert float((rounded - linear.weight.detach()).abs().max()) <= float(d.max()) / 2
        assert all(torch.equal(a, b) for a, b in zip(kernels.q8_rounded(linear.weight), q8_pack(*block_codes(rounded))))
    hidden, lm_head = torch.randn(5, model.config.hidden_size), guess_projection(model)
    embeds = model.get_input_embeddings()(torch.randint(model.config.vocab_size, (5, heads.config.num_heads)))
    with torch.no_grad():
        got = heads(hidden, lm_head, embeds=embeds if kind == "hydra" else None)
        expected = exact(hidden, lm_head, embeds=embeds if kind == "hydra" else None)
    assert float((got - expected).norm() / expected.norm()) < Q8_TOLERANCE
    MedusaModel(model, tiny_tokenizer(), heads, kernels="native")  # the same heads, other kernels: switched afresh
    assert all(type(m) is NativeLinear and "codes" not in m._buffers for m in linears)
    MedusaModel(model, tiny_tokenizer(), heads.float(), kernels="q8")  # scales made anew, float16 as the op takes
    assert all(type(m) is Q8Linear and m.scales.dtype == torch.float16 for m in linears)
    reset_kernels(heads)
    assert all(type(m) is torch.nn.Linear for m in linears)


def q8_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """linear_q8's arithmetic in float64, written from its description: x per block of 32 to round(x / d), d = amax /
    127; per block the integer sum of code * q, scaled by both d; Q4_1 adds its offset m times the block's
    d * sum(q)."""
    blocks = x.reshape(x.shape[0], -1, 32).double()
    d = blocks.abs().amax(-1, keepdim=True).float().div(127).double()
    q = torch.where(d > 0, blocks / d, 0).round().clamp(-127, 127)
    if bits == 4:  # byte i of a block: weight i (low nibble), weight i + 16 (high)
        packed = codes.reshape(codes.shape[0], -1, 16).long()
        w = torch.cat([packed & 15, packed >> 4], -1).double()
    else:
        w = codes.reshape(codes.shape[0], -1, 32).double() - 128  # q + 128 stored: the signed code
    dots = torch.einsum("mbj,nbj->mnb", q, w)  # exact integers in float64
    out = dots * scales[None, :, :, 0].double() * d[:, None, :, 0]
    if bits == 4:
        out = out + scales[None, :, :, 1].double() * (d[..., 0] * q.sum(-1))[:, None, :]
    return out.sum(-1)


@needs_native
def test_q8_activations_round_half_to_even_on_every_path():
    """A block whose largest value is 127 has d = 1, so its codes are round(x): ties go to the even integer (4.5 ->
    4, 5.5 -> 6, -2.5 -> -2); 0.5 away from zero would give other outputs. Identity weights read the codes back."""
    load_native()
    codes, scales = block_codes(gguf_exact(torch.eye(32), "Q8_0"))  # row j: 127 * d_w at column j
    packed = q8_pack(codes, scales)
    ties = torch.arange(-15, 15) + 0.5
    x = torch.cat([torch.tensor([127.0]), ties, torch.tensor([-126.5])])[None]
    assert not torch.equal(x.round(), x.sign() * (x.abs() + 0.5).floor())  # the ties tell the two roundings apart
    expected = (x.round() * 127) * scales[:, 0, 0].float()  # the integer sum times d_w * d_x, rounded once
    for name in q8_paths():
        assert torch.equal(kernels.native_ops().linear_q8(x, *packed, 32, Q8_PATHS.index(name)), expected), name


@needs_native
@pytest.mark.parametrize(("qtype", "bits"), [("Q4_1", 4), ("Q8_0", 8)])
@pytest.mark.parametrize(("rows", "in_features", "out_features"), [(1, 32, 5), (9, 96, 37), (6, 576, 20), (130, 64, 3)])
def test_q8_linear_paths_give_the_same_bits_its_arithmetic_and_nearly_float32(qtype, bits, rows, in_features,
                                                                              out_features):
    load_native()
    torch.manual_seed(rows)
    weight = gguf_exact(torch.randn(out_features, in_features), qtype)
    weight[out_features // 2] = 0  # a row of zero blocks (d = 0)
    codes, scales = block_codes(weight)
    packed = q8_pack(codes, scales)
    x = torch.randn(rows, in_features)
    x[0, 32:64] = 0  # a block of zero activations (where there are two)
    paths = q8_paths()
    assert "scalar" in paths and all(name in Q8_PATHS for name in paths)
    out = {name: kernels.native_ops().linear_q8(x, *packed, out_features, Q8_PATHS.index(name)) for name in paths}
    fastest = kernels.native_ops().linear_q8(x, *packed, out_features, -1)
    assert all(torch.equal(o, fastest) for o in out.values()), {n: float((o - fastest).abs().max())
                                                                for n, o in out.items()}
    for m in range(min(rows, 5)):  # each token as computed alone
        assert torch.equal(kernels.native_ops().linear_q8(x[m : m + 1], *packed, out_features, -1), fastest[m : m + 1])
    for size in range(2, 18):  # and first or last among others: in every pass size a group's tokens take (8, the rest)
        m, others = size % min(rows, 5), torch.randn(size, in_features)
        for at in (0, size - 1):
            batch = others.clone()
            batch[at] = x[m]
            assert torch.equal(kernels.native_ops().linear_q8(batch, *packed, out_features, -1)[at], fastest[m])
    torch.testing.assert_close(fastest.double(), q8_reference(x, codes, scales, bits), rtol=1e-5, atol=1e-5)
    exact = x @ weight.T
    assert float((fastest - exact).norm() / exact.norm()) < Q8_TOLERANCE


@needs_native
def test_a_q8_linear_runs_a_prefills_rows_in_q8_and_a_recorded_pass_in_float32():
    """Past MAX_ROWS rows (a prompt) a Q8Linear still quantizes each row, as its few-row passes do (each row bitwise
    what it gets alone); where autograd records, float32 linears, whose backward exists."""
    load_native()
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 24)
    linear.weight.data = gguf_exact(torch.randn(24, 64), "Q4_1")
    linear.__class__ = Q8Linear
    for name, tensor in zip(("codes", "scales"), q8_pack(*block_codes(linear.weight.data)), strict=True):
        linear.register_buffer(name, tensor, persistent=False)
    x = torch.randn(MAX_ROWS + 72, 64)
    with torch.inference_mode():
        out = linear(x)
        assert all(torch.equal(linear(x[m : m + 1]), out[m : m + 1]) for m in (0, MAX_ROWS, MAX_ROWS + 71))
    recorded = linear(x.requires_grad_())
    torch.testing.assert_close(recorded, torch.nn.functional.linear(x, linear.weight, linear.bias))
    recorded.sum().backward()
    assert x.grad is not None and linear.weight.grad is not None


@needs_native
@pytest.mark.parametrize("kernels_name", ["native", "q8"])
@pytest.mark.parametrize("tokens", [1, 5])  # one query: native attention's path; five: a causal pass (sdpa)
def test_a_switched_model_trains_with_the_stock_gradients_whatever_its_rows(kernels_name, tokens):
    """The medusa ops have no backward: a pass that autograd records (training a model switched to native or q8
    kernels, over a step's few rows) takes stock kernels and gets the stock model's gradients, with every weight
    trainable and with only the input embedding (an adapter's case: the layers' inputs need gradients)."""
    load_native()
    stock = gguf_model("llama")
    switched = use_kernels(copy.deepcopy(stock), kernels_name)
    ids = torch.randint(0, stock.config.vocab_size, (2, tokens), generator=torch.Generator().manual_seed(tokens))
    for trainable in (lambda name: True, lambda name: "embed_tokens" in name):
        for model in (stock, switched):
            model.zero_grad()
            for name, parameter in model.named_parameters():
                parameter.requires_grad_(trainable(name))
            model(ids).logits.logsumexp(-1).sum().backward()
        grads = {name: parameter.grad for name, parameter in switched.named_parameters()}
        for name, parameter in stock.named_parameters():
            assert (parameter.grad is None) == (not trainable(name))
            if parameter.grad is not None:
                torch.testing.assert_close(grads[name], parameter.grad, msg=name)


@needs_native
def test_q8_linear_refuses_a_path_this_cpu_lacks():
    load_native()
    packed = q8_pack(*block_codes(gguf_exact(torch.randn(4, 32), "Q4_1")))
    missing = [i for i, name in enumerate(Q8_PATHS) if name not in q8_paths()] + [len(Q8_PATHS)]
    with pytest.raises(RuntimeError, match="does not run on this CPU"):
        kernels.native_ops().linear_q8(torch.randn(1, 32), *packed, 4, missing[0])


def test_q8_pack_interleaves_16_rows_4_codes_at_a_time_and_keeps_only_float16_scales():
    codes = torch.arange(20 * 64, dtype=torch.int32).remainder(251).to(torch.uint8).reshape(20, 64)  # Q8_0, K = 64
    scales = torch.rand(20, 2, 2).half().float()
    packed, halves = q8_pack(codes, scales)
    assert packed.shape == (2, 2, 16 * 32) and halves.dtype == torch.float16
    for row, block, code in ((0, 0, 0), (5, 1, 7), (19, 1, 31)):  # code j of row r: vector j // 4, lane r, byte j % 4
        assert packed[row // 16, block, (code // 4) * 64 + (row % 16) * 4 + code % 4] == codes[row, block * 32 + code]
    assert torch.equal(halves[1, 1, :, 3].float(), scales[19, 1]) and not halves[1, :, :, 4:].any()  # padding rows
    assert q8_pack(codes, scales + 1e-4) is None  # not what a GGUF block holds


@needs_native
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "prefix"),  # 150: keys over three tiles of 64
                         [(9, 3, 64, 37), (9, 3, 64, 150), (4, 2, 8, 37), (2, 2, 128, 37)])
def test_native_attention_is_sdpa_computed_per_query_over_the_keys_it_sees(heads, kv_heads, head_dim, prefix):
    load_native()
    torch.manual_seed(head_dim)
    tree = Tree.from_spec(DEFAULT_TREE)
    n, keys = tree.num_nodes, prefix + tree.num_nodes
    q, k, v = (torch.randn(1, heads, n, head_dim), torch.randn(1, kv_heads, keys, head_dim),
               torch.randn(1, kv_heads, keys, head_dim))
    mask = torch.zeros(1, n, keys)
    mask[:, :, prefix:] = torch.where(tree.attention, 0.0, torch.finfo(torch.float32).min)
    scale = 1 / math.sqrt(head_dim)
    out = kernels.native_ops().attention(q, k, v, mask, scale)  # [B, T, H, D]
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale,
                                                                enable_gqa=True)
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=1e-5, atol=1e-5)
    for node in range(n):  # the same token in a one-token pass over its own keys, contiguous: the same bits
        seen = torch.cat([torch.arange(prefix), prefix + tree.attention[node].nonzero()[:, 0]])
        alone = kernels.native_ops().attention(q[:, :, node : node + 1], k[:, :, seen], v[:, :, seen], None, scale)
        assert torch.equal(alone[0, 0], out[0, node])


@needs_native
def test_native_attention_reads_a_float16_cache_as_the_float32_values_it_holds():
    """The q8 engine's cache holds float16 keys and values: read by every variant, widened exactly (every float16,
    infinities, NaNs and subnormals included: a key alone gets softmax weight 1, so the output is its value),
    and the attention over them is bitwise the attention over the same values in float32."""
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16).reshape(256, 1, 1, 256)
    q, k = torch.zeros(256, 1, 1, 256), torch.zeros(256, 1, 1, 256, dtype=torch.float16)
    torch.manual_seed(0)
    tree = Tree.from_spec(DEFAULT_TREE)
    n, keys = tree.num_nodes, 150 + tree.num_nodes
    queries, cache = torch.randn(1, 9, n, 64), torch.randn(2, 1, 3, keys, 64).half()
    mask = torch.zeros(1, n, keys)
    mask[:, :, 150:] = torch.where(tree.attention, 0.0, torch.finfo(torch.float32).min)
    for name in kernels.cpu_variants():
        ops = load_native(name)
        out = ops.attention(q, k, every, None, 1.0).flatten().view(torch.int32)
        assert torch.equal(out[1:], every.float().flatten().view(torch.int32)[1:]), name
        assert out[0] == 0  # -0.0: 1 * -0 added to 0 is +0, as in float32
        widened = ops.attention(queries, *cache.float(), mask, 0.125)
        assert torch.equal(ops.attention(queries, *cache, mask, 0.125), widened), name


@needs_native
def test_native_ops_over_no_token_give_empty_outputs():
    """A pass of no query, or of no row, gives an empty output, not a division by zero that kills the process."""
    load_native()
    k = torch.randn(1, 3, 11, 64).half()
    for rows, tokens in ((1, 0), (0, 4)):
        out = kernels.native_ops().attention(torch.randn(rows, 9, tokens, 64), k[:rows], k[:rows],
                                             torch.zeros(rows, tokens, 11), 0.125)
        assert out.shape == (rows, tokens, 9, 64)
    model = use_kernels(gguf_model("llama"), "q8")
    config, (*weights, eps, scale) = model.config, native_layers.weights(model)[0]
    cache = [torch.zeros(1, config.num_key_value_heads, 32, 8, dtype=native_layers.CACHE) for _ in range(2)]
    x, columns = torch.randn(1, 0, config.hidden_size), torch.zeros(1, 0, dtype=torch.long)
    out = kernels.native_ops().layer_q8(x, *weights, *cache, columns, *torch.randn(2, 1, 0, 8), torch.zeros(1, 0, 5),
                                        eps, scale)
    assert out.shape == x.shape


@needs_native
def test_native_attention_rows_of_a_batch_see_only_their_own_keys():
    """A batch of two: row 1's prefix is shorter, the columns between are a hole its mask hides (garbage there, even
    NaN, changes nothing); each row gets bitwise what it gets alone."""
    load_native()
    torch.manual_seed(0)
    heads, kv_heads, head_dim, width, short, n = 9, 3, 64, 20, 12, 3
    q = torch.randn(2, heads, n, head_dim)
    k, v = torch.randn(2, kv_heads, width + n, head_dim), torch.randn(2, kv_heads, width + n, head_dim)
    k[1, :, short:width], v[1, :, short:width] = float("nan"), float("nan")
    mask = torch.zeros(2, n, width + n)
    mask[1, :, short:width] = torch.finfo(torch.float32).min
    out = kernels.native_ops().attention(q, k, v, mask, 0.125)
    for row, prefix in ((0, width), (1, short)):
        seen = torch.cat([torch.arange(prefix), torch.arange(width, width + n)])
        alone = kernels.native_ops().attention(q[row : row + 1], k[row : row + 1, :, seen], v[row : row + 1, :, seen],
                                               torch.zeros(1, n, len(seen)), 0.125)
        assert torch.equal(alone[0], out[row])


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 40])  # whole vectors, and a partial last one
def test_native_attention_gives_a_query_what_it_gets_alone_whatever_keys_it_sees(head_dim, dtype):
    """Holes anywhere (hidden keys in the prefix, at its start, every key): the keys every query of a group sees from
    column 0 on go to several queries at once, the rest query by query; on every variant each query gets bitwise what
    it gets alone over its own keys, and a query that sees nothing gets zeros."""
    torch.manual_seed(head_dim)
    heads, kv_heads, n, keys = 6, 2, 7, 150
    q = torch.randn(2, heads, n, head_dim)
    k, v = torch.randn(2, kv_heads, keys, head_dim).to(dtype), torch.randn(2, kv_heads, keys, head_dim).to(dtype)
    seen = torch.rand(2, n, keys) < 0.9
    seen[0, :, :100] = True  # row 0: a long shared prefix, then holes
    seen[0, 3, 70] = False  # ... but one query misses a key inside it
    seen[1, :, 0] = False  # row 1: nothing shared from column 0
    seen[1, 5] = False  # a query that sees no key
    mask = torch.where(seen, 0.0, torch.finfo(torch.float32).min)
    for name in kernels.cpu_variants():
        ops = load_native(name)
        out = ops.attention(q, k, v, mask, 0.125)
        for row in range(2):
            for node in range(n):
                cols = seen[row, node].nonzero()[:, 0]
                alone = ops.attention(q[row : row + 1, :, node : node + 1], k[row : row + 1, :, cols],
                                      v[row : row + 1, :, cols], None, 0.125)
                assert torch.equal(alone[0, 0], out[row, node]), (name, row, node)
        assert not out[1, 5].any()


@needs_native
@pytest.mark.parametrize("layers", [(), (1,)], ids=["h", "h+layer1"])  # the heads' input state, with feature layers
@pytest.mark.parametrize("kernels_name", ["native", "q8"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_tree_pass_gives_every_node_the_bits_of_one_token_passes(family, kernels_name, layers):
    """Batch-invariant linears and attention: each node's logits and hidden state (and feature layers) are bitwise
    those of its token in plain one-token steps along its path, so greedy MEDUSA is plain decoding to the bit (q8's
    rounding included)."""
    model = use_kernels(gguf_model(family), kernels_name)
    assert model.config._attn_implementation == INVARIANT_ATTENTION
    assert any(isinstance(m, Q8Linear) for m in model.modules()) == (kernels_name == "q8")
    tree = Tree.from_spec(DEFAULT_TREE)
    tokens = torch.arange(tree.num_nodes) * 7 + 3
    with torch.inference_mode():
        cache, _, _ = engine_prefill(model, PROMPT, len(PROMPT) + tree.num_nodes, layers)
        logits, hidden = verify(model, cache, tokens, tree, len(PROMPT), layers)
        for leaf in tree.leaf_paths.tolist():
            path = [node for node in leaf if node >= 0]
            cache, _, _ = engine_prefill(model, PROMPT, len(PROMPT) + len(path), layers)
            for depth, node in enumerate(path):
                one_logits, one_hidden = verify(model, cache, tokens[node : node + 1], PLAIN, len(PROMPT) + depth,
                                                layers)
                assert torch.equal(one_logits[0], logits[node]) and torch.equal(one_hidden[0], hidden[node])


@needs_native
@pytest.mark.parametrize(("family", "compiled"), [("llama", False), ("qwen2", False), ("gpt2", False),
                                                  pytest.param("llama", True, marks=needs_compiler),
                                                  pytest.param("gpt2", True, marks=needs_compiler)])
def test_greedy_medusa_on_q8_kernels_is_plain_decoding_on_them(family, compiled):
    model = use_kernels(gguf_model(family), "q8", compiled)
    assert any(isinstance(m, Q8Linear) for m in model.modules())
    config = GenerationConfig(max_new_tokens=NEW_TOKENS)
    plain = [t for step, _ in decode(model, None, PROMPT, replace(config, medusa=False), PLAIN, compiled=compiled)
             for t in step]
    medusa = [t for step, _ in decode(model, random_heads(model), PROMPT, config, Tree.from_spec(DEFAULT_TREE),
                                      compiled=compiled) for t in step]
    assert medusa == plain
    reference = greedy_reference(gguf_model(family), PROMPT, NEW_TOKENS)  # the float32 model: q8 rounds
    assert sum(a == b for a, b in zip(plain, reference)) >= NEW_TOKENS // 4


@needs_native
@pytest.mark.parametrize("family", FAMILIES)
def test_a_native_layers_step_is_transformers_step_on_llama_shaped_q8_models(family):
    """native_layers.py: on q8 kernels a Llama or Mistral step runs each layer in one native call, computing what
    `transformers`' layers compute (to float32 rounding: no 8-bit activation lands elsewhere on these models), the
    feature layers and the keys written to the cache included; other families and kernels keep `transformers`'."""
    model = use_kernels(gguf_model(family), "q8")
    weights = native_layers.weights(model)
    assert (weights is not None) == (family in ("llama", "mistral"))
    assert native_layers.weights(use_kernels(gguf_model(family), "native")) is None
    if weights is None:
        return
    tree = Tree.from_spec(DEFAULT_TREE)
    tokens, nodes = torch.arange(tree.num_nodes) * 7 + 3, slice(len(PROMPT), len(PROMPT) + tree.num_nodes)
    positions, mask = (len(PROMPT) + tree.depths)[None], tree_mask(tree, len(PROMPT), torch.float32, "cpu")
    runs = []
    with torch.inference_mode():
        for native in (weights, None):  # both over the engine's float16 cache: transformers' reads it widened
            cache = engine_prefill(model, PROMPT, len(PROMPT) + tree.num_nodes, (1,))[0]
            assert all(layer.dtype == native_layers.CACHE for layer in cache.layers)
            logits, states = step_forward(model, native, tokens[None], cache, torch.tensor([len(PROMPT)]), positions,
                                          mask, (1,))
            runs.append([logits, states, *(b[0, :, nodes] for layer in cache.layers
                                           for b in (layer.key_buffer, layer.value_buffer))])
    for native, reference in zip(*runs):
        torch.testing.assert_close(native, reference, rtol=0, atol=1e-5 * float(reference.abs().max()))
    assert torch.equal(runs[0][0].argmax(-1), runs[1][0].argmax(-1))


@needs_native
def test_stock_kernels_restores_q8_linears_and_native_attention():
    model = use_kernels(gguf_model("llama"), "q8")
    kinds = {name: type(m) for name, m in model.named_modules()}
    assert Q8Linear in kinds.values() and NativeLinear not in kinds.values()  # every linear of a GGUF model has blocks
    with stock_kernels(model):
        assert all(type(m) is torch.nn.Linear for m in model.modules() if isinstance(m, torch.nn.Linear))
        assert model.config._attn_implementation == "sdpa"
    assert {name: type(m) for name, m in model.named_modules()} == kinds
    assert model.config._attn_implementation == INVARIANT_ATTENTION
