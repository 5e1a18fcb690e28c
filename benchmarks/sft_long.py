"""SFT on long agent transcripts: seconds per optimizer step of the loss's forward and backward,
four ways, on the same synthetic transcripts (issue 31, item 5).

A transcript is shaped like a wrapped retail-support benchmark's demo: one system prompt (policy
and tool schemas) every example shares, a short user turn, then ``--turns`` assistant tool calls
each answered by a long tool result, and a final answer: ``--length`` tokens at most (examples
from 70% to 100% of it), of which about ``--trained`` carry loss. Token ids are random (seeded):
the cost does not depend on what they spell.

- ``textbook``: the full model (``causal_lm(input_ids).logits``): the output head and a
  log-softmax over the vocabulary at every position, each micro-batch padded;
- ``before``: the code before this change: per micro-batch, ``shared_prefix_logprobs`` (the
  micro-batch's common prefix once, the head on trained positions only);
- ``after``: ``SFTRun._loss`` now: the step's common prefix once for all micro-batches
  (``SharedPrefix``), each micro-batch cut after its last trained token, the head on trained
  positions only;
- ``packed``: ``after`` with the rule for a micro-batch's rows before 2026-12-06: one unpadded
  sequence whenever that saves any padding (now only where it costs fewer multiply-adds:
  ``logprobs._packing_pays``);
- ``after+cut``: the same with ``data.max_seq_length = --cut`` (what it costs in trained tokens
  is printed).

The first four give the same loss and gradient (``tests/test_sft_long.py`` holds them to 1e-5
on the tiny model); the script prints each loss.

    python benchmarks/sft_long.py                        # bundled SmolLM2-135M, 4 examples of <= 2,000 tokens
    python benchmarks/sft_long.py --threads 1 --layers 6 # a busy machine: CPU time of 1 thread, 6 of 30 layers
    python benchmarks/sft_long.py --micro 4 --examples 8 --length 6000 --prefix 2500   # the issue's size
    python benchmarks/sft_long.py --sft-config examples/agents/helpdesk-sft.toml --micro 4 --examples 8  # real demos

The last line is machine-readable: ``sft_long model=.. textbook=WALLs/cpu=CPUs before=.. after=.. packed=.. cut=..``
(the ways ``--ways`` chose).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
import torch.nn.functional as F

from grooves.policy import LoRA, Policy, logprobs
from grooves.policy.logprobs import build_token_batch, shared_prefix_logprobs
from grooves.training.sft import SFTConfig, SFTRun
from grooves.types import Trajectory


def transcripts(vocab: int, args) -> list[Trajectory]:
    """``args.examples`` synthetic transcripts sharing a ``args.prefix``-token system prompt."""
    g = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(10, vocab, (n,), generator=g).tolist()

    system = ids(args.prefix)
    out = []
    for k in range(args.examples):
        length = int(args.length * (0.7 + 0.3 * k / max(args.examples - 1, 1)))
        prompt = system + ids(24)
        call = max(args.trained // (args.turns + 1), 1)
        result = max((length - len(prompt) - call * (args.turns + 1)) // args.turns, 1)
        completion, mask = [], []
        for _ in range(args.turns):
            completion += ids(call) + ids(result)
            mask += [1] * call + [0] * result
        completion += ids(call)
        mask += [1] * call
        out.append(Trajectory([], prompt, completion, mask, [0.0] * len(completion)))
    return out


def real(policy: Policy, args) -> list[Trajectory]:
    """The examples the first step of ``args.sft_config`` trains on (its data, in its order)."""
    from grooves.tasks.sources import TaskStream
    from grooves.training.config import load_config
    from grooves.training.sft import config_examples

    config = load_config(args.sft_config, SFTConfig)
    with tempfile.TemporaryDirectory() as runs:
        train, _ = config_examples(policy, config, runs)
    return [train[i] for i in TaskStream(list(range(len(train))), seed=config.seed).take(args.examples)]


def textbook(run: SFTRun, examples: list[Trajectory]) -> float:
    lm, tokens, total = run.policy.causal_lm, sum(sum(t.completion_mask) for t in examples), 0.0
    ordered = sorted(examples, key=lambda t: len(t.prompt_ids) + len(t.completion_ids))
    for i in range(0, len(ordered), run.config.optim.micro_batch_size):
        batch = build_token_batch(ordered[i: i + run.config.optim.micro_batch_size])
        logp_all = F.log_softmax(lm(input_ids=batch.input_ids).logits.float(), dim=-1)  # (B, L, V)
        index = batch.starts[:, None] - 1 + torch.arange(batch.targets.shape[1])  # (B, T)
        picked = logp_all.gather(1, index[..., None].expand(-1, -1, logp_all.shape[-1]))  # (B, T, V)
        logp = picked.gather(-1, batch.targets[..., None]).squeeze(-1)
        nll = -(logp * batch.mask).sum() / tokens
        nll.backward()
        total += nll.item()
    return total


def before(run: SFTRun, examples: list[Trajectory]) -> float:
    lm, tokens, total = run.policy.causal_lm, sum(sum(t.completion_mask) for t in examples), 0.0
    ordered = sorted(examples, key=lambda t: len(t.prompt_ids) + len(t.completion_ids))
    for i in range(0, len(ordered), run.config.optim.micro_batch_size):
        batch = build_token_batch(ordered[i: i + run.config.optim.micro_batch_size])
        logp, _ = shared_prefix_logprobs(lm, batch, 1.0)
        nll = -(logp * batch.mask).sum() / tokens
        nll.backward()
        total += nll.item()
    return total


def packed(run: SFTRun) -> float:
    """``run._loss`` with every micro-batch's rows packed whenever that saves padding."""
    rule = logprobs._packing_pays
    logprobs._packing_pays = lambda config, shared, lengths, padded: sum(lengths) < len(lengths) * padded
    try:
        return run._loss(run.train, backward=True)[0]
    finally:
        logprobs._packing_pays = rule


