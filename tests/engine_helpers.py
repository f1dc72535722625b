"""Models, heads and decoding helpers for the engine tests: lively tiny models, random heads, oracle heads; one request
decoded as a batch of one, one row's verification pass."""

from collections.abc import Iterator

import torch
from conftest import tiny_model

from medusa_decoding import cache as kv
from medusa_decoding import native_layers
from medusa_decoding.base import sliding_window
from medusa_decoding.config import GenerationConfig, HeadsConfig
from medusa_decoding.corpus import CorpusIndex
from medusa_decoding.decoding import Batch
from medusa_decoding.eager import Eager, prefill, step_forward
from medusa_decoding.guard import Ladder
from medusa_decoding.heads import MedusaHeads
from medusa_decoding.kernels import resolve_kernels, use_kernels
from medusa_decoding.tree import Tree

WEIGHT_STD = 0.3  # tiny models at their init scale (0.02) repeat one token; this makes them wander
ORACLE_RANK0, ORACLE_RANK1 = 0.7, 0.9  # luck below 0.7: rank 0, below 0.9: rank 1, else not proposed
# a greedy reference's smallest top-2 logit gap: 30x the rounding gap between engines on the tiny models (~1e-6),
# and far from the gaps the references have on 1 or 2 threads (the least, 9.9e-5); SmolLM2's (native kernels
# against MKL, ~5e-5 of a logit) asks for more
ARGMAX_MARGIN, SMOLLM_ARGMAX_MARGIN = 3e-5, 2e-3


def lively_model(family: str, attn: str = "sdpa", seed: int = 0, **kw):
    """A tiny model whose weight matrices are redrawn with std WEIGHT_STD: varied greedy continuations."""
    model = tiny_model(family, seed=seed, **kw)
    model.config._attn_implementation = attn
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.ndim == 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * WEIGHT_STD)
    return model


def on_compiled_engine(model):
    """`model` (in place) switched for the compiled engine, on the kernels "auto" names untimed (native where they
    build on a CPU in float32)."""
    return use_kernels(model, resolve_kernels("auto", model.device, model.dtype), compiled=True)


def random_heads(model, num_heads: int = 4, seed: int = 0, kind: str = "medusa", feature_layers=()) -> MedusaHeads:
    """Shared-projection heads with random residual blocks: their guesses are mostly wrong (a hydra head's differ
    from path to path; heads with feature layers read those too)."""
    config = model.config.get_text_config()
    heads = MedusaHeads(HeadsConfig(config.hidden_size, config.vocab_size, num_heads, kind=kind,
                                    feature_layers=feature_layers))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in heads.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * WEIGHT_STD)
    return heads.eval()


def greedy_reference(model, prompt: torch.Tensor, max_new_tokens: int, eos: int | None = None) -> list[int]:
    """`transformers`' own greedy continuation of prompt [T]: the output MEDUSA must reproduce, checked decisive."""
    out = model.generate(
        prompt[None], attention_mask=torch.ones_like(prompt)[None], max_new_tokens=max_new_tokens,
        do_sample=False, eos_token_id=eos, pad_token_id=eos if eos is not None else 0,
        output_scores=True, return_dict_in_generate=True,
    )
    assert_decisive(torch.stack(out.scores)[:, 0])
    return out.sequences[0, len(prompt):].tolist()


def assert_decisive(logits: torch.Tensor, margin: float = ARGMAX_MARGIN) -> None:
    """logits [N, V] of a greedy continuation: every argmax must lead its runner-up by `margin`.

    Greedy equality between two engines (a tree pass against one-token passes, native kernels against MKL) is
    equality of argmaxes, not of logits: their rounding differs by ~1e-6 (tiny models) to ~5e-5 (SmolLM2) of a
    logit, and by processor. Where every margin is far above that, the same tokens come out on any CPU; a
    reference with a near-tie would make a test pass or fail by processor, so it is refused here instead.
    """
    top = logits.float().topk(2, dim=-1).values
    margins = top[:, 0] - top[:, 1]
    assert margins.min() > margin, (
        f"greedy reference: step {int(margins.argmin())} is a near-tie (top-2 gap {float(margins.min()):.2e}); "
        "its token may differ by processor: use another prompt or seed")


