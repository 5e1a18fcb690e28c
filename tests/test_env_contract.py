"""The env contract carries someone else's benchmark: tools from JSON schemas, an argument named
``state``, and the env's own bugs counted apart from the model's mistakes."""

import json

import pytest

from grooves.envs.base import Env, State, Tool, call_text, tool
from grooves.envs.replay import replay

ADDRESS_SCHEMA = {"type": "function", "function": {
    "name": "modify_address", "description": "Change the user's address.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["user_id", "state", "zip"],
                   "properties": {"user_id": {"type": "string"}, "state": {"type": "string"},
                                  "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}


class Shop(Env):
    name = "shop-test"
    weights = {"moved": 1.0}

    def setup(self, state: State) -> None:
        state.data["users"] = {"u1": {"state": "NY", "zip": "10001"}}

    def extra_tools(self) -> list[Tool]:
        def modify_address(state: State, arguments: dict) -> dict:
            state.data["users"][arguments["user_id"]].update(state=arguments["state"], zip=arguments["zip"])
            return state.data["users"][arguments["user_id"]]

        def broken(state: State, arguments: dict, needs_more) -> str:  # the env author's mistake
            return "never"

        return [Tool.from_schema(ADDRESS_SCHEMA, modify_address),
                Tool.from_schema({"name": "broken", "parameters": {"type": "object", "properties": {}}}, broken)]

    @tool
    def lookup(self, ctx: State, state: str) -> list[str]:
        """Users who live in a US state.

        Args:
            state: two-letter code, e.g. NY
        """
        return [uid for uid, user in ctx.data["users"].items() if user["state"] == state]

    def tasks(self, split="train", n=None, seed=0):
        return [{"id": "t1", "prompt": "I moved to CA 94103."}]

    def score(self, state: State) -> dict[str, float]:
        return {"moved": float(state.data["users"]["u1"] == {"state": "CA", "zip": "94103"})}


def test_a_schema_tool_with_a_state_argument_runs_and_is_validated():
    env = Shop()
    assert env.tools_by_name["modify_address"].schema() == ADDRESS_SCHEMA  # offered to the model as given
    turns = [call_text("modify_address", user_id="u1", state="CA", zip="9410"),  # a bad zip: the model's error
             call_text("modify_address", user_id="u1", state="CA", zip="94103"),
             call_text("lookup", state="CA"), "Done."]
    result = replay(env, env.tasks()[0], turns)
    assert result.scores == {"moved": 1.0}
    tool_replies = [m["content"] for m in result.messages if m["role"] == "tool"]
    assert tool_replies[0].startswith("error: invalid arguments for modify_address: zip: '9410' does not match")
    assert json.loads(tool_replies[1]) == {"state": "CA", "zip": "94103"}
    assert json.loads(tool_replies[2]) == ["u1"]  # an @tool argument named state, the rollout state as ctx
    assert result.counters["tool_errors/bad_arguments"] == 1 and "tool_errors/env_bug" not in result.counters


def test_an_env_bug_is_counted_apart_from_the_models_mistakes():
    env = Shop()
    state = env.reset(env.tasks()[0])
    import asyncio

    reply = asyncio.run(env.respond(state, call_text("broken")))
    assert state.counters["tool_errors/env_bug"] == 1
    assert state.counters["tool_errors/raised"] == 0 and state.counters["tool_errors/bad_arguments"] == 0
    assert "an error in the environment" in reply[0]["content"]
    assert "missing a required argument: 'needs_more'" in state.data["env_bugs"][0]


def test_a_broken_schema_or_a_duplicate_tool_name_fails_when_the_env_is_built():
    from jsonschema.exceptions import SchemaError

    with pytest.raises(SchemaError):
        Tool.from_schema({"name": "x", "parameters": {"type": "objekt"}}, lambda state, arguments: None)

    class Twice(Shop):
        def extra_tools(self):
            return [Tool.from_schema({"name": "lookup"}, lambda state, arguments: None)]

    with pytest.raises(ValueError, match="two tools of one name"):
        Twice().tool_list


def test_class_level_settings_are_not_options():
    from grooves.envs import load_env

    for setting in ("success", "system_prompt", "prompt_budget"):
        with pytest.raises(ValueError, match=f"unknown option '{setting}'"):
            load_env("helpdesk", **{setting: "x"})
    assert load_env("helpdesk", max_turns=3).max_turns == 3


def test_an_env_that_needs_longer_prompts_than_the_run_allows_stops_at_start(tmp_path):
    from grooves.policy import LoRA, Policy
    from grooves.rewards.compose import EnvScore, Reward
    from grooves.training.config import ConfigError, parse_config
    from grooves.training.loop import TrainingRun
    from grooves.training.tasksets import TaskSet

    class Wordy(Shop):
        prompt_budget = 4096

    env = Wordy()
    task_set = TaskSet("", env.tasks(), [], Reward([EnvScore("moved")]), env=env)
    config = parse_config({"model": {"spec": "tiny"}, "sampling": {"max_prompt_length": 1024}})
    with pytest.raises(ConfigError, match="sampling.max_prompt_length: 1024 tokens is less than the 4096"):
        TrainingRun(config, Policy.load("tiny", lora=LoRA(rank=2)), [task_set], tmp_path / "run")


def test_a_skipped_long_prompt_is_shown_not_only_counted(tmp_path):
    from typer.testing import CliRunner

    from grooves.cli import app
    from helpers import tiny_config

    config = tiny_config(tmp_path, steps=1)
    config.write_text(config.read_text().replace("max_completion_length = 12", "max_completion_length = 12\nmax_prompt_length = 40"))
    result = CliRunner().invoke(app, ["train", str(config), "--runs", str(tmp_path / "runs"), "--quiet"])
    assert result.exit_code == 0, result.output
    assert "over sampling.max_prompt_length=40: skipped" in " ".join(result.output.split())


ORDERS = {"#1": {"status": "delivered"}}
ORDER_SCHEMA = {"type": "function", "function": {  # as published: no additionalProperties
    "name": "get_order_details", "description": "An order's details.",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}}}


def get_order_details(order_id: str) -> str:
    """A benchmark's own tool: failures come back as text, never raised."""
    return str(ORDERS[order_id]) if order_id in ORDERS else "Error: order not found"


class Bench(Env):
    name = "bench-test"

    def extra_tools(self) -> list[Tool]:
        def call_bench(state: State, arguments: dict) -> str:
            return get_order_details(**arguments)  # an extra argument would be a TypeError here

        return [Tool.from_schema(ORDER_SCHEMA, call_bench, is_error="Error:")]

    @tool(is_error=lambda result: isinstance(result, dict) and "error" in result)
    def cancel(self, state: State, order_id: str) -> dict:
        """Cancel an order."""
        return {"error": "only pending orders can be cancelled"}

    def tasks(self, split="train", n=None, seed=0):
        return [{"id": "t1", "prompt": "Where is #1?"}]

    def score(self, state: State) -> dict[str, float]:
        return {}


def test_errors_returned_as_text_are_counted_and_reach_the_model_as_returned():
    env = Bench()
    turns = [call_text("get_order_details", order_id="#9"), call_text("get_order_details", order_id="#1"),
             call_text("cancel", order_id="#1"), "Done."]
    result = replay(env, env.tasks()[0], turns)
    replies = [m["content"] for m in result.messages if m["role"] == "tool"]
    assert replies[0] == "Error: order not found"  # the text as the tool wrote it, nothing added
    assert replies[1] == "{'status': 'delivered'}"
    assert json.loads(replies[2]) == {"error": "only pending orders can be cancelled"}
    assert result.counters["tool_errors/returned"] == 2  # #9 and the refused cancel; #1 was fine
    assert result.counters["tool_calls"] == 3 and "tool_errors/raised" not in result.counters


def test_an_error_rule_is_a_predicate_or_prefixes_and_a_rule_that_raises_is_the_envs_bug():
    rule = Tool.from_schema(ORDER_SCHEMA, lambda state, arguments: None, is_error=("Error:", "FAILED")).is_error
    assert [rule(r) for r in ("Error: x", "  FAILED", "no Error:", {"Error:": 1}, None)] == [True, True, False,
                                                                                           False, False]
    with pytest.raises(TypeError, match="is_error must be"):
        Tool.from_schema(ORDER_SCHEMA, lambda state, arguments: None, is_error=("",))

    class Fussy(Bench):
        def extra_tools(self):
            return [Tool.from_schema(ORDER_SCHEMA, lambda state, arguments: "x", is_error=lambda result: 1 / 0)]

    env = Fussy()
    state = env.reset(env.tasks()[0])
    import asyncio

    reply = asyncio.run(env.respond(state, call_text("get_order_details", order_id="#1")))
    assert reply[0]["content"] == "x" and state.counters["tool_errors/env_bug"] == 1
    assert "tool_errors/returned" not in state.counters
    assert state.data["env_bugs"] == ["get_order_details: is_error: ZeroDivisionError: division by zero"]


def test_an_argument_the_schema_does_not_declare_is_the_models_error():
    env = Bench()
    turns = [call_text("get_order_details", order_id="#1", reason="curious"),
             call_text("cancel", order_id="#1", reason="curious"), "Done."]
    result = replay(env, env.tasks()[0], turns)
    replies = [m["content"] for m in result.messages if m["role"] == "tool"]
    assert replies[0] == ("error: invalid arguments for get_order_details: (arguments): Additional properties are "
                          "not allowed ('reason' was unexpected)")
    assert replies[1].startswith("error: invalid arguments for cancel: reason: Extra inputs are not permitted")
    assert result.counters["tool_errors/bad_arguments"] == 2 and "tool_errors/raised" not in result.counters
    assert env.tools_by_name["get_order_details"].schema() == ORDER_SCHEMA  # offered as published


def test_extra_arguments_pass_where_the_schema_or_the_env_author_allows_them():
    seen = []
    open_schema = {"name": "note", "parameters": {"type": "object", "properties": {"text": {"type": "string"}},
                                                  "additionalProperties": True}}
    allowed = Tool.from_schema(ORDER_SCHEMA, lambda state, arguments: seen.append(arguments), extra_arguments=True)
    assert allowed.validate({"order_id": "#1", "reason": "x"}) == {"order_id": "#1", "reason": "x"}
    assert Tool.from_schema(open_schema, print).validate({"text": "a", "more": 1}) == {"text": "a", "more": 1}
    patterned = {"name": "tag", "parameters": {"type": "object", "patternProperties": {"^x_": {"type": "integer"}}}}
    assert Tool.from_schema(patterned, print).validate({"x_a": 1, "other": "kept"}) == {"x_a": 1, "other": "kept"}
