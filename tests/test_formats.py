"""Checkpoint layouts: reference MEDUSA-1/-2 and vLLM heads load losslessly; exports round-trip bit for bit."""

import json

import pytest
import torch
from conftest import HIDDEN, VOCAB, tiny_model
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from medusa_decoding import HeadsConfig, MedusaHeads, MedusaModel, formats
from medusa_decoding.cli import main

EOS = 95
NEW_TOKENS = 24
PROMPT = [5, 17, 42, 8, 63, 11]


def random_heads(projection: str, num_heads: int = 3, num_layers: int = 2, seed: int = 1) -> MedusaHeads:
    """Heads with every weight non-zero, so that a misplaced tensor changes the output."""
    heads = MedusaHeads(HeadsConfig(HIDDEN, VOCAB, num_heads, num_layers, projection, "tiny-llama"))
    torch.manual_seed(seed)
    for parameter in heads.parameters():
        parameter.data.normal_(0, 0.2)
    return heads


def reference_state(heads: MedusaHeads) -> dict[str, torch.Tensor]:
    return {k.removeprefix("heads."): v.clone() for k, v in heads.state_dict().items()}


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def save_tiny(model, directory) -> None:
    """The tiny model plus a word-level tokenizer over its 96 ids, so MedusaModel can load it."""
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")))
    tokenizer.eos_token = f"t{EOS}"
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def write_wrong_config(directory, heads: MedusaHeads) -> None:
    """The kind of config published checkpoints carry: counts and sizes that disagree with the weights."""
    config = heads.config
    wrong = {"medusa_num_heads": config.num_heads + 2, "medusa_num_layers": config.num_layers + 1,
             "base_model_name_or_path": "tiny-llama", "hidden_size": 4096, "vocab_size": 32000}
    (directory / "config.json").write_text(json.dumps(wrong))


def assert_lossless(medusa: MedusaModel, base) -> None:
    """Greedy MEDUSA emits exactly what the base model's own greedy generate emits."""
    out = medusa.generate(PROMPT, max_new_tokens=NEW_TOKENS)
    expected = base.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=EOS)
    assert out.token_ids == expected[0, len(PROMPT):].tolist()


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    save_tiny(tiny_model("llama"), directory)
    return directory


@pytest.fixture(scope="module")
def base(base_dir):
    return AutoModelForCausalLM.from_pretrained(base_dir).eval()


@pytest.mark.parametrize("suffix", ["pt", "safetensors"])
@pytest.mark.parametrize("projection", ["shared", "own"])
def test_reference_heads_load_with_counts_from_the_weights_and_decode_losslessly(
    tmp_path, base_dir, base, suffix, projection
):
    heads = random_heads(projection, num_heads=3, num_layers=2)
    state = reference_state(heads)
    if suffix == "pt":
        torch.save(state, tmp_path / "medusa_lm_head.pt")
    else:
        save_file(state, str(tmp_path / "medusa_lm_head.safetensors"))
    write_wrong_config(tmp_path, heads)

    medusa = MedusaModel.from_pretrained(base_dir, tmp_path)

    config = medusa.heads.config
    assert (config.num_heads, config.num_layers, config.projection) == (3, 2, projection)
    assert (config.hidden_size, config.vocab_size) == (HIDDEN, VOCAB)
    assert_same_state(medusa.heads.state_dict(), heads.state_dict())
    assert_lossless(medusa, base)


def test_reference_fp16_heads_keep_every_value(tmp_path):
    heads = random_heads("own")
    state = {k: v.half() for k, v in reference_state(heads).items()}
    torch.save(state, tmp_path / "medusa_lm_head.pt")
    loaded = MedusaHeads.from_pretrained(tmp_path)
    assert_same_state(reference_state(loaded), {k: v.float() for k, v in state.items()})


