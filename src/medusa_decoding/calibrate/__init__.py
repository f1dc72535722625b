"""Calibrated sparse trees: the tree that decodes fastest for these heads, this model and this device.

calibrate() runs the whole of it: the heads measured on data (accuracy.py), the best tree of each size and its
expected tokens per step (tree_search.py), the step latency of those trees on this device and the size that wins
(latency.py). persistence.py keeps the result beside the heads and fits it to another device when loaded there;
plots.py draws it.
"""

from dataclasses import replace

from ..config import CalibrateConfig
from ..kernels import set_guess_vocab
from .accuracy import answer_positions, guess_vocab, measure_accuracy, measure_yields
from .latency import (
    choose_kernels,
    device_name,
    fit_tree,
    measure_batch_latency,
    measure_step_latency,
    setup,
    synchronize,
)
from .persistence import HeadsCalibration, auto_tree, confident_yield, read_accuracy, save
from .plots import PLOT_NAMES
from .tree_search import (
    DEFAULTS,
    Calibration,
    choose_tree,
    expected_acceptance,
    fit_sizes,
    greedy_trees,
    grow_tree,
    tried_sizes,
)

__all__ = ["PLOT_NAMES", "Calibration", "HeadsCalibration", "answer_positions", "auto_tree", "calibrate",
           "choose_kernels", "choose_tree", "confident_yield", "device_name", "expected_acceptance", "greedy_trees",
           "grow_tree", "guess_vocab", "measure_accuracy", "measure_batch_latency", "measure_step_latency",
           "measure_yields", "read_accuracy", "save", "setup", "synchronize", "tried_sizes"]


def calibrate(medusa, conversations: list[list[dict]], config: CalibrateConfig = DEFAULTS,
              vocab_conversations: list[list[dict]] | None = None) -> Calibration:
    """The tokens the heads guess from (those `vocab_conversations`' answers use most, the conversations' where
    None), the accuracy table of those guesses on the conversations, the tokens per step of every tree size simulated
    on them, then the trees fitted to this device. A calibration set's answers fill the guess vocabulary with tokens
    seen once or twice: the training answers, many times more, rank it better."""
    vocab = guess_vocab(medusa, conversations if vocab_conversations is None else vocab_conversations, config)
    set_guess_vocab(medusa.model, vocab)
    accuracy = measure_accuracy(medusa, conversations, config)
    sizes = fit_sizes(accuracy, config)
    simulated, confident = measure_yields(medusa, conversations, grow_tree(accuracy, sizes[-1])[0], sizes, config)
    calibration = fit_tree(medusa, accuracy, config, confident)
    return replace(calibration, guess_vocab=None if vocab is None else vocab.tolist(), simulated_tokens=simulated)
