"""The report's figure: reward curves, guard pass rates and detector statistics of runs A and B.

matplotlib is an optional extra (``pip install 'grooves[examples]'``); it is imported here
only, so the rest of the report works without it.
"""

from __future__ import annotations

from pathlib import Path

from runs import RunData, offline_grounding_series

COLOURS = {"A": "tab:red", "B": "tab:blue"}


def _reward_panel(ax, runs: list[RunData], key: str, title: str) -> None:
    for run in runs:
        steps, values = run.series(f"reward/{key}")
        ax.plot(steps, values, color=COLOURS[run.label], lw=1.2, label=f"{run.label} train")
        steps, values = run.series(f"val/reward/{key}")
        ax.plot(steps, values, "o--", color=COLOURS[run.label], ms=4, lw=0.8, label=f"{run.label} held-out")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)


def _guard_panel(ax, runs: list[RunData]) -> None:
    for run in runs:
        for key, style in (("supported", "-"), ("grounded_terms", ":")):
            steps, values = run.series(f"reward/{key}")
            if steps:
                ax.plot(steps, values, style, color=COLOURS[run.label], lw=1.2, label=f"{run.label} {key}")
        if not run.series("reward/grounded_terms")[0]:
            steps, values = offline_grounding_series(run)
            ax.plot(steps, values, ":", color=COLOURS[run.label], lw=1.2,
                    label=f"{run.label} grounded_terms (offline)")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("guard pass rates (train samples)", fontsize=9)
    ax.legend(fontsize=7)


def _detector_panel(ax, runs: list[RunData]) -> None:
    for run in runs:
        for key, style in (("collapse", "-"), ("source_insensitivity", "--")):
            steps, values = run.series(f"alerts/{key}")
            ax.plot(steps, values, style, color=COLOURS[run.label], lw=1.2, label=f"{run.label} {key}")
        for alert in run.alerts:  # one tick per alert at the bottom of the panel
            ax.plot(alert["step"], -0.05 if run.label == "A" else -0.1, "|", color=COLOURS[run.label], ms=8)
    ax.set_title("detectors: collapse share, source margin (ticks: alerts)", fontsize=9)
    ax.legend(fontsize=7)


def plot(runs: list[RunData], out: Path) -> Path:
    """Four panels over training steps; written to ``out`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    _reward_panel(axes[0][0], runs, "hn_points", "reward/hn_points: predicted log(1 + points)")
    _reward_panel(axes[0][1], runs, "total", "reward/total (B: 0 when a guard vetoes)")
    _guard_panel(axes[1][0], runs)
    _detector_panel(axes[1][1], runs)
    for ax in axes[1]:
        ax.set_xlabel("step")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    fig.suptitle("Hacker News titles: A = reward model only, B = reward model + guards", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
