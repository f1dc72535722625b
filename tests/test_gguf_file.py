"""A GGUF file is a model: config and tokenizer from the file, one conversion per content (never shared by two files,
shared by copies), the embedded default's heads for its file given as a path, tiny random-block models of every type
the engine reads decoding losslessly and as `transformers` does; a bad file gets one clear line and leaves nothing in
the cache."""

import shutil
from pathlib import Path

import gguf_helpers as random_gguf
import pytest
import torch
from conftest import EXACT_KERNELS, needs_native
from engine_helpers import engine_prefill, greedy_reference, random_heads, verify

from medusa_decoding import MedusaModel, embedded, gguf_file
from medusa_decoding.base import load_base, resolve
from medusa_decoding.config import DEFAULT_TREE, GenerationConfig
from medusa_decoding.decoding import PLAIN
from medusa_decoding.kernels import NativeLinear, use_kernels
from medusa_decoding.tree import Tree

PROMPT = "the cat sat on the mat, then"
LIVELY = 6.0  # random blocks this many times a trained model's size: tiny models that do not repeat one token
NEW_TOKENS = 24


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty cache of the project's for this test (the native kernels' build is the process's already)."""
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def tiny(path: Path, qtype: str = "Q8_0", seed: int = 0, **kw) -> Path:
    return random_gguf.write(path, "tiny", qtype, seed=seed, weight_scale=LIVELY, **kw)


def test_a_gguf_file_is_converted_once_per_content(tmp_path, cache):
    a, b = tiny(tmp_path / "a.gguf"), tiny(tmp_path / "b.gguf", seed=1)
    copy = tmp_path / "elsewhere" / "renamed.gguf"
    copy.parent.mkdir()
    shutil.copy(a, copy)
    assert resolve(a) == resolve(copy) != resolve(b)  # a copy is the same model; another file never shares
    assert gguf_file.source_digest(resolve(a)) == gguf_file.digest(a)[0]
    model_a, tokenizer = load_base(a)
    model_b, _ = load_base(b)
    assert model_a.config.hidden_size == 256 and len(tokenizer) == model_a.config.vocab_size  # from the file
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    assert tokenizer.decode(ids[0]) == PROMPT
    with torch.no_grad():
        assert not torch.equal(model_a(ids).logits, model_b(ids).logits)
    assert len(list((cache / "models").iterdir())) == 2


@pytest.mark.parametrize("qtype", [name for name in gguf_file.TENSOR_TYPES if name in random_gguf.SCALES])
def test_tiny_gguf_models_of_every_type_decode_losslessly_and_as_transformers(tmp_path, cache, qtype):
    path = tiny(tmp_path / f"{qtype}.gguf", qtype, seed=3)
    base, tokenizer = load_base(path)
    prompt = torch.tensor(tokenizer(PROMPT)["input_ids"])
    reference = greedy_reference(base, prompt, NEW_TOKENS)
    medusa = MedusaModel.from_pretrained(path, random_heads(base), kernels=EXACT_KERNELS,
                                         tree=[[0], [1], [0, 0], [0, 0, 0]])
    for medusa_steps in (True, False):  # MEDUSA and plain decoding on the engine, each transformers' answer
        config = GenerationConfig(max_new_tokens=NEW_TOKENS, medusa=medusa_steps)
        assert medusa.generate(prompt, config=config).token_ids == reference