def test_medusa2_directory_loads_backbone_and_heads_from_the_same_shards(tmp_path, base):
    model = tiny_model("llama", seed=3)
    save_tiny(model, tmp_path)
    heads = random_heads("own", num_heads=4, num_layers=1)
    shards = load_file(str(tmp_path / "model.safetensors"))
    shards.update({"medusa_head." + k: v for k, v in reference_state(heads).items()})
    save_file(shards, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "medusa_num_heads": 5, "medusa_num_layers": 1}))

    assert formats.detect(tmp_path) == formats.MEDUSA2
    medusa = MedusaModel.from_pretrained(tmp_path)  # heads found beside the backbone, no --heads needed

    assert medusa.heads.config.num_heads == 4
    assert_same_state(medusa.heads.state_dict(), heads.state_dict())
    assert_same_state(medusa.model.state_dict(), model.state_dict())
    assert_lossless(medusa, model)


def vllm_keys(num_heads: int, num_layers: int, shared: bool = False) -> set[str]:
    """Exactly the tensors vLLM's Medusa model loads with medusa_fc_bias=True (model_executor/models/medusa.py): with
    original_lm_head, one LM head, `lm_heads.0`."""
    blocks = {f"blocks.{h}.layers.{layer}.{p}" for h in range(num_heads) for layer in range(num_layers)
              for p in ("weight", "bias")}
    return blocks | {f"lm_heads.{h}.weight" for h in range(1 if shared else num_heads)}


@pytest.mark.parametrize("projection", ["shared", "own"])
def test_vllm_export_has_vllms_keys_and_config_and_reads_back(tmp_path, base, projection):
    heads = random_heads(projection, num_heads=3, num_layers=2)
    lm_head = base.get_output_embeddings()
    formats.export(heads, tmp_path, "vllm", lm_head)

    shared = projection == "shared"
    config = json.loads((tmp_path / "config.json").read_text())
    assert config == {
        "architectures": ["MedusaModel"], "model_type": "medusa", "num_heads": 3, "num_hidden_layers": 2,
        "hidden_size": HIDDEN, "vocab_size": VOCAB, "medusa_fc_bias": True, "truncated_vocab_size": None,
        **({"original_lm_head": True} if shared else {}),
    }
    written = load_file(str(tmp_path / "model.safetensors"))
    assert set(written) == vllm_keys(3, 2, shared)
    ours = heads.state_dict()
    for h in range(3):
        for layer in range(2):
            for p in ("weight", "bias"):
                assert torch.equal(written[f"blocks.{h}.layers.{layer}.{p}"], ours[f"heads.{h}.{layer}.linear.{p}"])
        projection_weight = lm_head.weight if shared else ours[f"heads.{h}.2.weight"]
        assert torch.equal(written[f"lm_heads.{0 if shared else h}.weight"], projection_weight)

    loaded = MedusaHeads.from_pretrained(tmp_path)  # vLLM import: users may bring vLLM-format heads
    assert formats.detect(tmp_path) == formats.VLLM
    assert (loaded.config.num_heads, loaded.config.num_layers, loaded.config.projection) == (3, 2, "own")
    expected = {**heads.state_dict(), **{f"heads.{h}.2.weight": written[f"lm_heads.{0 if shared else h}.weight"]
                                         for h in range(3)}}
    assert_same_state(loaded.state_dict(), expected)


@pytest.mark.parametrize("projection", ["shared", "own"])
def test_ours_to_reference_to_ours_is_bit_identical(tmp_path, projection):
    heads = random_heads(projection)
    heads.save_pretrained(tmp_path / "ours")
    native = MedusaHeads.from_pretrained(tmp_path / "ours")
    formats.export(native, tmp_path / "reference", "reference")

    assert formats.detect(tmp_path / "reference") == formats.REFERENCE
    assert set(load_file(str(tmp_path / "reference" / "medusa_lm_head.safetensors"))) == set(reference_state(heads))
    config = json.loads((tmp_path / "reference" / "config.json").read_text())
    assert config == {"medusa_num_heads": 3, "medusa_num_layers": 2, "base_model_name_or_path": "tiny-llama",
                      "hidden_size": HIDDEN, "vocab_size": VOCAB}
    back = MedusaHeads.from_pretrained(tmp_path / "reference", vocab_size=VOCAB)
    assert back.config == heads.config
    assert_same_state(back.state_dict(), heads.state_dict())


