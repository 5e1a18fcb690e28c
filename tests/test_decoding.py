"""The shared decode loop: per-row settings, constraints and adapters in one batch."""

import tempfile

import pytest
import torch

from grooves.policy import LoRA, Policy
from grooves.policy.decoding import BASE_ADAPTER, Row, decode


def alone(policy, row):
    return decode(policy, [row])[0]


def tiny_lora_policy(std: float) -> Policy:
    """The tiny model with a rank-4 adapter whose B matrices are not zero, so the adapter matters."""
    policy = Policy.load("tiny", lora=LoRA(rank=4, alpha=8), seed=2)
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, std, generator=torch.Generator().manual_seed(1))
    return policy


def test_rows_with_different_settings_share_a_batch(tiny_policy):
    prompt = tiny_policy.chat_ids([{"role": "user", "content": "hi"}])
    greedy = Row(prompt, temperature=0, max_new_tokens=9)
    seeded = Row(prompt, temperature=0.8, top_p=0.9, max_new_tokens=5, generator=torch.Generator().manual_seed(3))
    other = Row([40, 41, 42], temperature=1.3, max_new_tokens=12, generator=torch.Generator().manual_seed(4))
    together = decode(tiny_policy, [greedy, seeded, other])
    for row, out in zip((greedy, seeded, other), together):
        row.generator = row.generator and torch.Generator().manual_seed(row.generator.initial_seed())
        assert out.token_ids == alone(tiny_policy, row).token_ids  # a row's own generator: batch-independent
    assert [len(o.token_ids) for o in together] == [9, 5, 12]


def test_top_logprobs(tiny_policy):
    out = alone(tiny_policy, Row([5, 6, 7], temperature=0, max_new_tokens=4, top_logprobs=3))
    assert len(out.top_logprobs) == 4
    for chosen, logprob, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
        assert len(top) == 3 and top[0] == (chosen, pytest.approx(logprob))  # greedy picks the most likely
        assert top[0][1] >= top[1][1] >= top[2][1]


class OnlyTokens:
    """A constraint that allows a fixed sequence of token sets, then only the stop token."""

    def __init__(self, steps, stop):
        self.steps, self.stop, self.seen = steps, stop, []

    def mask(self, logits, remaining):
        allowed = self.steps[len(self.seen)] if len(self.seen) < len(self.steps) else {self.stop}
        keep = torch.full_like(logits, float("-inf"))
        keep[list(allowed)] = 0
        logits += keep

    def accept(self, token):
        self.seen.append(token)

    def is_terminated(self):
        return len(self.seen) > len(self.steps)


def test_a_constraint_masks_tokens_and_ends_the_row(tiny_policy):
    stop = tiny_policy.tokenizer.eos_token_id
    constraint = OnlyTokens([{50, 51}, {60}, {70, 71, 72}], stop)
    row = Row([5, 6, 7], temperature=1.0, max_new_tokens=20, constraint=constraint,
              generator=torch.Generator().manual_seed(0))
    out = alone(tiny_policy, row)
    assert out.token_ids[0] in {50, 51} and out.token_ids[1] == 60 and out.token_ids[2] in {70, 71, 72}
    assert out.token_ids[3] == stop and out.finish_reason == "stop" and len(out.token_ids) == 4
    assert constraint.seen == out.token_ids


def test_mixed_adapters_in_one_batch_match_separate_runs():
    from peft import PeftModel

    folder = tempfile.mkdtemp()
    for name, seed in (("a", 1), ("b", 2)):
        trained = Policy.load("tiny", lora=LoRA(rank=2 + seed), seed=seed)
        with torch.no_grad():
            for param_name, param in trained.model.named_parameters():
                if "lora_B" in param_name:
                    param.normal_(0, 0.3, generator=torch.Generator().manual_seed(seed))
        trained.save_adapter(f"{folder}/{name}")
    policy = Policy.load("tiny")
    policy.model = PeftModel.from_pretrained(policy.model, f"{folder}/a", adapter_name="a")
    policy.model.load_adapter(f"{folder}/b", adapter_name="b")
    prompt = [5, 6, 7, 8]
    rows = [Row(prompt, temperature=0, max_new_tokens=8, adapter=name) for name in ("a", "b", BASE_ADAPTER)]
    mixed = decode(policy, rows)
    separate = [Policy.load("tiny", adapter=f"{folder}/a"), Policy.load("tiny", adapter=f"{folder}/b"),
                Policy.load("tiny")]
    for out, single in zip(mixed, separate):
        expected = alone(single, Row(prompt, temperature=0, max_new_tokens=8))
        assert out.token_ids == expected.token_ids
        assert out.logprobs == pytest.approx(expected.logprobs, abs=1e-5)
    assert mixed[0].token_ids != mixed[2].token_ids  # the adapters matter


def test_packed_linears_decode_like_the_plain_path(monkeypatch):
    """The oneDNN fast path: same tokens, logprobs within float rounding, with a non-zero LoRA
    on top; a changed base weight (a merge) is packed again, and nothing stays swapped in."""
    from grooves.policy import packing as decoding

    policy = tiny_lora_policy(0.05)
    prompt = policy.chat_ids([{"role": "user", "content": "hello there"}])

    def run():
        rows = [Row(prompt, 1.0, 1.0, 12, (), torch.Generator().manual_seed(i), ignore_eos=True) for i in range(3)]
        return decode(policy, rows)

    packed = run()
    assert len(policy._packed_linears) > 0
    assert not any(isinstance(m, decoding.PackedLinear) for m in policy.causal_lm.modules())  # swapped back
    monkeypatch.setattr(decoding, "PACK_LINEARS", False)
    plain = run()
    for a, b in zip(packed, plain):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    monkeypatch.setattr(decoding, "PACK_LINEARS", True)
    policy.model.merge_adapter()  # base weights change in place: the packed copies must follow
    try:
        merged = run()
    finally:
        policy.model.unmerge_adapter()
    for a, b in zip(merged, plain):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3


