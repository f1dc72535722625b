"""`medusa bench`: MEDUSA against plain decoding (same engine) and `transformers` generate, on MT-Bench; and, where
asked, llama.cpp on the same GGUF file (llamacpp.py), with both engines' step latency over 1, 4, 8 and 16 tokens.

Every turn of every question is answered by the decoders one after the other (their order rotating
from turn to turn), so machine noise hits them alike. Turn 2's history holds the PLAIN decoder's answer to
turn 1, so all three see the same prompt (greedy MEDUSA's answer is the same anyway: it is lossless).

>>> questions = read_questions("mt_bench_question.jsonl", categories=["coding"], limit=2)
>>> report = benchmark(MedusaModel.from_pretrained(), questions, GenerationConfig(max_new_tokens=64))
>>> report["overall"]["speedup"], report["lossless"]
"""

import json
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

from . import llamacpp
from .base import context_limit
from .calibrate import (DEFAULTS as CALIBRATION, device_name, expected_acceptance, greedy_trees, measure_accuracy,
                        measure_step_latency, read_accuracy)
from .config import GenerationConfig
from .decoding import PLAIN
from .guard import Ladder
from .kernels import guess_projection, stock_kernels
from .model import GenerationOutput, MedusaModel
from .tree import Tree

DECODERS = ("medusa", "plain", "transformers")
LLAMA_CPP = "llama.cpp"  # a decoder where `benchmark` is given a llama.cpp model
OTHER_ENGINES = ("transformers", LLAMA_CPP)  # their tokens are not held to plain decoding's (lossless)
NO_LOOKUP = "medusa, no lookup"  # MEDUSA without its lookup drafts, where the config has them: what they add
NO_CORPUS = "medusa, no corpus"  # MEDUSA without its corpus drafts, where its heads have an index: what they add
WITHOUT = {NO_LOOKUP: "lookup", NO_CORPUS: "corpus"}  # such variants: the GenerationConfig field they set to 0
OWN_PLAIN = "/plain"  # NAME/plain: plain decoding on a rival's engine where it is not MEDUSA's, the rival's reference
STEP_TOKENS = (1, 4, 8, 16)  # the passes whose latency both engines report: plain steps and trees of 3, 7, 15
WARMUP_TOKENS = 8  # the untimed first generation: loads kernels and allocator pools before the clock runs
UNCATEGORIZED = "uncategorized"


@dataclass(frozen=True)
class Question:
    question_id: str
    category: str
    turns: tuple[str, ...]


@dataclass
class Totals:
    """One decoder's sums over some turns: new tokens, forward passes, seconds, tokens per forward pass."""

    new_tokens: int = 0
    steps: int = 0
    seconds: float = 0.0
    accept_lengths: Counter = field(default_factory=Counter)
    drafted: int = 0  # tokens only a draft (lookup, corpus) proposed
    turns: int = 0
    first_seconds: float = 0.0  # to each turn's first token: the prefill, the same work for MEDUSA and plain

    def add(self, out: GenerationOutput) -> None:
        self.new_tokens += len(out.token_ids)
        self.drafted += sum(out.drafted)
        self.steps += out.steps
        self.seconds += out.seconds
        self.accept_lengths.update(out.accept_lengths)
        self.turns += 1
        self.first_seconds += out.first_token_seconds

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """The tokens after each turn's first over their seconds: the steps alone, without the prefill."""
        return ratio(self.new_tokens - self.turns, self.seconds - self.first_seconds)

    @property
    def seconds_per_step(self) -> float:
        return self.seconds / self.steps if self.steps else 0.0


# --- input ------------------------------------------------------------------------------------------------


