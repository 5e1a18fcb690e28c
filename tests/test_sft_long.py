"""SFT on long transcripts: ``data.max_seq_length`` cuts and skips what it says and counts it, an
example over the model's context is said before the first step, and a step runs the system
prompt its examples share once (not once per micro-batch) with the output head on trained tokens
only, for the same loss and gradient as the textbook full-logits computation."""

import json
import os

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from grooves.cli import app
from grooves.policy import LoRA, Policy
from grooves.runs.store import read_metrics
from grooves.training.sft_data import fit_examples, render_transcript
from grooves.types import Trajectory

runner = CliRunner()


def example(prompt: int, mask: list[int], task: str) -> Trajectory:
    ids = list(range(100, 100 + len(mask)))
    return Trajectory([], list(range(prompt)), ids, list(mask), [0.0] * len(mask), metadata={"task_id": task})


def test_max_seq_length_cuts_the_end_skips_what_keeps_no_trained_token_and_counts_it():
    examples = [example(4, [1, 1, 0, 0, 1, 1], "a"),  # 10 tokens: keeps 4 of 6, of them 2 trained; 2 trained lost
                example(3, [1, 1, 1], "b"),  # 6 tokens: whole
                example(8, [1, 1], "c"),  # the prompt alone fills the 8: skipped, 2 trained lost
                example(5, [0, 0, 0, 1], "d")]  # keeps 3 untrained tokens: skipped, 1 trained lost
    kept, fit = fit_examples(examples, 8, context=2048)
    assert [t.metadata["task_id"] for t in kept] == ["a", "b"]
    assert kept[0].completion_ids == [100, 101, 102, 103] and kept[0].completion_mask == [1, 1, 0, 0]
    assert len(kept[0].logprobs) == 4 and kept[1] is examples[1]
    assert examples[0].completion_ids == [100, 101, 102, 103, 104, 105]  # the input is left as it was
    assert (fit.examples, fit.cut, fit.skipped, fit.tokens_cut, fit.loss_tokens_cut, fit.longest) == (4, 1, 2, 2, 5, 10)
    assert fit.metrics("train") == {"train/examples_cut": 1.0, "train/examples_skipped": 2.0,
                                    "train/loss_tokens_cut": 5.0}
    assert fit.sentence("training examples", 8) == (
        "training examples: 1 of 4 cut to max_seq_length = 8 tokens (2 tokens, 5 of them trained), 2 skipped "
        "(the longest was 10 tokens)")

    kept, fit = fit_examples(examples, None, context=9)  # no limit: all kept, the two of 10 tokens said
    assert kept == examples and fit.over_context == 2 and fit.cut == fit.skipped == 0
    assert "2 of 4 are longer than the model's context of 9 tokens (the longest: 10)" in fit.sentence("x", None)
    assert fit_examples(examples, None, context=10)[1].sentence("x", None) is None
    with pytest.raises(ValueError, match="data.max_seq_length = 12 is over the model's context of 10 tokens"):
        fit_examples(examples, 12, context=10)


def write_chats(path, rows):
    path.write_text("".join(json.dumps({"id": f"c{i}", "messages": m}) + "\n" for i, m in enumerate(rows)))
    return path


def sft_toml(tmp_path, chats, extra=""):
    path = tmp_path / "sft.toml"
    path.write_text(f'name = "long"\nsteps = 1\nbatch_size = 2\n[model]\nspec = "tiny"\n[lora]\nrank = 2\n'
                    f'[data]\nsource = "{chats}"\nheldout_fraction = 0.25\n{extra}\n[log]\ntensorboard = false\n')
    return path


def test_sft_cuts_to_max_seq_length_says_so_and_logs_the_counts(tmp_path):
    policy = Policy.load("tiny")
    rows = [[{"role": "user", "content": f"Say colour {i}."}, {"role": "assistant", "content": "It is red."}]
            for i in range(8)]
    chats = write_chats(tmp_path / "chats.jsonl", rows)
    rendered = render_transcript(policy, rows[0])
    prompt, trained = len(rendered.prompt_ids), sum(rendered.completion_mask)
    assert trained == len(rendered.completion_ids) == 11  # "It is red." (10 bytes) + end of turn, all trained
    limit = prompt + 4  # every example keeps 4 of its 11 trained tokens
    result = runner.invoke(app, ["sft", str(sft_toml(tmp_path, chats, f"max_seq_length = {limit}")),
                                 "--runs", str(tmp_path / "runs")])
    assert result.exit_code == 0, result.output
    rows0 = read_metrics(tmp_path / "runs" / "long" / "metrics.jsonl")[0]
    train = int(rows0["train/examples_cut"])
    held = int(rows0["val/examples_cut"])
    assert train + held == 8 and train >= 1  # heldout_fraction splits the 8 rows by a hash of their ids
    assert rows0["train/examples_skipped"] == 0 and rows0["train/loss_tokens_cut"] == 7 * train
    assert rows0["val/loss_tokens_cut"] == 7 * held
    assert (f"training examples: {train} of {train} cut to max_seq_length = {limit} tokens ({7 * train} tokens, "
            f"{7 * train} of them trained), 0 skipped (the longest was {prompt + 11} tokens)") in result.output

    over = runner.invoke(app, ["sft", str(sft_toml(tmp_path, chats, "max_seq_length = 4096")),
                               "--runs", str(tmp_path / "runs2")])
    assert over.exit_code == 2
    assert "data.max_seq_length = 4096 is over the model's context of 2048 tokens" in over.output


