"""The figure `bench peers` and `bench tier` draw: one panel per metric, bars grouped by
block (or chunk) size, one colour per system, saved as PNG (matplotlib)."""
from __future__ import annotations

from typing import Callable

import numpy as np

from kvstore.format.layout import format_size


def size_panels(path: str, sizes: list, systems: list, value: Callable[[str, str, str], float | None],
                panels: list, labels: dict, colors: dict, title: str, *, figsize: tuple,
                title_size: int = 10, legend_room: float = 0.07, bar_values: bool = False,
                xlabel: str | None = None) -> None:
    """`value(size, system, field)`: the bar's height (None draws 0); `panels`: (field,
    panel title) pairs; `sizes`: the results' keys (bytes, as strings or ints)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=figsize)
    x = np.arange(len(sizes))
    w = 0.8 / max(1, len(systems))
    for ax, (field, panel) in zip(axes, panels):
        for i, s in enumerate(systems):
            vals = [value(b, s, field) or 0.0 for b in sizes]
            bars = ax.bar(x + (i - (len(systems) - 1) / 2) * w, vals, w, label=labels[s], color=colors[s])
            if bar_values:
                ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.set_xticks(x, [format_size(int(b)).replace(".0", "") for b in sizes])
        if xlabel:
            ax.set_xlabel(xlabel)
        ax.set_title(panel, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    handles, lbls = axes[0].get_legend_handles_labels()
    fig.legend(handles, lbls, loc="lower center", ncol=len(systems), fontsize=9, frameon=False)
    fig.suptitle(title, fontsize=title_size)
    fig.tight_layout(rect=(0, legend_room, 1, 1))
    fig.savefig(path, dpi=80)
    plt.close(fig)