def parse_question(line: str, path: Path, number: int) -> Question:
    """One JSONL line -> Question; a clear ValueError naming the file, line and question otherwise."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"questions: {path} line {number} is not JSON: {error}") from None
    record = record if isinstance(record, dict) else {}  # not an object: reported below as a question without turns
    name = record.get("question_id", f"on line {number}")
    turns = record.get("turns")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise ValueError(f"questions: question {name} in {path} has no turns (expected 'turns': [text, ...])")
    return Question(str(name), str(record.get("category") or UNCATEGORIZED), tuple(turns))


def read_questions(paths, categories=None, limit: int | None = None, per_category: int | None = None) -> list[Question]:
    """MT-Bench-style JSONL ({"question_id", "category", "turns": [...]}) from one file or several (in order),
    filtered by category, the first per_category of each category kept (a balanced sample), then cut to limit."""
    paths = [Path(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"questions: {path} does not exist")
    for name, value in (("limit", limit), ("per_category", per_category)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    questions = []
    for path in paths:
        lines = path.read_text(encoding="utf-8").splitlines()
        found = [parse_question(line, path, n) for n, line in enumerate(lines, 1) if line.strip()]
        if not found:
            raise ValueError(f"questions: {path} holds no questions")
        questions += found
    if categories:
        known = sorted({q.category for q in questions})
        unknown = [c for c in categories if c not in known]
        if unknown:
            names = ", ".join(map(str, paths))
            raise ValueError(f"categories: unknown {', '.join(map(repr, unknown))}; {names} hold {', '.join(known)}")
        questions = [q for q in questions if q.category in categories]
    if per_category is not None:
        seen = Counter()
        questions = [q for q in questions if seen.update([q.category]) or seen[q.category] <= per_category]
    return questions[:limit]


# --- the three decoders -------------------------------------------------------------------------------------


def hf_generate(medusa: MedusaModel, ids: torch.Tensor, config: GenerationConfig) -> GenerationOutput:
    """`transformers` generate with the same settings on stock kernels; one forward pass per token (the prefill's first)."""
    sampling = config.temperature > 0
    settings = transformers.GenerationConfig(
        max_new_tokens=config.max_new_tokens, do_sample=sampling, temperature=config.temperature if sampling else None,
        top_p=config.top_p if sampling else None, top_k=config.top_k if sampling else None,
        eos_token_id=sorted(medusa.eos_ids), pad_token_id=min(medusa.eos_ids, default=0),
    )
    if sampling and config.seed is not None:
        torch.manual_seed(config.seed)
    with torch.inference_mode(), stock_kernels(medusa.model):  # what `transformers` alone gives
        start = time.perf_counter()  # after a GGUF model's float32 weights are made
        sequence = medusa.model.generate(ids[None], attention_mask=torch.ones_like(ids)[None], generation_config=settings)
    new = sequence[0, len(ids):].tolist()  # inside the clock: waits for the device, as MEDUSA's per-step lists do
    seconds = time.perf_counter() - start
    return GenerationOutput(token_ids=new, accept_lengths=[1] * len(new), text=medusa.decode(new), seconds=seconds)


def without(medusa: MedusaModel, config: GenerationConfig) -> tuple[str, ...]:
    """The variants of MEDUSA with one source of drafts off, for the sources this run decodes with."""
    return tuple(name for name, field in WITHOUT.items()
                 if getattr(config, field) and (field != "corpus" or medusa.corpus is not None))


def run_decoder(name: str, medusa: MedusaModel, ids: torch.Tensor, config: GenerationConfig,
                llama=None, rivals: dict[str, MedusaModel] | None = None) -> GenerationOutput:
    if rivals and name in rivals:
        return rivals[name].generate(ids, config=config)
    if rivals and name.removesuffix(OWN_PLAIN) in rivals:  # engines round differently: each is held to its own plain
        return rivals[name.removesuffix(OWN_PLAIN)].generate(ids, config=config, medusa=False)
    if name in WITHOUT:
        return medusa.generate(ids, config=replace(config, **{WITHOUT[name]: 0}))
    if name == "transformers":
        return hf_generate(medusa, ids, config)
    if name == LLAMA_CPP:
        out = llamacpp.generate(llama, ids.tolist(), config.max_new_tokens, medusa.eos_ids)
        out.text = medusa.decode(out.token_ids)
        return out
    return medusa.generate(ids, config=config, medusa=name == "medusa")


def answer_turn(medusa: MedusaModel, ids: torch.Tensor, config: GenerationConfig, turn: int,
                llama=None, repeat: int = 1, rivals: dict[str, MedusaModel] | None = None) -> dict[str, GenerationOutput]:
    """Every decoder on one prompt, `repeat` rounds, their order rotated by `turn` and the round so none always runs
    first; each decoder's fastest run counts (another process on a shared machine only ever slows a run down, and by
    as much from one minute to the next as the decoders differ)."""
    names = DECODERS + tuple(rivals or ()) + tuple(f"{name}{OWN_PLAIN}" for name, view in (rivals or {}).items()
                                                   if view.compiled != medusa.compiled)
    names += (LLAMA_CPP,) if llama is not None else ()
    names += without(medusa, config)
    fastest: dict[str, GenerationOutput] = {}
    for round_ in range(repeat):
        shift = (turn + round_) % len(names)
        for name in names[shift:] + names[:shift]:
            out = run_decoder(name, medusa, ids, config, llama, rivals)
            if name not in fastest or out.seconds < fastest[name].seconds:
                fastest[name] = out
    return fastest


# --- the benchmark ------------------------------------------------------------------------------------------


def benchmark(medusa: MedusaModel, questions: list[Question], config: GenerationConfig, progress: bool = True,
              accuracy: torch.Tensor | None = None, sweep: tuple[int, ...] = (), llama=None, repeat: int = 1,
              rivals: dict[str, MedusaModel] | None = None, raw: bool = False) -> dict:
    """Runs every turn with each decoder, `repeat` times (the fastest run counts); returns the report (see `report`).

    raw: the turns as raw text (conversation.py), where the model has a chat template too.

    rivals: {name: MEDUSA with other heads or another tree on the same model (MedusaModel.with_heads)}: decoders of
    their own (hydra heads against MEDUSA heads, confidence-driven trees against fixed ones), side by side.

    llama: a llama.cpp model (llamacpp.load) of the same GGUF file: a fourth decoder (greedy only), and the step
    latency of both engines over STEP_TOKENS tokens in the report.

    accuracy: the heads' calibrated table [K, S]: then the speed the calibration model predicts (measured step
    latency x expected tokens per step) is set beside the measured one, for the tree used and for MEDUSA with
    the greedy tree of each size in `sweep`, which is run on every turn too.
    """
    if config.stop:
        raise ValueError("stop: bench compares with transformers generate, which runs without stop strings")
    if not questions:
        raise ValueError("questions: none to run")
    if sweep and accuracy is None:
        raise ValueError("sweep: needs the heads' accuracy table (run medusa calibrate on them)")
    if llama is not None and config.temperature > 0:
        raise ValueError("llama.cpp: bench compares it in greedy decoding (temperature 0)")
    if repeat < 1 or repeat > 1 and config.temperature > 0 and config.seed is None:
        raise ValueError(f"repeat: a positive number of runs that give the same tokens (greedy, or sampling with a "
                         f"seed), got {repeat} at temperature {config.temperature} with no seed")
    warmup = medusa.encode(messages=[{"role": "user", "content": questions[0].turns[0]}], raw=raw)
    answer_turn(medusa, warmup, replace(config, max_new_tokens=WARMUP_TOKENS), 0, llama, rivals=rivals)
    swept = [medusa.with_heads(medusa.heads, tree) for tree in greedy_trees(accuracy, sweep)] if sweep else []
    # the compiled engine compiles a tree size on its first step: never on the clock (nor a tree the guard picks later)
    for view in (medusa, *(rivals or {}).values(), *swept):
        view.warm_up(warmup, config, WARMUP_TOKENS)
    for name in without(medusa, config):  # MEDUSA without some drafts steps at shapes of its own
        medusa.warm_up(warmup, replace(config, **{WITHOUT[name]: 0}), WARMUP_TOKENS)
    turns, conversations, sweep_outputs = [], [], [[] for _ in swept]
    total = sum(len(q.turns) for q in questions)
    bar = tqdm(total=total, desc="bench", unit="turn", file=sys.stderr, disable=not progress)
    for question in questions:
        history = []
        for number, text in enumerate(question.turns):
            history.append({"role": "user", "content": text})
            ids = medusa.encode(messages=history, raw=raw)
            outputs = answer_turn(medusa, ids, config, len(turns), llama, repeat, rivals)
            turns.append((question, number, len(ids), outputs))
            for view, outs in zip(swept, sweep_outputs):
                outs.append(view.generate(ids, config=config))
            history.append({"role": "assistant", "content": outputs["plain"].text})
            bar.update()
        conversations.append(history)
    bar.close()
    result = report(turns, config, medusa.model.device)
    if llama is not None:
        result["step_latency_ms"] = step_latency(medusa, llama, turns)
    result["heads_accuracy"] = heads_accuracy(medusa, conversations, result["overall"]["new_tokens"])
    measured = {id(medusa.heads)}
    for name, view in (rivals or {}).items():  # each other set of heads once
        if id(view.heads) not in measured:
            measured.add(id(view.heads))
            result.setdefault("rival_heads_accuracy", {})[name] = heads_accuracy(view, conversations,
                                                                                  result["overall"]["new_tokens"])
    vocab = getattr(guess_projection(medusa.model), "rows", None)  # the tokens the heads guess from; None: all
    result["config"].update(model=medusa.model.name_or_path, kernels=medusa.kernels,
                            num_heads=medusa.heads.config.num_heads, tree=[list(path) for path in medusa.tree.paths],
                            guess_vocab=None if vocab is None else len(vocab), repeat=repeat)
    if accuracy is not None:
        decoders = [(name, medusa, accuracy, trees, [outputs[name] for *_, outputs in turns])
                    for name, trees in (("plain", Ladder.fixed(PLAIN)), ("medusa", medusa.trees))]
        for name, view in (rivals or {}).items():
            if view.heads_dir is not None and (calibrated := read_accuracy(view.heads_dir)) is not None:
                decoders.append((name, view, calibrated.accuracy, view.trees, [outputs[name] for *_, outputs in turns]))
        decoders += [("sweep", view, accuracy, view.trees, outs) for view, outs in zip(swept, sweep_outputs)]
        result["prediction"] = predictions(decoders, turns)
    return result


def step_latency(medusa: MedusaModel, llama, turns: list) -> dict:
    """Both engines' step over STEP_TOKENS tokens at the run's mean context: plain steps and trees (one head's top
    3, 7, 15) of MEDUSA, and llama.cpp's decode call over as many tokens (milliseconds, medians)."""
    context = round(sum(prompt_len + len(outputs["plain"].token_ids) / 2 for *_, prompt_len, outputs in turns) / len(turns))
    trees = [Tree.from_spec([n - 1] if n > 1 else []) for n in STEP_TOKENS]
    timing = replace(CALIBRATION, latency_contexts=(context,))
    _, (engine,) = measure_step_latency(medusa, trees, timing)
    prefix = torch.randint(medusa.heads.config.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
    theirs = llamacpp.step_latency(llama, prefix.tolist(), list(STEP_TOKENS), timing.latency_repeats)
    return {"context": context, "tokens": list(STEP_TOKENS), "medusa_engine": [1000 * s for s in engine],
            LLAMA_CPP: [1000 * s for s in theirs]}


def heads_accuracy(medusa: MedusaModel, conversations: list[list[dict]], positions: int) -> dict:
    """Each head's teacher-forced top-1 and top-5 accuracy on the run's own answers (the calibration's measure)."""
    config = replace(CALIBRATION, top_k=5, max_positions=positions, max_length=context_limit(medusa.model))
    accuracy = measure_accuracy(medusa, conversations, config)  # [K, 5]: rank i right
    return {"top1": accuracy[:, 0].tolist(), "top5": accuracy.sum(1).tolist()}


def step_contexts(prompt_len: int, out: GenerationOutput) -> list[int]:
    """The context each step after the prefill started at: the prompt and every token before that step's root."""
    contexts = [prompt_len]
    for accepted in out.accept_lengths[1:-1]:
        contexts.append(contexts[-1] + accepted)
    return contexts


def spanning_contexts(turns: list) -> tuple[int, ...]:
    """Three contexts spanning every step of the run (step latency is close to linear in between)."""
    low = min(prompt_len for *_, prompt_len, _ in turns)
    high = max(prompt_len + len(outputs["plain"].token_ids) for *_, prompt_len, outputs in turns)
    return tuple(sorted({low, (low + high) // 2, high}))


def predictions(decoders: list, turns: list) -> list[dict]:
    """The calibration model against the run, per decoder, overall and per category. Each step is predicted at its
    own tree and context: tokens 1 + the tree's expected acceptance under the accuracy table, seconds its step
    latency timed now (the trees taking turns) at contexts spanning the run's, interpolated. Measured: the decode
    phase (every step after the prefill). A tree cut at the token budget's end (a turn's last few steps) counts as
    the decoder's tree nearest in size.

    decoders: (name, its MedusaModel, its heads' accuracy table [K, S], Ladder of the trees it may use, its outputs on
    every turn).
    """
    config = replace(CALIBRATION, latency_contexts=spanning_contexts(turns))
    rows = []
    for name, medusa, accuracy, trees, outputs in decoders:
        measured = list(trees.trees)
        contexts, latency = measure_step_latency(medusa, measured, config, trees.confident)  # as the decoder steps
        timed = replace(trees, contexts=tuple(contexts), latency_s=tuple(map(tuple, latency)))
        sizes = [tree.num_nodes - 1 for tree in measured]
        expected = (list(trees.expected_tokens) if trees.confident  # the calibration's (a confident tree: its size)
                    else [1 + expected_acceptance(tree.paths, accuracy) for tree in measured])
        sums: dict[str, list[float]] = {}  # category -> predicted tokens, predicted s, measured tokens, s, steps
        for (question, _, prompt_len, _), out in zip(turns, outputs):
            total = sums.setdefault(question.category, [0.0] * 5)
            for size, context in zip(out.tree_sizes[1:], step_contexts(prompt_len, out)):
                index = min(range(len(sizes)), key=lambda i: abs(sizes[i] - size))
                total[0] += expected[index]
                total[1] += timed.latency(context)[index]
            total[2:] = [total[2] + len(out.token_ids) - 1, total[3] + out.seconds - out.first_token_seconds,
                         total[4] + out.steps - 1]
        steps = [size for out in outputs for size in out.tree_sizes[1:]]
        rows.append({"decoder": name, "tree_size": sum(steps) / len(steps) if steps else 0.0,
                     "contexts": contexts, **prediction_figures([sum(col) for col in zip(*sums.values())]),
                     "categories": {category: prediction_figures(total) for category, total in sums.items()}})
    return rows


def prediction_figures(total: list[float]) -> dict:
    """Predicted against measured per step and per second, from the sums `predictions` adds up."""
    predicted_tokens, predicted_seconds, tokens, seconds, steps = total
    predicted = ratio(predicted_tokens, predicted_seconds)
    return {"steps": int(steps),
            "predicted_tokens_per_step": ratio(predicted_tokens, steps), "measured_tokens_per_step": ratio(tokens, steps),
            "predicted_step_latency_s": ratio(predicted_seconds, steps), "measured_step_latency_s": ratio(seconds, steps),
            "predicted_tokens_per_s": predicted, "measured_tokens_per_s": ratio(tokens, seconds),
            "error": ratio(ratio(tokens, seconds), predicted) - 1}


def turn_record(out: GenerationOutput, plain: GenerationOutput | None) -> dict:
    """One decoder's turn; beside plain's greedy answer, how many tokens it shared before they parted (all of them:
    lossless on this turn), so that a difference shows where it began."""
    record = {"new_tokens": len(out.token_ids), "steps": out.steps, "seconds": out.seconds}
    return record if plain is None else {**record, "agreed_with_plain": agreed_prefix(out.token_ids, plain.token_ids),
                                         "same_as_plain": out.token_ids == plain.token_ids}


def agreed_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens two answers share before their first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def gains(decoder: Totals, plain: Totals, hf: Totals) -> dict:
    """A speculative decoder's figures: tokens per step, step time and speed against plain decoding (and after the
    prefill alone: a long prompt's prefill, the same for both, dilutes the speedup of the whole), speed against
    `transformers` generate."""
    return {"acceleration_rate": ratio(decoder.new_tokens, decoder.steps),
            "overhead": ratio(decoder.seconds_per_step, plain.seconds_per_step),
            "speedup": ratio(decoder.tokens_per_s, plain.tokens_per_s),
            "decode_speedup": ratio(decoder.decode_tokens_per_s, plain.decode_tokens_per_s),
            "speedup_vs_transformers": ratio(decoder.tokens_per_s, hf.tokens_per_s)}


def order(name: str) -> tuple:
    """How reports list the decoders that ran: MEDUSA, plain, transformers, then the others by name."""
    return (DECODERS.index(name) if name in DECODERS else len(DECODERS), name)


def summary(outputs: list[dict[str, GenerationOutput]]) -> dict:
    """The figures for some turns. speedup = acceleration_rate / overhead exactly: plain makes one token a step."""
    totals = {name: Totals() for name in sorted(outputs[0], key=order)}  # DECODERS, then rivals, llama.cpp where run
    for turn in outputs:
        for name, out in turn.items():
            totals[name].add(out)
    medusa, plain, hf = (totals[name] for name in DECODERS)
    extra = {"speedup_vs_llama_cpp": ratio(medusa.tokens_per_s, totals[LLAMA_CPP].tokens_per_s)} if LLAMA_CPP in totals else {}
    rivals = {name: t for name, t in totals.items() if name not in DECODERS + (LLAMA_CPP,)}
    if rivals:
        extra["rivals"] = {name: {**gains(t, totals.get(f"{name}{OWN_PLAIN}", plain), hf),  # against its engine's plain
                                  "speedup_vs_medusa": ratio(t.tokens_per_s, medusa.tokens_per_s)}
                           for name, t in rivals.items()}
    trees = Counter(size for turn in outputs for size in turn["medusa"].tree_sizes[1:])  # the steps after the prefill
    return {
        "turns": len(outputs),
        **gains(medusa, plain, hf),
        **extra,
        "tokens_per_s": {name: t.tokens_per_s for name, t in totals.items()},
        "new_tokens": medusa.new_tokens,
        "steps": medusa.steps,
        "accept_lengths": {str(n): medusa.accept_lengths[n] for n in sorted(medusa.accept_lengths)},
        "drafted_per_step": ratio(medusa.drafted, medusa.steps),  # of its tokens a step, those its drafts gave
        "tree_sizes": {str(n): trees[n] for n in sorted(trees)},  # MEDUSA's steps by candidates verified
        "mean_tree_size": ratio(sum(n * c for n, c in trees.items()), trees.total()),
        "plain_step_share": ratio(trees[0], trees.total()),
        "prefill_share": ratio(plain.first_seconds, plain.seconds),  # of plain decoding's time, to the first tokens
        "totals": {name: {"new_tokens": t.new_tokens, "steps": t.steps, "seconds": t.seconds,
                          "first_token_seconds": t.first_seconds} for name, t in totals.items()},
    }


def reference(name: str, outputs: dict[str, GenerationOutput]) -> GenerationOutput:
    """The plain decoding a decoder's greedy answer must equal: on its own engine (a rival's NAME/plain where it
    decodes on the other one), else MEDUSA's engine's. NAME/plain itself is compared with MEDUSA's plain decoding:
    where two engines round apart, the report shows it there, not as a loss."""
    return outputs.get(f"{name}{OWN_PLAIN}", outputs["plain"])


def report(turns: list, config: GenerationConfig, device: torch.device) -> dict:
    """overall and per-category summaries, losslessness (temperature 0 only), per-turn records, settings, device."""
    greedy = config.temperature == 0  # every rule is greedy at temperature 0
    by_category: dict[str, list] = {}
    for question, *_, outputs in turns:
        by_category.setdefault(question.category, []).append(outputs)
    return {
        "overall": summary([outputs for *_, outputs in turns]),
        "categories": {name: summary(outputs) for name, outputs in by_category.items()},
        "lossless": all(out.token_ids == reference(name, o).token_ids for *_, o in turns for name, out in o.items()
                        if name not in OTHER_ENGINES and not name.endswith(OWN_PLAIN)) if greedy else None,
        "matches_transformers": all(o["medusa"].token_ids == o["transformers"].token_ids for *_, o in turns) if greedy else None,
        "turns": [
            {"question_id": q.question_id, "category": q.category, "turn": number + 1, "prompt_tokens": prompt_len,
             **{name: turn_record(o, reference(name, outputs) if greedy and name != "plain" else None)
                for name, o in sorted(outputs.items(), key=lambda item: order(item[0]))}}
            for q, number, prompt_len, outputs in turns
        ],
        "config": {**{k: v for k, v in asdict(config).items() if k != "medusa"}, "rule": config.rule, "torch": torch.__version__, "transformers": transformers.__version__},
        "device": device_name(device),
    }


# --- output -------------------------------------------------------------------------------------------------


def table(report: dict) -> str:
    """One row per category and one for all: tokens/s of each decoder, and the ratios that explain them."""
    header = (f"{'category':<14} {'turns':>5} {'tokens':>7} {'MEDUSA tok/s':>12} {'plain tok/s':>11} {'HF tok/s':>9} "
              f"{'tokens/step':>11} {'drafted':>7} {'tree':>5} {'plain steps':>11} {'overhead':>8} {'speedup':>8} "
              f"{'prefill':>7} {'decoding':>8} {'vs HF':>6}")
    llama, rivals = "speedup_vs_llama_cpp" in report["overall"], list(report["overall"].get("rivals", {}))
    rows = [header + (f" {'llama.cpp tok/s':>15} {'vs llama.cpp':>12}" if llama else "")]
    for name, s in [*sorted(report["categories"].items()), ("all", report["overall"])]:
        speed = s["tokens_per_s"]
        rows.append(f"{name[:14]:<14} {s['turns']:>5} {s['new_tokens']:>7} {speed['medusa']:>12.1f} {speed['plain']:>11.1f} "
                    f"{speed['transformers']:>9.1f} {s['acceleration_rate']:>11.2f} {s['drafted_per_step']:>7.2f} "
                    f"{s['mean_tree_size']:>5.1f} "
                    f"{s['plain_step_share']:>11.0%} {s['overhead']:>8.2f} {s['speedup']:>7.2f}x "
                    f"{s['prefill_share']:>7.0%} {s['decode_speedup']:>7.2f}x {s['speedup_vs_transformers']:>5.2f}x"
                    + (f" {speed[LLAMA_CPP]:>15.1f} {s['speedup_vs_llama_cpp']:>11.2f}x" if llama else ""))
    if rivals:
        rows.append(f"\n{'rival':<22} {'category':<14} {'tok/s':>7} {'tokens/step':>11} {'overhead':>8} {'speedup':>8} "
                    f"{'vs HF':>6} {'vs MEDUSA':>9}")
        for rival in rivals:
            for name, s in [*sorted(report["categories"].items()), ("all", report["overall"])]:
                r = s["rivals"][rival]
                rows.append(f"{rival[:22]:<22} {name[:14]:<14} {s['tokens_per_s'][rival]:>7.1f} "
                            f"{r['acceleration_rate']:>11.2f} {r['overhead']:>8.2f} {r['speedup']:>7.2f}x "
                            f"{r['speedup_vs_transformers']:>5.2f}x {r['speedup_vs_medusa']:>8.2f}x")
    rows.append("drafted: of MEDUSA's tokens a step, those only its drafts proposed; tree: its mean candidates "
                "per step; plain steps: its steps that verified no candidate (the guard of --tree auto); prefill: of "
                "plain decoding's time, the share to each turn's first token (the prompt's pass, the same for both); "
                "decoding: MEDUSA's speedup after it")
    lossless = {True: "yes", False: "NO", None: "n/a (sampling)"}[report["lossless"]]
    if report["lossless"] is False:
        parted = [f"{name} at token {record['agreed_with_plain']} of q{turn['question_id']}.{turn['turn']}"
                  for turn in report["turns"] for name, record in turn.items()
                  if isinstance(record, dict) and record.get("same_as_plain") is False and name not in OTHER_ENGINES
                  and not name.endswith(OWN_PLAIN)]
        lossless += f" ({'; '.join(parted)})"
    engines = [f"{name.removesuffix(OWN_PLAIN)}'s engine parts at token {record['agreed_with_plain']} of "
               f"q{turn['question_id']}.{turn['turn']}" for turn in report["turns"] for name, record in turn.items()
               if name.endswith(OWN_PLAIN) and record.get("same_as_plain") is False]
    if engines:  # not a loss: each decoder is held to plain decoding on its own engine
        rows.append(f"engines round apart (plain decoding on each): {'; '.join(engines)}")
    rows.append(f"lossless (greedy MEDUSA{' and every rival' if rivals else ''} == plain on every turn): {lossless}; "
                f"device: {report['device']}")
    if "step_latency_ms" in report:
        steps = report["step_latency_ms"]
        rows.append(f"step latency (ms, median) at a {steps['context']}-token context, by tokens in the pass: "
                    + ", ".join(f"{n}: MEDUSA engine {a:.1f}, llama.cpp {b:.1f}"
                                for n, a, b in zip(steps["tokens"], steps["medusa_engine"], steps[LLAMA_CPP])))
    for label, accuracy in [("heads", report["heads_accuracy"]),
                            *((f"{name}'s heads", a) for name, a in report.get("rival_heads_accuracy", {}).items())]:
        rows.append(f"{label} on these answers (teacher-forced), top-1: " + " ".join(f"{a:.3f}" for a in accuracy["top1"])
                    + "; top-5: " + " ".join(f"{a:.3f}" for a in accuracy["top5"]))
    if "prediction" in report:
        rows.append("\nthe calibration's prediction against the decode phase (steps after the prefill), each step at its "
                    "own tree and context")
        rows.append(f"{'decoder':<8} {'category':<14} {'tree':>5} {'tokens/step':>18} {'step ms':>18} {'tokens/s':>18} "
                    f"{'error':>7}")
        rows.append(f"{'':<8} {'':<14} {'':>5} {'predicted measured':>18} {'predicted measured':>18} "
                    f"{'predicted measured':>18}")
        for p in report["prediction"]:
            groups = [("all", p)] + (sorted(p["categories"].items()) if p["decoder"] != "sweep" else [])
            for name, g in groups:
                rows.append(f"{p['decoder']:<8} {name[:14]:<14} {p['tree_size']:>5.1f} "
                            f"{g['predicted_tokens_per_step']:>9.2f} {g['measured_tokens_per_step']:>8.2f} "
                            f"{1000 * g['predicted_step_latency_s']:>9.1f} {1000 * g['measured_step_latency_s']:>8.1f} "
                            f"{g['predicted_tokens_per_s']:>9.1f} {g['measured_tokens_per_s']:>8.1f} {g['error']:>+7.1%}")
    return "\n".join(rows)


def plot(report: dict, path) -> None:
    """One PNG: tokens/s by category for every decoder; the trees MEDUSA's steps verified, by category; tokens
    per MEDUSA forward pass; with predictions, speed against tree size, measured and predicted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [*sorted(report["categories"]), "all"]
    stats = [report["categories"].get(name, report["overall"]) for name in names]
    predicted = "prediction" in report
    figure = plt.figure(figsize=(16, 10))
    grid = figure.add_gridspec(2, 3 if predicted else 2, width_ratios=[2, 1, 1.3][: 3 if predicted else 2])
    bars, trees, histogram = figure.add_subplot(grid[0, :]), figure.add_subplot(grid[1, 0]), figure.add_subplot(grid[1, 1])
    speed = [figure.add_subplot(grid[1, 2])] if predicted else []
    decoders = list(report["overall"]["tokens_per_s"])  # DECODERS, and llama.cpp where it ran
    width = 1 / (len(decoders) + 1)
    for i, decoder in enumerate(decoders):
        positions = [n + (i - (len(decoders) - 1) / 2) * width for n in range(len(names))]
        bars.bar(positions, [s["tokens_per_s"][decoder] for s in stats], width, label=decoder)
    bars.set_xticks(range(len(names)), names, rotation=30, ha="right")
    bars.set_ylabel("new tokens / s")
    bars.set_title(f"speed by category (speedup vs plain {report['overall']['speedup']:.2f}x)")
    bars.margins(y=0.15)  # headroom for the legend
    bars.legend(ncol=len(decoders), loc="upper left")
    plot_trees(trees, names, stats)
    lengths = report["overall"]["accept_lengths"]
    histogram.bar([int(n) for n in lengths], list(lengths.values()), color="tab:blue")
    histogram.set_xlabel("tokens per MEDUSA forward pass")
    histogram.set_ylabel("forward passes")
    histogram.set_title(f"acceptance (mean {report['overall']['acceleration_rate']:.2f})")
    histogram.xaxis.get_major_locator().set_params(integer=True)
    if predicted:
        plot_speed(speed[0], report["prediction"])
    figure.suptitle(f"{report['config'].get('model') or 'model'} on {report['device']}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def plot_trees(axes, names: list[str], stats: list[dict]) -> None:
    """The share of MEDUSA's steps that verified each tree size, stacked, by category (`--tree auto`'s picks)."""
    import matplotlib.pyplot as plt

    sizes = sorted({int(n) for s in stats for n in s["tree_sizes"]})
    bottom = [0.0] * len(names)
    for i, size in enumerate(sizes):
        share = [s["tree_sizes"].get(str(size), 0) / max(sum(s["tree_sizes"].values()), 1) for s in stats]
        label = "plain" if size == 0 else f"{size} candidate{'s' if size > 1 else ''}"
        axes.bar(range(len(names)), share, 0.7, bottom=bottom, label=label, color=plt.cm.viridis(i / max(len(sizes) - 1, 1)))
        bottom = [b + x for b, x in zip(bottom, share)]
    axes.set_xticks(range(len(names)), names, rotation=30, ha="right")
    axes.set_ylim(0, 1.18)  # headroom for the legend
    axes.set_ylabel("share of MEDUSA's steps")
    axes.set_title("trees verified, by category")
    axes.legend(ncol=min(len(sizes), 4), fontsize=7, loc="upper left")


def plot_speed(axes, rows: list[dict]) -> None:
    """Tokens/s against tree size: the calibration model's prediction as a line, the measured speed as dots."""
    import matplotlib.ticker
    rows = sorted(rows, key=lambda p: p["tree_size"])
    sizes = [p["tree_size"] for p in rows]  # a guard's mean tree size is fractional
    axes.plot(sizes, [p["predicted_tokens_per_s"] for p in rows], color="tab:blue", marker=".", label="predicted")
    axes.scatter(sizes, [p["measured_tokens_per_s"] for p in rows], color="tab:orange", zorder=3, label="measured")
    chosen = next(p for p in rows if p["decoder"] == "medusa")
    axes.axvline(chosen["tree_size"], color="tab:green", ls="--", lw=1,
                 label=f"MEDUSA: {chosen['tree_size']:.1f} candidates a step")
    axes.set_xscale("symlog", linthresh=4)
    ticks = sorted({round(n) for n in sizes})
    axes.set_xticks(ticks, [str(n) for n in ticks])
    axes.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    axes.set_xlim(-0.5, max(sizes) * 1.3 + 1)
    axes.set_xlabel("tree size (candidates; 0 = plain)")
    axes.set_ylabel("new tokens / s")
    axes.set_title("speed vs tree size")
    top = max(max(p["predicted_tokens_per_s"], p["measured_tokens_per_s"]) for p in rows)
    axes.set_ylim(0, 1.15 * top)  # headroom: the highest point is not cut by the frame
    axes.legend(fontsize=8, loc="lower right")
