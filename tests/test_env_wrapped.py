"""The wrapped-benchmark example of docs/envs.md, run as printed: schemas over plain functions,
errors returned as text, an undeclared argument refused, the data store in state.resources."""

import asyncio
import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from grooves.cli import app
from grooves.envs import load_env
from grooves.envs.base import call_text
from grooves.envs.replay import replay
from grooves.envs.rollout import trajectory

DOC = Path(__file__).resolve().parents[1] / "docs" / "envs.md"


def doc_code() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    [code] = [b for b in blocks if b.startswith('"""retail.py:')]
    return code


@pytest.fixture
def env(tmp_path, monkeypatch):
    (tmp_path / "retail.py").write_text(doc_code())
    monkeypatch.chdir(tmp_path)
    return load_env("retail.py:Retail")


def expert(task) -> list[str]:
    """Look the order up, do the task's expected writes, answer."""
    order = "#" + task["id"]
    return ([call_text("get_order_details", order_id=order)]
            + [call_text(name, **arguments) for name, arguments in task["actions"]] + ["Done."])


def test_every_tasks_expected_actions_replay_at_full_score(env):
    tasks = env.tasks("train") + env.tasks("heldout")
    assert [t["id"] for t in env.tasks("heldout")] == ["W4", "W8", "W12"] and len(tasks) == 12  # n=None: all
    assert [replay(env, t, expert(t)).scores for t in tasks] == [{"outcome": 1.0}] * 12
    w1 = env.tasks("train")[0]
    wrong = [call_text("cancel_pending_order", order_id="#W1", reason="ordered by mistake"), "Done."]
    assert replay(env, w1, wrong).scores == {"outcome": 0.0}  # not the write the benchmark expects


def test_errors_returned_as_text_and_an_undeclared_argument_are_counted_as_documented(env):
    turns = [call_text("get_order_details", order_id="#W999"),
             call_text("cancel_pending_order", order_id="#W3", reason="no longer needed"),  # delivered
             call_text("cancel_pending_order", order_id="#W1", reason="no longer needed", refund=True),
             "Sorry, order #W3 was delivered."]
    result = replay(env, env.tasks("train")[2], turns)  # W3: the right outcome is no change
    replies = [m["content"] for m in result.messages if m["role"] == "tool"]
    assert replies[:2] == ["Error: order not found", "Error: only a pending order can be cancelled"]
    assert "Additional properties are not allowed ('refund' was unexpected)" in replies[2]
    assert result.counters["tool_errors/returned"] == 2 and result.counters["tool_errors/bad_arguments"] == 1
    assert "tool_errors/raised" not in result.counters and result.scores == {"outcome": 1.0}  # #W1 untouched


def test_a_snapshot_restores_the_store_and_a_trajectory_does_not_carry_it(env):
    state = env.reset(env.tasks("train")[0])
    asyncio.run(env.respond(state, call_text("cancel_pending_order", order_id="#W1", reason="no longer needed")))
    restored = env.restore(env.snapshot(state))
    assert restored.resources["store"] == state.resources["store"]
    assert restored.resources["store"]["orders"]["#W1"]["status"] == "cancelled"
    for live in (state, restored):
        asyncio.run(env.respond(live, "Cancelled."))
    assert restored.messages == state.messages and env.score(restored) == env.score(state) == {"outcome": 1.0}
    stored = json.dumps(trajectory(env, state).to_dict())
    assert len(json.dumps(state.resources["store"])) > 27_000 and len(stored) < 3_000


def test_env_try_runs_the_wrapped_benchmark(env):
    result = CliRunner().invoke(app, ["env", "try", "retail.py:Retail", "--model", "tiny", "--turn-tokens", "8",
                                      "-o", "max_tokens=8"])
    assert result.exit_code == 0, result.output
    assert "retail.py:Retail · task W4 · cut at the token budget (max_tokens = 8) after 1 turn" in result.output
