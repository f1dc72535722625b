"""Llama-shaped GGUF files with random weights, in any block type: a step's cost does not depend on the weights'
values, so these time a 1B or 8B model that cannot be downloaded here; tiny ones are the tests' GGUF models.

Each quantized tensor is random block bytes with its float16 scales set to small values (no float weights are
quantized, so any type is written as fast as any other); the model's weights are whatever those blocks decode to.
The tokenizer is a byte-level BPE of 256 tokens plus a few merges and an end token, <|endoftext|>
(`tokenizer.ggml.model` gpt2), or copied from another GGUF file (`--tokenizer-from`, e.g. the embedded default's).

    python benchmarks/random_gguf.py out.gguf --shape 1b --type Q4_K [--tokenizer-from SmolLM2.gguf]
"""

import argparse
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import GGML_QUANT_SIZES

# hidden, intermediate, layers, heads, kv heads, vocabulary (the tokenizer's, where copied), tied embeddings
SHAPES = {
    "tiny": dict(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, tied=True),
    "1b": dict(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, tied=True),  # Llama-3.2-1B
    "3b": dict(hidden=3072, intermediate=8192, layers=28, heads=24, kv_heads=8, tied=True),  # Llama-3.2-3B
    "8b": dict(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, tied=False),  # Llama-3.1-8B
}
# where each block type keeps its float16 scales (byte offsets in a block), and the value each gets: small enough
# that the random codes make weights of a trained model's size
SCALES = {
    "Q4_0": ([0], 0.004), "Q4_1": ([0, 2], 0.004), "Q5_0": ([0], 0.002), "Q5_1": ([0, 2], 0.002),
    "Q8_0": ([0], 0.0003), "Q4_K": ([0, 2], 0.0002), "Q5_K": ([0, 2], 0.0001), "Q6_K": ([208], 0.00005),
    "Q2_K": ([80, 82], 0.001),  # a type the engine does not read (its tests' bad input)
}
# llama.cpp's Q4_K_M: Q6_K for the output, and for attention's values and the MLP's down projection in half the layers
# (the first and last eighth, and every third between); Q4_K elsewhere
Q4_K_M = "Q4_K_M"


def q4_k_m_type(name: str, layer: int, layers: int) -> str:
    more = layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2
    return "Q6_K" if name == "output" or (name in ("attn_v", "ffn_down") and more) else "Q4_K"


