"""Agents that learn: base, SFT, SFT+RL and RL on the helpdesk and search envs, compared on the
same held-out tasks.

For each env, one after another, each step skipped when its run has finished (a step cut
short resumes from its newest checkpoint):

1. SFT on a small set of the env's own demonstrations (``Env.demonstrate`` on training
   tasks, replayed and kept only at full score): ``grooves sft examples/agents/ENV-sft.toml``;
2. RL (GRPO) from that adapter: ``grooves train examples/agents/ENV-sft-rl.toml``
   (``[model] adapter = "ENV-sft@latest"``);
3. RL from the base model, the same config without the adapter:
   ``grooves train examples/agents/ENV-rl.toml``.

Both RL runs validate greedily on the same held-out tasks (search at steps 0 and 6,
helpdesk at 0 and 4), so step 0 of run 3 is the base model and step 0 of run 2 is the SFT
model. The report reads the per-task results from the runs' ``run.sqlite`` and writes
``docs/agents.md`` (the tables overall and per task kind, the commands, the phase times)
and ``docs/img/agents_success.png`` (held-out success vs RL step); text between
``<!-- notes -->`` and ``<!-- /notes -->`` in an existing docs/agents.md is kept.
It ends with one line per env:
``agents env=NAME base=X sft=Y sft_rl=Z rl=W paired_stderr=S seconds=T``, where
``paired_stderr`` is the standard error of the per-task difference SFT+RL - SFT.

Run from the repository root: ``python examples/agents/run.py`` (needs ``pip install -e
'.[examples]'`` for the plot). Never part of ``make test``: its whole run took 77.4 min on 2 CPU
cores on 2026-12-06, the helpdesk SFT 28.4 min of it (see docs/agents.md). ``--report``
rewrites the report from the runs there are, training nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from grooves.envs import load_env
from grooves.training.config import RunConfig, load_config
from grooves.training.sft import SFTConfig
from grooves.runs.store import RunStore, read_metrics

HERE = Path(__file__).resolve().parent
ENVS = ("search", "helpdesk")
PHASES = (("sft", "sft"), ("sft-rl", "train"), ("rl", "train"))  # config suffix, grooves command
MODELS = ("base", "sft", "sft_rl", "rl")
LABELS = {"base": "base model", "sft": "SFT", "sft_rl": "SFT + RL", "rl": "RL from the base"}
FORMAT_ERRORS = ("tool_errors/malformed", "tool_errors/unknown_tool", "tool_errors/bad_arguments")
NOTES = ("<!-- notes -->", "<!-- /notes -->")
LOCK = threading.Lock()


def grooves_command() -> str:
    """The grooves next to this interpreter (the venv's), else the one on PATH."""
    local = Path(sys.executable).parent / "grooves"
    found = str(local) if local.exists() else shutil.which("grooves")
    if not found:
        sys.exit("grooves is not installed in this environment (pip install -e .)")
    return found


def config_path(env: str, suffix: str) -> Path:
    return HERE / f"{env}-{suffix}.toml"


def load(env: str, suffix: str):
    return load_config(config_path(env, suffix), SFTConfig if suffix == "sft" else RunConfig)


def finished(run_dir: Path, steps: int) -> bool:
    metrics = run_dir / "metrics.jsonl"
    return metrics.exists() and any(row["step"] >= steps for row in read_metrics(metrics))


def run_phase(env: str, suffix: str, command: str, runs: Path, threads: int | None, log) -> str:
    """One grooves command, resumed when its run folder exists; its wall time goes to timings.jsonl.
    With ``threads``, the command's torch uses that many threads. Returns "kept" (finished earlier),
    "ran" or "failed"."""
    config = load(env, suffix)
    run_dir = runs / config.name
    if finished(run_dir, config.steps):
        say(f"{config.name}: finished earlier, kept")
        return "kept"
    argv = [grooves_command(), command, os.path.relpath(config_path(env, suffix)),
            "--runs", str(runs)]
    if (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").glob("step-*")):
        argv.append("--resume")
    say(f"$ {' '.join(argv[1:])}" + (f"    (progress: {log.name})" if log else ""))
    variables = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    start = time.time()
    code = subprocess.call(argv, env=variables, stdout=log, stderr=subprocess.STDOUT if log else None)
    seconds = round(time.time() - start, 1)
    entry = {"env": env, "phase": suffix, "command": " ".join(argv[1:]), "seconds": seconds, "threads": threads,
             "exit_code": code, "started": datetime.fromtimestamp(start, UTC).isoformat(timespec="seconds")}
    with LOCK, (runs / "timings.jsonl").open("a") as handle:
        handle.write(json.dumps(entry) + "\n")
    if code != 0:
        say(f"{config.name}: grooves {command} exited with {code}; fix the cause and run this again "
            f"(finished steps are kept)")
        return "failed"
    say(f"{config.name}: done in {seconds / 60:.1f} min")
    return "ran"


def run_env(env: str, runs: Path, threads: int | None, to_file: bool) -> list[str]:
    """Each phase's outcome (see run_phase), stopping at the first that failed."""
    log = (runs / f"{env}.log").open("a") if to_file else None
    results = []
    try:
        for suffix, command in PHASES:
            results.append(run_phase(env, suffix, command, runs, threads, log))
            if results[-1] == "failed":
                break
        return results
    finally:
        if log:
            log.close()


def say(text: str) -> None:
    with LOCK:
        print(f"[{datetime.now().strftime('%H:%M:%S')}] {text}", flush=True)


# --- reading the results -----------------------------------------------------------------


@dataclass
class Outcome:
    """One held-out rollout, reduced to what the table shows."""

    success: float
    total: float
    calls: float  # tool-call attempts, well formed or not
    invalid: float  # attempts that were malformed, named no tool, or had invalid arguments


def outcomes(run_dir: Path, env, step: int) -> dict[str, Outcome]:
    """task id -> the held-out rollout a run validated at ``step``."""
    store = RunStore(run_dir)
    try:
        rows = store.read_trajectories(step, "val")
    finally:
        store.close()
    out = {}
    for _, trajectory in rows:
        scores, counters = trajectory.metadata["env_scores"], trajectory.metadata["state"]["counters"]
        out[trajectory.metadata["task_id"]] = Outcome(
            float(env.solved(scores)), trajectory.reward,
            counters.get("tool_calls", 0) + counters.get("tool_errors/malformed", 0),
            sum(counters.get(key, 0) for key in FORMAT_ERRORS))
    return out


def val_steps(run_dir: Path) -> list[int]:
    store = RunStore(run_dir)
    try:
        return store.trajectory_steps("val")
    finally:
        store.close()


def mean_se(values: list[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan
    return statistics.fmean(values), se


@dataclass
class EnvResult:
    env: str
    models: dict[str, dict[str, Outcome]]  # model -> task id -> outcome
    curves: dict[str, list[tuple[int, float, float]]]  # "sft_rl"/"rl" -> [(step, success, se)]
    seconds: float
    phase_seconds: dict[str, float]
    kinds: dict[str, str]  # task id -> its kind (the env's task["kind"])

    def success(self, model: str) -> float:
        return mean_se([o.success for o in self.models[model].values()])[0]

    def paired(self, kind: str | None = None) -> tuple[float, float, int]:
        """Mean and standard error of SFT+RL - SFT per task, over the tasks both validated (of
        ``kind`` only, when given)."""
        common = sorted(t for t in set(self.models["sft_rl"]) & set(self.models["sft"])
                        if kind is None or self.kinds.get(t) == kind)
        diffs = [self.models["sft_rl"][t].success - self.models["sft"][t].success for t in common]
        mean, se = mean_se(diffs)
        return mean, se, len(common)

    def line(self) -> str:
        _, se, _ = self.paired()
        values = " ".join(f"{m}={self.success(m):.3f}" for m in MODELS)
        return f"agents env={self.env} {values} paired_stderr={se:.3f} seconds={self.seconds:.0f}"


def read_env(env_name: str, runs: Path) -> EnvResult | None:
    names = {suffix: load(env_name, suffix).name for suffix, _ in PHASES}
    rl_dirs = {"sft_rl": runs / names["sft-rl"], "rl": runs / names["rl"]}
    if not all((d / "run.sqlite").exists() and val_steps(d) for d in rl_dirs.values()):
        return None
    env = load_env(env_name, **load(env_name, "rl").env.options)
    models, curves = {}, {}
    for key, run_dir in rl_dirs.items():
        steps = val_steps(run_dir)
        by_step = {step: outcomes(run_dir, env, step) for step in steps}
        curves[key] = [(step, *mean_se([o.success for o in by_step[step].values()])) for step in steps]
        models["sft" if key == "sft_rl" else "base"] = by_step[steps[0]]
        models[key] = by_step[steps[-1]]
    phase_seconds = {}  # a phase's newest successful run (an earlier config's runs stay in the file)
    timings = runs / "timings.jsonl"
    for line in timings.read_text().splitlines() if timings.exists() else []:
        entry = json.loads(line)
        if entry["env"] == env_name and entry.get("exit_code") == 0:
            phase_seconds[entry["phase"]] = entry["seconds"]
    kinds = {task["id"]: task["kind"] for task in env.tasks("heldout")}
    return EnvResult(env_name, models, curves, sum(phase_seconds.values()), phase_seconds, kinds)


# --- the report ----------------------------------------------------------------------------


def table(result: EnvResult) -> str:
    rows = ["| model | held-out success | total reward | tool calls / rollout | invalid calls / rollout |",
            "|---|---|---|---|---|"]
    for model in MODELS:
        outs = list(result.models[model].values())
        cells = []
        for field in ("success", "total", "calls", "invalid"):
            mean, se = mean_se([getattr(o, field) for o in outs])
            cells.append(f"{mean:.3f} ± {se:.3f}" if field in ("success", "total") else f"{mean:.2f} ± {se:.2f}")
        rows.append(f"| {LABELS[model]} | " + " | ".join(cells) + " |")
    mean, se, n = result.paired()
    rows.append("")
    rows.append(f"SFT + RL − SFT, paired over the same {n} held-out tasks: {mean:+.3f} ± {se:.3f} "
                f"({mean / se:.1f} standard errors)." if se and se > 0 else
                f"SFT + RL − SFT, paired over the same {n} held-out tasks: {mean:+.3f} (no variance).")
    return "\n".join(rows)


def kind_table(result: EnvResult) -> str:
    """Held-out success per task kind, and SFT+RL - SFT paired within the kind: RL must not buy
    one kind with another."""
    kinds = sorted({result.kinds.get(t, "?") for t in result.models["sft"]})
    rows = ["| kind | " + " | ".join(LABELS[m] for m in MODELS) + " | SFT + RL − SFT (paired) |",
            "|---|" + "---|" * (len(MODELS) + 1)]
    for kind in kinds:
        cells = []
        for model in MODELS:
            values = [o.success for t, o in result.models[model].items() if result.kinds.get(t, "?") == kind]
            cells.append(f"{sum(values):.0f}/{len(values)}")
        mean, se, n = result.paired(kind)
        rows.append(f"| {kind} | " + " | ".join(cells) + f" | {mean:+.3f} ± {se:.3f} ({n}) |")
    return "\n".join(rows)


def plot(results: list[EnvResult], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("no plot: matplotlib is missing (pip install -e '.[examples]')")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.6), squeeze=False)
    for ax, result in zip(axes[0], results):
        for key, style in (("sft_rl", "o-"), ("rl", "s--")):
            steps, means, ses = zip(*result.curves[key])
            ax.errorbar(steps, means, yerr=[0 if math.isnan(s) else s for s in ses], fmt=style, capsize=3,
                        label=LABELS[key])
        n = len(result.models["sft"])
        ax.set(title=f"{result.env} ({n} held-out tasks, greedy)", xlabel="RL step", ylabel="held-out success",
               ylim=(-0.02, 1.02))
        ax.set_xticks(sorted({step for key in ("sft_rl", "rl") for step, _, _ in result.curves[key]}))
        ax.grid(alpha=0.3)
        ax.legend(loc="center right")  # the curves sit near 1 and near 0
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def kept_notes(doc: Path) -> str:
    text = doc.read_text() if doc.exists() else ""
    if NOTES[0] in text and NOTES[1] in text:
        return text[text.index(NOTES[0]): text.index(NOTES[1]) + len(NOTES[1])]
    return f"{NOTES[0]}\n{NOTES[1]}"


def write_doc(results: list[EnvResult], doc: Path, image: Path, runs: Path) -> None:
    parts = [
        "# Agents that learn: SFT warm start, then RL",
        "",
        "The bundled SmolLM2-135M-Instruct never calls a tool on its own, so RL from the base model has",
        "nothing to reinforce. A few of the env's own expert transcripts (SFT) teach the tool format; RL",
        "then improves what the SFT model does. This page is written by `examples/agents/run.py`.",
        "",
        "```",
        "pip install -e '.[examples]'",
        "python examples/agents/run.py            # the whole comparison, both envs",
        "```",
        "",
        "It runs, per env (configs in `examples/agents/`):",
        "",
        "```",
    ]
    for result in results:
        for suffix, command in PHASES:
            parts.append(f"grooves {command} examples/agents/{result.env}-{suffix}.toml --runs {runs}")
    parts += ["```", "",
              "Both RL runs validate greedily on the same held-out tasks (at steps "
              + "; ".join(f"{val_schedule(r.env)} for {r.env}" for r in results) + "): step 0 of the",
              "RL-from-base run is the base model, step 0 of the SFT+RL run is the SFT model. ± is one",
              "standard error over tasks.", ""]
    for result in results:
        phases = ", ".join(f"{suffix} {result.phase_seconds.get(suffix, 0) / 60:.1f} min" for suffix, _ in PHASES)
        parts += [f"## {result.env}", "", table(result), "", "Held-out tasks solved, by kind:", "",
                  kind_table(result), "", f"Wall time: {result.seconds / 60:.1f} min ({phases}).", ""]
    total = whole_run(runs)
    if total:
        kept = total.get("kept")
        how = ("every phase run in it" if kept == 0 else
               f"{kept} phases finished earlier kept" if kept else "phases finished earlier kept")
        parts += [f"The newest invocation (envs {total['env']}, {total['jobs']} at a time, {how}) took "
                  f"{total['seconds'] / 60:.1f} min of wall time on this machine ({os.cpu_count()} CPU cores); "
                  "a phase's minutes above are its own wall time.", ""]
    parts += [f"![held-out success vs RL step]({image.relative_to(doc.parent).as_posix()})", "",
              "The machine-readable lines the example ends with:", "", "```"]
    parts += [result.line() for result in results]
    parts += ["```", "", kept_notes(doc), ""]
    doc.write_text("\n".join(parts))


def val_schedule(env: str) -> str:
    """An env's RL validation steps, from its SFT + RL config (its RL-from-base config agrees)."""
    config = load(env, "sft-rl")
    steps = list(range(0, config.steps + 1, config.log.val_every))
    return ", ".join(map(str, steps[:-1])) + f" and {steps[-1]}"


def whole_run(runs: Path) -> dict | None:
    """The newest timing of a whole training (every env), if any."""
    timings = runs / "timings.jsonl"
    entries = [json.loads(line) for line in timings.read_text().splitlines()] if timings.exists() else []
    return next((e for e in reversed(entries) if e["phase"] == "all"), None)


def report(envs: list[str], runs: Path, doc: Path, image: Path) -> None:
    results = [r for r in (read_env(env, runs) for env in envs) if r is not None]
    if not results:
        sys.exit(f"no finished runs under {runs} to report on")
    for result in results:
        print(f"\n{result.env}\n{table(result)}\n\n{kind_table(result)}")
    plot(results, image)
    write_doc(results, doc, image, runs)
    print(f"\nwrote {doc} and {image}\n")
    for result in results:
        print(result.line())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", default=",".join(ENVS), help="comma-separated envs (default: both)")
    parser.add_argument("--runs", type=Path, default=Path("runs/agents"), help="runs root (default runs/agents)")
    parser.add_argument("--doc", type=Path, default=Path("docs/agents.md"))
    parser.add_argument("--image", type=Path, default=Path("docs/img/agents_success.png"))
    parser.add_argument("--report", action="store_true", help="only rewrite the report from the runs there are")
    parser.add_argument("--jobs", type=int, default=1, help="envs trained at the same time, each with its share "
                        "of the CPU cores and its output in RUNS/ENV.log (default 1: one after another, "
                        "output here; the timings in docs/agents.md are for 1)")
    args = parser.parse_args()
    envs = [e for e in args.envs.split(",") if e]
    unknown = sorted(set(envs) - set(ENVS))
    if unknown:
        sys.exit(f"unknown env {', '.join(unknown)}; this example covers {', '.join(ENVS)}")
    args.runs.mkdir(parents=True, exist_ok=True)
    if not args.report:
        started = time.time()
        jobs = max(1, min(args.jobs, len(envs)))
        threads = max(1, (os.cpu_count() or 1) // jobs) if jobs > 1 else None
        with ThreadPoolExecutor(jobs) as pool:
            results = [r for per_env in pool.map(lambda env: run_env(env, args.runs, threads, jobs > 1), envs)
                       for r in per_env]
        seconds = round(time.time() - started, 1)
        say(f"training done in {seconds / 60:.1f} min")
        with (args.runs / "timings.jsonl").open("a") as handle:
            handle.write(json.dumps({"env": ",".join(envs), "phase": "all", "jobs": jobs, "seconds": seconds,
                                     "kept": results.count("kept")}) + "\n")
        if "failed" in results:
            sys.exit(1)
    report(envs, args.runs, args.doc, args.image)


if __name__ == "__main__":
    main()
