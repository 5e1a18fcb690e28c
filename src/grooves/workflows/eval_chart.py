"""``eval.png``: quality against cost per 1,000 tasks and against p95 latency, one point per candidate.

Candidates are told apart by colour and marker, named once in a legend under both charts: names
written beside the points collide when two candidates score and cost alike (a checkpoint and its
merged folder always do) and a long endpoint name runs out of the axes.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from grooves.workflows.evals import Result

MARKERS = "osD^vPX<>*"


def chart(results: list[Result]) -> Figure:
    """The figure; raises ModuleNotFoundError without matplotlib."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    figure = Figure(figsize=(10, 4.6), layout="constrained")
    FigureCanvasAgg(figure)  # drawn off-screen, without pyplot's global state
    by_cost, by_latency = figure.subplots(1, 2)
    handles = {}
    for axis, attribute, label in ((by_cost, "cost_per_1k", "cost per 1,000 tasks ($)"),
                                   (by_latency, "latency_p95", "p95 latency (s)")):
        for index, r in enumerate(results):  # one colour and marker per candidate in both charts
            x = getattr(r, attribute)
            if x is None or r.reward is None:  # no price, or every total failed: nothing to place
                continue
            handles[index] = axis.errorbar([x], [r.reward], yerr=[r.reward_se or 0], fmt=MARKERS[index % len(MARKERS)],
                                           capsize=3, color=f"C{index % 10}", label=r.name)
        axis.set_xlabel(label)
        axis.set_ylabel("reward (mean ± s.e.)")
        # Few ticks, each with its own short value (no "1e-4" offset text beside the axis label).
        axis.xaxis.set_major_locator(MaxNLocator(nbins=4))
        axis.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:.3g}"))
        axis.grid(alpha=0.3)
    by_cost.set_title("quality vs cost")
    by_latency.set_title("quality vs p95 latency")
    if handles:
        ordered = [handles[i] for i in sorted(handles)]
        figure.legend(ordered, [results[i].name for i in sorted(handles)], loc="outside lower center",
                      ncols=min(3, len(ordered)), frameon=False)
    return figure


def write_chart(results: list[Result], path: Path) -> bool:
    """Write the chart as a PNG; False without matplotlib."""
    try:
        figure = chart(results)
    except ModuleNotFoundError:
        return False
    figure.savefig(path, dpi=110)
    return True
