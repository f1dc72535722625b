"""Which kernels run the model's few-token forward passes: the CPU fast path for MEDUSA steps.

A MEDUSA step on a CPU is a forward pass over 2-16 tokens, where stock `F.linear` (MKL) is at its worst: it
repacks the weight on every call, and on a 2-core AVX2 machine a SmolLM2 pass over 2 tokens costs 1.5x one over
1 token. oneDNN with each weight reordered once (`packed`) picks the same argmax as stock (logits within 1e-4)
and runs 4-16 token passes 5-15% faster on a 2-core Xeon (up to 35% on a 2-core AMD EPYC); for 1-3 tokens the
packed layers fall back to stock kernels, which were as fast or faster there. int8 dynamic quantization
(`torch.ao`) halves the latency again but is not offered: on SmolLM2-135M its greedy output leaves the float32
model's within the first few tokens (per-tensor or per-channel). bfloat16 (`dtype=torch.bfloat16`: oneDNN AMX
tiles on a recent Xeon) is not the CPU default: its step latency is nearly flat from 1 to 16 tokens (40 to 50 ms,
against stock 35 to 76), but greedy MEDUSA no longer equals greedy plain decoding (a 16-token pass rounds
differently from a 1-token pass), so the output would depend on the tree.

`compiled` runs the backbone through `torch.compile` (inductor, dynamic shapes: a few graphs, for the prefill, the
trees and a single token; the packed weights do not lower through it, so its linears are the compiler's). It
fuses what eager mode runs as hundreds of small ops per pass (norms, rotary, the tree mask): on a 2-core Xeon a
SmolLM2 pass over 2 tokens cost 34.7 ms against packed 39.6 and a 1-token one 33.6, the same argmax as stock.
Not the default: its first calls compile for 2-4 minutes on that CPU (less with inductor's on-disk cache), which
only a long-running process (`medusa serve`, `medusa bench`) wins back.

The heads' guesses need no such care: the float32 model verifies every one, so a guess may be approximate and the
output stays the same. Under packed or compiled kernels they go through an int8 copy of the LM head (`Int8Linear`,
one scale per row): a quarter of the bytes of the largest matrix, read once more every step for the guesses alone.
With the shipped heads and tree on a 2-core Xeon that took a step from 44.0 to 41.3 ms, the output and acceptance
unchanged. Measured side by side: benchmarks/cpu_kernels.py and its results.
"""

import contextlib

import torch
from torch import nn

KERNELS = ("auto", "stock", "packed", "compiled")
GUESS_COPY = "int8"  # the LM head's submodule that the heads' guesses go through on a CPU in float32


class PackedLinear(nn.Linear):
    """An nn.Linear that runs oneDNN on a copy of its weight reordered once (inference only), for inputs of at
    least `min_rows` rows; below that stock kernels are as fast or faster (a SmolLM2 step over 1 and 2 tokens on
    a 2-core Xeon: stock 34 and 41 ms, packed 41 and 49; over 4 and 8: stock 56 and 67, packed 50 and 56).

    `weight` and `bias` stay as they are, so the state dict, tied embeddings and save_pretrained are unchanged.
    """

    min_rows = 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() < self.min_rows * self.in_features:
            return nn.functional.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class Int8Linear(nn.Module):
    """An approximate copy of a linear layer for inference: int8 weights with one scale per output row (weight-only,
    bfloat16 activations through `torch._weight_int8pack_mm`). Its buffers are not saved with the model.

    >>> Int8Linear(nn.Linear(576, 49152, bias=False))(torch.randn(4, 576)).shape
    torch.Size([4, 49152])
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        scales = weight.abs().amax(1).clamp(min=torch.finfo(torch.float32).tiny) / 127
        self.register_buffer("weight", torch.round(weight / scales[:, None]).to(torch.int8), persistent=False)
        self.register_buffer("scales", scales.bfloat16(), persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]).bfloat16(), self.weight, self.scales).to(x.dtype)
        out = out if self.bias is None else out + self.bias
        return out.reshape(*x.shape[:-1], -1)


def cpu_float32(device: torch.device, dtype: torch.dtype) -> bool:
    return torch.device(device).type == "cpu" and dtype == torch.float32


def resolve_kernels(kernels: str, device: torch.device, dtype: torch.dtype) -> str:
    """auto: packed on a CPU in float32 where oneDNN exists, else stock. compiled runs anywhere."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    cpu_fp32 = cpu_float32(device, dtype) and torch.backends.mkldnn.is_available()
    if kernels == "auto":
        return "packed" if cpu_fp32 else "stock"
    if kernels == "packed" and not cpu_fp32:
        raise ValueError(f"kernels={kernels!r} runs on the CPU in float32 only, not {torch.device(device)} {dtype}")
    return kernels


def use_kernels(model: nn.Module, kernels: str) -> nn.Module:
    """Switches `model` (in place) to `kernels`: every nn.Linear to PackedLinear ("packed"), or the backbone through
    `torch.compile` with dynamic shapes ("compiled": a few graphs, for the prefill, the trees and a single token).
    Both give the LM head of a float32 CPU model its int8 copy for the heads' guesses (`guess_projection`)."""
    if kernels == "packed":
        for module in [m for m in model.modules() if type(m) is nn.Linear]:
            module.__class__ = PackedLinear
            module.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(module.weight.detach()),
                                   persistent=False)
    if kernels == "compiled" and model.base_model._compiled_call_impl is None:
        model.base_model.compile(dynamic=True)
    lm_head = model.get_output_embeddings()
    guessing = kernels != "stock" and cpu_float32(lm_head.weight.device, lm_head.weight.dtype)
    if guessing and not hasattr(lm_head, GUESS_COPY):
        lm_head.add_module(GUESS_COPY, Int8Linear(lm_head))
    return model


def guess_projection(model: nn.Module) -> nn.Module:
    """What the heads' guesses are projected through: the LM head's int8 copy where use_kernels made one, else
    the LM head itself. The model's own logits always come from the LM head."""
    lm_head = model.get_output_embeddings()
    return getattr(lm_head, GUESS_COPY, lm_head)


@contextlib.contextmanager
def stock_kernels(model: nn.Module):
    """Runs packed linears on stock kernels and a compiled backbone eagerly inside the block: the baseline of what
    `transformers` alone gives."""
    packed = [m for m in model.modules() if type(m) is PackedLinear]
    compiled, model.base_model._compiled_call_impl = model.base_model._compiled_call_impl, None
    for module in packed:
        module.__class__ = nn.Linear
    try:
        yield model
    finally:
        model.base_model._compiled_call_impl = compiled
        for module in packed:
            module.__class__ = PackedLinear