def test_the_adapter_folded_into_the_packed_weights_decodes_like_the_plain_path(monkeypatch):
    """The training sampler's adapter is folded into the packed copies (W + scale * B @ A): greedy
    tokens as the plain path, logprobs within float rounding; after a fused AdamW step (which
    does not bump the tensors' versions) the fold follows the new values; a batch on the base
    model is not folded; a layer never holds two packed copies at once."""
    from grooves.policy import packing as decoding

    policy = tiny_lora_policy(0.1)
    prompt = policy.chat_ids([{"role": "user", "content": "hello there"}])
    rows = lambda adapter=None: [Row(prompt, temperature=0, max_new_tokens=12, ignore_eos=True,  # noqa: E731
                                     adapter=adapter)]
    folds = []
    real_folded = decoding._folded
    monkeypatch.setattr(decoding, "_folded", lambda *a: folds.append(a[1]) or real_folded(*a))

    def plain(adapter=None):
        monkeypatch.setattr(decoding, "PACK_LINEARS", False)
        try:
            return decode(policy, rows(adapter))[0]
        finally:
            monkeypatch.setattr(decoding, "PACK_LINEARS", True)

    def assert_alike(a, b):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4

    folded = decode(policy, rows())[0]
    lora_layers = {id(layer) for _, _, layer in decoding._lora_layers(policy.causal_lm, "default")}
    assert lora_layers and set(map(id, folds)) == lora_layers  # every LoRA layer ran folded
    assert_alike(folded, plain())
    params = [p for p in policy.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=0.05, fused=True)
    versions = [p._version for p in params]
    policy.model.train()
    policy.causal_lm(torch.tensor([prompt])).logits.sum().backward()
    policy.model.eval()
    optimizer.step()
    assert [p._version for p in params] == versions  # the case the value comparison is there for
    after = decode(policy, rows())[0]
    assert_alike(after, plain())
    assert after.logprobs != folded.logprobs

    base = decode(policy, rows(BASE_ADAPTER))[0]
    assert_alike(base, plain(BASE_ADAPTER))
    assert base.token_ids != folded.token_ids  # the adapter matters, so the fold was tested
    folds.clear()
    assert_alike(decode(policy, rows("default"))[0], plain())  # a server's rows name their adapter:
    assert folds == []  # not folded, so a base batch and an adapter batch do not pack in turn
    assert not any(isinstance(m, decoding.PackedLinear) for m in policy.causal_lm.modules())  # swapped back
    for _, _, layer in decoding._lora_layers(policy.causal_lm, "default"):  # one packed copy per layer
        assert (id(layer) in policy._packed_linears) != (id(layer.base_layer) in policy._packed_linears)


def test_prompts_that_begin_alike_prefill_their_common_beginning_once(monkeypatch):
    """An agent env's tasks share a long system prompt: it runs once, and every row decodes as it
    would alone (greedy tokens equal, logprobs within float rounding); a row asking to keep its KV
    gets the whole of it, the shared beginning included."""
    from grooves.policy import prefill as decoding

    policy = tiny_lora_policy(0.05)
    system = {"role": "system", "content": "You answer questions about a shop. " * 12}
    prompts = [policy.chat_ids([system, {"role": "user", "content": ask}]) for ask in ("hi", "a refund?", "hi")]
    assert decoding._common_prefix(prompts) >= decoding.SHARED_PREFIX_MIN
    runs = []
    real = decoding._prefix_past
    monkeypatch.setattr(decoding, "_prefix_past", lambda *args: runs.append(len(args[2])) or real(*args))
    rows = [Row(p, temperature=0, max_new_tokens=10, ignore_eos=True, keep_past=True) for p in prompts]
    together = decode(policy, rows)
    assert runs == [decoding._common_prefix(prompts)]  # the beginning ran once, for all three rows
    for prompt, out in zip(prompts, together):
        single = alone(policy, Row(prompt, temperature=0, max_new_tokens=10, ignore_eos=True))
        assert out.token_ids == single.token_ids
        assert max(abs(x - y) for x, y in zip(out.logprobs, single.logprobs)) < 1e-4
        assert out.past.length == len(prompt) + len(out.token_ids) - 1


def test_each_row_is_told_as_it_leaves_the_batch_while_the_others_go_on(tiny_policy):
    rows = [Row([5, 6, 7], temperature=0, max_new_tokens=n) for n in (9, 2, 5)]
    produced = [0, 0, 0]  # tokens chosen so far, per row
    told = []  # (row, its output, the tokens every row had then)

    def on_token(row, token, logprob):
        produced[row] += 1

    outputs = decode(tiny_policy, rows, on_token=on_token, on_finish=lambda row, out: told.append(
        (row, out, list(produced))))
    assert [row for row, _, _ in told] == [1, 2, 0]  # in the order they ended, each once
    assert told[0][2][0] == 2 and told[1][2][0] == 5  # the longest row (9 tokens) was still generating
    for row, out, _ in told:
        assert out is outputs[row] and out.text == tiny_policy.decode(out.token_ids)