def test_ours_to_vllm_to_ours_is_bit_identical_and_reexports_the_same_bytes(tmp_path):
    heads = random_heads("own")
    formats.export(heads, tmp_path / "a", "vllm")
    back = MedusaHeads.from_pretrained(tmp_path / "a")
    assert_same_state(back.state_dict(), heads.state_dict())
    formats.export(back, tmp_path / "b", "vllm")
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


@pytest.mark.parametrize("variant", ["prefixed, no biases", "original_lm_head"])
def test_vllm_checkpoints_as_published_load(tmp_path, variant):
    """vLLM also accepts a `medusa_heads.` prefix, medusa_fc_bias=false and one shared `original_lm_head`."""
    heads = random_heads("own", num_heads=2, num_layers=1)
    ours = heads.state_dict()
    state = {f"blocks.{h}.layers.0.weight": ours[f"heads.{h}.0.linear.weight"] for h in range(2)}
    config = {"model_type": "medusa", "num_heads": 2, "num_hidden_layers": 1}
    if variant == "original_lm_head":
        state |= {f"blocks.{h}.layers.0.bias": ours[f"heads.{h}.0.linear.bias"] for h in range(2)}
        state["lm_heads.0.weight"] = ours["heads.0.1.weight"]
        config["original_lm_head"] = True
    else:
        state |= {f"lm_heads.{h}.weight": ours[f"heads.{h}.1.weight"] for h in range(2)}
        state = {"medusa_heads." + k: v for k, v in state.items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))

    loaded = MedusaHeads.from_pretrained(tmp_path).state_dict()
    for h in range(2):
        assert torch.equal(loaded[f"heads.{h}.0.linear.weight"], ours[f"heads.{h}.0.linear.weight"])
        bias = torch.zeros(HIDDEN) if variant != "original_lm_head" else ours[f"heads.{h}.0.linear.bias"]
        assert torch.equal(loaded[f"heads.{h}.0.linear.bias"], bias)
        projection = ours["heads.0.1.weight"] if variant == "original_lm_head" else ours[f"heads.{h}.1.weight"]
        assert torch.equal(loaded[f"heads.{h}.1.weight"], projection)


def test_cli_export_reads_any_layout_and_writes_vllm(tmp_path, base_dir, base, capsys):
    heads = random_heads("shared")
    torch.save(reference_state(heads), tmp_path / "medusa_lm_head.pt")
    out = tmp_path / "vllm"
    main(["export", "--format", "vllm", str(out), "--model", str(base_dir), "--heads", str(tmp_path)])
    written = load_file(str(out / "model.safetensors"))
    assert set(written) == vllm_keys(3, 2, shared=True)
    assert torch.equal(written["lm_heads.0.weight"], base.get_output_embeddings().weight)
    printed = capsys.readouterr().out
    assert str(out) in printed and "MiB" in printed


def test_cli_export_of_the_embedded_default_writes_its_medusa_heads_and_one_lm_head(tmp_path, capsys, monkeypatch):
    """Nothing runs (no model pass, no tree fit, no kernels): heads and one LM head out, hydra heads refused by name."""
    from medusa_decoding import embedded
    from medusa_decoding.model import MedusaModel

    monkeypatch.setattr(MedusaModel, "__init__", lambda *a, **k: pytest.fail("export built a MedusaModel"))
    main(["export", "--format", "vllm", str(tmp_path / "vllm")])
    written = load_file(str(tmp_path / "vllm" / "model.safetensors"))
    heads = MedusaHeads.from_pretrained(embedded.MEDUSA_HEADS)
    assert set(written) == vllm_keys(heads.config.num_heads, heads.config.num_layers, shared=True)
    size = sum(p.stat().st_size for p in (tmp_path / "vllm").iterdir())
    assert size < 1.1 * written["lm_heads.0.weight"].nbytes + sum(p.nbytes for p in heads.state_dict().values())
    assert f"{size / 2**20:.1f} MiB" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["export", "--format", "vllm", str(tmp_path / "hydra"), "--heads", str(embedded.SMOLLM2.heads)])
    assert str(embedded.MEDUSA_HEADS) in capsys.readouterr().err