def test_sft_says_before_the_first_step_when_examples_are_over_the_models_context(tmp_path):
    rows = [[{"role": "user", "content": "x" * (2100 if i < 2 else 10)}, {"role": "assistant", "content": "ok"}]
            for i in range(8)]
    chats = write_chats(tmp_path / "chats.jsonl", rows)
    result = runner.invoke(app, ["sft", str(sft_toml(tmp_path, chats)), "--runs", str(tmp_path / "runs"),
                                 "--steps", "1"])
    assert result.exit_code == 0, result.output
    said = [line for line in result.output.splitlines() if "longer than the model's context of 2048" in line]
    assert len(said) >= 1  # the two long rows: in the training or the held-out set, or both
    assert result.output.index(said[0]) < result.output.index("step 1/1")


def reference_loss(lm, examples: list[Trajectory]) -> torch.Tensor:
    """The textbook SFT loss: full logits at every position, log-softmax, the trained tokens' mean NLL."""
    total = sum(sum(t.completion_mask) for t in examples)
    loss = 0.0
    for t in examples:
        ids = torch.tensor([t.prompt_ids + t.completion_ids])
        logp = F.log_softmax(lm(input_ids=ids).logits.float(), dim=-1)[0]  # (L, V)
        start = len(t.prompt_ids)
        for k, (token, m) in enumerate(zip(t.completion_ids, t.completion_mask)):
            if m:
                loss = loss - logp[start + k - 1, token]
    return loss / total


def test_a_step_runs_the_shared_system_prompt_once_for_the_textbook_loss_and_gradient(tmp_path):
    from grooves.training.sft import SFTConfig, SFTRun

    policy = Policy.load("tiny", lora=LoRA(rank=4), seed=0)
    system = {"role": "system", "content": "You are a shop assistant. Policy: " + "be exact. " * 12}
    call = {"id": "c1", "type": "function", "function": {"name": "find", "arguments": "{\"q\": \"x\"}"}}
    rows = [[system, {"role": "user", "content": f"Order {i}?" + " please" * i},
             {"role": "assistant", "content": "", "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "c1", "content": "found: " + "item " * (40 if i == 4 else i + 1)},
             {"role": "assistant", "content": f"Order {i} ships."}] for i in range(5)]
    examples = [render_transcript(policy, r) for r in rows]
    prompt = min(len(t.prompt_ids) for t in examples)
    answer = len(examples[4].completion_mask) - examples[4].completion_mask[::-1].index(0)  # its last answer's start
    limit = len(examples[4].prompt_ids) + answer - 20  # the longest is cut inside its tool result, and trimmed
    config = SFTConfig(data={"source": "x", "max_seq_length": limit}, optim={"micro_batch_size": 2})
    run = SFTRun(config, policy, examples, [], tmp_path / "r")
    assert len(run.train) == 5 and sum(len(t.completion_ids) < len(e.completion_ids)
                                       for t, e in zip(run.train, examples)) == 1

    lm, shared = policy.causal_lm, len(os.path.commonprefix([t.prompt_ids for t in examples]))
    assert policy.tokenizer.decode(examples[0].prompt_ids[shared - 6: shared]) == "Order "  # the system prompt too
    embedded, headed = [], []
    hooks = [lm.get_input_embeddings().register_forward_hook(lambda m, i, o: embedded.append(tuple(i[0].shape))),
             lm.get_output_embeddings().register_forward_hook(lambda m, i, o: headed.append(i[0].shape[0]))]
    try:
        run.optimizer.zero_grad()
        loss, tokens = run._loss(run.train, backward=True)
    finally:
        for hook in hooks:
            hook.remove()
    grads = [p.grad.clone() for p in run.params]
    # the system prompt's tokens (and "<|im_start|>user\nOrder ") run once for the step's three micro-batches
    assert len(embedded) == 4 and embedded.count((1, shared)) == 1 and shared < prompt
    assert sum(headed) == tokens == sum(sum(t.completion_mask) for t in run.train)  # the head: trained tokens only

    run.optimizer.zero_grad()
    expected = reference_loss(lm, run.train)
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-5)
    for got, want in zip(grads, [p.grad for p in run.params]):
        assert torch.allclose(got, want, atol=1e-6)
    assert any(g.abs().sum() > 0 for g in grads)
