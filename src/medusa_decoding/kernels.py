"""Which matrix-multiply kernels the model's linear layers run: the CPU fast path for few-token passes.

A MEDUSA step on a CPU is a forward pass over 2-16 tokens, where stock `F.linear` (MKL) is at its worst: it
repacks the weight on every call, and on a 2-core AVX2 machine a SmolLM2 pass over 2 tokens costs 1.5x one over
1 token. oneDNN with each weight reordered once (`packed`) runs 1-16 token passes 20-35% faster than stock,
picks the same argmax (logits within 1e-4) and computes every row independently of the others, so MEDUSA stays
token-identical to plain decoding. `int8` (dynamic quantization) is faster still but changes the model's outputs,
and it scales activations per call, so a token's logits depend on the other tokens in its pass: an option for
who accepts that, never the default, and not lossless. Measured: benchmarks/results/cpu_kernels.json.
"""

import contextlib

import torch
from torch import nn

KERNELS = ("auto", "stock", "packed", "int8")


class PackedLinear(nn.Linear):
    """An nn.Linear that runs oneDNN on a copy of its weight reordered once (inference only).

    `weight` and `bias` stay as they are, so the state dict, tied embeddings and save_pretrained are unchanged.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def resolve_kernels(kernels: str, device: torch.device, dtype: torch.dtype) -> str:
    """auto: packed on a CPU in float32 where oneDNN exists, else stock."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    cpu_fp32 = torch.device(device).type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
    if kernels == "auto":
        return "packed" if cpu_fp32 else "stock"
    if kernels != "stock" and not cpu_fp32:
        raise ValueError(f"kernels={kernels!r} runs on the CPU in float32 only, not {torch.device(device)} {dtype}")
    return kernels


def use_kernels(model: nn.Module, kernels: str) -> nn.Module:
    """Switches every nn.Linear of `model` (in place) to `kernels` ("packed", "int8" or "stock")."""
    if kernels == "int8":
        return torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8, inplace=True)
    if kernels == "packed":
        for module in model.modules():
            if type(module) is nn.Linear:
                module.__class__ = PackedLinear
                weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach())
                module.register_buffer("packed", weight, persistent=False)
    return model


@contextlib.contextmanager
def stock_kernels(model: nn.Module):
    """Runs packed linears on stock kernels inside the block: the baseline of what `transformers` alone gives."""
    packed = [m for m in model.modules() if type(m) is PackedLinear]
    for module in packed:
        module.__class__ = nn.Linear
    try:
        yield model
    finally:
        for module in packed:
            module.__class__ = PackedLinear
