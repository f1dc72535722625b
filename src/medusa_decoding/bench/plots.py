"""The benchmark's report as one PNG."""


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
    bars = figure.add_subplot(grid[0, :])
    trees, histogram = figure.add_subplot(grid[1, 0]), figure.add_subplot(grid[1, 1])
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
        axes.bar(range(len(names)), share, 0.7, bottom=bottom, label=label,
                 color=plt.cm.viridis(i / max(len(sizes) - 1, 1)))
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
