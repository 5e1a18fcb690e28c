"""Baselines of the agent environments: how well a model does before any RL.

For each env, N held-out tasks, one rollout each, with the bundled model (greedy unless
``--temperature``), through the same rollout code training uses; with ``--base-url`` also
with a model behind any OpenAI-compatible endpoint (its tool calls go through the env as
the Hermes text the env parses, so both sides meet the same tools and the same checks).

    python benchmarks/envs_baseline.py [--envs helpdesk,search] [--n 40]
    python benchmarks/envs_baseline.py --base-url http://127.0.0.1:8000/v1 --endpoint-model NAME
    python benchmarks/envs_baseline.py --kv [--rollouts 4 --turns 4 --turn-tokens 32]

Reports per env and model: success rate (the env's ``success`` score is 1), the weighted
total, each score's mean, tool calls, tool errors, turns and generated tokens per rollout,
seconds per rollout. For search it also prints the BM25 baseline: the answer read off
BM25's top hit for the raw question. The last line is machine-readable:
``envs_baseline helpdesk_success=X search_success=Y`` (the bundled model).

``--kv`` instead times helpdesk rollouts of ``--turns`` turns (a scripted user keeps each
going) with the KV cache rebuilt every turn and kept between turns, both in this process,
and ends with ``envs_kv plain_tps=X reuse_tps=Y ratio=R same_tokens=B`` (model tokens per
second; ``same_tokens``: the two paths sampled the same tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch
from rich.console import Console

from grooves.envs import load_env
from grooves.envs.rollout import env_groups, sampler_generate
from grooves.policy.tools import tool_call_text
from grooves.progress import Reporter

BASE = "bundled:smollm2-135m-instruct"


def summarise(env, trajectories, seconds: float) -> dict:
    scores = [t.metadata["env_scores"] for t in trajectories]
    states = [t.metadata["state"] for t in trajectories]
    row = {"n": len(trajectories), "s_per_rollout": seconds / len(trajectories)}
    row["success"] = statistics.fmean(env.solved(s) for s in scores)
    row["total"] = statistics.fmean(sum(env.weights.get(k, 0) * v for k, v in s.items()) for s in scores)
    for key in scores[0]:
        row[key] = statistics.fmean(s[key] for s in scores)
    row["tool_calls"] = statistics.fmean(s["counters"].get("tool_calls", 0) for s in states)
    row["tool_errors"] = statistics.fmean(sum(v for k, v in s["counters"].items() if k.startswith("tool_errors"))
                                          for s in states)
    row["turns"] = statistics.fmean(s["turns"] for s in states)
    row["tokens"] = statistics.fmean(t.metadata["state"]["data"].get("endpoint_tokens", sum(t.completion_mask))
                                     for t in trajectories)
    return row


def bundled(env, tasks, temperature: float, turn_tokens: int) -> dict:
    from grooves.policy.policy import Policy

    policy = Policy.load(BASE)
    generator = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    groups = env_groups(policy, env, tasks, 1, sampler_generate(policy, temperature, 1.0, generator), turn_tokens)
    return summarise(env, [g.trajectories[0] for g in groups], time.perf_counter() - start)


def endpoint(env, tasks, base_url: str, model: str, api_key: str, temperature: float, turn_tokens: int,
             progress: Reporter) -> dict:
    """Rollouts driven by an OpenAI-compatible chat endpoint with native tool calling."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key)
    start = time.perf_counter()
    trajectories = []
    with progress.counting(len(tasks), unit="task"):
        for task in tasks:
            trajectories.append(endpoint_rollout(env, task, client, model, temperature, turn_tokens))
            solved = env.solved(trajectories[-1].metadata["env_scores"])
            progress.advance(len(trajectories), {"solved": "yes" if solved else "no"})
    return summarise(env, trajectories, time.perf_counter() - start)


def endpoint_rollout(env, task, client, model: str, temperature: float, turn_tokens: int):
    """One task's episode, each model turn a chat completion; the env parses its tool calls."""
    from grooves.envs.rollout import trajectory

    tools = env.tool_schemas()
    state = env.reset(task)
    tokens = 0
    while not env.is_done(state):
        messages = [{k: v for k, v in m.items() if k != "raw"} for m in state.messages]
        reply = client.chat.completions.create(model=model, messages=messages, tools=tools or None,
                                               temperature=temperature, max_tokens=turn_tokens)
        message = reply.choices[0].message
        tokens += reply.usage.completion_tokens if reply.usage else 0
        calls = "".join(tool_call_text(c.model_dump()) for c in message.tool_calls or [])
        asyncio.run(env.respond(state, ((message.content or "") + calls).strip()))
        if not env.is_done(state) and state.turns >= env.max_turns:
            env.finish(state, None, "max_turns")
    state.data["endpoint_tokens"] = tokens
    result = trajectory(env, state)
    env.close(state)
    return result


