"""Draft heads: K small residual MLPs on the last hidden state h_t; head k guesses token t+k+2.

MEDUSA head k computes `W2 · (h + SiLU(W1 · h))` (one residual block per layer). W1 starts at zero and
W2 is the base LM head (shared) or a copy of it (own), so an untrained head repeats the base model.

A hydra head (Ankner et al. 2024, "sequentially-dependent draft heads") also sees the tokens between h_t and its
target: its first block reads `[h; e(x_t+1); ...; e(x_t+k+1)]`, the base model's input embeddings of the root token
and of the candidates before its guess, and adds the result to h as MEDUSA's does. A MEDUSA head guesses t+k+2
without knowing what comes before it; a hydra head's guess follows the path it extends (candidates.candidates).

Heads of either kind may also read earlier layers (`feature_layers`, EAGLE-3's fused features): their first block
reads those layers' outputs at t, RMS-normalised, beside h (`run_backbone` gives the heads' input state
`[h; f_l1; ...]`). Their columns start at zero too.
"""

import itertools
import json
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from . import formats
from .config import HeadsConfig
from .formats import CONFIG_NAME, WEIGHTS_NAME
from .kernels import weight_rows


def run_backbone(model: nn.Module, layers: tuple[int, ...] = (), **inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """model.base_model(**inputs) -> (its last hidden states [..., H], the heads' input state [..., (1 + L) H]: the
    last hidden state, then the output of each of `layers` RMS-normalised (no weight); without layers, the last
    hidden state itself). Training, calibration and decoding all read the heads' input through here."""
    out = model.base_model(**inputs, **({"output_hidden_states": True} if layers else {}))
    return out.last_hidden_state, heads_input(out.last_hidden_state, out.hidden_states, layers)


def heads_input(hidden: torch.Tensor, hidden_states: tuple[torch.Tensor, ...] | None, layers: tuple[int, ...]
                ) -> torch.Tensor:
    """run_backbone's heads' input state from the last hidden states and `transformers`' hidden_states (the
    embeddings, then each layer's output, the last one normalised)."""
    if not layers:
        return hidden
    return torch.cat([hidden, *(F.rms_norm(hidden_states[i], hidden.shape[-1:]) for i in layers)], -1)


class ResBlock(nn.Module):
    """x + SiLU(Linear([x; context])), zero-initialised so that it starts as the identity. context: [..., C, H]
    read beside x (a first block's: fused layer features, then a hydra head's token embeddings), C fixed at
    construction."""

    def __init__(self, hidden_size: int, context: int = 0):
        super().__init__()
        self.linear = nn.Linear((1 + context) * hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        inputs = x if context is None else torch.cat([x, context.flatten(-2)], -1)
        return x + nn.functional.silu(self.linear(inputs))


class OwnTokens:
    """One row's own tokens outside the heads' guess vocabulary: its prompt's, then its answer's as it grows. On
    held-out answers 14% of the tokens lie outside the 4096 SmolLM2's training answers use most, and most of those
    the row has seen already (answers reuse their prompt's words and names: benchmarks/guess_vocab_coverage.py):
    guessed beside the vocabulary, they cost a few hundred LM head rows, not all of them. columns [V' + E]: the
    token of each column the heads rank (the vocabulary's, then the row's own); weight [E, H]: their LM head rows."""

    def __init__(self, vocabulary: torch.Tensor, lm_head: nn.Linear, tokens: list[int]):
        self.known = torch.zeros(lm_head.out_features, dtype=torch.bool, device=vocabulary.device)
        self.known[vocabulary] = True
        self.lm_head = lm_head
        self.columns = vocabulary
        self.weight = weight_rows(lm_head, vocabulary[:0])
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        new = torch.tensor(list(dict.fromkeys(tokens)), dtype=torch.long, device=self.known.device)
        new = new[~self.known[new]]
        if len(new):  # only these rows of the LM head, as floats (a GGUF one's decoded from its blocks)
            self.known[new] = True
            self.columns = torch.cat([self.columns, new])
            self.weight = torch.cat([self.weight, weight_rows(self.lm_head, new)])


class MedusaHeads(nn.Module):
    """K heads. `forward(hidden, lm_head)` -> logits [K, ..., V]; `lm_head` is used when shared.

    >>> heads = MedusaHeads(HeadsConfig(hidden_size=576, vocab_size=49152, num_heads=4))
    >>> heads(torch.zeros(1, 576), lm_head).shape
    torch.Size([4, 1, 49152])
    """

    def __init__(self, config: HeadsConfig, lm_head: nn.Linear | None = None):
        super().__init__()
        self.config = config
        own = config.projection == "own"
        hydra = config.kind == "hydra"
        first = [len(config.feature_layers) + (k + 1 if hydra else 0) for k in range(config.num_heads)]  # contexts
        self.heads = nn.ModuleList(
            nn.Sequential(
                *(ResBlock(config.hidden_size, first[k] if layer == 0 else 0) for layer in range(config.num_layers)),
                *([nn.Linear(config.hidden_size, config.vocab_size, bias=False)] if own else []),
            )
            for k in range(config.num_heads)
        )
        if own and lm_head is not None:
            for head in self.heads:
                head[-1].weight.data.copy_(weight_rows(lm_head))

    def forward(self, hidden: torch.Tensor, lm_head: nn.Module | None = None, num_heads: int | None = None,
                embeds: torch.Tensor | None = None, first: int = 0) -> torch.Tensor:
        """hidden: [..., H], or the input state [..., (1 + L) H] of heads with L feature_layers (run_backbone) ->
        logits [K', ..., V] of heads first..num_heads-1 (default: all).

        embeds: [..., D, H], hydra heads only: the input embeddings of the tokens after h's position (the root
        first; head k reads the first k+1). Shared heads go through the LM head in one call: its weight, a fifth of
        a small model's, is read once.
        """
        return self.project(self.states(hidden, num_heads, embeds, first), lm_head, first)

    def states(self, hidden: torch.Tensor, num_heads: int | None = None, embeds: torch.Tensor | None = None,
               first: int = 0) -> torch.Tensor:
        """forward's residual blocks alone: [K', ..., H], what each head projects onto the vocabulary."""
        if self.config.kind == "hydra" and embeds is None:
            raise ValueError("hydra heads read the tokens before their guess: pass embeds")
        size, fused = self.config.hidden_size, len(self.config.feature_layers)
        if hidden.shape[-1] != (1 + fused) * size:
            raise ValueError(f"these heads read {1 + fused} states of {size} (the last hidden state and feature "
                             f"layers {list(self.config.feature_layers)}), got {hidden.shape[-1]} values")
        features = hidden[..., size:].unflatten(-1, (fused, size)) if fused else None
        hidden = hidden[..., :size]
        states = []
        for k in range(first, self.config.num_heads if num_heads is None else num_heads):
            blocks = itertools.islice(self.heads[k], self.config.num_layers)  # a slice of a Sequential builds one
            context = [c for c in (features, embeds[..., : k + 1, :] if self.config.kind == "hydra" else None)
                       if c is not None]
            x = next(blocks)(hidden, torch.cat(context, -2) if context else None)
            for block in blocks:
                x = block(x)
            states.append(x)
        return torch.stack(states)

    def project(self, states: torch.Tensor, lm_head: nn.Module | None, first: int = 0) -> torch.Tensor:
        """states [K', ..., H] (of heads first..) -> their logits [K', ..., V]."""
        if self.config.projection == "own":
            return torch.stack([self.heads[k][-1](x) for k, x in enumerate(states, first)])
        if lm_head is None:
            raise ValueError("these heads share the base model's LM head: pass lm_head")
        return lm_head(states)

    def guesses(self, hidden: torch.Tensor, lm_head: nn.Module | None, k: int, num_heads: int | None = None,
                embeds: torch.Tensor | None = None, first: int = 0, own: OwnTokens | None = None) -> torch.Tensor:
        """hidden: [B, ..., H] -> token ids [K', B, ..., k]: each head's top k (heads and embeds as in forward). A
        shared projection onto part of the vocabulary (a guess copy with `rows`, kernels.set_guess_vocab) ranks those
        tokens only, and, for one row's states, its `own` tokens beside them."""
        rows = self.guess_rows(lm_head)
        if own is None or rows is None or not len(own.weight):
            top = self(hidden, lm_head, num_heads, embeds, first).topk(k, dim=-1).indices
            return top if rows is None else rows[top]
        states = self.states(hidden, num_heads, embeds, first)
        logits = self.project(states, lm_head, first)
        logits = torch.cat([logits, (states.to(own.weight.dtype) @ own.weight.T).to(logits.dtype)], -1)
        return own.columns[logits.topk(k, dim=-1).indices]

    def guess_rows(self, lm_head: nn.Module | None) -> torch.Tensor | None:
        """The token ids of the logits' columns where the heads guess from part of the vocabulary (a shared
        projection with `rows`, kernels.set_guess_vocab), else None: column i is token i."""
        return getattr(lm_head, "rows", None) if self.config.projection == "shared" else None

    def save_pretrained(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / CONFIG_NAME).write_text(json.dumps(asdict(self.config), indent=2) + "\n")
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(
        cls, directory: str | Path, dtype: torch.dtype | None = None, vocab_size: int | None = None
    ) -> "MedusaHeads":
        """Heads in any layout of formats.py (ours, reference MEDUSA-1/-2, vLLM), told apart by their files.

        vocab_size: the base model's; read only for shared-projection heads whose files record none.
        """
        directory = Path(directory)
        layout = formats.detect(directory)
        if layout == formats.OURS:
            config, state = read_ours(directory)
        else:
            config, state = formats.read(directory, layout, vocab_size)
        heads = cls(config)
        expected = {k: v.shape for k, v in heads.state_dict().items()}
        found = {k: v.shape for k, v in state.items()}
        if expected != found:
            diff = sorted(set(expected.items()) ^ set(found.items()))[:4]
            raise ValueError(
                f"MEDUSA heads: the tensors in {directory} ({layout} layout) are inconsistent with its config "
                f"(first differences: {diff})"
            )
        heads.load_state_dict(state)
        return heads.to(dtype) if dtype is not None else heads

    def check_compatible(self, hidden_size: int, vocab_size: int, name: str = "the base model",
                         num_layers: int | None = None) -> None:
        """Heads trained for another model must fail loudly, not decode garbage. num_layers: the model's (its
        last layer's output is the last hidden state, so feature layers lie below it)."""
        mine = (self.config.hidden_size, self.config.vocab_size)
        if mine != (hidden_size, vocab_size):
            raise ValueError(
                f"MEDUSA heads were built for hidden_size={mine[0]}, vocab_size={mine[1]} "
                f"(base model {self.config.base_model!r}), but {name} has hidden_size={hidden_size}, "
                f"vocab_size={vocab_size}"
            )
        if num_layers is not None and any(layer >= num_layers for layer in self.config.feature_layers):
            raise ValueError(f"MEDUSA heads read the outputs of layers {list(self.config.feature_layers)}, but "
                             f"{name} has {num_layers} layers (feature layers must lie below the last)")


def read_ours(directory: Path) -> tuple[HeadsConfig, dict[str, torch.Tensor]]:
    """Our own layout: config.json + model.safetensors, as save_pretrained writes them."""
    config_path, weights_path = directory / CONFIG_NAME, directory / WEIGHTS_NAME
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"MEDUSA heads: {path} does not exist")
    try:
        fields = json.loads(config_path.read_text())
        if isinstance(fields, dict) and fields.pop("prefix_layer", None) is not None:  # null: saved without one
            raise TypeError("prefix_layer: heads with a prefix layer are not supported (removed)")
        config = HeadsConfig(**fields)
    except (json.JSONDecodeError, TypeError) as error:
        raise ValueError(f"MEDUSA heads: {config_path} is not a valid heads config: {error}") from None
    try:
        return config, load_file(str(weights_path))
    except (SafetensorError, OSError) as error:
        raise ValueError(f"MEDUSA heads: {weights_path} is corrupt or unreadable: {error}") from None
