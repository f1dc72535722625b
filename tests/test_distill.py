"""Self-distillation: input formats, multi-turn history, batching, resume without duplicates, the CLI."""

import json
import lzma
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import tiny_tokenizer
from engine_helpers import greedy_reference, lively_model, random_heads

from medusa_decoding.cli import main
from medusa_decoding.config import DistillConfig
from medusa_decoding.model import MedusaModel
from medusa_decoding.training import distill as distill_module
from medusa_decoding.training.data import IGNORE_INDEX, Prompt, assistant_labels, read_prompts
from medusa_decoding.training.distill import completed_ids, distill

pytestmark = pytest.mark.usefixtures("one_thread")
DATA = Path(__file__).resolve().parents[2] / "shared" / "data"  # ../shared/data beside the checkout
GREEDY = DistillConfig(max_new_tokens=6, temperature=0.0, batch_size=3)
PROMPTS = [Prompt(f"p{i}", (" ".join(f"w{j}" for j in range(i + 1)),)) for i in range(5)]  # lengths 1..5


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return lively_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)


@pytest.fixture(scope="module")
def medusa(model, tokenizer):
    """The engine that distills: plain steps of the model (its heads are not asked)."""
    return MedusaModel(model, tokenizer, random_heads(model), kernels="auto")


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().split("\n") if line]


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_reads_seed_sharegpt_and_mt_bench_records(tmp_path):
    chat = {"id": "s1", "conversations": [{"from": "human", "value": "w1"}, {"from": "gpt", "value": "w9"},
                                           {"from": "human", "value": "w2"}]}
    empty = {"id": "s2", "conversations": [{"from": "gpt", "value": "w9"}]}
    (tmp_path / "sharegpt.json").write_text(json.dumps([chat, empty]))
    assert read_prompts(tmp_path / "sharegpt.json") == [Prompt("s1", ("w1", "w2"))]  # human turns; none: skipped
    assert read_prompts(write_jsonl(tmp_path / "sharegpt.jsonl", [chat, empty])) == [Prompt("s1", ("w1", "w2"))]
    seed = write_jsonl(tmp_path / "seed.jsonl", [{"id": "a", "source": "gsm8k-train", "prompt": "w1 w2"}])
    assert read_prompts(seed) == [Prompt("a", ("w1 w2",))]
    bench = write_jsonl(tmp_path / "bench.jsonl", [{"question_id": 81, "category": "writing", "turns": ["w1", "w2"]}])
    assert read_prompts(bench) == [Prompt("81", ("w1", "w2"))]
    packed = tmp_path / "bench.jsonl.xz"  # as the larger distilled sets ship
    packed.write_bytes(lzma.compress(bench.read_bytes()))
    assert read_prompts(packed) == [Prompt("81", ("w1", "w2"))]


def test_reads_the_shipped_prompt_sets():
    seeds = read_prompts(DATA / "seed_prompts.jsonl")  # some prompts hold U+2028: lines are split on \n only
    assert len(seeds) == 11728 and all(len(p.turns) == 1 for p in seeds)
    bench = read_prompts(DATA / "mt_bench_question.jsonl")
    assert len(bench) == 80 and all(len(p.turns) == 2 for p in bench)


@pytest.mark.parametrize("text, error", [
    ("", "empty"),
    ('{"id": "a", "prompt": "w1"}\n{"id": "b", "prompt": \n', r"jsonl:2: not valid JSON"),
    ('{"id": "a", "question": "w1"}\n', "expected a 'prompt', 'conversations' or 'turns' field"),
    ('{"id": "a", "prompt": "w1"}\n{"id": "a", "prompt": "w2"}\n', "occurs twice"),
    ('{"id": "a", "conversations": [{"from": "robot", "value": "w1"}]}\n', "unknown speaker 'robot'"),
    ('{"id": "a", "prompt": "  "}\n', "no record holds a user turn"),
])
def test_bad_input_is_rejected_by_name(tmp_path, text, error):
    path = tmp_path / "in.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=error):
        read_prompts(path)