def write_reference(directory, state) -> None:
    save_file(state, str(directory / "medusa_lm_head.safetensors"))


def test_errors_name_the_problem(tmp_path):
    good = reference_state(random_heads("own"))
    cases = {
        "empty": (None, FileNotFoundError, "no weights"),
        "unknown": ({"encoder.weight": torch.zeros(2)}, ValueError, "unknown layout"),
        "shapes": ({**good, "1.0.linear.weight": torch.zeros(16, 16)}, ValueError, "inconsistent"),
        "layers": ({k: v for k, v in good.items() if not k.startswith("1.1.")}, ValueError, "inconsistent layers"),
        "projections": ({k: v for k, v in good.items() if k != "1.2.weight"}, ValueError, "vocab projections"),
        "stray": ({**good, "0.rotary.inv_freq": torch.zeros(2)}, ValueError, "unexpected tensor"),
        "gap": ({k: v for k, v in good.items() if not k.startswith("1.")}, ValueError, "heads \\[0, 2\\]"),
    }
    for name, (state, error, message) in cases.items():
        directory = tmp_path / name
        directory.mkdir()
        if name == "unknown":
            save_file(state, str(directory / "model.safetensors"))
        elif state is not None:
            write_reference(directory, state)
        with pytest.raises(error, match=message):
            MedusaHeads.from_pretrained(directory)

    with pytest.raises(FileNotFoundError, match="not a directory"):
        MedusaHeads.from_pretrained(tmp_path / "missing")
    (tmp_path / "shared").mkdir()
    write_reference(tmp_path / "shared", {k: v for k, v in good.items() if not k.endswith(".2.weight")})
    with pytest.raises(ValueError, match="vocab_size"):
        MedusaHeads.from_pretrained(tmp_path / "shared")
    with pytest.raises(ValueError, match="format must be one of"):
        formats.export(random_heads("own"), tmp_path / "out", "gguf")


@pytest.mark.parametrize("name", ["medusa_lm_head.pt", "medusa_lm_head.safetensors", "model.safetensors"])
def test_corrupt_files_are_reported(tmp_path, name):
    (tmp_path / name).write_bytes(b"\x00garbage, not a checkpoint" * 8)
    with pytest.raises(ValueError, match="corrupt or unreadable"):
        MedusaHeads.from_pretrained(tmp_path)


def test_a_pickle_that_is_not_a_state_dict_is_refused(tmp_path):
    torch.save([torch.zeros(2)], tmp_path / "medusa_lm_head.pt")
    with pytest.raises(ValueError, match="not a state dict"):
        MedusaHeads.from_pretrained(tmp_path)


@pytest.mark.parametrize("fmt", ["vllm", "reference"])
def test_hydra_heads_refuse_layouts_that_hold_medusa_heads_only(tmp_path, fmt):
    heads = MedusaHeads(HeadsConfig(HIDDEN, VOCAB, 3, 1, "shared", "tiny-llama", kind="hydra"))
    with pytest.raises(ValueError, match=f"hydra heads, which read the tokens before their guess; the {fmt} layout"):
        formats.export(heads, tmp_path / "out", fmt, torch.nn.Linear(HIDDEN, VOCAB, bias=False))
    assert not (tmp_path / "out").exists()  # nothing half-written


@pytest.mark.parametrize("fmt", ["vllm", "reference"])
def test_heads_that_read_feature_layers_refuse_layouts_that_feed_the_last_hidden_state_only(tmp_path, fmt):
    heads = MedusaHeads(HeadsConfig(HIDDEN, VOCAB, 3, 1, "shared", "tiny-llama", feature_layers=(1,)))
    with pytest.raises(ValueError, match=fr"read the outputs of layers \[1\] beside the last hidden state; the {fmt}"):
        formats.export(heads, tmp_path / "out", fmt, torch.nn.Linear(HIDDEN, VOCAB, bias=False))
    assert not (tmp_path / "out").exists()
