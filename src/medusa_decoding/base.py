"""The base model: loaded from a directory, the hub or the embedded default, with a MEDUSA-2 adapter merged in, the
tokens that end its answers and the context it attends over. `model` (decoding) and `training` both start here."""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from . import default_model


def eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Every token that ends an answer: the model's generation config's and the tokenizer's."""
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos]) | {tokenizer.eos_token_id}
    return frozenset(e for e in eos if e is not None)


def untie_output_embeddings(model: PreTrainedModel) -> None:
    """A tied lm_head gets its own copy: merging its LoRA must not move the input embeddings too."""
    output, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if output.weight.data_ptr() == embeddings.weight.data_ptr():
        output.weight = torch.nn.Parameter(embeddings.weight.detach().clone(), requires_grad=False)
        model.config.get_text_config().tie_word_embeddings = False
        model.config.tie_word_embeddings = False


def with_adapter(base: PreTrainedModel, adapter: Path) -> PreTrainedModel:
    """The base with a MEDUSA-2 LoRA adapter merged in (no adapter overhead when decoding)."""
    from peft import PeftModel

    untie_output_embeddings(base)  # as in training: the adapter's lm_head is not the embeddings
    return PeftModel.from_pretrained(base, adapter).merge_and_unload()


def load_base(model, dtype=None, device=None, **load_kwargs) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A base model and tokenizer from a directory or hub id; None: the embedded default.

    load_kwargs: passed on to `from_pretrained` (training's quantization_config, device_map).
    """
    if model is None:
        path = default_model.converted_dir()
    else:
        path = Path(model)
        looks_local = path.is_absolute() or str(model).startswith((".", "~")) or str(model).count("/") > 1
        if looks_local and not path.expanduser().exists():
            raise FileNotFoundError(f"model: {model} does not exist")
        path = path.expanduser() if path.expanduser().exists() else str(model)
    try:
        base = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, **load_kwargs)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except OSError as error:
        raise OSError(f"model: could not load {model!r}: {error}") from None
    return base.to(device) if device is not None else base, tokenizer


def context_limit(model: PreTrainedModel) -> int:
    """The longest sequence the model attends over correctly (sliding windows are not emulated)."""
    config = model.config.get_text_config()
    limits = [getattr(config, "max_position_embeddings", None), getattr(config, "sliding_window", None)]
    return min(int(n) for n in limits if n)


def check_context(model: PreTrainedModel, prompt_len: int, max_new_tokens: int) -> None:
    if prompt_len < 1:
        raise ValueError("the prompt is empty: nothing to continue")
    limit = context_limit(model)
    if prompt_len + max_new_tokens > limit:
        raise ValueError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = {prompt_len + max_new_tokens} "
            f"exceeds the model's context of {limit} tokens"
        )
