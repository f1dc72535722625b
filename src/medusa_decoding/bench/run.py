"""The benchmark's run: every turn of every question through every decoder, then the report with the calibration's
measures beside it."""

import sys
from dataclasses import replace

import torch
from tqdm import tqdm

from ..calibrate import greedy_trees, read_accuracy
from ..config import GenerationConfig
from ..decoding import PLAIN
from ..guard import Ladder
from ..kernels import guess_projection
from ..model import MedusaModel
from .decoders import WITHOUT, answer_turn, without
from .measures import heads_accuracy, predictions, step_latency
from .questions import Question
from .results import report

WARMUP_TOKENS = 8  # the untimed first generation: loads kernels and allocator pools before the clock runs


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
                            engine="compiled" if medusa.compiled else "eager",
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
