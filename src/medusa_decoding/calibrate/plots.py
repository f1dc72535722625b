"""A calibration drawn: the accuracy table, the chosen tree, speed against tree size and tokens per step, as PNGs.

matplotlib is imported only when drawing, so that loading a model never pays for it.
"""

import itertools
import textwrap
from pathlib import Path

import torch

from .tree_search import Calibration, path_probability

PLOT_NAMES = {"accuracy": "accuracy.png", "tree": "tree.png", "speed": "tokens_per_s.png", "yields": "yields.png"}


def plot(calibration: Calibration, directory: Path, device: str) -> None:
    """Each of PLOT_NAMES into `directory` (yields only where the calibration simulated them)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawings = {"accuracy": plot_accuracy, "tree": plot_tree, "speed": plot_speed, "yields": plot_yields}
    for name, draw in drawings.items():
        if name == "yields" and calibration.simulated_tokens is None:
            continue
        figure = draw(plt, calibration, device)
        figure.tight_layout()
        figure.savefig(directory / PLOT_NAMES[name], dpi=100)
        plt.close(figure)


def plot_accuracy(plt, calibration: Calibration, device: str):
    """Heatmap of a_k^(i), each cell labelled."""
    table = torch.tensor(calibration.accuracy)
    figure, axes = plt.subplots(figsize=(1.0 + 0.7 * table.shape[1], 1.2 + 0.6 * table.shape[0]))
    image = axes.imshow(table.numpy(), cmap="viridis", vmin=0, vmax=max(float(table.max()), 1e-9), aspect="auto")
    for (k, i), value in zip(itertools.product(*map(range, table.shape)), table.flatten().tolist()):
        axes.text(i, k, f"{value:.2f}", ha="center", va="center", fontsize=8,
                  color="black" if value > 0.6 * float(table.max()) else "white")
    axes.set_xticks(range(table.shape[1]))
    axes.set_yticks(range(table.shape[0]), [f"head {k} (t+{k + 2})" for k in range(table.shape[0])])
    axes.set_xlabel("rank i in the head's top-k")
    axes.set_title("P(head k's rank-i token is correct)")
    figure.colorbar(image, ax=axes)
    return figure


def plot_tree(plt, calibration: Calibration, device: str):
    """The chosen tree: columns by depth, leaves one row each, nodes labelled head/rank and path probability."""
    table = torch.tensor(calibration.accuracy)
    paths = sorted(calibration.tree_paths, key=lambda p: (len(p), p))
    children = {(): []} | {p: [] for p in paths}
    for p in paths:
        children[p[:-1]].append(p)
    rows: dict[tuple, float] = {}

    def place(node: tuple, next_row: float) -> float:  # depth-first; a parent sits at its children's mean row
        if not children[node]:
            rows[node] = next_row
            return next_row + 1
        for child in sorted(children[node]):
            next_row = place(child, next_row)
        rows[node] = sum(rows[c] for c in children[node]) / len(children[node])
        return next_row

    leaves = place((), 0)
    depth = max((len(p) for p in paths), default=0)
    figure, axes = plt.subplots(figsize=(2.0 + 2.2 * depth, 1.0 + 0.32 * leaves))
    for p in paths:
        axes.plot([len(p) - 1, len(p)], [rows[p[:-1]], rows[p]], color="0.6", lw=0.8, zorder=1)
    axes.scatter([0], [rows[()]], s=60, color="black", zorder=2)
    axes.annotate("root", (0, rows[()]), xytext=(-6, 0), textcoords="offset points", ha="right", va="center",
                  fontsize=8)
    probabilities = [path_probability(p, table) for p in paths]
    axes.scatter([len(p) for p in paths], [rows[p] for p in paths], c=probabilities, cmap="viridis", vmin=0, vmax=1,
                 s=40, zorder=2)
    for p, probability in zip(paths, probabilities):
        axes.annotate(f"h{len(p) - 1} r{p[-1]}  {probability:.2f}", (len(p), rows[p]), xytext=(6, 0),
                      textcoords="offset points", va="center", fontsize=7)
    axes.set_xticks(range(depth + 1), ["root"] + [f"head {k}" for k in range(depth)])
    axes.set_xlim(-0.6, depth + 0.9)
    axes.invert_yaxis()
    axes.set_yticks([])
    expected = calibration.expected_tokens[calibration.sizes.index(calibration.size)]
    axes.set_title(f"chosen tree: {calibration.size} candidates, {expected:.2f} expected tokens/step\n"
                   f"(labels: head, rank, probability the whole path is accepted)", fontsize=9)
    return figure


def plot_speed(plt, calibration: Calibration, device: str):
    """Predicted tokens/s against tree size at each measured context, the measured step latency on a second axis."""
    sizes = calibration.sizes
    figure, axes = plt.subplots(figsize=(8, 4.5))
    latency = axes.twinx()
    for c, (context, row) in enumerate(zip(calibration.contexts, calibration.latency_s)):
        color = plt.cm.viridis(0.8 * c / max(len(calibration.contexts) - 1, 1))  # dark to green: no pale yellow
        speed = [tokens / seconds for tokens, seconds in zip(calibration.expected_tokens, row)]
        axes.plot(sizes, speed, marker=".", color=color, label=f"predicted tokens/s, {context}-token context")
        axes.axhline(speed[0], color=color, ls=":", lw=1)
        latency.plot(sizes, [1000 * s for s in row], color=color, ls="--", lw=1, label=f"step ms, {context} tokens")
    axes.axvline(calibration.size, color="tab:green", ls="--", lw=1, label=f"chosen: {calibration.size} candidates")
    axes.set_xlabel("tree size (candidate nodes; dotted: plain decoding)")
    axes.set_ylabel("predicted tokens / s (solid)")
    latency.set_ylabel("measured step latency, ms (dashed)")
    latency.set_ylim(bottom=0)
    lines = axes.get_legend_handles_labels()
    more = latency.get_legend_handles_labels()
    axes.legend(lines[0] + more[0], lines[1] + more[1], loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3,
                fontsize=7, frameon=False)
    axes.set_title(f"tree size vs speed: (1 + expected acceptance) / step latency\n{textwrap.fill(device, 100)}",
                   fontsize=9)
    return figure


def plot_yields(plt, calibration: Calibration, device: str):
    """Tokens per step against tree size: predicted from the accuracy table, and simulated on the data (measure_yields)
    for the static trees and for confidence-driven ones."""
    figure, axes = plt.subplots(figsize=(7, 4.5))
    curves = ((calibration.expected_tokens, "static tree, predicted (products of accuracies)", ":"),
              (calibration.simulated_tokens, "static tree, simulated on the data", "-"),
              (calibration.confident_tokens, "confident tree (each step's likeliest), simulated", "-"))
    for tokens, label, style in curves:
        axes.plot(calibration.sizes, tokens, ls=style, marker=".", label=label)
    axes.axvline(calibration.size, color="tab:green", ls="--", lw=1, label=f"chosen: {calibration.size} candidates")
    axes.set_xscale("symlog", linthresh=1)
    axes.set_xlim(0, calibration.sizes[-1] * 1.1)
    axes.set_xlabel("tree size (candidate nodes)")
    axes.set_ylabel("tokens per step")
    axes.legend(fontsize=8)
    axes.grid(alpha=0.3)
    axes.set_title(f"tokens per step against tree size\n{textwrap.fill(device, 80)}", fontsize=9)
    return figure
