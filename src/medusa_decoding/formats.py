"""The MEDUSA ecosystem's checkpoint layouts, read and written without changing a bit.

    ours       config.json + model.safetensors: heads.{h}.{l}.linear.weight|bias, heads.{h}.{L}.weight
               (MedusaHeads.save_pretrained; L = number of layers, the projection exists only when own)
    reference  medusa_lm_head.safetensors or .pt: {h}.{l}.linear.weight|bias, {h}.{L}.weight
               (FasterDecoding/Medusa, MEDUSA-1 heads; no {h}.{L}.weight means the base LM head is shared)
    medusa-2   a whole model directory whose shards also hold medusa_head.{h}.{l}... (reference MEDUSA-2)
    vllm       config.json (model_type "medusa") + model.safetensors: blocks.{h}.layers.{l}.weight|bias,
               lm_heads.{h}.weight (with `original_lm_head`: lm_heads.0.weight alone, the base LM head)

Every layout is read into the reference key scheme (ours without its `heads.` prefix), and the
number of heads, layers and the sizes come from the tensors: published `config.json` files are known to
disagree with their weights (medusa_num_heads=5 beside 4 heads).
"""

import json
import pickle
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import EXPORT_FORMATS, HeadsConfig
from .embedded import MEDUSA_HEADS

# the files this project writes, one name each
CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"  # heads (MedusaHeads.save_pretrained)
TREE_NAME = "tree.json"  # the tree the heads decode with (MedusaModel.save_pretrained, `medusa calibrate`)
CALIBRATION_NAME = "accuracy.json"  # `medusa calibrate`'s accuracy table and latency fit
TRAIN_ACCURACY_NAME, TRAIN_CONFIG_NAME = "head_accuracy.json", "train_config.json"  # `medusa train`'s record
ADAPTER_DIR = "adapter"  # `medusa train --mode medusa2` writes its LoRA adapter here, beside the heads
MERGED_DIR = "model"  # and with --merge the merged backbone here

OURS, REFERENCE, MEDUSA2, VLLM = "ours", "reference", "medusa-2", "vllm"  # the layouts `detect` tells apart

REFERENCE_SAFETENSORS, REFERENCE_PT = "medusa_lm_head.safetensors", "medusa_lm_head.pt"
OURS_PREFIX = "heads."
MEDUSA2_PREFIX = "medusa_head."
VLLM_PREFIX = "medusa_heads."  # some vLLM checkpoints nest their tensors under it; vLLM strips it

BLOCK = re.compile(r"(\d+)\.(\d+)\.linear\.(weight|bias)")  # reference: residual block l of head h
PROJECTION = re.compile(r"(\d+)\.(\d+)\.weight")  # reference: head h's own vocab projection, after its L blocks
VLLM_BLOCK = re.compile(r"blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)")
VLLM_PROJECTION = re.compile(r"lm_heads\.(\d+)\.weight")


def detect(directory: Path) -> str:
    """Which layout `directory` holds, from its files (and their tensor names, never their config)."""
    if not directory.is_dir():
        raise FileNotFoundError(f"MEDUSA heads: {directory} is not a directory")
    if (directory / REFERENCE_SAFETENSORS).is_file() or (directory / REFERENCE_PT).is_file():
        return REFERENCE
    files = weight_files(directory)
    if not files:
        raise FileNotFoundError(
            f"MEDUSA heads: no weights in {directory}: expected {REFERENCE_SAFETENSORS}, {REFERENCE_PT}, "
            f"{WEIGHTS_NAME} (medusa-decoding or vLLM layout) or a MEDUSA-2 model's shards"
        )
    names = names_in(directory)
    if any(name.startswith(MEDUSA2_PREFIX) for name in names):
        return MEDUSA2
    if any(VLLM_BLOCK.fullmatch(name.removeprefix(VLLM_PREFIX)) for name in names):
        return VLLM
    if any(name.startswith(OURS_PREFIX) for name in names):
        return OURS
    raise ValueError(
        f"MEDUSA heads: unknown layout in {directory}: {', '.join(p.name for p in files)} hold no "
        f"heads.*, medusa_head.* or blocks.* tensors (first names: {sorted(names)[:3]})"
    )


def holds_medusa2_heads(model) -> bool:
    """Whether a base model argument is a local MEDUSA-2 directory (backbone and heads in one place)."""
    path = Path(model).expanduser()
    return path.is_dir() and any(name.startswith(MEDUSA2_PREFIX) for name in names_in(path))


