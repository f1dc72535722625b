"""What bench measures with the calibration's tools beside the run: the heads' accuracy on its answers, both engines'
step latency (with llama.cpp), and the calibration model's predicted speed against the measured one."""

from dataclasses import replace

import torch

from .. import llamacpp
from ..base import context_limit
from ..calibrate import expected_acceptance, measure_accuracy, measure_step_latency
from ..config import CalibrateConfig
from ..model import GenerationOutput, MedusaModel
from ..tree import Tree
from .decoders import LLAMA_CPP
from .results import ratio

CALIBRATION = CalibrateConfig()  # the calibration's own settings: bench measures as it does
STEP_TOKENS = (1, 4, 8, 16)  # the passes whose latency both engines report: plain steps and trees of 3, 7, 15


def step_latency(medusa: MedusaModel, llama, turns: list) -> dict:
    """Both engines' step over STEP_TOKENS tokens at the run's mean context: plain steps and trees (one head's top
    3, 7, 15) of MEDUSA, and llama.cpp's decode call over as many tokens (milliseconds, medians)."""
    context = round(sum(prompt_len + len(outputs["plain"].token_ids) / 2 for *_, prompt_len, outputs in turns)
                    / len(turns))
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
            "predicted_tokens_per_step": ratio(predicted_tokens, steps),
            "measured_tokens_per_step": ratio(tokens, steps),
            "predicted_step_latency_s": ratio(predicted_seconds, steps),
            "measured_step_latency_s": ratio(seconds, steps),
            "predicted_tokens_per_s": predicted, "measured_tokens_per_s": ratio(tokens, seconds),
            "error": ratio(ratio(tokens, seconds), predicted) - 1}