def kv_reuse(rollouts: int, turns: int, turn_tokens: int, progress: Reporter) -> None:
    """Tokens per second of multi-turn rollouts, the conversation re-run each turn vs its KV kept."""
    from grooves.envs.users import ScriptedUser
    from grooves.policy.policy import Policy

    policy = Policy.load(BASE)
    env = load_env("helpdesk", max_turns=turns)
    env.user = ScriptedUser()
    follow = ["Please check that again.", "Are you sure?", "Thanks. Anything else I should know?"] * turns
    tasks = [dict(t, user_turns=follow) for t in env.tasks("train", rollouts, seed=0)]
    result = {}
    for reuse in (False, True):
        progress.phase("rollouts", f"{rollouts} x {turns} turns, KV {'kept' if reuse else 'rebuilt'} between turns")
        generator = torch.Generator().manual_seed(0)
        start = time.perf_counter()
        groups = env_groups(policy, env, tasks, 1, sampler_generate(policy, 1.0, 1.0, generator, reuse_kv=reuse),
                            turn_tokens)
        seconds = time.perf_counter() - start
        trajectories = [t for g in groups for t in g.trajectories]
        tokens = sum(sum(t.completion_mask) for t in trajectories)
        longest = max(len(t.prompt_ids) + len(t.completion_ids) for t in trajectories)
        result[reuse] = (tokens / seconds, [t.completion_ids for t in trajectories])
        print(f"KV {'kept' if reuse else 'rebuilt'}: {seconds:.1f} s, {tokens} model tokens, {tokens / seconds:.2f} "
              f"tokens/s, turns {[t.metadata['state']['turns'] for t in trajectories]}, longest {longest} tokens")
    plain, reused = result[False][0], result[True][0]
    print(f"envs_kv plain_tps={plain:.3f} reuse_tps={reused:.3f} ratio={reused / plain:.2f} "
          f"same_tokens={result[False][1] == result[True][1]}")


def print_table(rows: list[tuple[str, str, dict]]) -> None:
    keys = ["success", "total", "tool_calls", "tool_errors", "turns", "tokens", "s_per_rollout"]
    print(f"{'env':<10} {'model':<24} " + " ".join(f"{k:>13}" for k in keys))
    for env_name, model, row in rows:
        print(f"{env_name:<10} {model:<24} " + " ".join(f"{row[k]:>13.3f}" for k in keys))
    for env_name, model, row in rows:
        scores = {k: round(v, 3) for k, v in row.items() if k not in keys and k != "n"}
        print(f"{env_name} / {model}: n={row['n']} scores {json.dumps(scores)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", default="helpdesk,search")
    parser.add_argument("--n", type=int, default=40, help="Held-out tasks per env (one rollout each).")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--turn-tokens", type=int, default=128, help="New tokens per model turn.")
    parser.add_argument("--base-url", help="Also run a model behind this OpenAI-compatible endpoint.")
    parser.add_argument("--endpoint-model", default="default")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--kv", action="store_true", help="Only time multi-turn rollouts with and without KV reuse.")
    parser.add_argument("--rollouts", type=int, default=4, help="With --kv: rollouts, decoded as one batch.")
    parser.add_argument("--turns", type=int, default=4, help="With --kv: turns per rollout.")
    args = parser.parse_args()
    rows = []
    progress = Reporter(Console())  # stdout: a bar on a terminal, lines in a log
    if args.kv:
        kv_reuse(args.rollouts, args.turns, args.turn_tokens, progress)
        return
    for name in args.envs.split(","):
        env = load_env(name)
        tasks = env.tasks("heldout", args.n, seed=0)
        progress.phase("rollouts", f"{name}: {len(tasks)} held-out tasks, the bundled model, in one batch")
        rows.append((name, "smollm2-135m (bundled)", bundled(env, tasks, args.temperature, args.turn_tokens)))
        if args.base_url:
            progress.phase("rollouts", f"{name}: {len(tasks)} held-out tasks, {args.endpoint_model} at {args.base_url}")
            rows.append((name, args.endpoint_model, endpoint(env, tasks, args.base_url, args.endpoint_model,
                                                             args.api_key, args.temperature, args.turn_tokens,
                                                             progress)))
        if name == "search":
            from grooves.envs.search import bm25_baseline

            print(f"search BM25 top-hit baseline on the same {len(tasks)} tasks: {json.dumps(bm25_baseline(env, tasks))}")
    print_table(rows)
    own = {name: row["success"] for name, model, row in rows if model.endswith("(bundled)")}
    print("envs_baseline " + " ".join(f"{name}_success={value:.3f}" for name, value in own.items()))


if __name__ == "__main__":
    main()
