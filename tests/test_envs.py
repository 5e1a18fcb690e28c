"""The env contract and the multi-turn rollout, on a small SQLite app and a scripted policy.

The policy side is scripted (fixed texts tokenised with the tiny model's tokenizer, which is
SmolLM2's); everything else is real: the chat template, the tool schemas, pydantic argument
checks, worker threads with timeouts, in-memory SQLite copies and snapshots.
"""

import json
import time

import pytest

from grooves.envs import SQLiteApp, Turn, available, env_class, env_groups, load_env, start, tool
from grooves.envs.rollout import advance, env_metrics, run_states, trajectory
from grooves.policy.policy import Policy


class Notes(SQLiteApp):
    name = "notes"
    schema = "CREATE TABLE notes (id INTEGER PRIMARY KEY, owner TEXT NOT NULL, body TEXT NOT NULL);"
    weights = {"added": 1.0}
    tool_timeout_s = 0.5
    max_result_chars = 40

    def seed_data(self, db, rng):
        for i in range(4):
            db.execute("INSERT INTO notes (owner, body) VALUES (?, ?)", (rng.choice("ab"), f"note {i}"))

    def tasks(self, split="train", n=None, seed=0):
        return [{"id": f"n{i}", "prompt": f"Add the note 'hello {i}' for owner a."} for i in range(n or 2)]

    @tool
    def add_note(self, state, owner: str, body: str) -> dict:
        """Add a note for an owner.

        Args:
            owner: Who the note belongs to.
            body: The note's text.
        """
        cursor = self.db(state).execute("INSERT INTO notes (owner, body) VALUES (?, ?)", (owner, body))
        return {"id": cursor.lastrowid}

    @tool
    def count(self, state, owner: str, at_least: int = 0) -> int:
        """Count an owner's notes.

        Args:
            owner: Whose notes.

        Returns:
            The number of notes.
        """
        return self.db(state).execute("SELECT count(*) FROM notes WHERE owner = ?", (owner,)).fetchone()[0]

    @tool
    def dump(self, state) -> str:
        """Everything, as text (too long to show whole)."""
        return "x" * 100

    @tool
    def hang(self, state) -> str:
        """Never answers in time."""
        time.sleep(2)
        return "late"

    @tool
    def crash(self, state, why: str) -> str:
        """Raises."""
        raise RuntimeError(why)

    @tool
    def roll(self, state) -> int:
        """A die from the rollout's own generator."""
        return state.rng.randint(1, 6)

    def score(self, state):
        added = self.changed_rows(state).get("notes", {}).get("added", [])
        return {"added": float(any(r["owner"] == "a" for r in added))}


@pytest.fixture(scope="module")
def policy():
    return Policy.load("tiny")


def call(name, **arguments):
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def play(policy, env, script, task=None, seed=0):
    """One rollout driven turn by turn with ``script`` (one text per turn)."""
    state = start(policy, env, task or env.tasks(n=1)[0], seed)
    for text in script:
        if env.is_done(state):
            break
        advance(policy, env, [state], fixed(policy, text), 512)
    return state


def fixed(policy, text, finish="stop"):
    """``generate`` that writes ``text`` for every rollout (the tiny tokenizer is byte-level);
    over the budget it is cut there, as a sampler would."""
    def generate(prompts, budgets, pasts=None):
        ids = policy.tokenizer.encode(text, add_special_tokens=False)
        if finish == "stop":
            ids = ids + [policy.end_of_turn_id]
        out = []
        for budget in budgets:
            cut = len(ids) > budget
            out.append(Turn(text, ids[:budget], [-0.25] * min(budget, len(ids)), "length" if cut else finish))
        return out
    return generate


def test_tool_schemas_come_from_signatures_and_docstrings():
    schema = {t["function"]["name"]: t["function"] for t in Notes().tool_schemas()}
    assert schema["add_note"]["description"] == "Add a note for an owner."
    assert schema["add_note"]["parameters"] == {
        "type": "object", "additionalProperties": False, "required": ["owner", "body"],
        "properties": {"owner": {"type": "string", "description": "Who the note belongs to."},
                       "body": {"type": "string", "description": "The note's text."}}}
    assert schema["count"]["parameters"]["properties"]["at_least"] == {"type": "integer", "default": 0}
    assert schema["count"]["parameters"]["properties"]["owner"]["description"] == "Whose notes."
    assert "Returns" not in schema["count"]["parameters"]["properties"]
    assert schema["dump"]["parameters"]["properties"] == {}


