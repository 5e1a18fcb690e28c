"""Why helpdesk fails (issue 28, part 1): measurements of the base, SFT and SFT + RL models.

Stages, each adding its results to one JSON file (``--out``, default
``runs/issue28/analysis.json``), so they can run one at a time:

- ``eval``: greedy rollouts (``grooves.training.gather.evaluate``, as a run validates) of the
  held-out tasks, for each model named in ``--models`` (``base``, ``sft``, ``sft_rl``); each
  transcript's first error is found by comparing it with ``Env.demonstrate`` for its task.
  The env's held-out split has only 48 tasks (customers whose id is a multiple of 5); with
  ``--db-seeds 0,1`` the held-out tasks of a second generated shop are added (96 in all);
- ``variance``: G samples per training task with the SFT adapter at the RL temperature, and
  the share of groups whose rewards differ at all (no difference: no GRPO gradient);
- ``probe``: can the model decide the refund window? Log-probabilities of the two next turns
  (``issue_refund`` or a refusal) right after the demo's ``get_order`` result, on the
  ``refund`` and ``refuse_late`` tasks, and a bare yes/no question on the same dates;
- ``flag`` (part 2): the same decision point with ``refund_window_open`` as shown and flipped:
  the log-odds of the two calls' names, and the tool the model's own greedy turn calls;
- ``classify``: the first errors of the stored transcripts found again (no model);
- ``report``: the markdown tables from the JSON.

``python examples/agents/analyse_helpdesk.py eval variance probe report --runs runs/issue28``
(torch uses ``OMP_NUM_THREADS`` threads). Not part of ``make test``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch

from grooves.envs import load_env, start
from grooves.envs.tools import call_text
from grooves.policy.policy import Policy
from grooves.policy.tools import parse_tool_calls
from grooves.policy.sampler import Sampling
from grooves.rewards.compose import EnvScore, Reward
from grooves.training.gather import evaluate, rollout_groups

SPEC = "bundled:smollm2-135m-instruct"
OPTIONS = {"max_turns": 6, "max_tokens": 384}  # examples/agents/helpdesk-*.toml
TURN_TOKENS, TEMPERATURE = 128, 0.7  # [sampling] max_completion_length and temperature of the RL configs
KINDS = ("refund", "refuse_late", "refuse_refunded", "refuse_other", "status", "address")
COMPONENTS = ("action", "reply", "customer", "order", "format")
ERRORS = ("none", "wrong tool", "wrong arguments", "wrong policy decision", "wrong facts in the reply",
          "ran out of turns/tokens", "no tool call", "other")
ACTIONS = ("issue_refund", "update_address")
ADAPTERS = {"sft": "helpdesk-sft@latest", "sft_rl": "helpdesk-sft-rl@latest"}


def load_policy(model: str, runs: Path) -> Policy:
    adapter = ADAPTERS.get(model)
    return Policy.load(SPEC, adapter=adapter, runs=runs) if adapter else Policy.load(SPEC)


LIMIT: int | None = None  # --limit: tasks per shop (a smoke test)


def reward_of(env) -> Reward:
    return Reward([EnvScore(key, weight) for key, weight in env.weights.items()])


def total(env, scores: dict[str, float]) -> float:
    return sum(env.weights[k] * scores[k] for k in env.weights)


# --- where a transcript first goes wrong ------------------------------------------------------


def calls_of(messages: list[dict]) -> list[dict]:
    """The model's tool calls in order, each with its result; a turn without a call is ``{"name": None}``."""
    out, results = [], {m.get("tool_call_id"): m for m in messages if m.get("role") == "tool"}
    for m in messages:
        if m.get("role") != "assistant":
            continue
        if not m.get("tool_calls"):
            out.append({"name": None, "text": m.get("raw", m.get("content", ""))})
        for call in m.get("tool_calls", []):
            args = call["function"]["arguments"]
            result = results.get(call["id"], {}).get("content", "")
            out.append({"name": call["function"]["name"], "args": json.loads(args) if isinstance(args, str) else args,
                        "error": result.startswith("error:"), "result": result[:300]})
    if any(m.get("role") == "tool" and m.get("name") == "error" for m in messages):
        out.append({"name": "<malformed>"})  # a call that did not parse (its place is approximate)
    return out


