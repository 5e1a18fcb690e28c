"""A file-defined env's user from a config or ``env try --user``, and ``env try`` saying when a
first prompt is longer than a run, the env or the model allows."""

import pytest
from typer.testing import CliRunner

from grooves.cli import app
from grooves.envs import load_env, start
from grooves.envs.users import LLMUser, ScriptedUser, make_user
from grooves.policy.policy import Policy

TALK_PY = '''
from grooves.envs import Env


class Talk(Env):
    name = "talk"
    weights = {"talked": 1.0}
    system_prompt = "You help. " * REPEAT

    def tasks(self, split="train", n=None, seed=0):
        return [{"id": "t1", "prompt": "Hello.", "user_turns": ["Add 2.", "Now add 3.", "Thanks!"]}]

    def score(self, state):
        return {"talked": float(state.counters["user_turns"] > 0)}
'''


@pytest.fixture
def talk(tmp_path, monkeypatch):
    def write(repeat: int = 1) -> str:
        (tmp_path / "talk.py").write_text(TALK_PY.replace("REPEAT", str(repeat)))
        return "talk.py:Talk"

    monkeypatch.chdir(tmp_path)
    return write


def test_a_user_is_a_kind_or_a_table_and_a_bad_one_names_its_setting():
    assert isinstance(make_user("scripted"), ScriptedUser) and make_user({"kind": "scripted", "key": "k"}).key == "k"
    llm = make_user({"kind": "llm", "base_url": "http://127.0.0.1:9/v1", "model": "m", "temperature": 0.5})
    assert isinstance(llm, LLMUser) and llm.model == "m" and llm.sampling["temperature"] == 0.5
    for spec, message in [("robot", "user.kind: 'robot'; allowed: scripted, llm"),
                          ({"kind": "llm", "model": "m"}, "user.base_url: required when kind = 'llm'"),
                          ({"kind": "scripted", "keys": "x"}, "user.keys: not a setting when kind = 'scripted'; "
                                                              "allowed: key"),
                          (3, "user: 3 is neither a kind (scripted, llm) nor a table")]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            make_user(spec)


def test_load_env_and_the_config_take_a_user(talk):
    from grooves.training.config import parse_config

    env = load_env(talk(), user="scripted")
    assert isinstance(env.user, ScriptedUser) and load_env(talk()).user is None
    config = parse_config({"model": {"spec": "tiny"}, "env": {"name": "talk.py:Talk", "user": {
        "kind": "llm", "base_url": "http://127.0.0.1:9/v1", "model": "m"}}})
    assert config.env.user == {"kind": "llm", "base_url": "http://127.0.0.1:9/v1", "model": "m"}


def test_env_try_with_a_scripted_user_counts_its_turns(talk):
    """Random weights never write a tool call: each of the 2 turns is text, answered by the script."""
    result = CliRunner().invoke(app, ["env", "try", talk(), "--model", "tiny", "--turn-tokens", "4", "--user",
                                      "scripted", "-o", "max_turns=2"])
    assert result.exit_code == 0, result.output
    assert 'counters: {"user_turns": 2}' in result.output
    assert "cut at the turn budget (max_turns = 2) after 2 turns" in result.output
    bad = CliRunner().invoke(app, ["env", "try", talk(), "--model", "tiny", "--user", "{\"kind\": \"robot\"}"])
    assert bad.exit_code == 2 and "user.kind: 'robot'; allowed: scripted, llm" in bad.output


def test_env_try_says_when_the_prompt_is_over_a_runs_limit_and_stops_over_the_context(talk):
    policy = Policy.load("tiny")
    env = load_env(talk(40))
    tokens = len(start(policy, env, env.tasks()[0]).tokens.prompt_ids)
    assert 100 < tokens < 2048
    result = CliRunner().invoke(app, ["env", "try", talk(40), "--model", "tiny", "--turn-tokens", "4",
                                      "--max-prompt-length", "100", "-o", "max_turns=1"])
    assert result.exit_code == 0, result.output
    assert (f"warning: the prompt is {tokens} tokens, over sampling.max_prompt_length = 100 (--max-prompt-length): "
            f"a training run would skip this task") in " ".join(result.output.split())
    quiet = CliRunner().invoke(app, ["env", "try", talk(40), "--model", "tiny", "--turn-tokens", "4", "-o",
                                     "max_turns=1"])
    assert quiet.exit_code == 0 and "warning" not in quiet.output  # under the default 1024
    huge = CliRunner().invoke(app, ["env", "try", talk(1000), "--model", "tiny"])
    assert huge.exit_code == 2, huge.output
    assert "over the model's context of 2048" in huge.output and "rolling out" not in huge.output


def test_env_replay_with_a_scripted_user_plays_the_whole_conversation(talk, tmp_path):
    (tmp_path / "turns.json").write_text('["Hi.", "Sure.", "Done.", "Bye."]')
    args = ["env", "replay", talk(), "--task", "t1", "--turns", "turns.json"]
    result = CliRunner().invoke(app, args + ["--user", "scripted"])
    assert result.exit_code == 0, result.output
    assert "ended by its answer after 4 turns" in result.output and 'counters: {"user_turns": 3}' in result.output
    alone = CliRunner().invoke(app, args)  # no user: the first text turn is the answer
    assert alone.exit_code == 0 and "ended by its answer after 1 turn" in alone.output


def test_a_runs_env_gets_the_configs_user(talk):
    from grooves.training.build import env_task_set
    from grooves.training.config import ConfigError, parse_config

    config = parse_config({"model": {"spec": "tiny"}, "env": {"name": talk(), "user": "scripted"}})
    assert isinstance(env_task_set(config).env.user, ScriptedUser)
    bad = parse_config({"model": {"spec": "tiny"}, "env": {"name": talk(), "user": {"kind": "llm"}}})
    with pytest.raises(ConfigError, match="env: user.base_url: required when kind = 'llm'"):
        env_task_set(bad)
