"""grooves eval says, before a candidate answers anything, when a held-out prompt is over the
model's context (it stops) or over the run's sampling.max_prompt_length (it warns)."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from grooves.cli import app
from grooves.policy import Policy
from grooves.progress import Reporter
from grooves.workflows import evals
from grooves.workflows.evals import Candidate, EvalConfig, EvalError, evaluate_candidates
from helpers import tiny_config

runner = CliRunner()


def long_prompts(tmp_path, chars: int):
    """The tiny run config, every task's text ``chars`` characters (bytes: tokens) long."""
    path = tiny_config(tmp_path)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{i}", "text": "ab" * (chars // 2), "limit": 6}) + "\n"
                             for i in range(24)))
    return path


def prompt_tokens(chars: int) -> int:
    return len(Policy.load("tiny").chat_ids([{"role": "user", "content": "Echo: " + "ab" * (chars // 2)}]))


def test_a_prompt_over_the_models_context_stops_eval_before_it_answers(tmp_path, monkeypatch):
    def answered(*args, **kwargs):
        raise AssertionError("a candidate answered before the prompts were checked")

    monkeypatch.setattr(evals, "heldout_groups", answered)
    tokens = prompt_tokens(2100)
    assert tokens > 2048  # the tiny model's context (max_position_embeddings)
    run = long_prompts(tmp_path, 2100)
    (tmp_path / "eval.toml").write_text(f'config = "{run.name}"\nlimit = 2\n[[candidates]]\nname = "base"\n'
                                        'model = "base"\n')
    result = runner.invoke(app, ["eval", str(tmp_path / "eval.toml"), "--runs", str(tmp_path / "runs"), "--quiet"])
    assert result.exit_code == 2, result.output
    assert ("candidate base: 2 of 2 held-out prompts are longer than the model's context; the longest, task "
            in result.output)
    assert f": the prompt is {tokens} tokens, over the model's context of 2048" in result.output
    assert "Traceback" not in result.output


def test_a_prompt_over_max_prompt_length_is_said_before_answering(tmp_path, monkeypatch):
    tokens = prompt_tokens(1100)
    assert 1024 < tokens <= 2048  # over sampling.max_prompt_length (default 1024), within the context
    log = io.StringIO()
    order = []
    real = evals.heldout_groups

    def answering(*args, **kwargs):
        order.append(("answer", log.getvalue().count("warning:")))
        return real(*args, **kwargs)

    monkeypatch.setattr(evals, "heldout_groups", answering)
    cfg = EvalConfig(config=str(long_prompts(tmp_path, 1100)), limit=2, latency_tasks=1,
                     candidates=[Candidate(name="base", model="base")])
    (result,) = evaluate_candidates(cfg, tmp_path, tmp_path / "runs",
                                    progress=Reporter(Console(file=log, width=300), enabled=False))
    assert result.tasks == 2
    warnings = [line for line in log.getvalue().splitlines() if line.startswith("warning:")]
    assert len(warnings) == 2 and order == [("answer", 2)]  # both said, before the first answer
    assert warnings[0].endswith(f": the prompt is {tokens} tokens, over sampling.max_prompt_length = 1024")
    assert warnings[0].startswith("warning: candidate base: task t")


def test_prompts_within_the_limits_say_nothing(tmp_path):
    policy = Policy.load("tiny")
    from grooves.training.config import load_config

    run_config = load_config(long_prompts(tmp_path, 100))
    heldout = evals.heldout_tasks(run_config, 3)
    assert evals.check_prompts(policy, run_config, heldout, "base") == []
    run_config.sampling.max_prompt_length = prompt_tokens(100) - 1
    assert len(evals.check_prompts(policy, run_config, heldout, "base")) == len(heldout[0][1]) == 3
    with pytest.raises(EvalError, match="3 of 3 held-out prompts are longer than the model's context"):
        _with_context(policy, prompt_tokens(100) - 1, lambda: evals.check_prompts(policy, run_config, heldout, "b"))


def _with_context(policy, context: int, call):
    """``call()`` with the model's ``max_position_embeddings`` set to ``context`` for its duration."""
    config = policy.causal_lm.config
    saved = config.max_position_embeddings
    config.max_position_embeddings = context
    try:
        return call()
    finally:
        config.max_position_embeddings = saved
