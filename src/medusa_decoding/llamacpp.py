"""llama.cpp beside MEDUSA: what a CPU user runs today on the same GGUF file, timed on the same prompts.

`medusa bench --llama-cpp` runs it through `llama-cpp-python`, an optional extra
(`pip install 'medusa-decoding[llama]'`; it builds llama.cpp from source for this CPU), never needed by the tests.
Greedy (temperature 0), one token per llama.cpp decode call, the prompt's prefill on the clock, no prompt cache
carried from one request to the next.
"""

import statistics
import time
from pathlib import Path

from .model import GenerationOutput

INSTALL = ("pip install 'medusa-decoding[llama]'"
           " (llama-cpp-python: builds llama.cpp for this CPU, about 15 minutes on 2 cores)")


def require():
    """llama_cpp.Llama, or a clear error where the extra is missing (checked before any model loads)."""
    try:
        from llama_cpp import Llama
    except ImportError:
        raise ModuleNotFoundError(f"llama.cpp: llama-cpp-python is not installed: {INSTALL}") from None
    return Llama


def load(gguf: str | Path, threads: int, context: int):
    """A llama.cpp model of `context` positions on `threads` threads."""
    Llama = require()
    if not Path(gguf).is_file():
        raise FileNotFoundError(f"llama.cpp: {gguf} does not exist (a GGUF file)")
    return Llama(model_path=str(gguf), n_ctx=context, n_threads=threads, n_threads_batch=threads, verbose=False)


def generate(llm, ids: list[int], max_new_tokens: int, eos_ids) -> GenerationOutput:
    """Greedy continuation of the token ids `ids` (the engine's own tokenizer: the same GGUF vocabulary)."""
    out = GenerationOutput()
    llm.reset()  # no prefix of an earlier request reused: every request prefills its whole prompt
    start = time.perf_counter()
    for token in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0):
        out.first_token_seconds = out.first_token_seconds or time.perf_counter() - start
        out.token_ids.append(int(token))
        if len(out.token_ids) == max_new_tokens or token in eos_ids:
            break
    out.seconds = time.perf_counter() - start
    out.accept_lengths = [1] * len(out.token_ids)
    out.tree_sizes = [0] * len(out.token_ids)
    return out


def step_latency(llm, prefix: list[int], sizes: list[int], repeats: int) -> list[float]:
    """Median seconds of one llama.cpp decode call over each of `sizes` tokens after `prefix`, the sizes taking turns
    (the first round a warm-up) and the cache rolled back to the prefix after each: what `calibrate`'s
    measure_step_latency does for the engine's MEDUSA steps."""
    llm.reset()
    llm.eval(prefix)
    times = [[] for _ in sizes]
    for _ in range(repeats + 1):
        for size, timed in zip(sizes, times):
            llm.n_tokens = len(prefix)  # eval drops every cache entry from n_tokens on
            start = time.perf_counter()
            llm.eval(prefix[:size])
            timed.append(time.perf_counter() - start)
    return [statistics.median(timed[1:]) for timed in times]
