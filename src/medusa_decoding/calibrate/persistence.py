"""A calibration kept: written beside the heads, read back, and its latency fit reused where it was measured on this
setup, else fitted here once and cached (fitted again where the cached one was timed under load)."""

import hashlib
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import NamedTuple

import torch

from ..config import CalibrateConfig, cache_root
from ..formats import CALIBRATION_NAME, TREE_NAME
from ..guard import Ladder, interpolate
from ..kernels import code_digest
from ..tree import build
from .latency import fit_tree, measure_step_latency, setup
from .plots import plot
from .tree_search import DEFAULTS, Calibration, fit_sizes, grow_tree, ladder

# what the guard's ladder is built from (confident_size: where confident trees were fitted too)
FIT = ("sizes", "contexts", "latency_s", "size", "batch_sizes", "batch_latency_s", "confident_size")
STALE_FIT = 1.4  # a cached fit whose plain step is this much slower than now was timed under load (beyond noise)


def save(calibration: Calibration, directory: str | Path, setup: str) -> None:
    """tree.json (read by MedusaModel.from_pretrained beside the heads), accuracy.json and the plots (PLOT_NAMES)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / TREE_NAME).write_text(json.dumps([list(p) for p in calibration.tree_paths]) + "\n")
    record = {**asdict(calibration), "paths": [list(p) for p in calibration.paths], "setup": setup}
    (directory / CALIBRATION_NAME).write_text(json.dumps(record, indent=1) + "\n")
    plot(calibration, directory, setup)


class HeadsCalibration(NamedTuple):
    """What `medusa calibrate` left beside the heads."""

    accuracy: torch.Tensor  # [K, S]
    setup: str | None  # what the latency was measured on
    guess_vocab: torch.Tensor | None  # the tokens the heads guess from; None: all
    fit: dict | None  # FIT's fields, measured on `setup`; None where the record predates latency by context
    confident_tokens: list[float] | None  # confident trees' tokens per step, per size of the fit (measure_yields)


def confident_yield(calibration: HeadsCalibration, size: int) -> float:
    """Tokens a step of `size` confident candidates yields: the calibration's simulation, linear between its sizes;
    beyond them, or where it simulated none, the static tree of that size's (a floor)."""
    sizes = calibration.fit["sizes"] if calibration.fit else []
    if calibration.confident_tokens and sizes and size <= sizes[-1]:
        return interpolate(sizes, [(t,) for t in calibration.confident_tokens], size)[0]
    return 1.0 + grow_tree(calibration.accuracy, size)[1][-1]


def read_accuracy(heads_dir: str | Path) -> HeadsCalibration | None:
    """The heads' calibration (accuracy.json), if they have one."""
    path = Path(heads_dir) / CALIBRATION_NAME
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        vocab = record.get("guess_vocab")
        vocab = None if vocab is None else torch.tensor(vocab, dtype=torch.long)
        fit = {name: record[name] for name in FIT if name in record} if "contexts" in record else None
        return HeadsCalibration(torch.tensor(record["accuracy"], dtype=torch.float64), record.get("setup"), vocab, fit,
                                record.get("confident_tokens"))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as error:
        raise ValueError(f"calibration: {path} is not a valid accuracy table: {error}") from None


def auto_tree(medusa, heads_dir: str | Path, calibration: HeadsCalibration, config: CalibrateConfig = DEFAULTS,
              confident: bool = False) -> Ladder:
    """`--tree auto`: the trees fitted to these heads, this model and this device, from the heads' calibration
    (`read_accuracy(heads_dir)`), as a Ladder for the guard to choose from at run time (confident: `--tree
    confident`'s, where the calibration simulated confident trees, else auto's).

    The calibration's own latency fit where it was measured on this very setup; else one fitted now (a short latency
    measurement), cached under cache_root()/trees, keyed by model, heads, setup, the kernels' code and what is
    measured.
    """
    here, fit, tokens = setup(medusa), calibration.fit, calibration.confident_tokens
    if calibration.setup == here and fit is not None and "batch_latency_s" in fit:  # measured on this very setup
        return ladder(calibration.accuracy, **fit, confident_tokens=tokens if confident else None)
    if fit is None or fit["sizes"] != fit_sizes(calibration.accuracy, config):
        tokens = None  # confident trees' tokens per size of the calibration's fit: not the sizes a refit measures
    vocab = calibration.guess_vocab
    what = [medusa.model.name_or_path, asdict(medusa.heads.config), calibration.accuracy.tolist(), here, code_digest(),
            None if vocab is None else vocab.tolist(), config.max_nodes, config.latency_contexts,
            config.batch_sizes, tokens]  # all the fit depends on
    key = hashlib.sha256(json.dumps(what).encode()).hexdigest()[:24]
    cached = cache_root() / "trees" / f"{key}.json"
    if cached.is_file():
        record = json.loads(cached.read_text())
        if not timed_under_load(medusa, record, config):
            return ladder(calibration.accuracy, **{name: record[name] for name in FIT},
                          confident_tokens=tokens if confident else None)
        print("tree auto: the cached fit's plain step is slower than this machine's now (timed under load): fitting "
              "again", file=sys.stderr)
    print(f"tree auto: fitting the trees to {here} (once; cached in {cached.parent})", file=sys.stderr)
    fitted = fit_tree(medusa, calibration.accuracy, config, tokens)
    cached.parent.mkdir(parents=True, exist_ok=True)
    record = {"tree": [list(p) for p in fitted.tree_paths], "setup": here, "model": medusa.model.name_or_path,
              "heads": str(heads_dir), "tokens_per_s": fitted.tokens_per_s,
              **{name: getattr(fitted, name) for name in FIT}}
    tmp = cached.with_suffix(".tmp")
    tmp.write_text(json.dumps(record) + "\n")
    tmp.replace(cached)  # whole or not at all
    return fitted.ladder(confident)


def timed_under_load(medusa, record: dict, config: CalibrateConfig = DEFAULTS) -> bool:
    """Whether a cached fit's plain step at its shortest context is STALE_FIT times slower than one timed now. Load
    from elsewhere only slows steps, so such a fit was timed under load, and its trees' relative costs with it;
    it is fitted again. A fit faster than now stands: this moment is the loaded one, which the guard's own timing
    corrects."""
    context = record["contexts"][0]
    _, ((now, *_),) = measure_step_latency(medusa, [build(())], replace(config, latency_contexts=(context,)))
    return record["latency_s"][0][0] > STALE_FIT * now
