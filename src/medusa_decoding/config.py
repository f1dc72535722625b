"""Every default of the project, in one place: the CLI, the server and the API are built from these."""

import os
from dataclasses import dataclass, field
from pathlib import Path

ACCEPTANCE_RULES = ("greedy", "typical", "rejection")
PROJECTIONS = ("shared", "own")
HEAD_KINDS = ("medusa", "hydra")  # hydra: a head also sees the tokens between the hidden state and its target
EXPORT_FORMATS = ("vllm", "reference")  # `medusa export` targets; formats.py reads these and more

# A small sparse tree (published MEDUSA path format: each path lists the rank taken in each head's
# top-k). Kept small because on a CPU every extra node costs time; `medusa calibrate` replaces it.
DEFAULT_TREE = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0))


@dataclass(frozen=True)
class HeadsConfig:
    """What a set of heads was built for; saved as the heads' `config.json`."""

    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1
    projection: str = "shared"  # "shared": the base LM head; "own": one copied per head (published layout)
    base_model: str = ""
    kind: str = "medusa"  # "hydra": head k also sees the input embeddings of the k+1 tokens before its target
    # the base model's layers whose outputs (RMS-normalised) the heads read beside the last hidden state, EAGLE-3's
    # fused features; () reads the last hidden state alone, the published layout
    feature_layers: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "feature_layers", check_layers(self.feature_layers))
        if self.projection not in PROJECTIONS:
            raise ValueError(f"projection must be one of {PROJECTIONS}, got {self.projection!r}")
        if self.kind not in HEAD_KINDS:
            raise ValueError(f"kind must be one of {HEAD_KINDS}, got {self.kind!r}")
        for name in ("hidden_size", "vocab_size", "num_heads", "num_layers"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")


def check_layers(layers) -> tuple[int, ...]:
    """feature_layers as a tuple of distinct positive layer numbers (config.json holds a list)."""
    if not isinstance(layers, (list, tuple)) or not all(isinstance(i, int) and i >= 1 for i in layers) \
            or len(set(layers)) != len(layers):
        raise ValueError(f"feature_layers must be distinct layer numbers >= 1 (layer i's output), got {layers!r}")
    return tuple(layers)


@dataclass(frozen=True)
class GenerationConfig:
    """How to decode one request. temperature 0 means greedy (argmax) targets."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    acceptance: str = "auto"  # auto: greedy at temperature 0, rejection sampling above
    typical_epsilon: float = 0.09  # the paper's code: posterior_threshold
    typical_delta: float = 0.3  # the paper's code: posterior_alpha
    stop: tuple[str, ...] = ()
    seed: int | None = None
    medusa: bool = True  # False: plain one-token-per-step decoding in the same engine
    # lookup drafts (lookup.py): at most this many tokens a step copied from where the text's last few tokens occurred
    # before, verified beside the heads' candidates, each step only as many as pay for their time; 0: none
    lookup: int = 8
    # corpus drafts (corpus.py), where the heads come with an index of the model's own answers: at most this many
    # tokens a step of what followed the text's last tokens there most often, verified as lookup drafts are; 0: none
    corpus: int = 8

    def __post_init__(self):
        if self.acceptance not in ACCEPTANCE_RULES + ("auto",):
            raise ValueError(f"acceptance must be one of {ACCEPTANCE_RULES + ('auto',)}, got {self.acceptance!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k!r}")
        for name in ("lookup", "corpus"):
            if not isinstance(value := getattr(self, name), int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.acceptance == "greedy" and self.temperature > 0:
            raise ValueError("acceptance 'greedy' needs temperature 0; use 'typical' or 'rejection' to sample")
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def rule(self) -> str:
        """The acceptance rule in force. "auto" stays stored, so `replace(config, temperature=0.7)` re-resolves it."""
        if self.acceptance == "auto":
            return "greedy" if self.temperature == 0 else "rejection"
        return self.acceptance


@dataclass(frozen=True)
class DistillConfig:
    """Self-distillation: the base model answers the seed prompts itself (its answers train the heads)."""

    max_new_tokens: int = 512
    temperature: float = 0.3  # the MEDUSA paper's: sampled, so answers cover what the model may say
    # turns decoded together: answer throughput rises with rows up to about 32 on 2 cores (q8), then falls
    batch_size: int = 32
    seed: int = 0
    raw: bool = False  # prompts as raw text, continued (conversation.py), where the model has a chat template too

    def __post_init__(self):
        for name in ("max_new_tokens", "batch_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")


TRAIN_MODES = ("medusa1", "medusa2")
LM_LOSSES = ("kl", "ce")
HEAD_TARGETS = ("tokens", "teacher")  # what the heads' loss ranks against: TrainConfig.targets
QUANTIZATIONS = ("8bit", "4bit")


@dataclass(frozen=True)
class TrainConfig:
    """Head training. medusa1: frozen backbone, heads only. medusa2: LoRA backbone and heads together."""

    mode: str = "medusa1"
    kind: str = HeadsConfig.kind
    num_heads: int = HeadsConfig.num_heads
    num_layers: int = HeadsConfig.num_layers
    projection: str = HeadsConfig.projection
    feature_layers: tuple[int, ...] = HeadsConfig.feature_layers
    epochs: float = 2.0
    max_steps: int = -1  # > 0 overrides epochs
    learning_rate: float = 1e-3  # the heads'; the LoRA backbone's is learning_rate / heads_lr_ratio
    heads_lr_ratio: float = 4.0  # MEDUSA-2: heads learn 4x faster than the backbone
    batch_size: int = 8
    gradient_accumulation_steps: int = 1
    max_length: int = 2048
    warmup_steps: int = 50  # learning-rate warm-up, and MEDUSA-2's sine ramp of lambda0 without --init-heads
    scheduler: str = "cosine"
    decay: float = 0.8  # head k's loss weight is decay**k
    # medusa1: "tokens", CE to the data's token t+k+2; "teacher", CE to the frozen model's own distribution over it
    # (softmax of its logits at t+k+1, over the guess vocabulary where there is one: Hydra++'s target)
    targets: str = "tokens"
    lambda0: float = 0.2  # MEDUSA-2: loss = L_LM + lambda0 * L_heads
    lm_loss: str = "kl"  # MEDUSA-2 backbone term: KL to the original model (self-distilled data) or CE
    lora_r: int = 32
    lora_alpha: int = 16
    lora_dropout: float = 0.05
    quantize: str | None = None  # MEDUSA-1: load the frozen backbone in 8bit / 4bit (bitsandbytes, GPU)
    # MEDUSA-1, shared projection: the heads' loss ranks the N tokens the training answers use most (0: all) and the
    # batch's targets beside them, as they guess on a CPU (calibrate's guess_vocab, and each row's own tokens): the
    # projection onto 49k tokens is most of a CPU step
    guess_vocab: int = 0
    # MEDUSA-1: > 0 computes the frozen backbone's states at the answer positions once (batch_size conversations at a
    # time) and trains on shuffled batches of this many positions; 0 trains on batches of batch_size conversations
    position_batch: int = 0
    bf16: bool = False
    eval_fraction: float = 0.05
    save_steps: int = 200  # checkpoint (and evaluate) every this many optimizer steps
    save_total_limit: int = 2
    logging_steps: int = 10
    seed: int = 0

    def __post_init__(self):
        object.__setattr__(self, "feature_layers", check_layers(self.feature_layers))
        choices = {"mode": TRAIN_MODES, "kind": HEAD_KINDS, "projection": PROJECTIONS, "lm_loss": LM_LOSSES,
                   "targets": HEAD_TARGETS, "quantize": QUANTIZATIONS + (None,)}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        positive = ("num_heads", "num_layers", "batch_size", "gradient_accumulation_steps", "max_length", "lora_r",
                    "lora_alpha", "save_steps", "logging_steps", "learning_rate", "heads_lr_ratio", "decay", "epochs")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        for name in ("lambda0", "warmup_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not 0 <= self.eval_fraction < 1:
            raise ValueError(f"eval_fraction must be in [0, 1), got {self.eval_fraction!r}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout!r}")
        if self.guess_vocab and (self.mode != "medusa1" or self.projection != "shared"):
            raise ValueError(f"guess_vocab is for mode 'medusa1' with a shared projection, got mode {self.mode!r}, "
                             f"projection {self.projection!r}")
        if not isinstance(self.guess_vocab, int) or self.guess_vocab < 0:
            raise ValueError(f"guess_vocab must be 0 (all) or a positive integer, got {self.guess_vocab!r}")
        if not isinstance(self.position_batch, int) or self.position_batch < 0:
            raise ValueError(f"position_batch must be 0 (batches of conversations) or a positive integer, "
                             f"got {self.position_batch!r}")
        if self.position_batch and self.mode != "medusa1":
            raise ValueError(f"position_batch caches a frozen backbone's states: it is for mode 'medusa1', got "
                             f"mode {self.mode!r}")
        if self.targets == "teacher" and self.mode != "medusa1":
            raise ValueError(f"targets 'teacher' is the frozen backbone's distribution: mode 'medusa1', got mode "
                             f"{self.mode!r}")
        if self.quantize and self.mode != "medusa1":
            raise ValueError(f"quantize is for mode 'medusa1' (frozen backbone), got mode {self.mode!r}")


@dataclass(frozen=True)
class DefaultModel:
    """The embedded default (embedded.DEFAULT) as the demo and the server name it."""

    name: str = "SmolLM2-135M-Instruct"
    demo_prompts: tuple[str, ...] = field(
        default=(
            "Write a short poem about the sea.",
            "Explain what a hash table is in two sentences.",
            "List three tips for staying focused while studying.",
        )
    )
    demo_max_new_tokens: int = 96  # three answers, MEDUSA and plain: a demo that is over in minutes on a laptop CPU


DEFAULT_MODEL = DefaultModel()


def cache_root() -> Path:
    """Where the project keeps what it makes once per machine: $MEDUSA_CACHE, else the user's cache directory."""
    base = (os.environ.get("MEDUSA_CACHE")
            or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "medusa-decoding")
    return Path(base)


@dataclass(frozen=True)
class ServerConfig:
    """Where `medusa serve` listens (loopback unless asked) and what it takes from a request."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 8  # requests decoded together (also `MedusaModel.generate` over a list of prompts)
    max_queue: int = 32  # requests waiting for a row beyond those; more are refused (503), not queued without bound
    # the largest tree a request's `medusa.tree` may ask for, checked before anything is allocated (the calibrated
    # trees have at most CalibrateConfig.max_nodes candidates); a deeper tree than the heads reach is refused anyway
    max_tree_nodes: int = 256
    max_tree_depth: int = 8
    api_key: str | None = None  # every /v1/ request must send it (Authorization: Bearer KEY); None: no check


@dataclass(frozen=True)
class CalibrateConfig:
    """`medusa calibrate`: measure the heads' accuracy and the step latency, then pick the fastest tree."""

    top_k: int = 10  # ranks measured per head (S of the accuracy table)
    max_nodes: int = 64  # the largest tree tried (candidates, root not counted)
    max_positions: int = 4096  # answer positions measured; enough for a table to 1-2 points
    simulated_positions: int = 2000  # answer positions at which every tree is simulated (calibrate.measure_yields)
    max_length: int = 1024  # tokens per conversation (longer ones are cut)
    batch_size: int = 4
    # context lengths the step latency is timed at (attention grows with the context, and with it a tree step's cost
    # against a plain one's); the guard interpolates between them, the tree chosen for the middle one
    latency_contexts: tuple[int, ...] = (128, 512, 2048)
    latency_repeats: int = 5  # timed steps per tree size; the median is kept
    # batches whose step latency is timed too (at the first context), for each tree the guard may pick: a batch's
    # rows share a forward pass, and from some size on plain steps for all of them give more tokens per second
    # (linear between, up to the server's default max_batch)
    batch_sizes: tuple[int, ...] = (1, 3, 8)
    guess_vocab: int = 4096  # the heads guess from the tokens the answers use most (kernels.set_guess_vocab); 0: all

    def __post_init__(self):
        for name in ("top_k", "max_nodes", "max_positions", "simulated_positions", "max_length", "batch_size",
                     "latency_repeats"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if not self.latency_contexts or not all(isinstance(n, int) and n >= 1 for n in self.latency_contexts):
            raise ValueError(f"latency_contexts must be positive integers, got {self.latency_contexts!r}")
        object.__setattr__(self, "latency_contexts", tuple(self.latency_contexts))
        if list(self.batch_sizes)[:1] != [1] or list(self.batch_sizes) != sorted(set(self.batch_sizes)):
            raise ValueError(f"batch_sizes must increase from 1, got {self.batch_sizes!r}")
        object.__setattr__(self, "batch_sizes", tuple(self.batch_sizes))
        if not isinstance(self.guess_vocab, int) or not (self.guess_vocab == 0 or self.guess_vocab >= self.top_k):
            raise ValueError(f"guess_vocab must be 0 (the whole vocabulary) or at least top_k ({self.top_k}), "
                             f"got {self.guess_vocab!r}")