def read(directory: Path, layout: str, vocab_size: int | None = None) -> tuple[HeadsConfig, dict]:
    """A layout not ours -> (config inferred from the tensors, state dict in MedusaHeads' keys).

    vocab_size: the base model's, needed only by heads that share its LM head (their files carry none).
    """
    if layout == REFERENCE:
        state, label = read_reference(directory), reference_base_model(directory)
    elif layout == MEDUSA2:
        medusa2 = read_shards(directory, lambda name: name.startswith(MEDUSA2_PREFIX))
        state, label = {k.removeprefix(MEDUSA2_PREFIX): t for k, t in medusa2.items()}, str(directory)
    elif layout == VLLM:
        vllm = {k.removeprefix(VLLM_PREFIX): t for k, t in read_shards(directory).items()}
        state, label = from_vllm(vllm, read_config(directory)), ""
    else:
        raise ValueError(f"layout must be one of {(REFERENCE, MEDUSA2, VLLM)}, got {layout!r}")
    config = infer_config(state, vocab_size, label, directory)
    return config, {OURS_PREFIX + key: tensor for key, tensor in state.items()}


def infer_config(state: dict, vocab_size: int | None, base_model: str, source: Path) -> HeadsConfig:
    """Heads, layers, hidden and vocab size from reference-keyed tensors; shapes are checked on load."""
    layers: dict[int, set[int]] = {}
    projections: dict[int, int] = {}
    for key in state:
        if match := BLOCK.fullmatch(key):
            layers.setdefault(int(match[1]), set()).add(int(match[2]))
        elif match := PROJECTION.fullmatch(key):
            projections[int(match[1])] = int(match[2])
        else:
            raise ValueError(f"MEDUSA heads: unexpected tensor {key!r} in {source}")
    num_heads = len(layers)
    num_layers = len(layers.get(0, ()))
    if not num_heads or set(layers) != set(range(num_heads)):
        raise ValueError(f"MEDUSA heads: {source} holds residual blocks for heads {sorted(layers)}, expected 0..K-1")
    if any(found != set(range(num_layers)) for found in layers.values()):
        found = {head: sorted(indices) for head, indices in layers.items()}
        raise ValueError(f"MEDUSA heads: inconsistent layers per head in {source}: {found}")
    if projections and projections != dict.fromkeys(range(num_heads), num_layers):
        raise ValueError(
            f"MEDUSA heads: {source} has vocab projections {projections} (head: index); expected none "
            f"(shared LM head) or one per head at index {num_layers}"
        )
    hidden_size = state.get("0.0.linear.weight", state.get("0.0.linear.bias")).shape[-1]
    if projections:
        vocab_size = state[f"0.{num_layers}.weight"].shape[0]
    elif vocab_size is None:
        raise ValueError(
            f"vocab_size: the heads in {source} share the base model's LM head, so their files carry no "
            "vocab size; pass the base model's (MedusaModel.from_pretrained does)"
        )
    projection = "own" if projections else "shared"
    return HeadsConfig(hidden_size, vocab_size, num_heads, num_layers, projection, base_model)


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files, else the torch pickles, as transformers picks them."""
    return sorted(directory.glob("*.safetensors")) or sorted(directory.glob("pytorch_model*.bin"))


def names_in(directory: Path) -> set[str]:
    return {name for path in weight_files(directory) for name in tensor_names(path)}


def tensor_names(path: Path) -> list[str]:
    if path.suffix == ".safetensors":
        try:
            with safe_open(str(path), "pt") as file:
                return list(file.keys())
        except (SafetensorError, OSError) as error:
            raise ValueError(f"MEDUSA heads: {path} is corrupt or unreadable: {error}") from None
    return list(load_pickle(path))


def load_tensors(path: Path, keep=lambda name: True) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors or torch pickle file whose names pass `keep`."""
    if path.suffix != ".safetensors":
        return {name: tensor for name, tensor in load_pickle(path).items() if keep(name)}
    try:
        with safe_open(str(path), "pt") as file:
            return {name: file.get_tensor(name) for name in file.keys() if keep(name)}
    except (SafetensorError, OSError) as error:
        raise ValueError(f"MEDUSA heads: {path} is corrupt or unreadable: {error}") from None


def load_pickle(path: Path) -> dict[str, torch.Tensor]:
    """A torch pickle state dict, loaded with weights_only=True (no code runs from the file)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as error:
        raise ValueError(f"MEDUSA heads: {path} is corrupt or unreadable: {error}") from None
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise ValueError(f"MEDUSA heads: {path} is not a state dict of tensors")
    return state


def read_reference(directory: Path) -> dict[str, torch.Tensor]:
    path = directory / REFERENCE_SAFETENSORS
    return load_tensors(path if path.is_file() else directory / REFERENCE_PT)


def reference_base_model(directory: Path) -> str:
    """A label only: the reference config's counts are not trusted, its base model name is kept."""
    return str(read_config(directory).get("base_model_name_or_path", ""))


