"""Draw a run's key metric curves with the steps where a symptom rule fired marked (matplotlib, Agg backend)."""

from __future__ import annotations

import math
import os
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

from rlguard.diagnose.rules import Report, series

# Panels in order: (title, metric names drawn together, log scale, healthy band or None).
PANELS: list[tuple[str, tuple[str, ...], bool, tuple[float, float] | None]] = [
    ("reward / pass rate", ("reward", "eval_pass", "pass_rate"), False, None),
    ("entropy", ("entropy",), False, None),
    ("approx_kl", ("approx_kl",), True, None),  # its healthy range depends on the trainer
    ("ratio_max / ratio_min", ("ratio_max", "ratio_min"), False, None),
    ("clip_frac", ("clip_frac",), False, None),
    ("grad_norm", ("grad_norm",), False, None),
    ("logp_gap (trainer - sampler)", ("logp_gap",), True, (0.0, 1e-4)),
    ("zero_adv_frac", ("zero_adv_frac",), False, None),
    ("kl_ref", ("kl_ref",), False, None),
    ("policy tokens per episode", ("length_pass", "length_fail", "length"), False, None),
    ("extras", ("malformed", "hardcode", "reads", "thinks"), False, None),
]

COLORS = ["#d62728", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#1f77b4"]


def plot_history(history: Sequence[Mapping[str, Any]], report: Report, out: str | os.PathLike,
                 title: str | None = None) -> list[str]:
    """Write a PNG of the metric panels the history has; each symptom's steps are marked (coloured dots on its
    metrics, shaded spans) and named in the legend. -> the metric names drawn."""
    import matplotlib  # noqa: PLC0415 -- optional dependency, imported only to plot

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt  # noqa: PLC0415

    panels = [(t, [k for k in keys if series(history, k)], log, band) for t, keys, log, band in PANELS]
    panels = [p for p in panels if p[1]]
    if not panels:
        raise ValueError("nothing to plot: the log has none of the dashboard metrics")
    cols = 3 if len(panels) > 4 else 2
    rows = math.ceil(len(panels) / cols)
    height = 2.9 * rows + 1.2
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, height), squeeze=False)
    colour = {s.rule: COLORS[i % len(COLORS)] for i, s in enumerate(report.symptoms)}
    drawn: list[str] = []
    for ax, (panel_title, keys, log, band) in zip(axes.flat, panels):
        for key in keys:
            pts = series(history, key)
            if key in ("length_pass", "length_fail"):
                pts = [(s, v) for s, v in pts if v > 0]  # 0: no passing (failing) episode at that step
            steps, values = [s for s, _ in pts], [v for _, v in pts]
            if log:
                values = [max(v, 1e-12) for v in values]
            style = "o-" if len(pts) <= 6 or key == "eval_pass" else "-"
            ax.plot(steps, values, style, lw=1.6, ms=3.5, label=key)
            drawn.append(key)
            for symptom in report.symptoms:
                if key not in symptom.metrics:
                    continue
                at = [(s, v) for s, v in zip(steps, values) if s in set(symptom.steps)]
                if at:
                    ax.scatter([s for s, _ in at], [v for _, v in at], s=46, marker="X", zorder=5,
                               color=colour[symptom.rule], edgecolors="black", linewidths=0.5)
        for symptom in report.symptoms:
            if any(k in symptom.metrics for k in keys) and symptom.steps:
                ax.axvspan(min(symptom.steps) - 0.5, max(symptom.steps) + 0.5, color=colour[symptom.rule],
                           alpha=0.08, lw=0)
        if band is not None:
            ax.axhspan(max(band[0], 1e-12) if log else band[0], band[1], color="#2ca02c", alpha=0.12, lw=0,
                       label="healthy range")
        if log:
            ax.set_yscale("log")
        ax.set_title(panel_title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", framealpha=0.6)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if report.symptoms:
        found = "; ".join(f"{s.rule}" + (f" ({'/'.join(s.codes[:1])})" if s.codes else f" ({s.cause})")
                          for s in report.symptoms)
        handles = [plt.Line2D([], [], marker="X", ls="", color=colour[s.rule], markeredgecolor="black",
                              label=textwrap.fill(f"{s.rule}" + (f" [{'/'.join(s.codes)}]" if s.codes else "")
                                                  + f": {s.cause}", 48))
                   for s in report.symptoms]
        spare = list(axes.flat)[len(panels):]
        if spare:  # the symptom legend in the first empty slot of the grid
            spare[0].legend(handles=handles, loc="center", fontsize=8.5, frameon=False, title="rules that fired",
                            title_fontsize=9)
        else:
            fig.legend(handles=handles, loc="lower center", ncol=min(2, len(handles)), fontsize=8, frameon=False)
    else:
        found = "no symptom found"
    fig.suptitle(f"{title + ': ' if title else ''}{found}", fontsize=11)
    # fixed margins in inches (tight_layout costs seconds with a dozen panels)
    legend_below = bool(report.symptoms) and len(panels) == rows * cols
    fig.subplots_adjust(left=0.055, right=0.985, wspace=0.22, hspace=0.62, top=1 - 0.75 / height,
                        bottom=(0.85 if legend_below else 0.45) / height)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return drawn