def test_only_model_tokens_are_trainable(policy):
    env = Notes()
    state = play(policy, env, [call("add_note", owner="a", body="hello"), "Done: added."])
    t = trajectory(env, state)
    assert state.finish == "answer" and t.metadata["env_scores"] == {"added": 1.0}
    tokenizer = policy.tokenizer
    generated = tokenizer.decode([i for i, m in zip(t.completion_ids, t.completion_mask) if m])
    inserted = tokenizer.decode([i for i, m in zip(t.completion_ids, t.completion_mask) if not m])
    assert generated == (call("add_note", owner="a", body="hello") + "<|im_end|>" + "Done: added.<|im_end|>")
    assert inserted == '\n<|im_start|>user\n<tool_response>\n{"id": 5}\n</tool_response><|im_end|>\n<|im_start|>assistant\n'
    # logprobs: the sampler's on model tokens, 0 on inserted ones
    assert all(lp == -0.25 for lp, m in zip(t.logprobs, t.completion_mask) if m)
    assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.completion_mask) if not m)
    # the token stream is exactly what the model saw: prompt + turns + inserted tokens, in order
    whole = tokenizer.decode(t.prompt_ids + t.completion_ids)
    assert whole.endswith("<|im_start|>assistant\nDone: added.<|im_end|>")
    assert tokenizer.decode(t.prompt_ids).endswith("Add the note 'hello 0' for owner a.<|im_end|>\n<|im_start|>assistant\n")
    assert '"name": "add_note"' in tokenizer.decode(t.prompt_ids)  # the tools are in the prompt


def test_a_near_miss_call_runs_and_is_counted_as_repaired(policy):
    env = Notes()
    turn = '<tool_call>{"name": "add_note", "arguments": {"owner": "a\', "body": "say "hi""}}</tool_call>'
    state = play(policy, env, [turn, "ok"])
    assert env.rows(env.db(state), "SELECT owner, body FROM notes WHERE id = 5") == [{"owner": "a'", "body": 'say "hi"'}]
    assert state.counters["tool_calls/repaired"] == 1 and state.counters["tool_errors/malformed"] == 0


def test_bad_input_becomes_messages_and_counters(policy):
    env = Notes()
    bad_turn = (call("count", owner=5) + call("nope") + "<tool_call>{bad json</tool_call>"
                + call("crash", why="disk on fire") + call("dump"))
    started = time.monotonic()
    state = play(policy, env, [bad_turn, call("hang"), "ok"])
    assert time.monotonic() - started < 1.9  # the hung tool (2 s) did not hold the rollout up
    replies = [m["content"] for m in state.messages if m["role"] == "tool"]
    assert replies[0].startswith("error: tool call is not valid JSON (Expecting property name enclosed in double "
                                 "quotes at position 1): {bad json.")
    assert replies[1] == "error: invalid arguments for count: owner: Input should be a valid string"
    assert replies[2] == ("error: unknown tool 'nope'; the tools are: add_note, count, crash, dump, hang, roll")
    assert replies[3] == "error: crash failed: RuntimeError: disk on fire"
    assert replies[4] == "x" * 40 + "\n[truncated: 60 more characters not shown; ask for less]"
    assert replies[5] == "error: hang did not finish within 0.5 s"
    assert state.finish == "answer" and state.answer == "ok"
    assert dict(state.counters) == {
        "tool_calls": 5, "tool_calls/count": 1, "tool_calls/unknown": 1, "tool_calls/crash": 1,
        "tool_calls/dump": 1, "tool_calls/hang": 1, "tool_errors/malformed": 1, "tool_errors/bad_arguments": 1,
        "tool_errors/unknown_tool": 1, "tool_errors/raised": 1, "tool_results/truncated": 1, "tool_errors/timeout": 1}
    assert env.rows(env.db(state), "SELECT count(*) AS n FROM notes") == [{"n": 4}]


def test_sql_in_arguments_is_just_text(policy):
    env = Notes()
    evil = "a'); DROP TABLE notes; --"
    state = play(policy, env, [call("add_note", owner=evil, body="x") + call("count", owner=evil), "done"])
    replies = [m["content"] for m in state.messages if m["role"] == "tool"]
    assert replies == ['{"id": 5}', "1"]
    assert [r["owner"] for r in env.rows(env.db(state), "SELECT owner FROM notes WHERE id = 5")] == [evil]
    with pytest.raises(Exception, match="not authorized"):
        env.db(state).execute("ATTACH DATABASE '/tmp/outside.db' AS outside")


