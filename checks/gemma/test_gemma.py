"""`make test-gemma`: Gemma 3 270M's own file at a context past its 512-token sliding window, on the exact kernels:
MEDUSA's greedy tokens equal plain decoding's and `transformers`' generate on the file's float32 conversion.

Outside `make test`: the conversion writes 1 GB once and takes minutes; the tiny Gemma 3 models of tests/ (a window
of 8, prompts past it) check the same masks on every run.
"""

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from medusa_decoding import MedusaModel, embedded
from medusa_decoding.kernels import native_build

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "spec_bench_dev.jsonl"
QUESTION = 253  # Spec-Bench's longest summarization prompt here: 1,324 Gemma tokens
NEW_TOKENS = 32


def test_a_long_raw_prompt_decodes_as_transformers_generate():
    text = next(json.loads(line)["turns"][0] for line in DATA.open() if json.loads(line)["question_id"] == QUESTION)
    medusa = MedusaModel.from_pretrained("gemma-3-270m", kernels="stock" if native_build() else "native")
    ids = medusa.encode(text + "\n\nSummary:")
    assert ids.numel() > 2 * medusa.model.config.sliding_window  # past the window: the local layers' masks matter
    plain = medusa.generate(ids, max_new_tokens=NEW_TOKENS, medusa=False).token_ids
    assert medusa.generate(ids, max_new_tokens=NEW_TOKENS).token_ids == plain
    reference = AutoModelForCausalLM.from_pretrained(embedded.converted_dir(embedded.GEMMA3), dtype=torch.float32)
    out = reference.generate(ids[None], attention_mask=torch.ones_like(ids)[None], max_new_tokens=NEW_TOKENS,
                             do_sample=False)
    assert out[0, ids.numel():].tolist() == plain