def same_args(env, name: str, got: dict, want: dict) -> bool:
    if name == "find_customer":  # any query that finds the asker is right (email or name, any case)
        found = env.row(env.template, "SELECT id FROM customers WHERE lower(email) = lower(?) OR lower(name) = "
                                      "lower(?)", " ".join(str(got.get("query", "")).split()),
                        " ".join(str(got.get("query", "")).split()))
        target = env.row(env.template, "SELECT id FROM customers WHERE lower(email) = lower(?) OR lower(name) = "
                                       "lower(?)", want["query"], want["query"])
        return found is not None and found == target
    norm = {k: " ".join(v.split()) if isinstance(v, str) else v for k, v in got.items()}
    try:
        norm = {k: int(v) if k.endswith("_id") else v for k, v in norm.items()}
    except (TypeError, ValueError):
        return False
    return norm == want


def first_error(env, task: dict, messages: list[dict], scores: dict[str, float], finish: str) -> tuple[str, str]:
    """(kind of error, the demo step it happened at) for a transcript, against ``env.demonstrate``."""
    if env.solved(scores):
        return "none", "-"
    demo = [json.loads(t.split("<tool_call>")[1].split("</tool_call>")[0]) for t in env.demonstrate(task)]
    j, kind = 0, task["kind"]
    for call in calls_of(messages):
        want = demo[min(j, len(demo) - 1)]
        step = want["name"]
        if call["name"] is None:
            return "no tool call", step
        if call["name"] == "<malformed>":
            return "other", f"{step} (malformed call)"
        if call["name"] == want["name"] and call["name"] != "reply":
            if not same_args(env, call["name"], call["args"], want["arguments"]):
                return "wrong arguments", step
            j += 1
            continue
        if call["name"] == "reply":
            if want["name"] == "issue_refund":
                return "wrong policy decision", "decision"  # refused (or only said it) where a refund was due
            if want["name"] != "reply":
                return "wrong tool", f"{step} (replied early)"
            return ("wrong facts in the reply", "reply") if scores["reply"] < 1 else ("other", "reply")
        if call["name"] in ACTIONS:
            if kind.startswith("refuse") or kind == "status":
                return "wrong policy decision", "decision"
            return "wrong tool", step
        if call["name"] == "list_orders" and want["name"] == "get_order" and not call["error"]:
            continue  # the demo of a refuse_other task skips the order list; an extra look is harmless
        if call["name"] in ("find_customer", "get_order", "get_product", "list_orders") and j > 0 and not call["error"]:
            if call["name"] == "get_order" and kind == "address":
                return "wrong tool", f"{step} (opened an order)"
            if call["name"] == "get_order" and call["args"].get("order_id") != task["expected"]["order_id"]:
                return "wrong arguments", f"{step} (opened another order)"
            continue  # another look-up of the right things
        return "wrong tool", step
    if finish in ("max_turns", "max_tokens"):
        return "ran out of turns/tokens", demo[min(j, len(demo) - 1)]["name"]
    return "other", demo[min(j, len(demo) - 1)]["name"]


# --- stages -----------------------------------------------------------------------------------


def heldout(db_seeds: list[int]) -> list[tuple[object, list[dict]]]:
    envs = [load_env("helpdesk", db_seed=s, **OPTIONS) for s in db_seeds]
    return [(env, env.tasks("heldout", None, seed=0)[:LIMIT]) for env in envs]


