"""`medusa bench` on a tiny model with a word-level tokenizer: report schema, figures that agree with each
other and with the per-turn records, losslessness, the plot, and clear errors for bad question files."""

import json
import math
import re
import sys
from dataclasses import replace

import pytest
import torch
from conftest import needs_compiler, tiny_model, tiny_tokenizer
from engine_helpers import lively_model, random_heads

from medusa_decoding import GenerationConfig, MedusaModel, Tree
from medusa_decoding import bench as bench_module
from medusa_decoding.acceptance import RULES
from medusa_decoding.bench import DECODERS, benchmark, plot, read_questions, table
from medusa_decoding.bench import decoders as decoders_module
from medusa_decoding.calibrate import expected_acceptance
from medusa_decoding.cli import main
from medusa_decoding.cli.measure import rival_specs
from medusa_decoding.corpus import CorpusIndex
from medusa_decoding.decoding import PLAIN
from medusa_decoding.guard import Guard, Ladder

TREE = ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))
TOKENS = 12
QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["w10 w11 w12", "w13 w14"]},
    {"question_id": 2, "category": "coding", "turns": ["w20 w21", "w22 w23 w24"]},
    {"question_id": 3, "category": "writing", "turns": ["w30"]},
]
KEYS = {"acceleration_rate", "overhead", "speedup", "speedup_vs_transformers", "tokens_per_s", "new_tokens", "steps"}

pytestmark = pytest.mark.usefixtures("one_thread")