def test_concurrent_rollouts_have_private_databases(policy):
    env = Notes()
    task = env.tasks(n=1)[0]
    writer, reader = start(policy, env, task), start(policy, env, task)
    advance(policy, env, [writer], fixed(policy, call("add_note", owner="a", body="mine")), 512)
    advance(policy, env, [reader], fixed(policy, call("count", owner="a")), 512)
    before = env.rows(env.template, "SELECT count(*) AS n FROM notes")[0]["n"]
    assert before == 4
    assert env.rows(env.db(writer), "SELECT count(*) AS n FROM notes")[0]["n"] == 5
    assert env.rows(env.db(reader), "SELECT count(*) AS n FROM notes")[0]["n"] == 4
    assert env.score(writer) == {"added": 1.0} and env.score(reader) == {"added": 0.0}


def test_a_group_decodes_as_one_batch_and_scores_each_rollout(policy):
    env = Notes()
    batches, first = [], []

    def generate(prompts, budgets, pasts=None):
        batches.append(len(prompts))
        first.append(max(len(p) for p in prompts))
        texts = [call("add_note", owner="a", body="hi") if len(p) < first[0] + 10 else "done" for p in prompts]
        return [Turn(t, policy.tokenizer.encode(t, add_special_tokens=False) + [policy.end_of_turn_id],
                     [0.0] * (len(policy.tokenizer.encode(t, add_special_tokens=False)) + 1), "stop") for t in texts]

    groups = env_groups(policy, env, env.tasks(n=2), 3, generate, 512)
    assert batches[0] == 6  # 2 tasks x 3 rollouts in one batch
    assert [len(g) for g in groups] == [3, 3]
    metrics = env_metrics(groups)
    assert metrics["env/finish/answer"] == 1.0 and metrics["env/tool_calls"] >= 1.0


def test_snapshot_restore_continue_matches_an_uninterrupted_rollout(policy):
    env = Notes()
    script = [call("roll") + call("add_note", owner="a", body="first"), call("roll"),
              call("add_note", owner="b", body="second"), "finished"]
    whole = play(policy, env, script)

    state = play(policy, env, script[:2])
    blob = env.snapshot(state)
    env.close(state)
    resumed = env.restore(blob)
    for text in script[2:]:
        advance(policy, env, [resumed], fixed(policy, text), 512)
    branch = env.restore(blob)  # a second branch from the same point starts from the same world
    assert env.rows(env.db(branch), "SELECT count(*) AS n FROM notes")[0]["n"] == 5

    assert resumed.messages == whole.messages  # the dice rolled the same after the restore
    assert resumed.tokens.ids == whole.tokens.ids and resumed.tokens.mask == whole.tokens.mask
    assert env.rows(env.db(resumed), "SELECT * FROM notes") == env.rows(env.db(whole), "SELECT * FROM notes")
    assert env.score(resumed) == env.score(whole) and resumed.counters == whole.counters
    with pytest.raises(ValueError, match="not a grooves env snapshot"):
        env.restore(b"junk")


def test_turn_and_token_budgets_end_a_rollout(policy):
    env = Notes(max_turns=2)
    state = start(policy, env, env.tasks(n=1)[0])
    run_states(policy, env, [state], fixed(policy, call("count", owner="a")), 512)
    assert (state.finish, state.turns) == ("max_turns", 2)
    env = Notes(max_tokens=30)
    state = start(policy, env, env.tasks(n=1)[0])
    run_states(policy, env, [state], fixed(policy, "word " * 50, finish="length"), 64)
    t = trajectory(env, state)
    assert state.finish == "max_tokens" and t.finish_reason == "length" and t.truncated
    assert state.tokens.generated == 30
    assert t.completion_ids[-1] == policy.end_of_turn_id and t.completion_mask[-1] == 0  # closed, not trained
    with pytest.raises(ValueError, match="unknown option 'max_turn'"):
        Notes(max_turn=3)


def test_registry_lists_builtins_and_rejects_unknown_names():
    assert {"helpdesk", "search"} <= set(available())
    with pytest.raises(KeyError, match="unknown env 'nope'; available: .*helpdesk"):
        env_class("nope")
    assert load_env("helpdesk").name == "helpdesk"