def stage_eval(models: list[str], runs: Path, db_seeds: list[int], results: dict) -> None:
    sampling = Sampling(temperature=0.0, max_new_tokens=TURN_TOKENS, seed=0)
    for model in models:
        policy, started, rows = load_policy(model, runs), time.time(), []
        for env, tasks in heldout(db_seeds):
            result = evaluate(policy, tasks, [env.prompt(t) for t in tasks], reward_of(env), sampling, 0, env)
            for task, group in zip(tasks, result.groups):
                t = group.trajectories[0]
                scores, state = t.metadata["env_scores"], t.metadata["state"]
                error, step = first_error(env, task, t.messages, scores, state["finish"])
                rows.append({"task_id": f"s{env.db_seed}:{task['id']}", "kind": task["kind"], "scores": scores,
                             "success": float(env.solved(scores)), "total": total(env, scores),
                             "finish": state["finish"], "turns": state["turns"], "error": error, "at": step,
                             "messages": [{k: v for k, v in m.items() if k != "raw"} for m in t.messages[2:]]})
        results.setdefault("eval", {})[model] = {"seconds": round(time.time() - started, 1), "rows": rows}
        print(f"eval {model}: {sum(r['success'] for r in rows):.0f}/{len(rows)} solved, "
              f"{time.time() - started:.0f} s", flush=True)


def stage_classify(db_seeds: list[int], results: dict) -> None:
    """Find the first errors of the stored held-out transcripts again (after a change to ``first_error``)."""
    tasks = {f"s{env.db_seed}:{t['id']}": (env, t) for env, ts in heldout(db_seeds) for t in ts}
    for run in results.get("eval", {}).values():
        for row in run["rows"]:
            env, task = tasks[row["task_id"]]
            row["error"], row["at"] = first_error(env, task, row["messages"], row["scores"], row["finish"])


def stage_variance(model: str, runs: Path, n_tasks: int, group: int, results: dict) -> None:
    env = load_env("helpdesk", **OPTIONS)
    tasks = env.tasks("train", 200, seed=0)[32: 32 + n_tasks]  # RL training tasks that SFT did not see
    policy, started = load_policy(model, runs), time.time()
    sampling = Sampling(temperature=TEMPERATURE, max_new_tokens=TURN_TOKENS, seed=0)
    generator = torch.Generator().manual_seed(0)
    groups = rollout_groups(policy, tasks, [env.prompt(t) for t in tasks], group, sampling, generator, 0, env)
    rows = []
    for task, g in zip(tasks, groups):
        scores = [t.metadata["env_scores"] for t in g.trajectories]
        errors = [first_error(env, task, t.messages, t.metadata["env_scores"], t.metadata["state"]["finish"])[0]
                  for t in g.trajectories]
        rows.append({"task_id": task["id"], "kind": task["kind"], "totals": [total(env, s) for s in scores],
                     "success": [float(env.solved(s)) for s in scores], "errors": errors})
    results["variance"] = {"model": model, "group": group, "temperature": TEMPERATURE,
                           "seconds": round(time.time() - started, 1), "rows": rows}
    print(f"variance {model}: {time.time() - started:.0f} s", flush=True)


def decision_prefix(policy: Policy, env, task: dict) -> list[int]:
    """The rollout's tokens up to the model's turn after the demo's get_order result, built as a
    rollout builds them (the model's text, its end of turn, the template's continuation)."""
    state = start(policy, env, task)
    ids = list(state.tokens.prompt_ids)
    try:
        for text in env.demonstrate(task)[:-2 if task["kind"] == "refund" else -1]:
            reply = asyncio.run(env.respond(state, text))
            ids += policy.tokenizer.encode(text, add_special_tokens=False) + [policy.end_of_turn_id]
            ids += policy.continuation_ids(reply)
    finally:
        env.close(state)
    return ids


@torch.no_grad()
def next_token_logprobs(policy: Policy, prefix: list[int], candidates: list[int]) -> list[float]:
    """Log-probabilities of each candidate token right after ``prefix`` (one forward pass)."""
    logits = policy.model(torch.tensor([prefix])).logits[0, -1].float()  # (V,)
    return torch.log_softmax(logits, -1)[candidates].tolist()