def timed(name: str, run: SFTRun, step, repeat: int) -> tuple[float, float]:
    """The fastest of ``repeat`` steps: wall seconds and CPU seconds (all threads; on a shared
    machine the CPU time is the steadier figure), and the loss."""
    best = (float("inf"), float("inf"))
    for _ in range(repeat):
        run.policy.model.train()
        run.optimizer.zero_grad(set_to_none=True)
        wall, cpu = time.perf_counter(), time.process_time()
        loss = step()
        best = min(best, (time.perf_counter() - wall, time.process_time() - cpu))
        run.policy.model.eval()
    print(f"{name:>10}: {best[0]:7.1f} s/step wall, {best[1]:7.1f} s CPU, loss {loss:.6f}", flush=True)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="bundled:smollm2-135m-instruct")
    parser.add_argument("--examples", type=int, default=4, help="Examples per optimizer step.")
    parser.add_argument("--micro", type=int, default=2, help="optim.micro_batch_size.")
    parser.add_argument("--length", type=int, default=2000, help="Tokens of the longest example.")
    parser.add_argument("--prefix", type=int, default=800, help="Tokens of the shared system prompt.")
    parser.add_argument("--turns", type=int, default=4, help="Tool calls per transcript.")
    parser.add_argument("--trained", type=int, default=120, help="Trained tokens per transcript, about.")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (1: CPU time is the work "
                        "done, even on a busy machine; default: torch's).")
    parser.add_argument("--layers", type=int, default=None, help="Keep only the model's first N decoder layers "
                        "(its widths and vocabulary stay): a quicker, head-heavier stand-in.")
    parser.add_argument("--repeat", type=int, default=2, help="Steps timed per way; the fastest counts.")
    parser.add_argument("--sft-config", default=None, help="Instead of synthetic transcripts, the first "
                        "--examples of the first step of this SFT config's data (its model and options).")
    parser.add_argument("--ways", default="textbook,before,after,packed,cut",
                        help="Which ways to time, comma-separated.")
    parser.add_argument("--cut", type=int, default=None, help="max_seq_length (default: 60%% of --length).")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    policy = Policy.load(args.model, lora=LoRA(rank=8), seed=0)
    if args.layers:
        decoder = policy.causal_lm.get_decoder()
        decoder.layers = decoder.layers[: args.layers]
        policy.causal_lm.config.num_hidden_layers = args.layers
    examples = real(policy, args) if args.sft_config else transcripts(policy.causal_lm.config.vocab_size, args)
    cut = args.cut or int(args.length * 0.6)
    lengths = [len(t.prompt_ids) + len(t.completion_ids) for t in examples]
    shared = next((k for k in range(min(lengths)) if len({t.prompt_ids[k] if k < len(t.prompt_ids) else -1
                                                          for t in examples}) > 1), min(lengths))
    trained = sum(sum(t.completion_mask) for t in examples) // len(examples)
    print(f"{args.sft_config or args.model}: {len(examples)} examples of {min(lengths)}-{max(lengths)} tokens, "
          f"{shared} shared, {trained} trained each on average; micro-batches of {args.micro}; "
          f"{policy.causal_lm.config.num_hidden_layers} layers; "
          f"{torch.get_num_threads()} threads", flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        config = SFTConfig(data={"source": "synthetic"}, optim={"micro_batch_size": args.micro})
        run = SFTRun(config, policy, examples, [], f"{tmp}/a", progress=False)
        ways = {"textbook": lambda: textbook(run, examples), "before": lambda: before(run, examples),
                "after": lambda: run._loss(run.train, backward=True)[0], "packed": lambda: packed(run)}
        for name in (w for w in ways if w in args.ways.split(",")):
            results[name] = timed(name, run, ways[name], args.repeat)
        if "cut" in args.ways.split(","):
            config = SFTConfig(data={"source": "synthetic", "max_seq_length": cut},
                               optim={"micro_batch_size": args.micro})
            cut_run = SFTRun(config, policy, examples, [], f"{tmp}/b", progress=False)
            results["cut"] = timed("after+cut", cut_run, lambda: cut_run._loss(cut_run.train, backward=True)[0],
                                   args.repeat)
    print(f"sft_long model={args.model} " + " ".join(f"{k}={v[0]:.1f}s/cpu={v[1]:.1f}s" for k, v in results.items()))


if __name__ == "__main__":
    main()
