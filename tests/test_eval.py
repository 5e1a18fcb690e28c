"""grooves eval: the base, a trained adapter, its merged folder and a grooves serve endpoint on
the same held-out tasks of a tiny run; numbers checked against the run's own held-out metrics."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from grooves.cli import app
from grooves.training.evals import Candidate, EvalConfig, evaluate_candidates, mean_se, percentile
from helpers import tiny_config

runner = CliRunner()
RUN = "tiny-run"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A 2-step tiny run (seed 0, so the served base is the run's base) with a checkpoint at 2,
    and that checkpoint merged into a plain model folder."""
    from grooves.serve import merge_checkpoint
    from grooves.training.api import run_config
    from grooves.training.config import load_config

    folder = tmp_path_factory.mktemp("eval")
    path = tiny_config(folder, steps=2)
    path.write_text(path.read_text().replace("seed = 3", "seed = 0"))
    runs = folder / "runs"
    run_config(load_config(path), runs=runs, progress=False)
    merge_checkpoint(f"{RUN}@2", folder / "merged", runs=runs)
    return runs


def heldout_reward(runs, step: int) -> float:
    rows = [json.loads(line) for line in (runs / RUN / "metrics.jsonl").read_text().splitlines()]
    return next(r["val/reward/total"] for r in rows if r["step"] == step and "val/reward/total" in r)


def test_local_candidates_match_the_runs_heldout_metrics(root):
    cfg = EvalConfig(run=RUN, latency_tasks=2, candidates=[
        Candidate(name="base", model="base"), Candidate(name="trained", model=f"{RUN}@2", price_in=1.0, price_out=2.0),
        Candidate(name="merged", model=str(root.parent / "merged"))])
    base, trained, merged = evaluate_candidates(cfg, runs=root)
    assert base.reward == pytest.approx(heldout_reward(root, 0))  # step 0 validates the untrained base
    assert trained.reward == pytest.approx(heldout_reward(root, 2))
    assert merged.reward == pytest.approx(trained.reward, abs=1e-6)
    assert trained.tasks == 4 and trained.failed == 0 and set(trained.components) == {"vowels", "short"}
    assert trained.latency_p50 > 0 and trained.latency_p95 >= trained.latency_p50 and trained.tokens_per_s > 0
    # Cost per 1,000 tasks by hand: $1 per million prompt tokens, $2 per million completion tokens.
    assert trained.cost_per_1k == pytest.approx(1000 * (trained.prompt_tokens + 2 * trained.completion_tokens) / 1e6)
    assert base.cost_per_1k is None and trained.tokens_per_1k == 1000 * (trained.prompt_tokens +
                                                                           trained.completion_tokens)


def test_an_endpoint_candidate_through_grooves_serve(root, tmp_path):
    from grooves.serve.app import ServerThread, build_server, create_app

    server = build_server("tiny", runs=root)
    try:
        with ServerThread(create_app(server)) as thread:
            config = tmp_path / "eval.toml"
            config.write_text(f'name = "t"\nrun = "{RUN}"\nlatency_tasks = 1\n'
                              f'[[candidates]]\nname = "trained"\nmodel = "{RUN}@2"\n'
                              f'[[candidates]]\nname = "served"\nmodel = "{RUN}@2"\nendpoint = "{thread.base_url}"\n'
                              f'price_in = 0.15\nprice_out = 0.6\n')
            result = runner.invoke(app, ["eval", str(config), "--runs", str(root), "--out", str(tmp_path / "out")])
    finally:
        server.engine.halt()
    assert result.exit_code == 0, result.output
    assert "served" in result.output and "p95 s" in result.output
    report = json.loads((tmp_path / "out" / "eval.json").read_text())
    local, served = report["candidates"]
    assert served["kind"] == "endpoint" and served["tasks"] == 4 and served["prompt_tokens"] > 0
    assert served["reward"] == pytest.approx(local["reward"], abs=1e-6)  # the same adapter, greedy, either way
    assert served["cost_per_1k"] == pytest.approx(
        1000 * (0.15 * served["prompt_tokens"] + 0.6 * served["completion_tokens"]) / 1e6)
    assert (tmp_path / "out" / "eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_statistics_by_hand():
    mean, se = mean_se([1.0, 2.0, 3.0, math.nan])  # NaN (failed) left out; stdev 1, n 3
    assert (mean, se) == (2.0, pytest.approx(1 / math.sqrt(3)))
    assert mean_se([math.nan]) == (None, None) and mean_se([0.5]) == (0.5, 0.0)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 95) == pytest.approx(3.85)
    assert percentile([], 50) is None


@pytest.mark.parametrize(("body", "message"), [
    ('name = "x"\n[[candidates]]\nname = "a"\nmodel = "base"\n', "exactly one of run"),
    ('run = "r"\nconfig = "c.toml"\n[[candidates]]\nname = "a"\nmodel = "base"\n', "exactly one of run"),
    ('run = "r"\n[[candidates]]\nname = "a"\nmodel = "base"\ncolour = 1\n', "candidates.0.colour"),
    ('run = "nope"\n[[candidates]]\nname = "a"\nmodel = "base"\n', "run 'nope' has no config.toml"),
])
def test_bad_configs_exit_2_with_a_message(tmp_path, body, message):
    path = tmp_path / "eval.toml"
    path.write_text(body)
    result = runner.invoke(app, ["eval", str(path), "--runs", str(tmp_path / "runs")])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
