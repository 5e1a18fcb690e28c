"""The user's side: a scripted user and an LLM user (served on 127.0.0.1) answer text turns."""

import pytest

from grooves.envs.rollout import advance, start
from grooves.envs.base import Env, State, call_text, tool
from grooves.envs.replay import replay
from grooves.envs.users import LLMUser, ScriptedUser
from grooves.policy import Policy
from test_envs import fixed


class Counter(Env):
    name = "counter-test"
    weights = {"right": 1.0}

    def setup(self, state: State) -> None:
        state.data["count"] = 0

    @tool
    def add(self, state: State, n: int) -> int:
        """Add to the counter.

        Args:
            n: how much
        """
        state.data["count"] += n
        return state.data["count"]

    def tasks(self, split="train", n=None, seed=0):
        return [{"id": "c1", "prompt": "Count for me.", "user_turns": ["Add 2.", "Now add 3.", "Thanks!"],
                 "user_instructions": "You want the counter at 5."}]

    def score(self, state: State) -> dict[str, float]:
        return {"right": float(state.data["count"] == 5)}


def test_a_scripted_user_keeps_the_conversation_going_until_its_script_ends():
    env = Counter()
    env.user = ScriptedUser()
    turns = ["How much?", call_text("add", n=2), "Done. More?", call_text("add", n=3), "It is 5.", "Bye."]
    result = replay(env, env.tasks()[0], turns)
    assert [m["role"] for m in result.messages] == ["user", "assistant", "user", "assistant", "tool", "assistant",
                                                    "user", "assistant", "tool", "assistant", "user", "assistant"]
    assert [m["content"] for m in result.messages if m["role"] == "user"][1:] == ["Add 2.", "Now add 3.", "Thanks!"]
    assert result.finish == "answer" and result.scores == {"right": 1.0} and result.counters["user_turns"] == 3
    without = Counter()  # no user: the first text turn is the answer
    assert replay(without, without.tasks()[0], turns).turns == 1


def test_user_turns_are_env_tokens_in_a_rollout():
    policy = Policy.load("tiny")
    env = Counter()
    env.user = ScriptedUser()
    state = start(policy, env, env.tasks()[0])
    advance(policy, env, [state], fixed(policy, "How much?"), 64)
    inserted = [i for i, m in zip(state.tokens.ids, state.tokens.mask) if m == 0]
    assert "Add 2." in policy.tokenizer.decode(inserted)  # the user's words, never trained on
    assert not env.is_done(state) and state.turns == 1


def test_an_llm_user_on_a_served_model_sees_the_conversation_from_its_side():
    from openai import OpenAI

    from grooves.serve.app import ServerThread, build_server, create_app

    with ServerThread(create_app(build_server("tiny"))) as server:
        env = Counter()
        env.user = LLMUser(server.base_url, "tiny", max_tokens=8, temperature=1.0, seed=7)  # greedy tiny says "\n"
        result = replay(env, env.tasks()[0], ["Hello! What can I do for you?", "Anything else?"])
        said = [m["content"] for m in result.messages if m["role"] == "user"]
        assert len(said) == 3 and result.counters["user/llm_calls"] == 2
        # What the user said is what the served model answers to the flipped conversation.
        flipped = [{"role": "system", "content": env.user.instructions + "\n\nYour situation: You want the counter at 5."},
                   {"role": "assistant", "content": "Count for me."},
                   {"role": "user", "content": "Hello! What can I do for you?"}]
        direct = OpenAI(base_url=server.base_url, api_key="none").chat.completions.create(
            model="tiny", messages=flipped, temperature=1.0, max_tokens=8, seed=7)
        assert said[1] == direct.choices[0].message.content.strip()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_reusing_the_kv_cache_across_turns_gives_the_same_tokens_and_logprobs(temperature):
    import torch

    from grooves.envs.rollout import env_groups, sampler_generate

    policy = Policy.load("tiny")
    env = Counter(max_turns=4)
    env.user = ScriptedUser()
    trajectories = {}
    for reuse in (False, True):
        generator = torch.Generator().manual_seed(3)
        generate = sampler_generate(policy, temperature, generator=generator, reuse_kv=reuse)
        groups = env_groups(policy, env, env.tasks() * 2, 2, generate, 12)  # 2 tasks x 2 rollouts
        trajectories[reuse] = [t for g in groups for t in g.trajectories]
    for plain, reused in zip(trajectories[False], trajectories[True]):
        assert plain.metadata["state"]["turns"] == 4  # the user kept it going: 3 turns on a cache
        assert reused.completion_ids == plain.completion_ids and reused.completion_mask == plain.completion_mask
        assert reused.logprobs == pytest.approx(plain.logprobs, abs=1e-4)


def test_a_turn_keeps_its_kv_for_the_next_and_drops_it_when_done():
    from grooves.envs.rollout import sampler_generate

    policy = Policy.load("tiny")
    env = Counter(max_turns=2)
    env.user = ScriptedUser()
    state = start(policy, env, env.tasks()[0])
    generate = sampler_generate(policy, 0.0)
    advance(policy, env, [state], generate, 6)
    assert state.past.length == len(state.tokens.prompt_ids) + 6 - 1  # the prompt and the turn but its last token
    advance(policy, env, [state], generate, 6)
    assert env.is_done(state) and state.past is None
