"""The heads measured on data: which tokens they guess from, how often each head's rank-i guess is right, and how
many tokens each tree would yield, all teacher-forced over the answers of chat conversations."""

import itertools
import math
from collections.abc import Iterator

import torch

from ..config import CalibrateConfig
from ..guard import first_sizes, yields
from ..heads_draft import guess, guess_confident
from ..kernels import guess_projection
from ..training import data, positions
from ..training.data import IGNORE_INDEX, build_examples
from ..tree import build
from .tree_search import DEFAULTS, Node

HEADS_CHUNK = 256  # positions per heads call: bounds the [K, n, V] logits one call holds


@torch.inference_mode()
def answer_positions(medusa, conversations: list[list[dict]], config: CalibrateConfig = DEFAULTS
                     ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]]:
    """The answer positions of `conversations`, teacher-forced, a batch of conversations at a time, as training reads
    them: (the heads' input state [n, (1 + L) H] (heads.run_backbone) at each position t where some head has a target,
    targets [K, n] (token t+k+2, IGNORE_INDEX past the answer), what hydra heads read of the true tokens after t
    [n, K, H] (else None), roots [n]: token t+1)."""
    model, heads, tokenizer = medusa.model, medusa.heads, medusa.tokenizer
    examples = build_examples(tokenizer, conversations, config.max_length)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    for state, targets, path in positions.answer_positions(model, heads, examples, pad_id, config.batch_size):
        yield state, targets, positions.path_embeddings(heads.config, model.get_input_embeddings(), path), path[:, 0]


def measure_accuracy(medusa, conversations: list[list[dict]], config: CalibrateConfig = DEFAULTS) -> torch.Tensor:
    """a_k^(i) [K, S] over the answer tokens of `conversations` (chat messages, e.g. `medusa distill`'s).

    Teacher-forced, as in training: at every position t whose token t+k+2 is an answer token, does
    head k rank that token i-th? (Hydra heads read the true tokens before it: the accuracy given that the path up
    to the guess is right, what a path's acceptance multiplies.) Stops after config.max_positions positions with a
    head-0 target.
    """
    from tqdm.auto import tqdm

    heads = medusa.heads
    num_heads, ranks = heads.config.num_heads, min(config.top_k, heads.config.vocab_size)
    hits = torch.zeros(num_heads, ranks, dtype=torch.long)
    counts = torch.zeros(num_heads, dtype=torch.long)
    lm_head = guess_projection(medusa.model)  # as the decoding loop guesses
    progress = tqdm(total=config.max_positions, desc="calibrate: head accuracy", unit="pos")
    with torch.inference_mode():
        for hidden, targets, embeds, _ in answer_positions(medusa, conversations, config):
            paths = itertools.repeat(None) if embeds is None else embeds.split(HEADS_CHUNK)
            for chunk_hidden, chunk_targets, chunk_embeds in zip(hidden.split(HEADS_CHUNK),
                                                                 targets.split(HEADS_CHUNK, dim=1), paths):
                top = heads.guesses(chunk_hidden, lm_head, ranks, embeds=chunk_embeds)  # [K, n, S]
                hits += (top == chunk_targets[..., None]).sum(1).cpu()  # an ignored target (-100) never matches
                counts += (chunk_targets != IGNORE_INDEX).sum(-1).cpu()
            progress.update(min(int(counts[0]), config.max_positions) - progress.n)
            if counts[0] >= config.max_positions:
                break
    progress.close()
    if counts[0] == 0:
        raise ValueError("calibration data: no answer token has a head target (answers too short)")
    return hits.double() / counts.clamp(min=1)[:, None]


def measure_yields(medusa, conversations: list[list[dict]], paths: list[Node], sizes: list[int],
                   config: CalibrateConfig = DEFAULTS) -> tuple[list[float], list[float]]:
    """Tokens per step of the static tree of each size (paths[:n]: the greedy order) and of the confident tree of each
    size, counted on about config.simulated_positions answer positions spread over all the data (every s-th position
    of every s-th conversation: neighbours are alike, and files differ), from the decoding loop's own proposals at
    each (heads_draft.guess, guess_confident; the root: the answer's next token) and the guard's count of what
    each tree accepts of the tokens that follow (guard.yields). What choose_tree predicts from products of
    accuracies, which assumes the heads right or wrong independently, measured; and for confident trees, whose
    nodes change every step, the only prediction there is."""
    from tqdm.auto import tqdm

    heads, largest = medusa.heads, build(tuple(paths[: sizes[-1]]))
    lm_head, embed = guess_projection(medusa.model), medusa.model.get_input_embeddings()
    static, confident, seen = [0] * len(sizes), [0] * len(sizes), 0
    first = first_sizes(paths, sizes)
    examples = build_examples(medusa.tokenizer, conversations, config.max_length)
    answers = sum(label != IGNORE_INDEX for example in examples for label in example["labels"])
    stride = math.ceil(math.sqrt(answers / config.simulated_positions))
    progress = tqdm(total=min(config.simulated_positions, math.ceil(answers / stride ** 2)),
                    desc="calibrate: tree yields", unit="pos")  # about: answers per conversation vary
    with torch.inference_mode():
        for hidden, targets, _, roots in answer_positions(medusa, conversations[::stride], config):
            for t in range(0, len(roots), stride):
                truth = targets[:, t].tolist()
                truth = truth[: truth.index(IGNORE_INDEX)] if IGNORE_INDEX in truth else truth
                _, guesses = guess(heads, lm_head, embed, hidden[t], int(roots[t]), largest, largest)
                counted = yields(guesses if isinstance(guesses, dict) else guesses.tolist(), truth, first, len(sizes))
                static = [a + b for a, b in zip(static, counted)]
                _, _, (tops, ranked) = guess_confident(heads, lm_head, embed, hidden[t], int(roots[t]), sizes[-1],
                                                       sizes[-1])
                counted = yields(tops, truth, first_sizes(ranked, sizes), len(sizes))
                confident = [a + b for a, b in zip(confident, counted)]
                seen += 1
                progress.update()
                if seen == config.simulated_positions:
                    break
            if seen == config.simulated_positions:
                break
    progress.close()
    if not seen:
        raise ValueError("calibration data: no answer token has a head target (answers too short)")
    return [n / seen for n in static], [n / seen for n in confident]


def guess_vocab(medusa, conversations: list[list[dict]], config: CalibrateConfig = DEFAULTS) -> torch.Tensor | None:
    """The config.guess_vocab tokens the conversations' answers use most, most used first (then unused ones by id),
    or None: the whole vocabulary (guess_vocab 0 or not smaller, or heads with projections of their own)."""
    size = medusa.heads.config.vocab_size
    if not config.guess_vocab or config.guess_vocab >= size or medusa.heads.config.projection != "shared":
        return None
    examples = build_examples(medusa.tokenizer, conversations, config.max_length)
    return data.answer_vocab(examples, size, config.guess_vocab)
