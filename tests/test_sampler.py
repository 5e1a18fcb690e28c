"""The sampler's token and logprob bookkeeping."""

import pytest
import torch

from grooves.policy import Sampling
from grooves.policy.logprobs import build_token_batch, completion_logprobs
from grooves.policy.decoding import sample_from, top_p_filter
from grooves.types import Trajectory


def as_trajectories(completions):
    return [Trajectory(messages=[], prompt_ids=c.prompt_ids, completion_ids=c.token_ids,
                       completion_mask=[1] * len(c.token_ids), logprobs=c.logprobs) for c in completions]


def recomputed_gap(policy, completions, temperature):
    batch = build_token_batch(as_trajectories(completions))
    with torch.no_grad():
        logp, _ = completion_logprobs(policy.causal_lm, batch, temperature)
    return ((logp - batch.sampler_logprobs) * batch.mask).abs().max().item()


def test_shapes_lengths_and_finish_reasons(tiny_policy):
    prompts = ["short", [{"role": "user", "content": "a much longer prompt than the first one"}], [5, 6, 7]]
    results = tiny_policy.sampler().generate(prompts, n=3, sampling=Sampling(max_new_tokens=10, seed=0))
    assert [len(r) for r in results] == [3, 3, 3]
    for prompt, samples in zip(prompts, results):
        for c in samples:
            assert c.prompt_ids == tiny_policy.sampler().encode(prompt)
            assert len(c.token_ids) == len(c.logprobs) <= 10
            assert c.finish_reason in ("stop", "length")
            assert (c.finish_reason == "length") == (len(c.token_ids) == 10 and c.token_ids[-1] not in
                                                     tiny_policy.stop_token_ids)
            assert all(lp <= 0 for lp in c.logprobs)


def test_logprobs_match_a_training_forward(tiny_policy):
    prompts = ["x", "a longer prompt to force left padding in the batch"]
    results = tiny_policy.sampler().generate(prompts, n=4, sampling=Sampling(temperature=0.7, top_p=0.9,
                                                                             max_new_tokens=24, seed=1))
    assert recomputed_gap(tiny_policy, [c for r in results for c in r], 0.7) < 1e-4


@pytest.mark.slow
def test_bundled_logprobs_match_a_training_forward(bundled_policy):
    prompts = ["Write a title for: the cat sat on the mat.", [{"role": "user", "content": "Say hi"}]]
    results = bundled_policy.sampler().generate(prompts, n=3, sampling=Sampling(temperature=0.7,
                                                                                max_new_tokens=16, seed=0))
    assert recomputed_gap(bundled_policy, [c for r in results for c in r], 0.7) < 1e-4


def test_seed_makes_sampling_reproducible(tiny_policy):
    sampling = Sampling(max_new_tokens=12, seed=7)
    a = tiny_policy.sampler().generate(["hi"], n=4, sampling=sampling)
    b = tiny_policy.sampler().generate(["hi"], n=4, sampling=sampling)
    assert [c.token_ids for c in a[0]] == [c.token_ids for c in b[0]]
    assert len({tuple(c.token_ids) for c in a[0]}) > 1  # the n samples differ from each other


def test_greedy_matches_transformers_generate(tiny_policy):
    ids = tiny_policy.sampler().encode("hello there")
    ours = tiny_policy.sampler().generate([ids], sampling=Sampling(temperature=0, max_new_tokens=15))[0][0]
    with torch.no_grad():
        ref = tiny_policy.causal_lm.generate(torch.tensor([ids]), max_new_tokens=15, do_sample=False,
                                             eos_token_id=list(tiny_policy.stop_token_ids), pad_token_id=0)
    assert ours.token_ids == ref[0, len(ids):].tolist()


def test_stop_string_keeps_its_token_and_cuts_the_text(tiny_policy):
    free = tiny_policy.sampler().generate(["go"], sampling=Sampling(temperature=0, max_new_tokens=20))[0][0]
    text = tiny_policy.decode(free.token_ids)
    stop = text[3:5]  # a string the greedy completion is known to produce
    assert stop
    stopped = tiny_policy.sampler().generate(
        ["go"], sampling=Sampling(temperature=0, max_new_tokens=20, stop=(stop,)))[0][0]
    assert stopped.finish_reason == "stop"
    assert stop in tiny_policy.decode(stopped.token_ids)  # the token that completed the stop string is kept
    assert stop not in tiny_policy.decode(stopped.token_ids[:-1])  # ... and it is the last one
    assert stopped.text == text[: text.find(stop)]


def test_pad_token_inside_a_prompt_is_not_padding(tiny_policy):
    """pad == eos for ChatML models: a prompt containing that id must be read whole."""
    eos = tiny_policy.tokenizer.eos_token_id
    sampling = Sampling(temperature=0, max_new_tokens=8)
    with_eos = [10, 11, eos, 12, 13]
    batched = tiny_policy.sampler().generate([with_eos, [20, 21, 22, 23, 24, 25, 26, 27]], sampling=sampling)
    alone = tiny_policy.sampler().generate([with_eos], sampling=sampling)
    assert batched[0][0].token_ids == alone[0][0].token_ids


def test_top_p_filter_and_sample_from():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=torch.float64)
    # 0.5 + 0.3 reaches 0.8: the 0.15 and 0.05 tokens go
    assert top_p_filter(probs, 0.8).tolist() == [[0.5, 0.3, 0.0, 0.0]]
    assert top_p_filter(probs, 0.81).tolist() == [[0.5, 0.3, 0.15, 0.0]]
    assert top_p_filter(probs, 0.1).tolist() == [[0.5, 0.0, 0.0, 0.0]]  # the top token always stays
    draws = sample_from(torch.tensor([[0.0, 1.0, 0.0, 3.0]]).repeat(4000, 1),
                        torch.rand(4000, generator=torch.Generator().manual_seed(0)))
    counts = torch.bincount(draws, minlength=4).tolist()
    assert counts[0] == counts[2] == 0 and 850 < counts[1] < 1150


def test_sampling_validates():
    with pytest.raises(ValueError, match="temperature"):
        Sampling(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        Sampling(top_p=0)


def test_a_stop_token_is_kept_and_finished_rows_leave_the_batch(tiny_policy, monkeypatch):
    sampling = Sampling(temperature=0, max_new_tokens=12)

    def greedy(prompts):
        return [r[0] for r in tiny_policy.sampler().generate(prompts, sampling=sampling)]

    short_prompt, long_prompt = [10, 11, 12], [30, 31, 32, 33, 34]
    alone_short, alone_long = greedy([short_prompt])[0].token_ids, greedy([long_prompt])[0].token_ids
    stop = next(t for t in alone_short[1:] if t not in alone_long)  # ends the short row only
    monkeypatch.setattr(tiny_policy, "stop_token_ids", {stop})
    short, long = greedy([short_prompt, long_prompt])
    assert short.finish_reason == "stop" and short.token_ids == alone_short[: alone_short.index(stop) + 1]
    # the long row went on alone after the short one was dropped from the batch and its cache
    assert long.finish_reason == "length" and long.token_ids == alone_long