def test_each_user_turn_follows_the_models_own_answer(medusa, model, tokenizer, tmp_path):
    out = tmp_path / "out.jsonl"
    distill(medusa, [Prompt("q", ("w3 w4", "w5"))], out, GREEDY, progress=False)
    [record] = lines(out)
    assert record["id"] == "q"
    assert [m["from"] for m in record["conversations"]] == ["human", "gpt", "human", "gpt"]
    chat = []
    for message in record["conversations"]:  # replay: every answer is transformers' own greedy continuation
        if message["from"] == "human":
            chat.append({"role": "user", "content": message["value"]})
            continue
        prompt = torch.tensor(tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False))
        expected = tokenizer.decode(greedy_reference(model, prompt, GREEDY.max_new_tokens, tokenizer.eos_token_id),
                                    skip_special_tokens=True).strip()
        assert message["value"] == expected and expected
        chat.append({"role": "assistant", "content": expected})


@pytest.mark.parametrize("config", [GREEDY, DistillConfig(max_new_tokens=6, temperature=0.8, batch_size=3)],
                         ids=["greedy", "sampled"])
def test_batched_turns_answer_as_one_prompt_at_a_time(medusa, tmp_path, config):
    """Every turn samples from its own seed: a batch, a second turn joining it, change no answer."""
    prompts = PROMPTS + [Prompt("two", ("w3 w4", "w5"))]
    distill(medusa, prompts, tmp_path / "batched.jsonl", config, progress=False)
    single = DistillConfig(**{**config.__dict__, "batch_size": 1})
    distill(medusa, prompts, tmp_path / "single.jsonl", single, progress=False)
    batched = {r["id"]: r for r in lines(tmp_path / "batched.jsonl")}
    assert batched == {r["id"]: r for r in lines(tmp_path / "single.jsonl")} and len(batched) == len(prompts)
    assert len({r["conversations"][1]["value"] for r in batched.values()}) > 1  # not one answer for all


def test_a_conversations_next_turn_goes_first_so_a_kill_loses_little(medusa, tmp_path, monkeypatch):
    """A follow-up turn is decoded before new conversations start: each conversation is written as soon as it can
    be, not after every first turn of the run."""
    started = []  # per conversation started, the records written by then
    out = tmp_path / "out.jsonl"
    real_add = distill_module.Requests.add

    def add(self, n, *args, **kwargs):
        started.append(len(lines(out)) if out.exists() else 0)
        return real_add(self, n, *args, **kwargs)

    monkeypatch.setattr(distill_module.Requests, "add", add)
    prompts = [Prompt(f"t{i}", ("w3 w4", "w5")) for i in range(4)]
    distill(medusa, prompts, out, DistillConfig(max_new_tokens=4, temperature=0.0, batch_size=1), progress=False)
    assert started == [0, 0, 1, 1, 2, 2, 3, 3]  # first turn, second turn, written; the next conversation


def test_a_conversation_past_the_context_is_skipped_or_cut_before_the_turn_that_does_not_fit(medusa, tmp_path):
    long = " ".join(["w9"] * 1100)  # the tiny model's context is 1024 positions
    out = tmp_path / "out.jsonl"
    stats = distill(medusa, [Prompt("long", (long,)), Prompt("cut", ("w1", long)), PROMPTS[0]], out, GREEDY,
                    progress=False)
    assert stats.skipped == 1 and stats.records == 2
    assert {r["id"]: len(r["conversations"]) for r in lines(out)} == {"cut": 2, "p0": 2}


def test_a_killed_run_resumes_without_duplicates_or_partial_lines(medusa, tmp_path):
    out = tmp_path / "out.jsonl"
    assert distill(medusa, PROMPTS[:3], out, GREEDY, progress=False).records == 3
    before = out.read_bytes()
    with open(out, "a") as file:  # killed while writing the 4th record
        file.write(json.dumps({"id": "p3", "conversations": []})[:15])
    assert completed_ids(out) == {"p0", "p1", "p2"} and out.read_bytes() == before
    stats = distill(medusa, PROMPTS, out, GREEDY, progress=False)
    assert stats.records == 2 and stats.tokens > 0
    assert out.read_bytes().startswith(before)
    assert sorted(r["id"] for r in lines(out)) == [p.id for p in PROMPTS]
    assert distill(medusa, PROMPTS, out, GREEDY, progress=False).records == 0  # all done


