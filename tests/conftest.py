"""Shared fixtures: tiny random-weight models of each supported family, and the embedded default."""

import os

import pytest
import torch
import transformers

from medusa_decoding.calibrate import device_name
from medusa_decoding.kernels import compile_error, native_build

# MEDUSA_TEST_THREADS=N runs the whole suite on N torch threads (default: torch's, and 1 where `one_thread` asks)
THREADS = int(os.environ.get("MEDUSA_TEST_THREADS", "0"))
if THREADS:
    torch.set_num_threads(THREADS)
# tests of the native kernel itself; elsewhere kernels="auto" falls back to stock kernels and the tests run on those
needs_native = pytest.mark.skipif(native_build() is not None, reason=f"native CPU kernel: {native_build()}")
# the exact float32 kernels the smollm fixture (and the CLI runs compared with it) decode on: kernels="auto" may pick q8
EXACT_KERNELS = "stock" if native_build() else "native"
# tests that compile graphs with torch.compile (inductor): minutes of C++ compiling on a cold CPU, so `make test` leaves
# them to `make test-compiled` (pytest -m compiles); skipped, with the reason, where torch.compile cannot run
needs_compiler = pytest.mark.compiles


def pytest_collection_modifyitems(config, items) -> None:
    if (error := compile_error("cpu")) is not None:
        for item in items:
            if item.get_closest_marker("compiles"):
                item.add_marker(pytest.mark.skip(reason=f"torch.compile: {error}"))


def pytest_report_header(config) -> str:
    """Which processor, vector width and kernels the run had: results differ by machine, so every log says so."""
    native = native_build() or "built"
    return (f"medusa: {device_name(torch.device('cpu'))}, ATen {torch.backends.cpu.get_cpu_capability()}, "
            f"native kernel: {native}, torch.compile: {compile_error('cpu') or 'available'}")

VOCAB = 96
HIDDEN = 32

TINY_CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {}),
    # a sliding window shorter than the tests' prompts, on one layer of two; untied (a tied lm_head reads back the
    # last token's sqrt(hidden)-scaled embedding: every continuation repeats it)
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 8, "sliding_window": 8,
                                                         "tie_word_embeddings": False,
                                                         "layer_types": ["sliding_attention", "full_attention"]}),
}
FAMILIES = tuple(TINY_CONFIGS)


def tiny_model(family: str, seed: int = 0, vocab_size: int = VOCAB, eos_token_id: int | None = None, **overrides):
    """A randomly initialised 2-layer model of `family`, in eval mode, fp32. overrides: config fields."""
    config_cls, model_cls, extra = TINY_CONFIGS[family]
    if family == "gpt2":
        shape = dict(n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=1024)
    else:
        shape = dict(
            hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024,
        )
    config = getattr(transformers, config_cls)(
        vocab_size=vocab_size, bos_token_id=0, eos_token_id=eos_token_id, pad_token_id=None,
        **{**shape, **extra, **overrides},
    )
    torch.manual_seed(seed)
    return getattr(transformers, model_cls)(config).eval()


TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer():
    """A word-level tokenizer of VOCAB tokens (specials, roles, words w0, w1, ...) with a ChatML template,
    for tiny models: fast training tests, whole-word decoding."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[PAD]", "[UNK]", "<|im_end|>", "<|im_start|>", "system", "user", "assistant"]
    words += [f"w{i}" for i in range(VOCAB - len(words))]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"], chat_template=TINY_CHAT_TEMPLATE,
    )


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module: tiny models gain nothing from threads, and on a shared CPU two
    OpenMP threads spin-wait against other processes (10-20x slower). MEDUSA_TEST_THREADS overrides it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS or 1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="session")
def smollm():
    """The embedded default (SmolLM2-135M-Instruct) with its default heads and tree, loaded once per session, on the
    exact float32 kernels (native where they build): the tests hold its answers to `transformers`' own, where
    kernels="auto" may pick q8's 8-bit activations (test_kernels tests that choice)."""
    from medusa_decoding import MedusaModel

    return MedusaModel.from_pretrained(kernels=EXACT_KERNELS)