def random_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: str, scale: float = 1.0) -> np.ndarray:
    """Random bytes of `rows` x `cols` weights of `qtype`, every float16 scale set to a small positive value (times
    `scale`)."""
    kind = GGMLQuantizationType[qtype]
    per_block, size = GGML_QUANT_SIZES[kind]
    assert cols % per_block == 0, f"{qtype}: a row of {cols} weights is not whole blocks of {per_block}"
    data = rng.integers(0, 256, size=(rows, cols // per_block, size), dtype=np.uint8)
    offsets, value = SCALES[qtype]
    halves = (scale * value * rng.uniform(0.5, 1.5, size=(rows, cols // per_block, len(offsets)))).astype(np.float16)
    for i, offset in enumerate(offsets):
        data[..., offset : offset + 2] = halves[..., i : i + 1].view(np.uint8)
    return data.reshape(rows, -1)


def byte_tokenizer(writer: GGUFWriter) -> int:
    """A byte-level BPE (GPT-2's byte alphabet) of 256 tokens, a few merges and <|endoftext|>; returns its size."""
    alphabet = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for b in range(256):
        chars.append(chr(b) if b in alphabet else chr(256 + extra))
        extra += b not in alphabet
    merges = ["Ġ t", "Ġ a", "h e", "i n", "r e", "o n"]
    tokens = ["<|endoftext|>", *chars, *(m.replace(" ", "") for m in merges)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3] + [1] * (len(tokens) - 1))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    return len(tokens)


def copied_tokenizer(writer: GGUFWriter, source: Path) -> int:
    """The tokenizer fields (and chat template) of another GGUF file; returns its vocabulary size."""
    reader = GGUFReader(source)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    writer.add_tokenizer_model(reader.fields["tokenizer.ggml.model"].contents())
    if "tokenizer.ggml.pre" in reader.fields:
        writer.add_tokenizer_pre(reader.fields["tokenizer.ggml.pre"].contents())
    writer.add_token_list(tokens)
    writer.add_token_types(reader.fields["tokenizer.ggml.token_type"].contents())
    writer.add_token_merges(reader.fields["tokenizer.ggml.merges"].contents())
    writer.add_bos_token_id(reader.fields["tokenizer.ggml.bos_token_id"].contents())
    writer.add_eos_token_id(reader.fields["tokenizer.ggml.eos_token_id"].contents())
    if "tokenizer.chat_template" in reader.fields:
        writer.add_chat_template(reader.fields["tokenizer.chat_template"].contents())
    return len(tokens)


def write(path: Path, shape: str | dict = "tiny", qtype: str = "Q8_0", *, seed: int = 0,
          tokenizer_from: Path | None = None, embedding_type: str | None = None, architecture: str = "llama",
          weight_scale: float = 1.0) -> Path:
    """A Llama-shaped GGUF file at `path`: every matrix of `qtype` (or "Q4_K_M": llama.cpp's mix), the embedding of
    `embedding_type` (default: qtype; under Q4_K_M Q6_K where tied to the output), norms F32; weight_scale: the
    weights' size against a trained model's (tests make tiny models lively with more)."""
    dims = SHAPES[shape] if isinstance(shape, str) else shape
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), architecture)
    writer.add_name(f"random-{shape if isinstance(shape, str) else 'custom'}-{qtype}")
    vocab = copied_tokenizer(writer, tokenizer_from) if tokenizer_from else byte_tokenizer(writer)
    hidden, layers, heads = dims["hidden"], dims["layers"], dims["heads"]
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(dims["intermediate"])
    writer.add_block_count(layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(dims["kv_heads"])
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)

    def matrix(name: str, rows: int, cols: int, kind: str) -> None:
        kind = q4_k_m_type(name.split(".")[-2], int(name.split(".")[1]) if name.startswith("blk") else 0, layers) \
            if kind == Q4_K_M else kind
        if kind == "F32":
            writer.add_tensor(name, (0.02 * weight_scale * rng.standard_normal((rows, cols))).astype(np.float32))
        else:
            writer.add_tensor(name, random_blocks(rng, rows, cols, kind, weight_scale),
                              raw_dtype=GGMLQuantizationType[kind])

    norm = lambda name: writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    embedding = embedding_type or (("Q6_K" if dims["tied"] else "Q4_K") if qtype == Q4_K_M else qtype)
    matrix("token_embd.weight", vocab, hidden, embedding)
    kv = dims["kv_heads"] * (hidden // heads)
    for i in range(layers):
        norm(f"blk.{i}.attn_norm.weight")
        for name, rows, cols in [("attn_q", hidden, hidden), ("attn_k", kv, hidden), ("attn_v", kv, hidden),
                                 ("attn_output", hidden, hidden), ("ffn_gate", dims["intermediate"], hidden),
                                 ("ffn_up", dims["intermediate"], hidden), ("ffn_down", hidden, dims["intermediate"])]:
            matrix(f"blk.{i}.{name}.weight", rows, cols, qtype)
        norm(f"blk.{i}.ffn_norm.weight")
    norm("output_norm.weight")
    if not dims["tied"]:
        matrix("output.weight", vocab, hidden, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", choices=SHAPES, default="tiny")
    parser.add_argument("--type", default="Q8_0", help=f"a block type ({', '.join(SCALES)}), F32 or {Q4_K_M}")
    parser.add_argument("--tokenizer-from", type=Path, help="copy the tokenizer of this GGUF file")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write(args.out, args.shape, args.type, seed=args.seed, tokenizer_from=args.tokenizer_from)
    print(f"{args.out}: {args.out.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
