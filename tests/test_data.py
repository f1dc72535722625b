"""The shipped training data never asks a benchmark's question."""

import importlib.util
from pathlib import Path

import pytest

from medusa_decoding.training.data import read_records

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "data" / "prompts" / "build.py"


@pytest.fixture(scope="module")
def build():
    spec = importlib.util.spec_from_file_location("build", BUILD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def benchmark(build):
    """Every run of 10 words of the benchmarks' turns; a benchmark's question, copied, is caught by them."""
    runs = build.benchmark_shingles()
    question = read_records(build.BENCHMARKS[0])[0]["turns"][0]
    assert build.shingles(f"Please answer. {question} Thanks!") & runs
    return runs


@pytest.mark.parametrize("path", sorted((ROOT / "data" / "distilled").glob("*.jsonl*")), ids=lambda p: p.name)
def test_no_distilled_user_turn_shares_ten_words_with_a_benchmark_turn(build, benchmark, path):
    """The check data/prompts/build.py applies to the prompts it makes, on every distilled file: no user turn shares
    a run of 10 words with a turn of MT-Bench, Spec-Bench dev or benchmarks/prompts/held_out.jsonl."""
    asked = [m["value"] for r in read_records(path) for m in r["conversations"] if m["from"] == "human"]
    assert asked and not [turn for turn in asked if build.shingles(turn) & benchmark]
