"""The eager q8 engine's steps through one native call per decoder layer (medusa::layer_q8, csrc/layer.cpp).

`transformers` runs a Llama layer as ~40 small ops, each a Python call and a dispatch: on a 2-core CPU those cost
more than SmolLM2's q8 arithmetic. Where every decoder layer is Llama-shaped (Llama, Mistral: no biases, no
per-head norms, SiLU MLP, full attention) on q8 linears, a step runs the embedding, the model's own rotary
embedding, the final norm and the LM head as `transformers` does and each layer in one call; the prefill, and
every other model or kernel, keep `transformers`' forward. The cache, positions and mask are the eager engine's;
plain and MEDUSA steps both go through here, so MEDUSA's greedy output is still plain decoding's on this engine.

The cache holds float16 keys and values (llama.cpp's default too): at long contexts a step's attention reads the
whole cache and its time is that reading, so half the bytes is most of what a long context costs; the rounding is
the same on every instruction set, a key's before any query reads it, in a tree pass as in a one-token pass.
"""

import torch
from transformers import Cache, PreTrainedModel

from . import kernels
from .heads import heads_input

LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer")
CACHE = torch.float16  # the cache's entries on this engine
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


def weights(model: PreTrainedModel) -> list[tuple] | None:
    """Per decoder layer, what layer_q8 takes of it (norms, q8 codes, scales, output sizes, eps, scale), or None
    where the model is not Llama-shaped on q8 linears throughout."""
    config, inner = model.config.get_text_config(), model.base_model
    if getattr(config, "hidden_act", None) != "silu" or getattr(config, "sliding_window", None):
        return None
    found = []
    for layer in getattr(inner, "layers", ()):
        if type(layer).__name__ not in LAYERS:
            return None
        linears = [layer.get_submodule(name) for name in PROJECTIONS]
        if any(type(linear) is not kernels.Q8Linear or linear.bias is not None for linear in linears):
            return None
        found.append((layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                        [linear._buffers["codes"] for linear in linears],
                        [linear._buffers["scales"] for linear in linears],
                        [linear.out_features for linear in linears], layer.input_layernorm.variance_epsilon,
                        layer.self_attn.scaling))
    return found or None


def forward(model: PreTrainedModel, weights: list[tuple], tokens: torch.Tensor, cache: Cache, lengths: torch.Tensor,
            positions: torch.Tensor, mask: torch.Tensor, layers: tuple[int, ...] = ()
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """eager.forward for a step: tokens [B, T] written at columns lengths[b].. of the cache (reserved), at
    `positions` [B, T], under `mask` [B, 1, T, S] -> (logits [B, T, V], the heads' input states)."""
    inner = model.base_model
    x = inner.embed_tokens(tokens)
    cos, sin = inner.rotary_emb(x, positions)
    columns = lengths[:, None] + torch.arange(tokens.shape[1], device=lengths.device)
    outputs = [x]  # transformers' hidden_states, where the heads read feature layers
    ops = kernels.native_ops()
    for (input_norm, post_norm, codes, scales, outs, eps, scale), layer in zip(weights, cache.layers):
        x = ops.layer_q8(x, input_norm, post_norm, codes, scales, outs, layer.key_buffer, layer.value_buffer,
                         columns, cos, sin, mask[:, 0], eps, scale)
        if layers:
            outputs.append(x)
    hidden = inner.norm(x)
    return model.get_output_embeddings()(hidden), heads_input(hidden, outputs[:-1] + [hidden], layers)
