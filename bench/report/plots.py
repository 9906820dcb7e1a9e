"""Plotting helpers shared by the benchmark reports (step-bench.py, layer-bench.py, mlp-report.py, fp8-mlp-report.py): no
module of this folder other than an importable one (a name without a dash) can be imported."""
import sys


def pyplot():
    """matplotlib's pyplot on the file backend, or None (saying so on stderr) where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not importable: no plot", file=sys.stderr)
        return None
    return plt


def grouped_bars(ax, labels, series, ylabel, reference=1.0):
    """Vertical bars grouped by label: `series` is [(name, [value per label (None: no bar)])]; a gray
    line at `reference` (None: none). Leaves the x tick labels to the caller (shared axes)."""
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(labels))]
        ax.bar(xs, [v or 0 for v in values], width, label=name)
    if reference is not None:
        ax.axhline(reference, color="gray", linewidth=0.8)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)


def case_ticks(ax, labels):
    """The case names under the bars, slanted."""
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
