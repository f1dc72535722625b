"""vLLM's side of checks/vllm/test_vllm.py, run in vLLM's own virtual environment (no medusa_decoding there): greedy
answers to the given prompts' token ids, plainly and with the exported MEDUSA heads as vLLM's speculator, and that
speculator's acceptance per draft position, from vLLM's own counters, over answers of exactly `max_tokens` tokens
(EOS ignored, so that every request drafts at the same positions as in our engine's count).

usage: python run_vllm.py MODEL_DIR HEADS_DIR IN.json OUT.json   (IN: {"prompts": [[ids]], "max_tokens": N})
"""

import json
import sys

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

SPECULATIVE_TOKENS = 4  # vLLM's MEDUSA proposes one top-1 chain of this many tokens, one per head
COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens_per_pos")


def counters(llm: LLM) -> dict:
    """The speculator's counters so far (a vector counter: one value a position)."""
    metrics = {m.name: m for m in llm.get_metrics()}
    missing = [name for name in COUNTERS if name not in metrics]
    if missing:
        raise KeyError(f"vLLM reports no metric {missing}: {sorted(metrics)}")
    return {name: getattr(metrics[name], "values", None) or metrics[name].value for name in COUNTERS}


def completions(llm: LLM, prompts: list[list[int]], params: SamplingParams, one_at_a_time: bool) -> list:
    groups = [[ids] for ids in prompts] if one_at_a_time else [prompts]
    return [out.outputs[0] for group in groups
            for out in llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in group], params, use_tqdm=False)]


def answers(llm: LLM, prompts: list[list[int]], params: SamplingParams, one_at_a_time: bool) -> list[list[int]]:
    return [list(out.token_ids) for out in completions(llm, prompts, params, one_at_a_time)]


def main() -> None:
    model, heads, inputs, output = sys.argv[1:5]
    request = json.loads(open(inputs).read())
    greedy = SamplingParams(temperature=0, max_tokens=request["max_tokens"])
    # on the CPU backend gpu_memory_utilization is the share of memory it reserves: a little is plenty here
    common = dict(model=model, dtype="float32", enforce_eager=True, max_model_len=2048, seed=0,
                  gpu_memory_utilization=0.3)
    plain = LLM(**common)
    report = {"plain": answers(plain, request["prompts"], greedy, one_at_a_time=False)}
    del plain
    medusa = LLM(**common, disable_log_stats=False,  # the counters get_metrics reads
                 per_request_spec_decode_metrics="detailed",  # and each request's accepted drafts, step by step
                 speculative_config={"method": "medusa", "model": heads, "num_speculative_tokens": SPECULATIVE_TOKENS})
    report["medusa"] = answers(medusa, request["prompts"], greedy, one_at_a_time=True)
    before = counters(medusa)
    full = SamplingParams(temperature=0, max_tokens=request["max_tokens"], ignore_eos=True)
    outs = completions(medusa, request["prompts"], full, one_at_a_time=True)
    after = counters(medusa)
    report["full_length"] = [list(out.token_ids) for out in outs]
    report["accepted_per_step"] = [list(out.spec_decode_metrics.per_step_accepted) for out in outs]
    report["drafts"] = after[COUNTERS[0]] - before[COUNTERS[0]]
    report["draft_tokens"] = after[COUNTERS[1]] - before[COUNTERS[1]]
    report["accepted_per_position"] = [a - b for a, b in zip(after[COUNTERS[2]], before[COUNTERS[2]])]
    open(output, "w").write(json.dumps(report))


if __name__ == "__main__":
    main()
