"""grooves eval: the base, a trained adapter, its merged folder and a grooves serve endpoint on
the same held-out tasks of a tiny run; numbers checked against the run's own held-out metrics."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from grooves.cli import app
from grooves.envs import load_env
from grooves.policy import Policy
from grooves.workflows.evals import Candidate, EvalConfig, evaluate_candidates, mean_se, percentile
from grooves.runs.store import RunStore
from helpers import tiny_config

runner = CliRunner()
RUN = "tiny-run"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A 2-step tiny run (seed 0, so the served base is the run's base) with a checkpoint at 2,
    and that checkpoint merged into a plain model folder."""
    from grooves.serve import merge_checkpoint
    from grooves.training.api import run_config
    from grooves.training.config import load_config

    folder = tmp_path_factory.mktemp("eval")
    path = tiny_config(folder, steps=2)
    path.write_text(path.read_text().replace("seed = 3", "seed = 0"))
    runs = folder / "runs"
    run_config(load_config(path), runs=runs, progress=False)
    merge_checkpoint(f"{RUN}@2", folder / "merged", runs=runs)
    return runs


def noisy_copy(runs, name: str) -> str:
    """A copy of the run whose step-2 adapter has every LoRA matrix replaced by noise."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from grooves.policy.checkpoints import MANIFEST

    shutil.copytree(runs / RUN, runs / name)
    checkpoint = runs / name / "checkpoints" / "step-0002"
    (checkpoint / MANIFEST).unlink()  # its hashes are of the real adapter; without it: a plain, older checkpoint
    path = checkpoint / "adapter" / "adapter_model.safetensors"
    generator = torch.Generator().manual_seed(0)
    save_file({key: torch.randn(t.shape, generator=generator) * 0.5 for key, t in load_file(str(path)).items()},
              str(path))
    return name


def heldout_reward(runs, step: int) -> float:
    rows = [json.loads(line) for line in (runs / RUN / "metrics.jsonl").read_text().splitlines()]
    return next(r["val/reward/total"] for r in rows if r["step"] == step and "val/reward/total" in r)


def test_local_candidates_match_the_runs_heldout_metrics(root):
    cfg = EvalConfig(run=RUN, latency_tasks=2, candidates=[
        Candidate(name="base", model="base"), Candidate(name="trained", model=f"{RUN}@2", price_in=1.0, price_out=2.0),
        Candidate(name="merged", model=str(root.parent / "merged"))])
    base, trained, merged = evaluate_candidates(cfg, runs=root)
    assert base.reward == pytest.approx(heldout_reward(root, 0))  # step 0 validates the untrained base
    assert trained.reward == pytest.approx(heldout_reward(root, 2))
    assert merged.reward == pytest.approx(trained.reward, abs=1e-6)
    # Task by task, the answers and rewards `grooves review tiny-run --split val` shows for steps 0 and 2.
    store = RunStore(root / RUN)
    try:
        for result, step in ((base, 0), (trained, 2)):
            stored = {r.task_id: r.trajectory for r in store.trajectory_records("val", [step])}
            answers = {s["task_id"]: s["completion"] for s in result.samples}
            assert answers == {task_id: t.completion for task_id, t in stored.items()}
            assert [s["reward"] for s in result.samples] == pytest.approx([stored[s["task_id"]].reward
                                                                           for s in result.samples])
    finally:
        store.close()
    # Two tiny steps leave the greedy answers as they were (base and trained agree above), so that
    # the adapter is really applied is checked on a copy of the run whose adapter is noise instead.
    noisy = noisy_copy(root, "noisy")
    (moved,) = evaluate_candidates(EvalConfig(run=RUN, latency_tasks=1, candidates=[
        Candidate(name="noisy", model=f"{noisy}@2")]), runs=root)
    assert [s["completion"] for s in moved.samples] != [s["completion"] for s in trained.samples]
    assert trained.tasks == 4 and trained.failed == 0 and set(trained.components) == {"vowels", "short"}
    assert trained.latency_p50 > 0 and trained.latency_p95 >= trained.latency_p50 and trained.tokens_per_s > 0
    # Cost per 1,000 tasks by hand: $1 per million prompt tokens, $2 per million completion tokens.
    assert trained.cost_per_1k == pytest.approx(1000 * (trained.prompt_tokens + 2 * trained.completion_tokens) / 1e6)
    assert base.cost_per_1k is None and trained.tokens_per_1k == 1000 * (trained.prompt_tokens +
                                                                           trained.completion_tokens)


def test_an_endpoint_candidate_through_grooves_serve(root, tmp_path):
    from grooves.serve.app import ServerThread, build_server, create_app

    server = build_server("tiny", runs=root)
    try:
        with ServerThread(create_app(server)) as thread:
            config = tmp_path / "eval.toml"
            config.write_text(f'name = "t"\nrun = "{RUN}"\nlatency_tasks = 1\n'
                              f'[[candidates]]\nname = "trained"\nmodel = "{RUN}@2"\n'
                              f'[[candidates]]\nname = "served"\nmodel = "{RUN}@2"\nendpoint = "{thread.base_url}"\n'
                              f'price_in = 0.15\nprice_out = 0.6\n')
            result = runner.invoke(app, ["eval", str(config), "--runs", str(root), "--out", str(tmp_path / "out")])
    finally:
        server.engine.halt()
    assert result.exit_code == 0, result.output
    assert "served" in result.output and "p95 s" in result.output
    report = json.loads((tmp_path / "out" / "eval.json").read_text())
    local, served = report["candidates"]
    assert served["kind"] == "endpoint" and served["tasks"] == 4 and served["prompt_tokens"] > 0
    assert served["reward"] == pytest.approx(local["reward"], abs=1e-6)  # the same adapter, greedy, either way
    assert served["cost_per_1k"] == pytest.approx(
        1000 * (0.15 * served["prompt_tokens"] + 0.6 * served["completion_tokens"]) / 1e6)
    assert (tmp_path / "out" / "eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_statistics_by_hand():
    mean, se = mean_se([1.0, 2.0, 3.0, math.nan])  # NaN (failed) left out; stdev 1, n 3
    assert (mean, se) == (2.0, pytest.approx(1 / math.sqrt(3)))
    assert mean_se([math.nan]) == (None, None) and mean_se([0.5]) == (0.5, 0.0)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 95) == pytest.approx(3.85)
    assert percentile([], 50) is None


@pytest.mark.parametrize(("body", "message"), [
    ('name = "x"\n[[candidates]]\nname = "a"\nmodel = "base"\n', "exactly one of run"),
    ('run = "r"\nconfig = "c.toml"\n[[candidates]]\nname = "a"\nmodel = "base"\n', "exactly one of run"),
    ('run = "r"\n[[candidates]]\nname = "a"\nmodel = "base"\ncolour = 1\n', "candidates.0.colour"),
    ('run = "nope"\n[[candidates]]\nname = "a"\nmodel = "base"\n', "run 'nope' has no config.toml"),
])
def test_bad_configs_exit_2_with_a_message(tmp_path, body, message):
    path = tmp_path / "eval.toml"
    path.write_text(body)
    result = runner.invoke(app, ["eval", str(path), "--runs", str(tmp_path / "runs")])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


ENV_RUN = '''
name = "shop"
seed = 0
[model]
spec = "tiny"
[env]
name = "{env}:Shop"
train_tasks = 2
heldout_tasks = 2
[sampling]
max_completion_length = 64
[log]
val_size = 2
tensorboard = false
'''


@pytest.fixture(scope="module")
def shop_server(tmp_path_factory):
    """A live grooves serve of the tiny base on 127.0.0.1, and a run config of an env task set on it:
    the shop env docs/envs.md prints (a price tool, 3 turns). The built-in envs' prompts alone (tools
    and all) fill most of the tiny model's 2,048-token context in its byte-level tokens, and the
    server refuses a request past it, so a multi-turn rollout of theirs cannot run on it."""
    from grooves.serve.app import ServerThread, build_server, create_app
    from test_env_files import doc_env

    folder = tmp_path_factory.mktemp("env-eval")
    (folder / "my_env.py").write_text(doc_env())
    (folder / "run.toml").write_text(ENV_RUN.format(env=folder / "my_env.py"))
    server = build_server("tiny", runs=folder / "runs")
    try:
        with ServerThread(create_app(server)) as thread:
            yield folder, thread.base_url
    finally:
        server.engine.halt()


def test_an_endpoint_candidate_on_env_tasks_scores_as_the_local_model(shop_server):
    """Env tasks through the endpoint's chat API with the env's tools: the same model, greedy, scores
    as it does in this process (each sample the same env scores, turns and ending)."""
    folder, url = shop_server
    cfg = EvalConfig(config="run.toml", latency_tasks=1, candidates=[
        Candidate(name="local", model="base"), Candidate(name="served", model="tiny", endpoint=url, price_out=1.0)])
    local, served = evaluate_candidates(cfg, folder, runs=folder / "runs")
    assert served.kind == "endpoint" and served.tasks == local.tasks == 2 and served.failed == 0
    assert served.reward == pytest.approx(local.reward, abs=1e-6) and served.success == local.success
    assert set(served.components) == set(local.components) == {"correct", "looked_up"}
    for mine, theirs in zip(local.samples, served.samples):
        assert (theirs["env_scores"], theirs["turns"], theirs["finish"], theirs["completion"]) == (
            mine["env_scores"], mine["turns"], mine["finish"], mine["completion"])
    assert served.prompt_tokens > 0 and served.completion_tokens > 0
    assert served.cost_per_1k == pytest.approx(1000 * served.completion_tokens / 1e6)


def test_an_endpoint_candidate_runs_multi_turn_tool_calls(shop_server):
    """tool_choice = "required": every turn of the tiny model through the endpoint is a structured tool
    call; the env runs it and its result goes back in the next request, turn after turn, up to the
    env's 3 turns (the shop's answer is a text turn, which "required" rules out)."""
    folder, url = shop_server
    cfg = EvalConfig(config="run.toml", candidates=[
        Candidate(name="served", model="tiny", endpoint=url, tool_choice="required")])
    (served,) = evaluate_candidates(cfg, folder, runs=folder / "runs")
    for sample in served.samples:
        assert sample["tool_calls"] >= sample["turns"] == 3 and sample["finish"] == "max_turns"
    # billed per request: every turn's prompt (the whole conversation so far, at least the first
    # prompt) counts, so a task's prompt tokens are more than 3 times its first prompt
    env, policy = load_env(f"{folder / 'my_env.py'}:Shop"), Policy.load("tiny")
    first = [len(policy.chat_ids(env.prompt(t), tools=env.tool_schemas())) for t in env.tasks("heldout")]
    assert served.prompt_tokens > 3 * sum(first) / len(first)


def test_tool_choice_is_checked():
    with pytest.raises(ValueError, match="tool_choice"):
        Candidate(name="x", model="m", endpoint="http://127.0.0.1:1/v1", tool_choice="always")


def test_conversation_messages_as_the_api_takes_them():
    from grooves.workflows.evals import _wire

    call = {"id": "call_1_0", "type": "function", "function": {"name": "search", "arguments": "{}"}}
    assert _wire({"role": "assistant", "content": "", "raw": "<tool_call>...", "tool_calls": [call]}) == {
        "role": "assistant", "content": "", "tool_calls": [call]}
    assert _wire({"role": "tool", "tool_call_id": "call_1_0", "name": "search", "content": "[]"}) == {
        "role": "tool", "tool_call_id": "call_1_0", "content": "[]"}
    # an env error that answers no call (a malformed one) cannot be a tool message
    assert _wire({"role": "tool", "name": "error", "content": "error: bad JSON"}) == {
        "role": "user", "content": "error: bad JSON"}


def test_eval_to_a_pipe_prints_the_whole_table_and_its_progress(root, tmp_path):
    config = tmp_path / "eval.toml"
    config.write_text(f'name = "piped"\nrun = "{RUN}"\nlatency_tasks = 2\n'
                      f'[[candidates]]\nname = "base"\nmodel = "base"\n'
                      f'[[candidates]]\nname = "trained"\nmodel = "{RUN}@2"\nprice_in = 0.15\nprice_out = 0.6\n')
    result = runner.invoke(app, ["eval", str(config), "--runs", str(root), "--out", str(tmp_path / "out")],
                           env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "eval.json").read_text())
    table = result.stdout
    assert "…" not in table
    header = next(line for line in table.splitlines() if "candidate" in line)
    for name in ("reward ± s.e.", "short", "vowels", "p50 s", "p95 s", "tok/s", "tokens / 1k tasks", "$ / 1k tasks"):
        assert name in header
    for candidate in report["candidates"]:  # every number whole, on the candidate's own line
        row = next(line for line in table.splitlines() if f" {candidate['name']} " in line)
        assert f"{candidate['reward']:.3f} ± {candidate['reward_se']:.3f}" in row
        assert f"{candidate['tokens_per_1k']:,.0f}" in row
    assert f"{report['candidates'][1]['cost_per_1k']:.4f}" in table
    # Progress on stderr: each candidate's phases, then answer counts over both candidates:
    # 4 tasks + 2 timed alone for each local candidate = 12 answers, the last with its ETA.
    progress = result.stderr.splitlines()
    for line in ("loading: base: tiny", "answering: base: 4 held-out tasks", "timing: base: 2 tasks, one at a time",
                 f"loading: trained: {RUN}@2", "answering: trained: 4 held-out tasks"):
        assert line in progress
    counts = [line for line in progress if line.startswith("answer ")]
    assert counts[0].startswith("answer 4/12  candidate base  ") and "eta" not in counts[0]  # no ETA from one step
    assert counts[-1].startswith("answer 12/12  candidate trained  ") and counts[-1].endswith("eta 0s")
    quiet = runner.invoke(app, ["eval", str(config), "--runs", str(root), "--out", str(tmp_path / "q"), "--quiet"])
    assert quiet.exit_code == 0 and quiet.stderr == ""


def test_the_chart_texts_never_overlap(tmp_path):
    """A checkpoint and its merged folder sit on one point, and an endpoint name is long: in the
    chart no two texts (titles, axis labels, tick labels, candidate names) overlap or leave it."""
    from grooves.workflows.eval_chart import chart, write_chart
    from grooves.workflows.evals import Result

    def result(name, reward, cost, p95):
        return Result(name, name, "local", 16, reward, 0.04, {}, None, 0, p95 / 2, p95, 10.0, 100.0, 20.0, cost)

    results = [result("base", 0.412, 0.0000123, 1.23), result("tiny-run@30", 0.55, 0.0000131, 1.31),
               result("merged", 0.551, 0.0000129, 1.29), result("priced", 0.3, None, 0.5),
               result("gpt-4o-mini @ https://api.openai.com/v1", 0.6, 0.0001375, 0.82)]
    figure = chart(results)
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    boxes = []
    for axes in figure.axes:
        for axis in (axes.xaxis, axes.yaxis):
            low, high = sorted(axis.get_view_interval())
            boxes += [(t.label1.get_text(), t.label1.get_window_extent(renderer)) for t in axis.get_major_ticks()
                      if low <= t.get_loc() <= high and t.label1.get_visible() and t.label1.get_text()]
            boxes.append((axis.label.get_text(), axis.label.get_window_extent(renderer)))
            if axis.get_offset_text().get_text():
                boxes.append((axis.get_offset_text().get_text(), axis.get_offset_text().get_window_extent(renderer)))
        boxes.append((axes.title.get_text(), axes.title.get_window_extent(renderer)))
        boxes += [(t.get_text(), t.get_window_extent(renderer)) for t in axes.texts]
    legend = [t.get_text() for legend in figure.legends for t in legend.get_texts()]
    boxes += [(t.get_text(), t.get_window_extent(renderer)) for legend in figure.legends for t in legend.get_texts()]
    assert legend == [r.name for r in results]  # every candidate named once, in order
    page = figure.bbox
    for index, (text, box) in enumerate(boxes):
        assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1, text
        for other, other_box in boxes[index + 1:]:
            assert not box.overlaps(other_box), f"{text!r} overlaps {other!r}"
    assert write_chart(results, tmp_path / "eval.png") and (tmp_path / "eval.png").read_bytes()[:4] == b"\x89PNG"
