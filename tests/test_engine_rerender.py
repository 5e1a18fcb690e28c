"""The bundled model's chat template and tool-call parsing agree between the trainer and the engine.

A multi-turn helpdesk rollout is sampled through a live ``grooves serve`` subprocess (the engine
sampler: token ids in, token ids out), then

- (a) the conversation's messages, re-rendered from scratch by the trainer's chat template (tools
  in the system prompt, calls and results as text), give back the very ids the trajectory trains
  on, turn by turn, and so does the SFT renderer (``render_transcript``);
- (b) the same messages sent to the server's ``/v1/chat/completions`` with the official openai
  client are rendered by the server to the same prompt ids (vLLM's ``return_token_ids`` ->
  ``prompt_token_ids``), the server samples the same turn, and the tool call in it parses to the
  same name and arguments on both sides.

The model: the bundled SmolLM2's tokenizer and chat template over a one-layer GPT-2 whose weights
are set so that it writes the env's own demonstration (three tool calls) at the positions where a
rollout of that task samples: its output depends only on the position (learned absolute position
embeddings, token embeddings and block outputs zero, the LM head reading each position's vector).
The bundled 135M model never calls a tool (docs/benchmarks.md), and training the tiny one to do so
takes minutes on this CPU. Nothing about the server, the template or the parser is stood in for.
"""

from __future__ import annotations

import json

import openai
import pytest
import torch

from grooves.envs.helpdesk import Helpdesk
from grooves.envs.rollout import Turn, env_groups, run_states, sampler_generate, start, trajectory
from grooves.policy import Policy
from grooves.policy.engine import EnginePolicy, EngineSampler
from grooves.policy.models import BUNDLED_DEFAULT, bundled_folder
from grooves.policy.tools import parse_tool_calls
from grooves.training.sft_data import render_transcript
from test_engine_sampler import free_port, start_server, stop_server

WIDTH = 192  # the model's width: more than the model tokens of the demonstration (orthogonal positions)


def scripted(policy: Policy, turns: list[str]):
    """A ``Generate`` writing ``turns`` in order, as the model would (text, then the end of turn)."""
    def generate(prompts, budgets, pasts=None):
        text = turns[len(done)]
        done.append(text)
        ids = policy.tokenizer.encode(text, add_special_tokens=False) + [policy.end_of_turn_id]
        return [Turn(text, ids, [0.0] * len(ids), "stop")]

    done: list[str] = []
    return generate


def write_agent(folder, env: Helpdesk, task: dict) -> Policy:
    """The bundled tokenizer with a GPT-2 that writes ``env.demonstrate(task)`` at a rollout's positions,
    saved in ``folder``; the trainer's policy of it."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(bundled_folder(BUNDLED_DEFAULT))
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=WIDTH, n_layer=1, n_head=2, n_positions=2048,
                        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id)
    model = GPT2LMHeadModel(config).eval()
    policy = Policy(model, tokenizer, str(folder))
    state = start(policy, env, task)
    run_states(policy, env, [state], scripted(policy, env.demonstrate(task)), turn_tokens=256)
    done = trajectory(env, state)
    ids = done.prompt_ids + done.completion_ids
    positions = [len(done.prompt_ids) + i - 1 for i, m in enumerate(done.completion_mask) if m]
    assert len(positions) < WIDTH
    generator = torch.Generator().manual_seed(0)
    centre = torch.eye(WIDTH) - 1.0 / WIDTH  # LayerNorm keeps zero-mean vectors' directions
    keys = torch.linalg.qr(centre @ torch.randn(WIDTH, len(positions), generator=generator)).Q.T
    with torch.no_grad():
        gpt = model.transformer
        gpt.wte.weight.zero_()
        spare = (centre @ torch.randn(WIDTH, config.n_positions, generator=generator)).T
        gpt.wpe.weight.copy_(spare / spare.norm(dim=1, keepdim=True))
        for block in gpt.h:
            for out in (block.attn.c_proj, block.mlp.c_proj):
                out.weight.zero_()
                out.bias.zero_()
        model.lm_head.weight.zero_()
        for key, position in zip(keys, positions):
            gpt.wpe.weight[position] = key
            model.lm_head.weight[ids[position + 1]] += 30.0 / WIDTH ** 0.5 * key  # logit 30 after ln_f
    tokenizer.save_pretrained(folder)
    model.save_pretrained(folder)
    return policy


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    """(trainer policy, env, task, server URL, served model name)."""
    env = Helpdesk()
    task = next(t for t in env.tasks("train") if t["kind"] == "address")
    folder = tmp_path_factory.mktemp("agent") / "model"
    policy = write_agent(folder, env, task)
    runs, port = tmp_path_factory.mktemp("rerender-runs"), free_port()
    proc = start_server(runs, port, model=str(folder))
    url = f"http://127.0.0.1:{port}/v1"
    try:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        served = client.models.list().data[0].id
        yield policy, env, task, client, served
    finally:
        stop_server(proc)


def calls(tool_calls) -> list[tuple[str, dict]]:
    """(name, arguments) of OpenAI tool calls, as dicts or as the openai client's objects."""
    out = []
    for call in tool_calls or []:
        function = call["function"] if isinstance(call, dict) else call.function
        name, arguments = (function["name"], function["arguments"]) if isinstance(function, dict) else (
            function.name, function.arguments)
        out.append((name, json.loads(arguments)))
    return out