def write_questions(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture(scope="module")
def tiny() -> MedusaModel:
    """A lively tiny llama behind a ChatML word tokenizer, with random heads (few guesses accepted)."""
    tokenizer = tiny_tokenizer()
    base = lively_model("llama", eos_token_id=tokenizer.eos_token_id)
    return MedusaModel(base, tokenizer, random_heads(base, num_heads=3), Tree.from_spec(TREE))


@pytest.fixture(scope="module")
def questions(tmp_path_factory):
    return read_questions(write_questions(tmp_path_factory.mktemp("q") / "q.jsonl", QUESTIONS))


@pytest.fixture(scope="module")
def greedy(tiny, questions) -> dict:
    return benchmark(tiny, questions, GenerationConfig(max_new_tokens=TOKENS, lookup=0), progress=False)


def test_corpus_drafts_run_beside_medusa_without_them(tiny, questions, monkeypatch):
    """Where the heads have a corpus index, MEDUSA without its corpus drafts runs on every turn too."""
    monkeypatch.setattr(tiny, "corpus", CorpusIndex.build([(list(range(3, 40)) * 2, [True] * 74)], min_seen=1))
    report = benchmark(tiny, questions[:1], GenerationConfig(max_new_tokens=TOKENS, lookup=0), progress=False)
    assert set(report["overall"]["tokens_per_s"]) == {*DECODERS, bench_module.NO_CORPUS} and report["lossless"] is True


def test_lookup_drafts_run_beside_medusa_without_them(tiny, questions):
    """With lookup drafts on, MEDUSA without them runs on every turn too, a rival held to plain decoding, and each
    category says how many of MEDUSA's tokens a step the drafts gave."""
    report = benchmark(tiny, questions[:1], GenerationConfig(max_new_tokens=TOKENS), progress=False)
    overall = report["overall"]
    assert set(overall["tokens_per_s"]) == {*DECODERS, bench_module.NO_LOOKUP} and report["lossless"] is True
    assert set(overall["rivals"]) == {bench_module.NO_LOOKUP}
    assert overall["rivals"][bench_module.NO_LOOKUP]["speedup"] > 0
    drafted = [s["drafted_per_step"] for s in [overall, *report["categories"].values()]]
    assert all(0 <= d <= overall["acceleration_rate"] for d in drafted)
    assert "drafted" in table(report)


def test_report_schema(greedy):
    assert KEYS <= set(greedy["overall"])
    assert set(greedy["categories"]) == {"writing", "coding"}
    assert all(KEYS <= set(s) for s in greedy["categories"].values())
    assert set(greedy["overall"]["tokens_per_s"]) == set(DECODERS)
    settings = {"model", "tree", "guess_vocab", "max_new_tokens", "temperature", "acceptance", "torch", "transformers"}
    assert settings <= set(greedy["config"])
    assert greedy["config"]["tree"] == [list(p) for p in TREE]
    assert "thread" in greedy["device"]  # CPU here: model name and thread count
    json.dumps(greedy)  # plain JSON all the way down


def test_heads_accuracy_on_the_runs_answers(greedy):
    accuracy = greedy["heads_accuracy"]  # one entry per head, top-5 holds top-1
    assert len(accuracy["top1"]) == len(accuracy["top5"]) == 3
    assert all(0 <= top1 <= top5 <= 1 for top1, top5 in zip(accuracy["top1"], accuracy["top5"]))
    assert "top-1: " + " ".join(f"{a:.3f}" for a in accuracy["top1"]) in table(greedy)


def test_figures_agree(greedy):
    overall = greedy["overall"]
    assert overall["turns"] == 5 and len(greedy["turns"]) == 5
    for s in [overall, *greedy["categories"].values()]:
        totals = s["totals"]
        assert math.isclose(s["speedup"], s["acceleration_rate"] / s["overhead"], rel_tol=1e-9)
        assert math.isclose(s["acceleration_rate"], s["new_tokens"] / s["steps"])
        assert totals["plain"]["steps"] == totals["plain"]["new_tokens"]  # one token per plain forward pass
        assert sum(int(n) * c for n, c in s["accept_lengths"].items()) == s["new_tokens"]
        assert sum(s["accept_lengths"].values()) == s["steps"]
        for name in DECODERS:
            assert math.isclose(s["tokens_per_s"][name], totals[name]["new_tokens"] / totals[name]["seconds"])
        assert math.isclose(s["speedup_vs_transformers"],
                            s["tokens_per_s"]["medusa"] / s["tokens_per_s"]["transformers"])
        medusa, plain = totals["medusa"], totals["plain"]  # after each turn's first token: the steps alone
        assert 0 < s["prefill_share"] == plain["first_token_seconds"] / plain["seconds"] < 1
        decode = [(t["new_tokens"] - s["turns"]) / (t["seconds"] - t["first_token_seconds"]) for t in (medusa, plain)]
        assert math.isclose(s["decode_speedup"], decode[0] / decode[1])
    for name in DECODERS:  # categories add up to overall, and overall to the per-turn records
        for key in ("new_tokens", "steps", "seconds"):
            by_category = sum(s["totals"][name][key] for s in greedy["categories"].values())
            by_turn = sum(t[name][key] for t in greedy["turns"])
            assert math.isclose(by_category, overall["totals"][name][key])
            assert math.isclose(by_turn, overall["totals"][name][key])
    writing = [t for t in greedy["turns"] if t["category"] == "writing"]
    assert greedy["categories"]["writing"]["new_tokens"] == sum(t["medusa"]["new_tokens"] for t in writing)


def test_greedy_is_lossless_and_multi_turn(greedy):
    assert greedy["lossless"] is True
    assert greedy["matches_transformers"] is True
    assert all(turn["medusa"]["same_as_plain"] and turn["medusa"]["agreed_with_plain"] == turn["plain"]["new_tokens"]
               and "agreed_with_plain" not in turn["plain"] for turn in greedy["turns"])
    first, second = greedy["turns"][:2]
    assert (first["turn"], second["turn"]) == (1, 2)
    assert second["prompt_tokens"] > first["prompt_tokens"] + first["plain"]["new_tokens"]  # own answer in history


def test_lossless_false_when_medusa_differs(tiny, questions, monkeypatch):
    """A verifier that accepts wrong guesses must show up as lossless: false."""
    original = RULES["greedy"]

    def accept_a_whole_leaf_path(tokens, logits, tree, config, generator):
        _, root = original(tokens, logits, tree, config, generator)
        leaf = tree.leaf_paths[0]
        return leaf[leaf >= 0], root

    monkeypatch.setitem(RULES, "greedy", accept_a_whole_leaf_path)
    report = benchmark(tiny, questions[:1], GenerationConfig(max_new_tokens=TOKENS, lookup=0), progress=False)
    assert report["lossless"] is False
    first = report["turns"][0]["medusa"]  # where it parted from plain, for a reader to look at
    assert not first["same_as_plain"] and first["agreed_with_plain"] < TOKENS
    assert f"NO (medusa at token {first['agreed_with_plain']} of q" in table(report)


@needs_compiler
def test_nothing_compiles_on_the_clock(tiny, questions, monkeypatch):
    """The compiled engine compiles each tree size on its first step: the untimed warm-up must run every tree the
    guard may pick (and a rival's, and plain steps), or a timed turn holds seconds of compiling."""
    trees = (PLAIN, *(Tree.from_spec(spec) for spec in ([[0]], [[0], [1]], TREE)))
    medusa = tiny.with_heads(tiny.heads, Tree.from_spec(TREE), engine="compiled")
    medusa.trees = Ladder(trees, (1.0,) * 4, (1,), ((1.0,) * 4,))
    # the guard moves up the ladder as a turn goes on: the largest tree only after the warm-up's 8 tokens
    def choose(guard, context, batch=1, pooled=None):
        ladder, watched = guard.ladder.trees, guard.watched
        return ladder[min(len(guard.generated) // 3, len(ladder) - 1)], watched  # None: plain decoding's root alone

    monkeypatch.setattr(Guard, "choose", choose)
    rivals = {"wide": tiny.with_heads(tiny.heads, Tree.from_spec([3, 2]), engine="compiled")}
    graphs, original = [], decoders_module.run_decoder

    def counting(name, medusa, ids, config, llama=None, rivals=None):
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        return original(name, medusa, ids, config, llama, rivals)

    monkeypatch.setattr(decoders_module, "run_decoder", counting)
    benchmark(medusa, questions[:1], GenerationConfig(max_new_tokens=TOKENS), progress=False, rivals=rivals)
    timed = (len(DECODERS) + len(rivals) + 1) * len(questions[0].turns)  # + MEDUSA without its lookup drafts
    assert graphs[-timed] > graphs[0]  # the warm-up compiled
    assert graphs[-1] == graphs[-timed] == torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_repeat_counts_each_decoders_fastest_run_and_rotates_who_goes_first(tiny, questions, monkeypatch):
    calls, original = [], decoders_module.run_decoder
    round_seconds = (9.0, 1.0, 5.0)  # every decoder's run of the second round is its fastest

    def timed(name, medusa, ids, config, llama=None, rivals=None):
        out = original(name, medusa, ids, config, llama, rivals)
        out.seconds = round_seconds[len(calls) // len(DECODERS)]
        calls.append(name)
        return out

    monkeypatch.setattr(decoders_module, "run_decoder", timed)
    outputs = decoders_module.answer_turn(tiny, tiny.encode("w1 w2"), GenerationConfig(max_new_tokens=TOKENS, lookup=0),
                                          0, repeat=3)
    rounds = [calls[i: i + len(DECODERS)] for i in range(0, len(calls), len(DECODERS))]
    assert [r[0] for r in rounds] == list(DECODERS) and all(sorted(r) == sorted(DECODERS) for r in rounds)
    assert {name: out.seconds for name, out in outputs.items()} == {name: 1.0 for name in DECODERS}
    with pytest.raises(ValueError, match="repeat"):  # sampling without a seed: the runs differ
        benchmark(tiny, questions[:1], GenerationConfig(max_new_tokens=TOKENS, lookup=0, temperature=0.8),
                  progress=False, repeat=2)
    with pytest.raises(ValueError, match="repeat"):
        benchmark(tiny, questions[:1], GenerationConfig(max_new_tokens=TOKENS, lookup=0), progress=False, repeat=0)


def test_typical_at_temperature_zero_is_checked(tiny, questions):
    report = benchmark(tiny, questions[:1], GenerationConfig(max_new_tokens=TOKENS, lookup=0, acceptance="typical"),
                       progress=False)
    assert report["lossless"] is True and report["config"]["rule"] == "typical"


def test_sampling_lossless_is_null(tiny, questions):
    report = benchmark(tiny, questions[:1], GenerationConfig(max_new_tokens=TOKENS, lookup=0, temperature=0.8, seed=0),
                       progress=False)
    assert report["lossless"] is None and report["matches_transformers"] is None
    assert report["overall"]["totals"]["transformers"]["new_tokens"] > 0


def test_table_and_plot(greedy, tmp_path):
    text = table(greedy)
    assert "writing" in text and "coding" in text and any(line.startswith("all ") for line in text.splitlines())
    path = tmp_path / "bench.png"
    plot(greedy, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


ACCURACY = torch.tensor([[0.6, 0.2], [0.4, 0.1], [0.3, 0.1]], dtype=torch.float64)  # a table as calibrate measures


@pytest.fixture(scope="module")
def predicted(tiny, questions) -> dict:
    config = GenerationConfig(max_new_tokens=TOKENS, lookup=0)
    return benchmark(tiny, questions[:2], config, progress=False, accuracy=ACCURACY, sweep=(1, 3, 6))


def test_prediction_rows_pair_the_calibration_model_with_measured_runs(predicted):
    rows = predicted["prediction"]
    assert [p["decoder"] for p in rows] == ["plain", "medusa", "sweep", "sweep", "sweep"]
    plain, medusa, *sweep = rows
    assert plain["tree_size"] == 0 and plain["predicted_tokens_per_step"] == 1 == plain["measured_tokens_per_step"]
    # a fixed tree, cut near the token budget's end (12 tokens); a cut step is predicted as the tree nearest in size
    assert 3 < medusa["tree_size"] < len(TREE) and all(0 < p["tree_size"] <= n for p, n in zip(sweep, (1, 3, 6)))
    assert medusa["predicted_tokens_per_step"] == pytest.approx(1 + expected_acceptance(TREE, ACCURACY))
    totals, turns = predicted["overall"]["totals"]["medusa"], predicted["turns"]
    assert medusa["measured_tokens_per_step"] == pytest.approx((totals["new_tokens"] - len(turns)) /
                                                               (totals["steps"] - len(turns)))  # after the prefills
    starts = [t["prompt_tokens"] for t in turns]
    ends = [t["prompt_tokens"] + t["plain"]["new_tokens"] for t in turns]
    for p in rows:
        assert p["contexts"] == sorted({min(starts), (min(starts) + max(ends)) // 2, max(ends)})  # the run's span
        assert set(p["categories"]) == {"writing", "coding"}
        assert sum(g["steps"] for g in p["categories"].values()) == p["steps"] > 0
        for g in [p, *p["categories"].values()]:
            assert g["predicted_step_latency_s"] > 0 and g["measured_step_latency_s"] > 0
            assert g["predicted_tokens_per_s"] == pytest.approx(g["predicted_tokens_per_step"]
                                                                / g["predicted_step_latency_s"])
            assert g["measured_tokens_per_s"] == pytest.approx(g["measured_tokens_per_step"]
                                                               / g["measured_step_latency_s"])
            assert g["error"] == pytest.approx(g["measured_tokens_per_s"] / g["predicted_tokens_per_s"] - 1)
    assert predicted["lossless"] is True


def test_prediction_table_and_three_panel_plot(predicted, tmp_path):
    assert "predicted measured" in table(predicted)
    plot(predicted, tmp_path / "bench.png")
    assert tmp_path.joinpath("bench.png").stat().st_size > 10_000


def test_sweep_needs_an_accuracy_table_and_sizes_the_heads_allow(tiny, questions):
    with pytest.raises(ValueError, match="sweep: needs"):
        benchmark(tiny, questions[:1], GenerationConfig(max_new_tokens=TOKENS, lookup=0), progress=False, sweep=(2,))
    with pytest.raises(ValueError, match="at most 14 nodes"):  # 2 + 4 + 8
        benchmark(tiny, questions[:1], GenerationConfig(max_new_tokens=TOKENS, lookup=0), progress=False,
                  accuracy=ACCURACY, sweep=(15,))


def test_benchmark_refuses_nothing_and_stop_strings(tiny, questions):
    with pytest.raises(ValueError, match="questions: none to run"):
        benchmark(tiny, [], GenerationConfig(max_new_tokens=TOKENS, lookup=0), progress=False)
    with pytest.raises(ValueError, match="stop"):
        benchmark(tiny, questions, GenerationConfig(max_new_tokens=TOKENS, lookup=0, stop=("w1",)), progress=False)


def test_agreed_prefix_counts_the_tokens_before_the_first_difference():
    assert bench_module.agreed_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert bench_module.agreed_prefix([1, 2], [1, 2, 3]) == 2 and bench_module.agreed_prefix([7], [8]) == 0


def test_read_questions_filters_and_limits(tmp_path):
    path = write_questions(tmp_path / "q.jsonl", QUESTIONS)
    assert [q.question_id for q in read_questions(path, ["writing"])] == ["1", "3"]
    assert [q.question_id for q in read_questions(path, limit=2)] == ["1", "2"]
    assert [q.question_id for q in read_questions(path, per_category=1)] == ["1", "2"]
    assert [q.question_id for q in read_questions(path, per_category=1, limit=1)] == ["1"]
    assert read_questions(path)[0].turns == ("w10 w11 w12", "w13 w14")
    other = write_questions(tmp_path / "other.jsonl", [{"question_id": 9, "category": "poetry", "turns": ["w1"]}])
    both = read_questions([path, other], ["poetry", "coding"])  # several files, in order; a category of either
    assert [(q.question_id, q.category) for q in both] == [("2", "coding"), ("9", "poetry")]
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        read_questions([path, tmp_path / "missing.jsonl"])


@pytest.mark.parametrize(
    "content, args, error",
    [
        (None, [], "does not exist"),
        ("", [], "holds no questions"),
        ('{"question_id": 7, "category": "math"}\n', [], "question 7 .* has no turns"),
        ('{"question_id": 7, "turns": []}\n', [], "question 7 .* has no turns"),
        ("not json\n", [], "line 1 is not JSON"),
        (json.dumps(QUESTIONS[0]) + "\n", ["--categories", "poetry"], "unknown 'poetry'"),
        (json.dumps(QUESTIONS[0]) + "\n", ["--limit", "0"], "limit must be a positive integer"),
        (json.dumps(QUESTIONS[0]) + "\n", ["--threads", "0"], "threads must be a positive integer"),
        (json.dumps(QUESTIONS[0]) + "\n", ["--per-category", "0"], "per_category must be a positive integer"),
        (json.dumps(QUESTIONS[0]) + "\n", ["--sweep", "0,2"], "sweep: tree sizes must be positive"),
    ],
)
def test_cli_errors(tmp_path, capsys, content, args, error):
    path = tmp_path / "q.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--questions", str(path), *args])
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith("medusa bench: error:")
    assert re.search(error, stderr), stderr


def test_cli_end_to_end(tmp_path, capsys):
    """A saved tiny model directory through `medusa bench`: table on stdout, JSON and PNG written."""
    model_dir = tmp_path / "model"
    tokenizer = tiny_tokenizer()
    tiny_model("llama", eos_token_id=tokenizer.eos_token_id).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    questions = write_questions(tmp_path / "q.jsonl", QUESTIONS)
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    hydra = random_heads(tiny_model("llama"), num_heads=2, kind="hydra")
    hydra.save_pretrained(tmp_path / "hydra")
    main(["bench", "--questions", questions, "--model", str(model_dir), "--max-new-tokens", "6", "--limit", "1",
          "--categories", "coding", "--json", str(out), "--plot", str(png), "--threads", "1", "--lookup", "0",
          "--rival", f"hydra={tmp_path / 'hydra'}", "--rival", "sure=@confident:3", "--rival", "flat=@[]+eager"])
    report = json.loads(out.read_text())
    assert report["config"]["kind"] == "medusa"
    assert report["config"]["rivals"] == {
        "hydra": {"heads": str(tmp_path / "hydra"), "kind": "hydra", "tree": "auto", "confident": False,
                  "compiled": False},
        "sure": {"heads": "None", "kind": "medusa", "tree": "confident:3", "confident": True, "compiled": False},
        "flat": {"heads": "None", "kind": "medusa", "tree": "[]", "confident": False, "compiled": False}}
    assert set(report["overall"]["rivals"]) == {"hydra", "sure", "flat"}
    assert report["overall"]["rivals"]["flat"]["acceleration_rate"] == 1  # plain decoding
    assert report["config"]["model"] == str(model_dir) and report["config"]["categories"] == ["coding"]
    assert set(report["categories"]) == {"coding"} and report["overall"]["turns"] == 2
    assert report["config"]["heads_trained"] is False and "medusa" not in report["config"]
    assert report["lossless"] is True and report["device"].endswith(", 1 thread")
    assert png.read_bytes()[:4] == b"\x89PNG"
    captured = capsys.readouterr()
    assert "coding" in captured.out and "heads: UNTRAINED" in captured.err


def test_rivals_run_side_by_side_and_must_be_lossless_too(tiny, questions, tmp_path, monkeypatch):
    hydra = tiny.with_heads(random_heads(tiny.model, num_heads=3, kind="hydra"), Tree.from_spec(TREE))
    sure = tiny.with_heads(tiny.heads, "confident:4")
    rivals = {"hydra": hydra, "sure": sure}
    report = benchmark(tiny, questions[:2], GenerationConfig(max_new_tokens=TOKENS, lookup=0), progress=False,
                       rivals=rivals)
    assert report["lossless"] is True and all({"hydra", "sure"} <= set(turn) for turn in report["turns"])
    totals, speed = report["overall"]["totals"], report["overall"]["tokens_per_s"]
    assert list(speed) == ["medusa", "plain", "transformers", "hydra", "sure"]
    for name in rivals:
        rival = report["overall"]["rivals"][name]
        assert rival["acceleration_rate"] == pytest.approx(totals[name]["new_tokens"] / totals[name]["steps"])
        assert rival["speedup"] == pytest.approx(speed[name] / speed["plain"])
        assert rival["speedup_vs_medusa"] == pytest.approx(speed[name] / speed["medusa"])
    assert list(report["rival_heads_accuracy"]) == ["hydra"]  # sure's heads are MEDUSA's own
    text = table(report)
    assert "hydra's heads on these answers" in text and "sure " in text and "every rival" in text
    plot(report, tmp_path / "r.png")
    generate = hydra.generate
    monkeypatch.setattr(hydra, "generate",  # warm_up passes its trees as keywords
                        lambda ids, config, **kwargs: replace_tokens(generate(ids, config=config, **kwargs)))
    assert benchmark(tiny, questions[:1], GenerationConfig(max_new_tokens=TOKENS, lookup=0), progress=False,
                     rivals={"hydra": hydra})["lossless"] is False


def test_a_rival_on_the_other_engine_is_held_to_plain_decoding_on_that_engine(tiny, questions, monkeypatch):
    """Two engines may round a near-tie apart (compiled and eager q8 do): each decoder is lossless against plain
    decoding on its own engine, and where the engines part the report says so apart from losslessness."""
    # the rival is another engine to the report (compiling one is make test-compiled's); its answers are an eager
    # view's, each parted from the eager one's at its end
    rival, same = (tiny.with_heads(tiny.heads, Tree.from_spec(TREE)) for _ in range(2))
    rival.compiled = not tiny.compiled
    generate = same.generate
    monkeypatch.setattr(rival, "generate", lambda ids, config, medusa=True: replace_tokens(
        generate(ids, config=replace(config, medusa=medusa))))
    monkeypatch.setattr(rival, "warm_up", lambda *args, **kwargs: None)
    report = benchmark(tiny, questions[:1], GenerationConfig(max_new_tokens=TOKENS, lookup=0), progress=False,
                       rivals={"other": rival})
    assert report["lossless"] is True
    for turn in report["turns"]:
        assert turn["other"]["same_as_plain"] and not turn["other/plain"]["same_as_plain"]
        assert turn["other/plain"]["agreed_with_plain"] == turn["plain"]["new_tokens"] - 1
    other = report["overall"]["rivals"]["other"]
    speed = report["overall"]["tokens_per_s"]
    assert other["speedup"] == pytest.approx(speed["other"] / speed["other/plain"])
    assert "engines round apart (plain decoding on each): other's engine parts at token" in table(report)


def replace_tokens(out):
    out.token_ids = out.token_ids[:-1] + [(out.token_ids[-1] + 1) % 90]
    return out


class FakeLlama:
    """llama-cpp-python's Llama as bench uses it (reset, eval, n_tokens, greedy generate), decoding with the tiny
    transformers model itself: the fourth decoder's plumbing, where llama.cpp is not installed."""

    def __init__(self, model):
        self.model, self.n_tokens, self.evals = model, 0, []

    def reset(self):
        self.n_tokens = 0

    def eval(self, tokens):
        self.evals.append((self.n_tokens, len(tokens)))
        self.n_tokens += len(tokens)

    def generate(self, tokens, temp, top_k, repeat_penalty):
        assert temp == 0 and top_k == 1 and repeat_penalty == 1 and self.n_tokens == 0  # greedy, no cache reused
        ids = torch.tensor(tokens)
        while True:
            with torch.no_grad():
                token = int(self.model(ids[None]).logits[0, -1].argmax())
            yield token
            ids = torch.cat([ids, torch.tensor([token])])


def test_llama_cpp_runs_as_a_fourth_decoder_with_both_engines_step_latency(tiny, questions, tmp_path):
    llama = FakeLlama(tiny.model)
    report = benchmark(tiny, questions, GenerationConfig(max_new_tokens=TOKENS, lookup=0), progress=False, llama=llama)
    overall = report["overall"]
    assert set(overall["tokens_per_s"]) == {*DECODERS, bench_module.LLAMA_CPP}
    assert overall["speedup_vs_llama_cpp"] == pytest.approx(
        overall["tokens_per_s"]["medusa"] / overall["tokens_per_s"]["llama.cpp"])
    assert all(turn["llama.cpp"]["steps"] == turn["llama.cpp"]["new_tokens"] for turn in report["turns"])
    assert overall["totals"]["llama.cpp"]["new_tokens"] == overall["totals"]["plain"]["new_tokens"]  # EOS alike
    steps = report["step_latency_ms"]
    assert steps["tokens"] == [1, 4, 8, 16] and len(steps["medusa_engine"]) == len(steps["llama.cpp"]) == 4
    assert min(steps["medusa_engine"]) > 0 and min(steps["llama.cpp"]) > 0
    timed = [size for prefix, size in llama.evals if prefix == steps["context"]]  # every size after the prefix
    assert sorted(set(timed)) == [1, 4, 8, 16] and len(timed) == 4 * (bench_module.CALIBRATION.latency_repeats + 1)
    text = table(report)
    assert "llama.cpp tok/s" in text and f"at a {steps['context']}-token context" in text
    plot(report, tmp_path / "four.png")
    assert (tmp_path / "four.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="greedy"):
        benchmark(tiny, questions, GenerationConfig(max_new_tokens=TOKENS, lookup=0, temperature=1.0), progress=False,
                  llama=llama)


def test_llama_cpp_not_installed_is_named_with_its_install_command(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` fails, as where it is not installed
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--questions", write_questions(tmp_path / "q.jsonl", QUESTIONS), "--llama-cpp"])
    assert exit_info.value.code == 2
    assert "llama-cpp-python is not installed: pip install 'medusa-decoding[llama]'" in capsys.readouterr().err


@pytest.mark.parametrize(("spec", "message"), [
    ("medusa=@confident", "with a new name"), ("x=", "with a new name"), ("x=@auto+warp", "the engine after"),
])
def test_a_malformed_rival_fails_before_loading(spec, message):
    with pytest.raises(ValueError, match=message):
        rival_specs([spec])
    assert rival_specs(["c=+compiled", "e=dir@[[0]]+eager", "t=@confident:4"]) == [
        ("c", None, "auto", "compiled"), ("e", "dir", "[[0]]", "eager"), ("t", None, "confident:4", None)]