@torch.no_grad()
def greedy_tool(policy: Policy, prefix: list[int]) -> str | None:
    """The tool the model's own greedy turn at ``prefix`` calls first (None: no call), whatever it
    writes before the call: the decision as a rollout would take it."""
    out = policy.model.generate(torch.tensor([prefix]), max_new_tokens=TURN_TOKENS, do_sample=False,
                                eos_token_id=policy.end_of_turn_id, pad_token_id=policy.end_of_turn_id)
    calls = parse_tool_calls(policy.decode(out[0, len(prefix):].tolist())).tool_calls
    return calls[0].name if calls else None


def stage_probe(models: list[str], runs: Path, db_seeds: list[int], results: dict) -> None:
    probe = results.setdefault("probe", {})
    for model in models:
        policy, rows, started = load_policy(model, runs), [], time.time()
        encode = lambda text: policy.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        for env, tasks in heldout(db_seeds):
            today = env.system_prompt.split("Today is ")[1][:10]
            for task in (t for t in tasks if t["kind"] in ("refund", "refuse_late")):
                oid, prefix = task["expected"]["order_id"], decision_prefix(policy, env, task)
                ends = env._order(env.template, oid)["refund_window_ends"]
                a, b = encode(call_text("issue_refund", order_id=oid)), encode(call_text("reply", message="x"))
                common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)  # the tool's name starts here
                refund_lp, refuse_lp = next_token_logprobs(policy, prefix + a[:common], [a[common], b[common]])
                question = [{"role": "system", "content": f"Today is {today}."},
                            {"role": "user", "content": f"An order's refund window ends on {ends}. Can it still be "
                                                        "refunded today? Answer yes or no."}]
                yes, no = next_token_logprobs(policy, policy.chat_ids(question), [encode("Yes")[0], encode("No")[0]])
                rows.append({"task_id": f"s{env.db_seed}:{task['id']}", "kind": task["kind"], "ends": ends,
                             "refund_name_lp": refund_lp, "refuse_name_lp": refuse_lp, "yes_lp": yes, "no_lp": no})
        probe[model] = rows
        print(f"probe {model}: {len(rows)} tasks, {time.time() - started:.0f} s", flush=True)


def stage_flag(models: list[str], runs: Path, db_seeds: list[int], results: dict) -> None:
    """Does the choice read ``refund_window_open``? Log-odds ``issue_refund`` : ``reply`` at the
    decision point of each held-out refund and refuse_late task, with the flag as get_order shows
    it and flipped (the rest of the context equal)."""
    flag = results.setdefault("flag", {})
    for model in models:
        policy, rows, started = load_policy(model, runs), [], time.time()
        encode = lambda text: policy.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        for env, tasks in heldout(db_seeds):
            real = env._order
            for task in (t for t in tasks if t["kind"] in ("refund", "refuse_late")):
                oid = task["expected"]["order_id"]
                a, b = encode(call_text("issue_refund", order_id=oid)), encode(call_text("reply", message="x"))
                common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
                odds, chose = [], []
                for flip in (False, True):
                    env._order = lambda db, i, flip=flip: (lambda o: o | {
                        "refund_window_open": o["refund_window_open"] != flip})(real(db, i))
                    prefix = decision_prefix(policy, env, task)
                    refund, refuse = next_token_logprobs(policy, prefix + a[:common], [a[common], b[common]])
                    odds.append(refund - refuse)
                    chose.append(greedy_tool(policy, prefix))
                env._order = real
                rows.append({"task_id": f"s{env.db_seed}:{task['id']}", "kind": task["kind"], "shown": odds[0],
                             "flipped": odds[1], "tool_shown": chose[0], "tool_flipped": chose[1]})
        flag[model] = rows
        print(f"flag {model}: {len(rows)} tasks, {time.time() - started:.0f} s", flush=True)