@needs_native
@pytest.mark.parametrize("kernels", ["native", "q8"])
@pytest.mark.parametrize("qtype", ["Q4_K_M", "Q5_K", "Q5_0", "Q8_0"])
def test_a_tree_pass_on_a_gguf_models_blocks_gives_every_node_the_bits_of_one_token_passes(tmp_path, cache, qtype,
                                                                                          kernels):
    """Read at its file's bytes (every linear on its blocks, q8's K-quant linears on 8-bit activations too), a tree
    pass gives each node bitwise its token's logits in one-token passes: greedy MEDUSA is plain decoding to the bit."""
    model = use_kernels(load_base(tiny(tmp_path / f"{qtype}.gguf", qtype), blocks=True)[0], kernels)
    linears = [m for m in model.modules() if isinstance(m, NativeLinear)]
    assert linears and all("blocks" in m._buffers and m.weight.isnan().all() for m in linears)  # no float weights
    assert any(m.integer for m in linears) == (kernels == "q8" and qtype == "Q4_K_M")
    prompt, tree = torch.arange(3, 40, 3), Tree.from_spec(DEFAULT_TREE)
    tokens = torch.arange(tree.num_nodes) * 7 + 3
    with torch.inference_mode():
        cache_, _, _ = engine_prefill(model, prompt, len(prompt) + tree.num_nodes)
        logits, _ = verify(model, cache_, tokens, tree, len(prompt))
        for leaf in tree.leaf_paths.tolist():
            path = [node for node in leaf if node >= 0]
            cache_, _, _ = engine_prefill(model, prompt, len(prompt) + len(path))
            for depth, node in enumerate(path):
                one, _ = verify(model, cache_, tokens[node : node + 1], PLAIN, len(prompt) + depth)
                assert torch.equal(one[0], logits[node])


def test_the_embedded_defaults_file_given_as_a_path_is_the_default(smollm, tmp_path):
    copy = tmp_path / "my-model.gguf"
    copy.symlink_to(embedded.gguf_path())
    medusa = MedusaModel.from_pretrained(copy, kernels=EXACT_KERNELS)
    assert medusa.model.name_or_path == smollm.model.name_or_path
    assert medusa.heads_dir == smollm.heads_dir == embedded.SMOLLM2.heads  # its shipped heads, by content
    config = GenerationConfig(max_new_tokens=16)
    assert medusa.generate("Name three colours.", config=config).token_ids == \
        smollm.generate("Name three colours.", config=config).token_ids


def corrupt(tmp_path: Path, what: str) -> tuple[Path, str]:
    """A bad model argument and what its one line must say."""
    good = tiny(tmp_path / "good.gguf")
    path = tmp_path / f"{what}.gguf"
    if what == "truncated":
        path.write_bytes(good.read_bytes()[: good.stat().st_size * 2 // 3])
        return path, "not a readable GGUF file (truncated or corrupt?)"
    if what == "garbage":
        path.write_bytes(b"GGUF" + bytes(range(256)) * 4)
        return path, "not a readable GGUF file (truncated or corrupt?)"
    if what == "text":
        path = tmp_path / "notes.txt"
        path.write_text("not a model\n")
        return path, "neither a GGUF file nor a model directory"
    if what == "empty-directory":
        path = tmp_path / "empty"
        path.mkdir()
        return path, "neither a GGUF file nor a model directory"
    if what == "missing":
        return path, "does not exist"
    if what == "architecture":
        random_gguf.write(path, "tiny", "Q8_0", architecture="rwkv6")
        return path, "architecture 'rwkv6', which this engine does not run (it runs llama, mistral"
    assert what == "tensor-type"
    random_gguf.write(path, "tiny", "Q8_0", embedding_type="Q2_K")
    return path, "tensor token_embd.weight is of type Q2_K, which this engine does not read (it reads F32"


@pytest.mark.parametrize("what", ["truncated", "garbage", "text", "empty-directory", "missing", "architecture",
                                  "tensor-type"])
def test_a_bad_model_argument_is_one_clear_line_and_leaves_nothing_in_the_cache(tmp_path, cache, what):
    path, says = corrupt(tmp_path, what)
    with pytest.raises((ValueError, FileNotFoundError)) as error:
        load_base(path)
    assert says in str(error.value) and "\n" not in str(error.value), str(error.value)
    assert not cache.exists() or not any(p.is_file() for p in cache.rglob("*")), list(cache.rglob("*"))