def test_a_training_run_on_an_env_scores_with_the_env_and_logs_its_metrics(policy, tmp_path):
    """Two real GRPO steps of the tiny model on the notes app: the rollouts are multi-turn
    trajectories, the reward is the env's score, the env counters are logged."""
    from grooves.rewards.compose import EnvScore, Reward
    from grooves.training.config import parse_config
    from grooves.training.loop import TrainingRun
    from grooves.runs.store import read_metrics
    from grooves.training.tasksets import TaskSet

    config = parse_config({"name": "notes", "seed": 1, "steps": 2, "model": {"spec": "tiny"},
                           "lora": {"rank": 4, "alpha": 8}, "sampling": {"max_completion_length": 16},
                           "train": {"group_size": 2, "tasks_per_step": 2},
                           "log": {"val_every": 2, "val_size": 2, "tensorboard": False}})
    env = Notes(max_turns=3, max_tokens=40)
    tiny = Policy.load("tiny", lora=config.lora, seed=1)
    tasks = env.tasks(n=6)
    task_set = TaskSet("", tasks[:4], tasks[4:], Reward([EnvScore("added")]), env=env)
    run = TrainingRun(config, tiny, [task_set], tmp_path / "run", progress=False).run()
    rows = read_metrics(run.dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[1]["env/turns"] >= 1 and "env/finish/max_tokens" in rows[1] and "val/env/turns" in rows[2]
    assert rows[1]["reward/added"] == 0.0  # random weights never write a valid add_note call
    assert rows[1]["completion_len"] <= 40


def test_training_logprobs_line_up_with_model_tokens_across_turns(policy):
    """The trainer's per-token logprobs of a multi-turn trajectory: exactly the model's own
    prediction at each generated token (after inserted tool results), 0 where the env wrote."""
    import torch
    import torch.nn.functional as F

    from grooves.policy.logprobs import build_token_batch, completion_logprobs

    env = Notes()
    state = play(policy, env, [call("add_note", owner="a", body="x"), call("count", owner="a"), "two notes"])
    t = trajectory(env, state)
    assert t.completion_mask.count(0) > 20 and t.completion_mask[-1] == 1  # two tool results inserted
    batch = build_token_batch([t])
    with torch.no_grad():
        logp, _ = completion_logprobs(policy.causal_lm, batch)
        logits = policy.causal_lm(input_ids=batch.input_ids).logits[0]  # (L, V)
    start = len(t.prompt_ids)
    for i, (token, generated) in enumerate(zip(t.completion_ids, t.completion_mask)):
        expected = F.log_softmax(logits[start + i - 1].float(), -1)[token].item() if generated else 0.0
        assert logp[0, i].item() == pytest.approx(expected, abs=1e-4)


def test_a_package_registers_an_env_through_an_entry_point(tmp_path, monkeypatch):
    """What a third-party package's pyproject [project.entry-points."grooves.envs"] installs."""
    (tmp_path / "acme_envs.py").write_text(
        "from grooves.envs import Env\n\nclass Shop(Env):\n    name = 'shop'\n    description = 'a shop'\n")
    dist = tmp_path / "acme_envs-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-envs\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[grooves.envs]\nshop = acme_envs:Shop\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert available()["shop"] == "acme_envs:Shop"
    assert load_env("shop").description == "a shop"


@pytest.mark.parametrize("name", ["helpdesk", "search"])
def test_the_example_configs_train(name, tmp_path):
    """examples/envs/NAME.toml as shipped, on the tiny model for one step with a smaller budget."""
    from pathlib import Path

    from grooves.training import load_config, run_config
    from grooves.runs.store import read_metrics

    config = load_config(Path(__file__).parents[1] / "examples" / "envs" / f"{name}.toml")
    config.model.spec, config.steps = "tiny", 1
    config.env.train_tasks, config.env.heldout_tasks, config.log.val_size = 4, 2, 2
    config.env.options = {**config.env.options, "max_tokens": 48}
    config.sampling.max_completion_length, config.train.group_size = 24, 2
    config.log.tensorboard = False
    run = run_config(config, out=tmp_path / name, progress=False)
    rows = read_metrics(run.dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    assert set(config.env.options) <= set(load_env(name).option_names())
    weights = load_env(name).weights
    assert all(f"reward/{score}" in rows[1] for score in weights) and "env/turns" in rows[1]


def test_a_package_env_that_fails_to_import_or_shadows_a_builtin_is_named(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from grooves.cli import app

    (tmp_path / "broken_envs.py").write_text("import a_module_nobody_has\n")
    dist = tmp_path / "broken_envs-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-envs\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[grooves.envs]\nbroken = broken_envs:Shop\nhelpdesk = broken_envs:Desk\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(UserWarning, match="broken_envs:Desk that a package registers as 'helpdesk' is shadowed"):
        assert available()["helpdesk"] == "grooves.envs.helpdesk:Helpdesk"
    with pytest.warns(UserWarning, match="shadowed"):  # said again each time the registry is read
        result = CliRunner().invoke(app, ["env", "try", "broken", "--model", "tiny"])
    assert result.exit_code == 2 and "No module named 'a_module_nobody_has'" in result.output
    assert "Traceback" not in result.output
