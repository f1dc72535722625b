"""What a training run starts from: the backbone (frozen, quantized, or under LoRA) and the heads (fresh, or trained
ones grown to the shape asked for, giving the same logits)."""

import importlib.util
import os
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel

from ..base import load_base, untie_output_embeddings
from ..config import HeadsConfig, TrainConfig
from ..heads import MedusaHeads


def load_backbone(model: str | None, config: TrainConfig):
    """The base model and tokenizer, in bf16 if asked, the frozen MEDUSA-1 backbone quantized if asked; on this
    process's GPU where there is one: position_batch computes the states before the Trainer would move it there."""
    dtype = torch.bfloat16 if config.bf16 else torch.float32
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else None
    if config.quantize is None:
        return load_base(model, dtype, device=device)
    if device is None or importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError(f"quantize={config.quantize!r} needs a CUDA GPU and the bitsandbytes package "
                         "(pip install bitsandbytes)")
    from transformers import BitsAndBytesConfig

    bits = BitsAndBytesConfig(load_in_8bit=config.quantize == "8bit", load_in_4bit=config.quantize == "4bit",
                              bnb_4bit_compute_dtype=dtype)
    return load_base(model, dtype, quantization_config=bits, device_map={"": device})


def make_heads(model: PreTrainedModel, config: TrainConfig, init_heads: str | Path | None) -> MedusaHeads:
    """Fresh heads (an untrained head repeats the base model), or trained ones to start from; fp32 to train.
    Trained MEDUSA heads start hydra heads too (`with_tokens`): they train only what the tokens add; trained heads
    start deeper ones (`deepened`) and ones that read feature layers (`with_features`): they train only what the new
    blocks and inputs add."""
    hidden_size = model.config.get_text_config().hidden_size
    lm_head = model.get_output_embeddings()
    vocab_size = lm_head.weight.shape[0]
    wanted = HeadsConfig(hidden_size, vocab_size, config.num_heads, config.num_layers, config.projection,
                         model.name_or_path, config.kind, config.feature_layers)
    num_layers = model.config.get_text_config().num_hidden_layers
    if init_heads is None:
        heads = MedusaHeads(wanted, lm_head)
    else:
        heads = MedusaHeads.from_pretrained(init_heads, vocab_size=vocab_size)
        heads.check_compatible(hidden_size, vocab_size, model.name_or_path)  # another model's: say so first
        if (heads.config.kind, wanted.kind) == ("medusa", "hydra"):
            heads = with_tokens(heads)
        if heads.config.num_layers < wanted.num_layers:
            heads = deepened(heads, wanted.num_layers)
        if not heads.config.feature_layers and wanted.feature_layers:
            heads = with_features(heads, wanted.feature_layers)
        for name in ("kind", "num_heads", "num_layers", "projection", "feature_layers"):
            if getattr(heads.config, name) != getattr(wanted, name):
                raise ValueError(f"init heads {init_heads} have {name}={getattr(heads.config, name)!r}, "
                                 f"but training asks for {name}={getattr(wanted, name)!r}")
    heads.check_compatible(hidden_size, vocab_size, model.name_or_path, num_layers)  # feature layers within the model
    return heads.float()


def with_tokens(heads: MedusaHeads) -> MedusaHeads:
    """MEDUSA heads as hydra heads that give the same logits: each first block reads the tokens too, through zero
    weights."""
    hydra = MedusaHeads(replace(heads.config, kind="hydra"))
    state = heads.state_dict()
    for k in range(heads.config.num_heads):
        name = f"heads.{k}.0.linear.weight"
        weight = state[name]
        state[name] = torch.cat([weight, weight.new_zeros(weight.shape[0], (k + 1) * weight.shape[1])], 1)
    hydra.load_state_dict(state)
    return hydra


def with_features(heads: MedusaHeads, layers: tuple[int, ...]) -> MedusaHeads:
    """Heads that read the outputs of `layers` too and give the same logits: each first block reads them, between h
    and the tokens, through zero weights."""
    fused = MedusaHeads(replace(heads.config, feature_layers=layers))
    state, size = heads.state_dict(), heads.config.hidden_size
    for k in range(heads.config.num_heads):
        weight = state[f"heads.{k}.0.linear.weight"]
        state[f"heads.{k}.0.linear.weight"] = torch.cat([weight[:, :size], weight.new_zeros(size, len(layers) * size),
                                                         weight[:, size:]], 1)
    fused.load_state_dict(state)
    return fused


def deepened(heads: MedusaHeads, num_layers: int) -> MedusaHeads:
    """Heads with num_layers blocks that give the same logits: the new blocks follow the trained ones, zero-initialised
    (the identity), and an own projection moves past them."""
    deeper = MedusaHeads(replace(heads.config, num_layers=num_layers))
    state, old = deeper.state_dict(), heads.config.num_layers
    for name, tensor in heads.state_dict().items():
        _, k, layer, rest = name.split(".", 3)  # heads.{k}.{layer}.{rest}
        state[f"heads.{k}.{int(layer) if int(layer) < old else int(layer) - old + num_layers}.{rest}"] = tensor
    deeper.load_state_dict(state)
    return deeper


def prepare_backbone(model: PreTrainedModel, config: TrainConfig) -> nn.Module:
    """MEDUSA-1: the model, frozen. MEDUSA-2: a peft LoRA model on every linear layer, lm_head included."""
    model.requires_grad_(False)
    if config.mode == "medusa1":
        return model
    from peft import LoraConfig, get_peft_model
    from transformers.pytorch_utils import Conv1D

    untie_output_embeddings(model)
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                     if isinstance(m, (nn.Linear, Conv1D))})
    lora = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                      target_modules=linear, task_type="CAUSAL_LM")
    return get_peft_model(model, lora)
