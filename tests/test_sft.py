"""SFT: the tokens of a transcript are the rollout's, the loss is on the assistant's tokens only,
a run resumes exactly, and RL continues from the SFT adapter itself."""

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from grooves.cli import app
from grooves.envs import load_env
from grooves.envs.rollout import Turn, run_states, start, trajectory
from grooves.policy import LoRA, Policy
from grooves.training.sft_data import render_transcript
from grooves.runs.store import read_metrics
from helpers import tiny_config

runner = CliRunner()


@pytest.fixture(scope="module")
def policy():
    return Policy.load("tiny")


def scripted(policy, turns):
    """``generate`` that writes the next scripted turn of each rollout, as a sampler would (text + EOS)."""
    position = {}

    def generate(prompts, budgets, pasts=None):
        out = []
        for prompt in prompts:
            k = position.get(len(prompts), 0)
            text = turns[k]
            ids = policy.tokenizer.encode(text, add_special_tokens=False) + [policy.end_of_turn_id]
            out.append(Turn(text, ids, [0.0] * len(ids), "stop"))
        position[len(prompts)] = position.get(len(prompts), 0) + 1
        return out

    return generate


def test_a_transcript_renders_to_the_rollouts_own_tokens(policy):
    env = load_env("helpdesk")
    task = next(t for t in env.tasks("train", 50) if t["kind"] == "refund")
    state = start(policy, env, task)
    run_states(policy, env, [state], scripted(policy, env.demonstrate(task)), 256)
    rolled = trajectory(env, state)
    assert state.finish == "answer" and rolled.metadata["env_scores"]["action"] == 1.0
    for messages in (rolled.messages, [{k: v for k, v in m.items() if k != "raw"} for m in rolled.messages]):
        rendered = render_transcript(policy, messages, env.tool_schemas())
        assert rendered.prompt_ids == rolled.prompt_ids
        assert rendered.completion_ids == rolled.completion_ids  # token by token
        assert rendered.completion_mask == rolled.completion_mask