def rl_groups(run_dir: Path) -> list[str]:
    """Per training step of an RL run: how many of its groups had any reward variance."""
    from grooves.runs.store import RunStore

    if not (run_dir / "run.sqlite").exists():
        return []
    store, out = RunStore(run_dir), []
    try:
        for step in store.trajectory_steps("train"):
            by_task = defaultdict(list)
            for _, t in store.read_trajectories(step, "train"):
                by_task[t.metadata["task_id"]].append(round(t.reward, 6))
            varied = sum(len(set(v)) > 1 for v in by_task.values())
            out.append(f"step {step}: {varied}/{len(by_task)} groups varied, rewards "
                       + " ".join("[" + ",".join(f"{x:.2f}" for x in v) + "]" for v in by_task.values()))
    finally:
        store.close()
    return out


# --- the report -------------------------------------------------------------------------------


def mean_se(values: list[float]) -> str:
    if not values:
        return "-"
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.2f} ± {se:.2f}"


def report(results: dict) -> str:
    out = []
    evals = results.get("eval", {})
    for model, run in evals.items():
        rows = run["rows"]
        out += [f"**{model}** ({len(rows)} held-out tasks, greedy, {run['seconds'] / 60:.1f} min)", "",
                "| kind | n | success | total | " + " | ".join(COMPONENTS) + " |",
                "|---|---|---|---|" + "---|" * len(COMPONENTS)]
        for kind in (*KINDS, "all"):
            some = [r for r in rows if kind in ("all", r["kind"])]
            cells = [mean_se([r["success"] for r in some]), mean_se([r["total"] for r in some])]
            cells += [mean_se([r["scores"][c] for r in some]) for c in COMPONENTS]
            out.append(f"| {kind} | {len(some)} | " + " | ".join(cells) + " |")
        out.append("")
    if evals:
        out += ["First error against the demonstration (count of held-out tasks):", "",
                "| model | " + " | ".join(ERRORS) + " |", "|---|" + "---|" * len(ERRORS)]
        for model, run in evals.items():
            counts = Counter(r["error"] for r in run["rows"])
            out.append(f"| {model} | " + " | ".join(str(counts.get(e, 0)) for e in ERRORS) + " |")
        out.append("")
        for model, run in evals.items():
            where = Counter(f"{r['kind']}: {r['error']} at {r['at']}" for r in run["rows"] if r["error"] != "none")
            out.append(f"{model}, most common (kind: error at demo step): "
                       + "; ".join(f"{k} ×{n}" for k, n in where.most_common(8)))
        out.append("")
    if "variance" in results:
        v = results["variance"]
        rows = v["rows"]
        varied = [r for r in rows if len(set(round(x, 6) for x in r["totals"])) > 1]
        succ = [r for r in rows if len(set(r["success"])) > 1]
        out += [f"Groups of G = {v['group']} at temperature {v['temperature']} ({v['model']}, {len(rows)} training "
                f"tasks, {v['seconds'] / 60:.1f} min): {len(varied)}/{len(rows)} groups have any variance in "
                f"total reward, {len(succ)}/{len(rows)} in success; mean within-group std of the total "
                f"{statistics.fmean(statistics.pstdev(r['totals']) for r in rows):.3f}; samples solved "
                f"{sum(sum(r['success']) for r in rows):.0f}/{len(rows) * v['group']}.", "",
                "| kind | groups | any reward variance | any success variance | samples solved |",
                "|---|---|---|---|---|"]
        for kind in KINDS:
            some = [r for r in rows if r["kind"] == kind]
            if some:
                out.append(f"| {kind} | {len(some)} | {sum(r in varied for r in some)} | "
                           f"{sum(r in succ for r in some)} | "
                           f"{sum(sum(r['success']) for r in some):.0f}/{len(some) * v['group']} |")
        errors = Counter(e for r in rows for e in r["errors"])
        out += ["", "Sampled first errors: " + ", ".join(f"{k} {n}" for k, n in errors.most_common()), ""]
    for model, rows in results.get("probe", {}).items():
        right = lambda r, a, b: (r[a] > r[b]) == (r["kind"] == "refund")  # noqa: E731
        by = {k: [r for r in rows if r["kind"] == k] for k in ("refund", "refuse_late")}
        cells = []
        for k, some in by.items():
            tool_right = sum(right(r, "refund_name_lp", "refuse_name_lp") for r in some)
            odds = statistics.fmean(r["refund_name_lp"] - r["refuse_name_lp"] for r in some)
            cells.append(f"{k} ({len(some)}): next tool {tool_right}, "
                         f"yes/no {sum(right(r, 'yes_lp', 'no_lp') for r in some)} right, mean log-odds "
                         f"refund:refuse {odds:+.2f}, "
                         f"yes:no {statistics.fmean(r['yes_lp'] - r['no_lp'] for r in some):+.2f}")
        out.append(f"Refund-window probe, {model}: " + "; ".join(cells) + ".")
    for model, rows in results.get("flag", {}).items():
        cells = [f"{k} ({len(some)}): mean log-odds refund:reply {statistics.fmean(r['shown'] for r in some):+.2f} "
                 f"as shown, {statistics.fmean(r['flipped'] for r in some):+.2f} flipped; refund preferred "
                 f"{sum(r['shown'] > 0 for r in some)} and {sum(r['flipped'] > 0 for r in some)}"
                 for k in ("refund", "refuse_late") if (some := [r for r in rows if r["kind"] == k])]
        out.append(f"refund_window_open flipped, {model}: " + "; ".join(cells) + ".")
        if all("tool_shown" in r for r in rows):  # the greedy turn, thought and all
            follows = sum((r["tool_shown"] == "issue_refund") == (r["kind"] == "refund")
                          and (r["tool_flipped"] == "issue_refund") == (r["kind"] != "refund") for r in rows)
            out.append(f"Greedy decision turn, {model}: it refunds exactly when the flag shown says open on "
                       f"{follows} of {len(rows)} tasks (shown and flipped both right); calls as shown: "
                       f"{dict(Counter(r['tool_shown'] for r in rows))}, flipped: "
                       f"{dict(Counter(r['tool_flipped'] for r in rows))}.")
    return "\n".join(out)


