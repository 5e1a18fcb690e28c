"""Envs named by file (``my_env.py:Shop``), the complete env printed in docs/envs.md, and what
``grooves env try`` says while and after it runs."""

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from grooves.cli import app
from grooves.envs import env_class, load_env, start
from grooves.envs.rollout import advance, trajectory
from grooves.policy.policy import Policy
from test_envs import Notes, call, fixed

DOC = Path(__file__).resolve().parents[1] / "docs" / "envs.md"


def doc_env() -> str:
    """The code block of docs/envs.md that begins with the my_env.py docstring, as printed."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    [code] = [b for b in blocks if b.startswith('"""my_env.py:')]
    return code


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """A working directory holding my_env.py exactly as the doc prints it."""
    (tmp_path / "my_env.py").write_text(doc_env())
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture(scope="module")
def policy():
    return Policy.load("tiny")


def test_the_doc_env_is_about_40_lines_and_plays_as_documented(in_tmp, policy):
    assert 30 <= len(doc_env().splitlines()) <= 45
    env = load_env("my_env.py:Shop")
    assert [t["item"] for t in env.tasks("heldout")] == ["eggs", "flour"] and len(env.tasks("train", 6)) == 6
    task = env.tasks("heldout")[0]
    state = start(policy, env, task)
    script = [call("price", product="egg"), call("price", product="eggs"), "Eggs cost 4 euros."]
    for text in script:
        advance(policy, env, [state], fixed(policy, text), 256)
    t = trajectory(env, state)
    assert t.metadata["env_scores"] == {"correct": 1.0, "looked_up": 1.0}
    assert state.finish == "answer" and state.turns == 3 and state.counters["tool_errors/raised"] == 1
    assert "no product 'egg'; we sell: apple, bread" in state.messages[3]["content"]


def test_env_try_runs_the_doc_env_from_its_file_and_says_it_was_cut(in_tmp):
    result = CliRunner().invoke(app, ["env", "try", "my_env.py:Shop", "--model", "tiny", "--turn-tokens", "16",
                                      "-o", "max_tokens=8"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    progress = [line for line in lines if line.startswith(("loading: ", "rolling out: ", "scoring"))]
    assert progress == ["loading: model tiny", "rolling out: task eggs, turn 1 of at most 3",
                        "scoring"]
    summary = next(line for line in lines if line.startswith("my_env.py:Shop · task eggs"))
    assert summary == ("my_env.py:Shop · task eggs · cut at the token budget (max_tokens = 8) "
                       "after 1 turn · 8 model tokens")
    assert re.search(r"looked_up\s+│\s+0\.000\s+│\s+0\.25", result.output)


def test_ending_names_the_budget_that_cut_a_rollout(policy):
    from grooves.cli.envs import ending
    env = Notes(max_turns=2)
    state = start(policy, env, env.tasks(n=1)[0])
    for _ in range(2):
        advance(policy, env, [state], fixed(policy, call("count", owner="a")), 512)
    assert ending(env, trajectory(env, state).metadata["state"]) == \
        "cut at the turn budget (max_turns = 2) after 2 turns"
    assert ending(env, {"finish": "answer", "turns": 1}) == "ended by its answer after 1 turn"
    assert ending(env, {"finish": "answer", "turns": 2}, 64) == \
        "ended by its answer after 2 turns, that turn cut at --turn-tokens 64"


def test_a_one_step_training_run_on_the_doc_env_from_its_file(in_tmp):
    (in_tmp / "shop.toml").write_text('''
name = "shop"
steps = 1
[model]
spec = "tiny"
[env]
name = "my_env.py:Shop"
train_tasks = 4
heldout_tasks = 2
options = {max_tokens = 24}
[sampling]
max_completion_length = 12
[train]
group_size = 2
tasks_per_step = 2
[log]
val_size = 2
tensorboard = false
''')
    result = CliRunner().invoke(app, ["train", "shop.toml", "--runs", str(in_tmp / "runs"), "--quiet"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (in_tmp / "runs" / "shop" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[1]["reward/looked_up"] == 0.0  # random weights never write a valid price call
    assert 0.0 <= rows[1]["reward/correct"] <= 1.0 and rows[1]["env/turns"] >= 1
    assert (in_tmp / "runs" / "shop" / "checkpoints" / "step-0001" / "adapter" / "adapter_config.json").exists()


BROKEN = {
    "syntax.py": ("from grooves.envs import Env\n\nclass Shop(Env:\n    pass\n",
                  "syntax.py:3: syntax error: "),
    "imports.py": ("import not_a_module_anywhere\n", "ModuleNotFoundError: No module named 'not_a_module_anywhere'"),
    "raises.py": ("raise RuntimeError('no database')\n", "RuntimeError: no database"),
    "notenv.py": ("class Shop:\n    pass\n", "notenv.py:Shop is not a grooves Env class"),
}


@pytest.mark.parametrize("file", sorted(BROKEN))
def test_a_broken_env_file_is_one_error_line_for_try_and_train(file, tmp_path, monkeypatch):
    code, message = BROKEN[file]
    (tmp_path / file).write_text(code)
    monkeypatch.chdir(tmp_path)
    tried = CliRunner().invoke(app, ["env", "try", f"{file}:Shop", "--model", "tiny"])
    assert tried.exit_code == 2 and message in tried.output
    assert "Traceback" not in tried.output and len(tried.output.strip().splitlines()) == 1
    (tmp_path / "c.toml").write_text(f'[model]\nspec = "tiny"\n[env]\nname = "{file}:Shop"\n')
    trained = CliRunner().invoke(app, ["train", "c.toml", "--runs", str(tmp_path / "runs"), "--quiet"])
    assert trained.exit_code == 2 and f"env: " in trained.output and message in trained.output
    assert "Traceback" not in trained.output


def test_a_missing_env_file_and_a_missing_class_are_named():
    with pytest.raises(ValueError, match="env file nope.py does not exist"):
        env_class("nope.py:Shop")
    with pytest.raises(ValueError, match="has no attribute 'Nope'"):
        env_class(f"{Path(__file__).parent / 'test_envs.py'}:Nope")
    with pytest.raises(KeyError, match="or a class in a file: my_env.py:MyEnv"):
        env_class("shopp")


def test_env_try_says_when_the_answer_turn_ran_out_of_turn_tokens(in_tmp):
    """Random weights never stop within 12 tokens; the cut turn, read as the answer, is named."""
    result = CliRunner().invoke(app, ["env", "try", "my_env.py:Shop", "--model", "tiny", "--turn-tokens", "12"])
    assert result.exit_code == 0, result.output
    assert ("my_env.py:Shop · task eggs · ended by its answer after 1 turn, that turn cut at --turn-tokens 12 · "
            "12 model tokens") in result.output.splitlines()