def read_shards(directory: Path, keep=lambda name: True) -> dict[str, torch.Tensor]:
    return {name: t for path in weight_files(directory) for name, t in load_tensors(path, keep).items()}


def read_config(directory: Path) -> dict:
    path = directory / CONFIG_NAME
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"MEDUSA heads: {path} is not valid JSON: {error}") from None


def from_vllm(state: dict, config: dict) -> dict[str, torch.Tensor]:
    """vLLM keys -> reference keys. Missing biases (medusa_fc_bias false) become zeros; with
    `original_lm_head` one projection, lm_heads.0, serves every head."""
    out, layers, projections = {}, {}, {}
    for key, tensor in state.items():
        if match := VLLM_BLOCK.fullmatch(key):
            out[f"{match[1]}.{match[2]}.linear.{match[3]}"] = tensor
            layers[int(match[1])] = max(layers.get(int(match[1]), 0), int(match[2]) + 1)
        elif match := VLLM_PROJECTION.fullmatch(key):
            projections[int(match[1])] = tensor
        else:
            out[key] = tensor  # infer_config names it as unexpected
    if config.get("original_lm_head") and list(projections) == [0]:
        projections = dict.fromkeys(layers, projections[0])
    for head, tensor in projections.items():
        out[f"{head}.{layers.get(head, 0)}.weight"] = tensor
    for key in [k for k in out if k.endswith(".linear.weight")]:
        bias = key.removesuffix("weight") + "bias"
        out.setdefault(bias, out[key].new_zeros(out[key].shape[0]))
    return out


def to_vllm(state: dict, num_layers: int) -> dict[str, torch.Tensor]:
    """Reference keys (the projections there are) -> the keys vLLM's Medusa.load_weights expects."""
    out = {}
    for key, tensor in state.items():
        if match := BLOCK.fullmatch(key):
            out[f"blocks.{match[1]}.layers.{match[2]}.{match[3]}"] = tensor
        else:
            match = PROJECTION.fullmatch(key)
            assert match and int(match[2]) == num_layers, key
            out[f"lm_heads.{match[1]}.weight"] = tensor
    return out


def export(heads, directory, fmt: str, lm_head: torch.nn.Module | None = None) -> Path:
    """Writes `heads` in another engine's layout. lm_head: the base model's, for heads that share it: vLLM's layout
    holds it once (`original_lm_head`: every head projects through it); the reference layout leaves it out.

    >>> export(medusa.heads, "out/vllm", "vllm", medusa.model.get_output_embeddings())
    """
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"format must be one of {EXPORT_FORMATS}, got {fmt!r}")
    config = heads.config
    if config.kind != "medusa":
        raise ValueError(f"export: these are {config.kind} heads, which read the tokens before their guess; the "
                         f"{fmt} layout holds MEDUSA heads only (its engines feed a head the hidden state alone), so "
                         "they cannot be written in it. Keep this project's layout (save_pretrained), or export MEDUSA "
                         f"heads (the embedded default's: --heads {MEDUSA_HEADS})")
    if config.feature_layers:
        raise ValueError(f"export: these heads read the outputs of layers {list(config.feature_layers)} beside the "
                         f"last hidden state; the {fmt} layout's engines feed a head the last hidden state alone, so "
                         "they cannot be written in it. Keep this project's layout (save_pretrained)")
    state = {key.removeprefix(OURS_PREFIX): t.detach().contiguous() for key, t in heads.state_dict().items()}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if fmt == REFERENCE:
        meta = {
            "medusa_num_heads": config.num_heads,
            "medusa_num_layers": config.num_layers,
            "base_model_name_or_path": config.base_model,
            "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size,
        }
        return write(directory, REFERENCE_SAFETENSORS, state, meta)
    shared = config.projection == "shared"
    if shared:
        if lm_head is None:
            raise ValueError("lm_head: these heads share the base model's LM head, which vLLM's layout holds once")
        state[f"0.{config.num_layers}.weight"] = lm_head.weight.detach().to(state["0.0.linear.weight"].dtype)
    meta = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "num_heads": config.num_heads,
        "num_hidden_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "vocab_size": state[f"0.{config.num_layers}.weight"].shape[0],
        "medusa_fc_bias": True,
        "truncated_vocab_size": None,
        **({"original_lm_head": True} if shared else {}),
    }
    return write(directory, WEIGHTS_NAME, to_vllm(state, config.num_layers), meta)


def write(directory: Path, weights_name: str, state: dict, config: dict) -> Path:
    save_file(state, str(directory / weights_name), metadata={"format": "pt"})
    (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return directory
