"""The benchmark's results: each decoder's totals, the report (overall, per category, per turn; written as JSON) and
its text table."""

from collections import Counter
from dataclasses import asdict, dataclass, field

import torch
import transformers

from ..calibrate import device_name
from ..config import GenerationConfig
from ..model import GenerationOutput
from .decoders import DECODERS, LLAMA_CPP, OTHER_ENGINES, OWN_PLAIN


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
    extra = ({"speedup_vs_llama_cpp": ratio(medusa.tokens_per_s, totals[LLAMA_CPP].tokens_per_s)}
             if LLAMA_CPP in totals else {})
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
        "matches_transformers": (all(o["medusa"].token_ids == o["transformers"].token_ids for *_, o in turns)
                                 if greedy else None),
        "turns": [
            {"question_id": q.question_id, "category": q.category, "turn": number + 1, "prompt_tokens": prompt_len,
             **{name: turn_record(o, reference(name, outputs) if greedy and name != "plain" else None)
                for name, o in sorted(outputs.items(), key=lambda item: order(item[0]))}}
            for q, number, prompt_len, outputs in turns
        ],
        "config": {**{k: v for k, v in asdict(config).items() if k != "medusa"}, "rule": config.rule,
                   "torch": torch.__version__, "transformers": transformers.__version__},
        "device": device_name(device),
    }


def table(report: dict) -> str:
    """One row per category and one for all: tokens/s of each decoder, and the ratios that explain them."""
    header = (f"{'category':<14} {'turns':>5} {'tokens':>7} {'MEDUSA tok/s':>12} {'plain tok/s':>11} {'HF tok/s':>9} "
              f"{'tokens/step':>11} {'drafted':>7} {'tree':>5} {'plain steps':>11} {'overhead':>8} {'speedup':>8} "
              f"{'prefill':>7} {'decoding':>8} {'vs HF':>6}")
    llama, rivals = "speedup_vs_llama_cpp" in report["overall"], list(report["overall"].get("rivals", {}))
    rows = [header + (f" {'llama.cpp tok/s':>15} {'vs llama.cpp':>12}" if llama else "")]
    for name, s in [*sorted(report["categories"].items()), ("all", report["overall"])]:
        speed = s["tokens_per_s"]
        rows.append(f"{name[:14]:<14} {s['turns']:>5} {s['new_tokens']:>7} {speed['medusa']:>12.1f} "
                    f"{speed['plain']:>11.1f} {speed['transformers']:>9.1f} {s['acceleration_rate']:>11.2f} "
                    f"{s['drafted_per_step']:>7.2f} {s['mean_tree_size']:>5.1f} "
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
        rows.append(f"{label} on these answers (teacher-forced), top-1: "
                    + " ".join(f"{a:.3f}" for a in accuracy["top1"])
                    + "; top-5: " + " ".join(f"{a:.3f}" for a in accuracy["top5"]))
    if "prediction" in report:
        rows.append("\nthe calibration's prediction against the decode phase (steps after the prefill), each step at "
                    "its own tree and context")
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
                            f"{g['predicted_tokens_per_s']:>9.1f} {g['measured_tokens_per_s']:>8.1f} "
                            f"{g['error']:>+7.1%}")
    return "\n".join(rows)