def test_the_loss_mask_covers_exactly_the_assistant_turns(policy):
    messages = [{"role": "user", "content": "add 2"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"n\": 2}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "2"},
                {"role": "assistant", "content": "It is 2."}]
    example = render_transcript(policy, messages, [{"type": "function", "function": {"name": "add"}}])
    ids, mask = example.completion_ids, example.completion_mask
    spans, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    spans.append(current)
    eot = policy.end_of_turn_id
    assert [s[-1] for s in spans] == [eot, eot]  # each turn ends with its end-of-turn token, trained
    texts = [policy.tokenizer.decode(s[:-1]) for s in spans]
    assert texts == ['<tool_call>{"name": "add", "arguments": {"n": 2}}</tool_call>', "It is 2."]
    untrained = policy.tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    assert "<tool_response>\n2\n</tool_response>" in untrained and "It is 2." not in untrained


def write_chats(path, n=24):
    rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"Say the colour {c}."},
                                         {"role": "assistant", "content": f"The colour is {c}."}]}
            for i, c in enumerate(["red", "blue", "green", "gold"] * (n // 4))]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sft_config(tmp_path, steps=6, **extra):
    chats = write_chats(tmp_path / "chats.jsonl")
    lines = [f'name = "sft-run"', f"steps = {steps}", "batch_size = 4", '[model]', 'spec = "tiny"',
             "[lora]", "rank = 4", "[data]", f'source = "{chats}"', "heldout_fraction = 0.25",
             "[optim]", "learning_rate = 0.01", "micro_batch_size = 3", "[log]", "save_every = 2", "val_every = 3",
             "tensorboard = false"]
    path = tmp_path / "sft.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def adapter(run_dir, step):
    return load_file(str(run_dir / "checkpoints" / f"step-{step:04d}" / "adapter" / "adapter_model.safetensors"))


def test_sft_lowers_the_loss_and_resumes_to_the_same_adapter(tmp_path):
    runs = tmp_path / "runs"
    config = sft_config(tmp_path)
    straight = runner.invoke(app, ["sft", str(config), "--runs", str(runs), "--out", str(runs / "straight")])
    assert straight.exit_code == 0, straight.output
    rows = read_metrics(runs / "straight" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(7))
    assert rows[-1]["val/loss/sft"] < rows[0]["val/loss/sft"] - 0.3  # held-out loss at 0, 3 and 6 (5.50 -> 5.04)
    assert "step 6/6" in straight.output

    first = runner.invoke(app, ["sft", str(config), "--runs", str(runs), "--out", str(runs / "split"), "--steps", "2"])
    assert first.exit_code == 0, first.output
    again = runner.invoke(app, ["sft", str(config), "--runs", str(runs), "--out", str(runs / "split"), "--resume"])
    assert again.exit_code == 0 and "resuming split after step 2" in again.output
    for key, value in adapter(runs / "straight", 6).items():
        assert torch.allclose(value, adapter(runs / "split", 6)[key], atol=1e-6), key


def test_micro_batches_give_the_whole_batchs_loss_and_gradient(tmp_path):
    from grooves.training.sft import SFTConfig, SFTRun

    policy = Policy.load("tiny", lora=LoRA(rank=4), seed=0)
    rows = [json.loads(line) for line in write_chats(tmp_path / "c.jsonl").read_text().splitlines()]
    examples = [render_transcript(policy, r["messages"]) for r in rows[:5]]
    results = []
    for micro in (1, 5):
        config = SFTConfig(data={"source": "x"}, optim={"micro_batch_size": micro})
        run = SFTRun(config, policy, examples, [], tmp_path / f"m{micro}")
        run.optimizer.zero_grad()
        loss, tokens = run._loss(examples, backward=True)
        results.append((loss, [p.grad.clone() for p in run.params]))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-5)
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.allclose(a, b, atol=1e-6)


def test_rl_starts_from_the_sft_adapter_itself(tmp_path):
    runs = tmp_path / "runs"
    assert runner.invoke(app, ["sft", str(sft_config(tmp_path, steps=2)), "--runs", str(runs)]).exit_code == 0
    config = tiny_config(tmp_path, steps=1)
    text = config.read_text().replace('spec = "tiny"', 'spec = "tiny"\nadapter = "sft-run@2"')
    config.write_text(text.replace("rank = 4\nalpha = 8\ndropout = 0.1", "rank = 4"))
    from grooves.training import load_config
    from grooves.training.build import load_policy

    policy = load_policy(load_config(config), runs)
    from peft import get_peft_model_state_dict

    start = get_peft_model_state_dict(policy.model, save_embedding_layers=False)
    sft = adapter(runs / "sft-run", 2)
    assert set(start) == set(sft)  # the same adapter, not a new one on top
    for key in sft:
        assert torch.equal(start[key], sft[key]), key
    result = runner.invoke(app, ["train", str(config), "--runs", str(runs), "--quiet"])
    assert result.exit_code == 0, result.output
    trained = adapter(runs / "tiny-run", 1)
    assert set(trained) == set(sft) and any(not torch.equal(trained[k], sft[k]) for k in sft)


def test_sft_on_env_demonstrations_reports_heldout_env_success(tmp_path):
    path = tmp_path / "env.toml"
    path.write_text('name = "demo-sft"\nsteps = 1\nbatch_size = 2\nheldout_tasks = 2\nturn_tokens = 8\n'
                    '[model]\nspec = "tiny"\n[lora]\nrank = 2\n[data]\nsource = "env:helpdesk"\nlimit = 4\n'
                    '[log]\nval_size = 2\ntensorboard = false\n')
    result = runner.invoke(app, ["sft", str(path), "--runs", str(tmp_path / "runs")])
    assert result.exit_code == 0, result.output
    rows = read_metrics(tmp_path / "runs" / "demo-sft" / "metrics.jsonl")
    assert {"val/loss/sft", "val/success", "val/reward/total", "val/env/turns"} <= set(rows[0])


def test_bad_sft_input_is_exit_2(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[data]\nsource = "missing.jsonl"\n[model]\nspec = "tiny"\n')
    result = runner.invoke(app, ["sft", str(path), "--runs", str(tmp_path)])
    assert result.exit_code == 2 and "missing.jsonl does not exist" in result.output
    path.write_text('[data]\nsource = "x.jsonl"\nsorce = 1\n')
    result = runner.invoke(app, ["sft", str(path)])
    assert result.exit_code == 2 and "data.sorce: Extra inputs are not permitted" in result.output
