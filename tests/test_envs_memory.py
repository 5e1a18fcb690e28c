"""Memory of an agent RL step (issue 28, part 4): a rollout's KV is held once, the trainer's
forward keeps a bounded number of tokens' activations, and the benchmark's quick mode runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grooves import algorithms
from grooves.policy import LoRA, Policy
from grooves.policy.decoding import Row, decode
from grooves.training.config import OptimConfig
from grooves.training.datums import Datum
from grooves.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]


def test_a_decode_consumes_the_past_it_reads_and_its_cache_is_allocated_once():
    """The next turn copies the previous turn's KV into its batch and drops it from the ``Past``
    (held once, not twice); the batch cache has room for the decode from the start."""
    from grooves.policy import prefill
    from grooves.policy.rows import _Model

    policy = Policy.load("tiny")
    prompt = policy.chat_ids([{"role": "user", "content": "count to three"}])
    first = decode(policy, [Row(prompt, temperature=0, max_new_tokens=5, ignore_eos=True, keep_past=True)])[0]
    past = first.past
    assert past.length == len(prompt) + 5 - 1
    follow = prompt + first.token_ids + policy.continuation_ids([{"role": "user", "content": "more"}])
    row = Row(follow, temperature=0, max_new_tokens=7, past=past)
    with torch.inference_mode():
        cache, _, attention, _ = prefill._prefill(_Model(policy, [row]), policy.device, [row], room=7)
    assert all(layer is None for layer in past.layers)  # consumed: its tensors are gone
    with pytest.raises(ValueError, match="consumed"):
        past.length  # noqa: B018
    rest = len(follow) - (len(prompt) + 4)
    for layer in cache.layers:  # (1, heads, used + room, dim), the prompt's rest written in place
        assert layer._keys.shape[2] == len(prompt) + 4 + rest + 7 and layer.keys.shape[2] == len(follow)
    assert attention.shape == (1, len(follow))


def datum(seed: int, prompt: int, completion: int) -> Datum:
    """A group's completion: the prompt is the same for every seed, the rest is the seed's."""
    gen = torch.Generator().manual_seed(seed)
    sequence = list(range(10, 10 + prompt)) + torch.randint(3, 200, (completion,), generator=gen).tolist()
    on = [0.0] * (prompt - 1) + [1.0] * completion
    advantage = float(torch.randn(1, generator=gen))
    return Datum(sequence[:-1], sequence[1:], weights=on, advantages=[advantage * w for w in on],
                 logprobs=[0.0] * (prompt - 1) + (-torch.rand(completion, generator=gen) - 2).tolist())


def test_a_micro_batch_over_the_token_budget_runs_in_parts_with_the_same_gradient():
    """4 rows of one prompt, 10 tokens each (9 positions + the last target), in one micro-batch:
    a budget of 20 tokens runs them 2 by 2 (2 x 10 = 20 fits, 3 x 10 = 30 does not); a budget
    of 12 runs them one by one. The loss and the gradient are the same sums as in one forward."""
    datums = [datum(seed, prompt=4, completion=6) for seed in range(4)]
    results = {}
    for budget, parts in ((10_000, [4]), (20, [2, 2]), (12, [1, 1, 1, 1])):
        policy = Policy.load("tiny", lora=LoRA(rank=4), seed=0)
        trainer = Trainer(policy, algorithms.grpo(), OptimConfig(micro_batch_size=4), forward_tokens=budget)
        seen, real = [], trainer._logprobs
        trainer._logprobs = lambda micro, *args, **kwargs: seen.append(len(micro)) or real(micro, *args, **kwargs)
        out = trainer.forward_backward(datums, "ppo")
        assert seen == parts
        grads = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.requires_grad}
        results[budget] = out.loss, grads
    loss, grads = results[10_000]
    for budget in (20, 12):
        assert results[budget][0] == pytest.approx(loss, rel=1e-5)
        for name, value in results[budget][1].items():
            assert torch.allclose(value, grads[name], atol=1e-6, rtol=1e-4), name


@pytest.mark.slow
def test_the_memory_benchmark_quick_mode_reports_peaks_and_a_group_of_8_stays_small():
    """``benchmarks/envs_memory.py --quick``: the tiny model, 3 scripted turns per rollout, G = 4, 8,
    16 rollouts of one task, each G in a fresh process. The bound: loading (Python, torch,
    transformers, the search corpus) measured 463 MB; with 4 tasks per step, G = 8 peaked at 815
    MB and G = 16 at 1,118 MB (32 and 64 rollouts of ~2,900 byte tokens), so 8 rollouts under
    800 MB leave room for the allocator and still catch a step that keeps every rollout's
    conversation, cache or activations around (+10 MB per rollout measured above, G = 8 to 16)."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "envs_memory.py"), "--quick"],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    last = done.stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"envs_memory g4_mb=(\d+) g8_mb=(\d+) g16_mb=(\d+)", last)
    assert match, last
    g4, g8, g16 = map(int, match.groups())
    assert 0 < g4 and g8 < 800