def main() -> None:
    global SPEC, LIMIT
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stages", nargs="+", choices=["eval", "classify", "variance", "probe", "flag", "report"])
    parser.add_argument("--runs", type=Path, default=Path("runs/agents"), help="runs root holding the adapters")
    parser.add_argument("--out", type=Path, default=Path("runs/issue28/analysis.json"))
    parser.add_argument("--models", default="base,sft", help="comma-separated: base, sft, sft_rl")
    parser.add_argument("--db-seeds", default="0,1", help="shops whose held-out tasks are used (48 each)")
    parser.add_argument("--variance-tasks", type=int, default=24)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--spec", default=SPEC, help=argparse.SUPPRESS)  # "tiny" for a smoke test
    parser.add_argument("--limit", type=int, default=None, help="held-out tasks per shop (a smoke test)")
    parser.add_argument("--customers", type=int, default=64, help="people in each shop (part 1: 64, 48 held-out "
                        "tasks a shop; the part 2 configs: 80, 64 held-out tasks)")
    args = parser.parse_args()
    SPEC, LIMIT = args.spec, args.limit
    OPTIONS["customers"] = args.customers
    models, seeds = args.models.split(","), [int(s) for s in args.db_seeds.split(",")]
    bad = sorted(set(models) - {"base", *ADAPTERS})
    if bad:
        parser.error(f"--models: unknown {', '.join(bad)}")
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    torch.manual_seed(0)
    for stage in args.stages:
        if stage == "eval":
            stage_eval(models, args.runs, seeds, results)
        elif stage == "classify":
            stage_classify(seeds, results)
        elif stage == "variance":
            stage_variance(models[-1], args.runs, args.variance_tasks, args.group, results)
        elif stage == "probe":
            stage_probe(models, args.runs, seeds, results)
        elif stage == "flag":
            stage_flag(models, args.runs, seeds, results)
        else:
            print(report(results))
            for line in rl_groups(args.runs / "helpdesk-sft-rl"):
                print(f"RL run {line}")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