def test_a_helpdesk_rollout_through_the_server_rerenders_to_the_ids_it_trains_on(agent):
    policy, env, task, client, served = agent
    from transformers import AutoTokenizer

    served_template = AutoTokenizer.from_pretrained(policy.base_spec).chat_template  # what the server loaded
    assert served_template == policy.tokenizer.chat_template and not policy.native_tools  # bundled's: tools fall back
    engine = EngineSampler(policy, client, served)
    view = EnginePolicy(policy, engine)
    [group] = env_groups(view, env, [task], 1, sampler_generate(view, 1.0, 1.0, torch.Generator().manual_seed(0)),
                         turn_tokens=128)
    [rollout] = group.trajectories
    state = rollout.metadata["state"]
    assert state["finish"] == "answer" and state["turns"] == 3 and state["counters"]["tool_calls"] == 3
    assert state["counters"].get("prefix_breaks", 0) == 0 and not any(k.startswith("tool_errors") for k in state["counters"])
    ids = rollout.prompt_ids + rollout.completion_ids  # what the trainer trains on
    tools = env.tool_schemas()
    messages = rollout.messages
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]

    # (a) the trainer's template, from the messages alone, turn by turn
    assert policy.chat_ids(messages[:turns[0]], tools=tools) == rollout.prompt_ids
    starts = []
    for i in turns:
        before = policy.chat_ids(messages[:i], tools=tools)
        assert ids[:len(before)] == before, f"turn at message {i}: the re-rendered conversation differs"
        starts.append(len(before))
    last = messages[:turns[-1] + 1]
    whole = policy.tokenizer.encode(policy.chat_text(last, tools=tools, add_generation_prompt=False),
                                    add_special_tokens=False)
    assert whole[:len(ids)] == ids and policy.tokenizer.decode(whole[len(ids):]).strip() == ""
    sft = render_transcript(policy, last, tools)
    assert sft.prompt_ids + sft.completion_ids == ids and sft.completion_mask == rollout.completion_mask

    # (b) the server renders the same messages to the same ids, samples the same turn, parses the same call
    ends = starts[1:] + [len(ids)]
    for i, begin, end in zip(turns, starts, ends):
        sent = [{k: v for k, v in m.items() if k != "raw"} for m in messages[:i]]
        reply = client.chat.completions.create(model=served, messages=sent, tools=tools, max_tokens=96,
                                               temperature=0, extra_body={"return_token_ids": True})
        assert reply.model_extra["prompt_token_ids"] == ids[:begin]
        [choice] = reply.choices
        sampled = choice.model_extra["token_ids"]
        turn = ids[begin:begin + len(sampled)]
        assert sampled == turn and sampled[-1] == policy.end_of_turn_id and begin + len(sampled) <= end
        ours = parse_tool_calls(policy.decode(turn), env.parser)
        assert choice.finish_reason == "tool_calls" and not ours.errors
        assert calls(choice.message.tool_calls) == calls(messages[i]["tool_calls"]) == [
            (c.name, c.arguments) for c in ours.tool_calls]
    assert [calls(messages[i]["tool_calls"])[0][0] for i in turns] == ["find_customer", "update_address", "reply"]
