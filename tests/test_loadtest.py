"""`medusa bench --concurrency` (loadtest.py): real HTTP clients against the server; every answer checked."""

import json

import pytest

from medusa_decoding import loadtest
from medusa_decoding.config import GenerationConfig

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = ["Name three colours.", "What is 2 + 2?", "Say hello in Spanish."]


def test_every_mode_serves_every_request_with_the_same_answers(smollm, tmp_path):
    trees, smollm.tree = smollm.trees, smollm.tree
    try:
        report = loadtest.load_benchmark(lambda: smollm, PROMPTS, (1, 3), 1, GenerationConfig(max_new_tokens=8), 60,
                                     progress=False, repeat=2)
    finally:
        smollm.trees = trees
    rows = report["rows"]
    assert [(r["clients"], r["mode"]) for r in rows] == [(n, m) for n in (1, 3)
                                                         for m in ("one-at-a-time", "plain", "medusa")]
    assert all(r["requests"] == r["clients"] and r["errors"] == 0 and r["wrong_answers"] == 0 for r in rows)
    assert all(r["runs"] == 2 for r in rows) and report["config"]["repeat"] == 2  # the fastest of two runs each
    assert all(r["tokens"] == 8 * r["clients"] and r["tokens_per_s"] > 0 for r in rows)
    assert [r["mean_candidates"] == 0 for r in rows if r["mode"] == "plain"] == [True, True]
    assert max(r["mean_batch"] for r in rows if r["clients"] == 3 and r["mode"] != "one-at-a-time") > 1
    loadtest.plot(report, tmp_path / "load.png")
    assert (tmp_path / "load.png").stat().st_size > 0 and "one-at-a-time" in loadtest.table(report)
    json.dumps(report)


def test_the_load_benchmark_refuses_sampling_and_bad_counts(smollm):
    with pytest.raises(ValueError, match="greedy"):
        loadtest.load_benchmark(lambda: smollm, PROMPTS, (1,), 1, GenerationConfig(temperature=0.7), 60)
    with pytest.raises(ValueError, match="positive"):
        loadtest.load_benchmark(lambda: smollm, PROMPTS, (0,), 1, GenerationConfig(), 60)
    with pytest.raises(ValueError, match="positive"):
        loadtest.load_benchmark(lambda: smollm, PROMPTS, (1,), 1, GenerationConfig(), 60, repeat=0)