class OracleHeads(torch.nn.Module):
    """Heads that know the greedy continuation `sequence` (prompt + continuation, [S]).

    They find where decoding stands by the nearest of the base model's hidden states over `sequence`,
    then head k proposes the true token k+2 places ahead at rank 0 mostly, at rank 1 or not at all
    sometimes (fixed per position and head by `luck`), so long paths are accepted and some are cut.
    Hydra oracles (kind="hydra") know it only on the true path: after any other tokens they guess noise.
    """

    def __init__(self, model, sequence: torch.Tensor, num_heads: int = 4, seed: int = 0, kind: str = "medusa"):
        super().__init__()
        with torch.no_grad():
            reference = model.base_model(input_ids=sequence[None]).last_hidden_state[0]  # [S, H]
        vocab_size = model.get_output_embeddings().weight.shape[0]
        self.config = HeadsConfig(reference.shape[-1], vocab_size, num_heads, projection="own", kind=kind)  # own logits
        with torch.no_grad():  # every token's embedding, as the model looks it up (a GGUF model's: decoded blocks)
            self.register_buffer("embedding", model.get_input_embeddings()(torch.arange(vocab_size)).clone())
        generator = torch.Generator().manual_seed(seed)
        self.register_buffer("reference", reference)
        self.register_buffer("sequence", sequence.clone())
        self.register_buffer("noise", torch.randn(len(sequence), num_heads, vocab_size, generator=generator))
        self.register_buffer("luck", torch.rand(len(sequence), num_heads, generator=generator))

    check_compatible = MedusaHeads.check_compatible
    guesses = MedusaHeads.guesses
    guess_rows = MedusaHeads.guess_rows

    def forward(self, hidden: torch.Tensor, lm_head=None, num_heads: int | None = None, embeds=None, first: int = 0
                ) -> torch.Tensor:
        # hidden: [..., H] (embeds: [..., D, H]) -> logits: [K', ..., V]
        flat = hidden.reshape(-1, hidden.shape[-1]).to(self.reference.dtype)
        positions = torch.cdist(flat, self.reference).argmin(-1)  # [B]
        logits = self.planted(positions)
        if self.config.kind == "hydra":  # off the true path: noise
            logits = torch.where(self.on_path(positions, embeds)[..., None], logits, self.noise[positions])
        logits = logits.movedim(1, 0).reshape(self.config.num_heads, *hidden.shape[:-1], -1).to(hidden.dtype)
        return logits[first:num_heads]

    def planted(self, positions: torch.Tensor) -> torch.Tensor:
        """[B] -> [B, K, V]: the true tokens ahead planted in the noise, in tensor ops (a compiled
        step runs them inside its graph)."""
        ahead = positions[:, None] + torch.arange(2, 2 + self.config.num_heads)  # [B, K]
        token = self.sequence[ahead.clamp(max=len(self.sequence) - 1)]
        luck = self.luck[positions]
        planted = torch.where(luck < ORACLE_RANK0, 100.0, torch.where(luck < ORACLE_RANK1, 50.0, -100.0))
        logits = self.noise[positions].scatter(2, token[..., None], planted[..., None])
        runner_up = (token + 1) % self.config.vocab_size  # rank 0 where the true token is at rank 1
        swapped = logits.scatter(2, runner_up[..., None], torch.full_like(planted[..., None], 100.0))
        logits = torch.where(((luck < ORACLE_RANK1) & (luck >= ORACLE_RANK0))[..., None], swapped, logits)
        return torch.where((ahead < len(self.sequence))[..., None], logits, self.noise[positions])

    def on_path(self, positions: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """[B] and the embedded paths [..., D, H] after them -> [B, K]: whether head k reads the true path (its first
        k + 1 tokens are the sequence's after the position)."""
        paths = embeds.reshape(len(positions), *embeds.shape[-2:])  # [B, D, H]
        index = (positions[:, None] + 1 + torch.arange(paths.shape[1])).clamp(max=len(self.sequence) - 1)
        same = (paths == self.embedding[self.sequence[index]]).all(-1).long().cumprod(1).bool()  # [B, D]
        heads = self.config.num_heads
        return torch.cat([same[:, :heads], same.new_zeros(len(positions), max(0, heads - same.shape[1]))], 1)


def decode(model, heads: MedusaHeads | None, prompt: torch.Tensor, config: GenerationConfig, trees: Tree | Ladder,
           eos_ids: frozenset[int] = frozenset(), generator: torch.Generator | None = None, compiled: bool = False,
           corpus: CorpusIndex | None = None) -> Iterator[tuple[list[int], int]]:
    """One request, a batch of one: the tokens of each forward pass and how many candidates it verified (the
    prefill's one token and 0 first)."""
    batch = Batch(model, heads, compiled)
    row = batch.join(prompt, config, trees, eos_ids, generator, corpus)
    yield [row.root], 0
    while batch.rows:
        (_, new, size), = batch.step()
        yield new, size


def tree_mask(tree: Tree, prefix_len: int, dtype: torch.dtype, device, window: int | None = None) -> torch.Tensor:
    """[1, 1, N+1, prefix_len+N+1] additive mask of one row's step: every node sees the prefix and its ancestors (a
    model's sliding `window`: one mask per kind of layer, cache.step_inputs)."""
    lengths, depths = torch.tensor([prefix_len], device=device), tree.depths[None].to(device)
    return kv.step_inputs(lengths, depths, tree.attention[None].to(device), prefix_len + tree.num_nodes, dtype,
                          window)[1]


def engine_prefill(model, prompt: torch.Tensor, capacity: int, layers: tuple[int, ...] = ()):
    """eager.prefill, its row moved into a cache as the eager engine keeps it (float16 where the layers run
    natively: native_layers.CACHE) -> (cache, logits [V], the heads' input state [S] at the last position)."""
    row, logits, state = prefill(model, prompt, len(prompt), layers)
    cache = Eager(model, None).cache(None)
    kv.insert(cache, row, capacity)
    return cache, logits, state


def verify(model, cache, tokens: torch.Tensor, tree: Tree, prefix_len: int, layers: tuple[int, ...] = ()):
    """One row's forward pass over all N+1 nodes, as the eager engine runs it -> logits [N+1, V], the heads' input
    states [N+1, (1 + L) H]."""
    positions = (prefix_len + tree.depths.to(tokens.device))[None]
    mask = tree_mask(tree, prefix_len, model.dtype, tokens.device, sliding_window(model))
    kv.reserve(cache, 1, prefix_len + tree.num_nodes)
    logits, states = step_forward(model, native_layers.weights(model), tokens[None], cache,
                                  torch.tensor([prefix_len], device=tokens.device), positions, mask, layers)
    return logits[0], states[0]