def test_cli_distills_with_sampling_and_resumes(model, tokenizer, tmp_path):
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    seeds = write_jsonl(tmp_path / "seeds.jsonl", [{"id": p.id, "prompt": p.turns[0]} for p in PROMPTS])
    args = ["distill", "--input", str(seeds), "--model", str(tmp_path / "model"), "--max-new-tokens", "4",
            "--batch-size", "2", "--temperature", "0.7"]
    main([*args, "--output", str(tmp_path / "a.jsonl"), "--limit", "2"])
    assert sorted(r["id"] for r in lines(tmp_path / "a.jsonl")) == ["p0", "p1"]
    main([*args, "--output", str(tmp_path / "a.jsonl"), "--limit", "4"])
    assert sorted(r["id"] for r in lines(tmp_path / "a.jsonl")) == ["p0", "p1", "p2", "p3"]
    main([*args, "--output", str(tmp_path / "b.jsonl"), "--limit", "4"])  # same seed, same samples
    first, second = ({r["id"]: r for r in lines(tmp_path / name)} for name in ("a.jsonl", "b.jsonl"))
    assert second["p3"] == first["p3"]
    with pytest.raises(SystemExit):
        main([*args, "--output", str(tmp_path / "c.jsonl"), "--limit", "0"])


def test_cli_distills_in_bfloat16_when_asked(model, tokenizer, tmp_path, monkeypatch):
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    seeds = write_jsonl(tmp_path / "seeds.jsonl", [{"id": p.id, "prompt": p.turns[0]} for p in PROMPTS])
    dtypes, real = [], distill_module.distill
    monkeypatch.setattr(distill_module, "distill", lambda m, *a, **k: dtypes.append(m.model.dtype) or real(m, *a, **k))
    for flag in ([], ["--dtype", "bfloat16"]):
        main(["distill", "--input", str(seeds), "--model", str(tmp_path / "model"), "--max-new-tokens", "4",
              "--output", str(tmp_path / f"out{len(flag)}.jsonl"), "--limit", "2", *flag])
        assert len(lines(tmp_path / f"out{len(flag)}.jsonl")) == 2
    assert dtypes == [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("template", [False, True], ids=["base-model", "forced-raw"])
def test_raw_distillation_continues_text_and_trains_on_the_models_own_tokens(model, tmp_path, template):
    """A base model (no chat template), or --raw: each prompt is continued as raw text, the continuation kept as
    it came (not stripped), and training reads back the very tokens the model produced after the prompt's; a kill
    mid-record resumes as a chat run does."""
    tokenizer = tiny_tokenizer()
    if not template:
        tokenizer.chat_template = None
    medusa = MedusaModel(model, tokenizer, random_heads(model), kernels="auto")
    raw = replace(GREEDY, raw=template)
    out = tmp_path / "out.jsonl"
    assert distill(medusa, PROMPTS[:2], out, raw, progress=False).records == 2
    with open(out, "a") as file:  # killed while writing the 3rd record
        file.write(json.dumps({"id": "p2", "conversations": []})[:15])
    assert distill(medusa, PROMPTS, out, raw, progress=False).records == 3
    records = {r["id"]: r["conversations"] for r in lines(out)}
    assert sorted(records) == [p.id for p in PROMPTS]
    for prompt in PROMPTS:
        chat = [{"role": "user" if m["from"] == "human" else "assistant", "content": m["value"]}
                for m in records[prompt.id]]
        ids = torch.tensor(tokenizer(prompt.turns[0])["input_ids"])
        expected = greedy_reference(model, ids, GREEDY.max_new_tokens, tokenizer.eos_token_id)
        expected = [t for t in expected if t not in tokenizer.all_special_ids]  # an answer is text: specials skipped
        tokens, labels = assistant_labels(tokenizer, chat) if not template else raw_labels(tokenizer, chat)
        assert tokens[: len(ids)] == ids.tolist() and [t for t in labels if t != IGNORE_INDEX] == expected


def raw_labels(tokenizer, chat):
    """assistant_labels of a chat rendered raw where the tokenizer has a template."""
    template, tokenizer.chat_template = tokenizer.chat_template, None
    try:
        return assistant_labels(tokenizer, chat)
    finally:
        tokenizer.chat_template = template
