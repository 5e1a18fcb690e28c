"""The search env: a stdlib documentation corpus in SQLite FTS5, its questions, tools and score."""

from __future__ import annotations

import asyncio
import json
import sqlite3

import pytest

from grooves.envs import load_env
from grooves.envs.rollout import Turn, advance, env_groups, start
from grooves.envs.search import (
    Search, baseline_answer, bm25_baseline, bm25_search, heldout, match_query, normalise, token_f1,
)
from grooves.policy.policy import Policy


@pytest.fixture(scope="module")
def env():
    return Search()


@pytest.fixture(scope="module")
def policy():
    return Policy.load("tiny")


def task_by_id(env: Search, task_id: str) -> dict:
    return dict(next(t for t in env.question_pool if t["id"] == task_id))


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def scripted(policy, turns: list[str]):
    """A ``generate`` for one rollout that plays ``turns`` in order."""
    remaining = list(turns)

    def generate(prompts, budgets, pasts=None):
        assert len(prompts) == 1
        text = remaining.pop(0)
        ids = policy.tokenizer.encode(text, add_special_tokens=False) + [policy.end_of_turn_id]
        return [Turn(text, ids, [0.0] * len(ids), "stop")]

    return generate


def play(policy, env, task, turns):
    (group,) = env_groups(policy, env, [task], n=1, generate=scripted(policy, turns), turn_tokens=64)
    (trajectory,) = group.trajectories
    return trajectory


# --- corpus and index -----------------------------------------------------------------


def test_corpus_has_a_known_function_and_bm25_ranks_it_first(env):
    doc = env.corpus["shutil.copytree"]
    assert doc.kind == "function"
    assert "dirs_exist_ok=False" in doc.signature and "<function copy2>" in doc.signature  # no memory address
    assert doc.body.startswith("Recursively copy a directory tree")
    assert 500 < len(env.corpus) < 1000
    assert Search().corpus == env.corpus  # a second build is identical
    hits = bm25_search(env.template, "recursively copy a directory tree", 3)
    assert hits[0]["doc_id"] == "shutil.copytree"
    assert hits[0]["title"] == "shutil.copytree (function)"
    assert "copytree(" not in hits[0]["snippet"]  # defaults are only found by reading


def test_a_missing_fts5_is_a_clear_error():
    class NoFts(Search):
        schema = "CREATE VIRTUAL TABLE docs USING no_such_fts(doc_id, title, signature, body);"

    with pytest.raises(RuntimeError, match="FTS5"):
        NoFts().reset({"prompt": "q", "id": "q"})


# --- questions ----------------------------------------------------------------------


def test_tasks_are_deterministic_and_splits_disjoint(env):
    assert env.tasks("train", 40, seed=3) == env.tasks("train", 40, seed=3)
    assert env.tasks("train", 40, seed=3) != env.tasks("train", 40, seed=4)
    train, held = env.tasks("train"), env.tasks("heldout")
    assert {t["source"] for t in train}.isdisjoint(t["source"] for t in held)
    assert len(held) >= 200 and len(train) + len(held) == len(env.question_pool)
    assert len({t["id"] for t in train + held}) == len(train) + len(held)
    assert [t["kind"] for t in env.tasks("heldout", 6)] == ["default", "name", "described_default"] * 2
    assert all(heldout(t["source"]) for t in held)
    with pytest.raises(ValueError, match="split"):
        env.tasks("test")


def test_the_kinds_option_keeps_only_those_kinds_in_the_same_order(env):
    some = Search(kinds=["default", "described_default"])
    tasks = some.tasks("train")
    assert {t["kind"] for t in tasks} == {"default", "described_default"}
    assert len(tasks) == sum(t["kind"] != "name" for t in env.tasks("train"))
    assert [t["kind"] for t in some.tasks("heldout", 4)] == ["default", "described_default"] * 2
    with pytest.raises(ValueError, match="unknown kinds"):
        Search(kinds=["nmae"]).tasks("train")


def test_every_answer_is_in_its_source_document(env):
    for task in env.question_pool:
        text = env.corpus[task["source"]].text
        if task["kind"] == "name":
            assert task["answer"] == task["source"] and task["source"] not in task["prompt"]
        else:
            assert f"{task['param']}={task['answer']}" in text, task["id"]
            assert task["answer"] != "None" and f"`{task['param']}`" in task["prompt"]


def test_question_wording_by_hand(env):
    task = task_by_id(env, "search/name/shutil.copytree")
    assert task["prompt"] == ('Which Python standard-library function or class is described as "Recursively copy a '
                              'directory tree and return the destination directory"? Answer with its full name, '
                              'like `module.name`.')
    task = task_by_id(env, "search/default/textwrap.wrap/width")
    assert task["answer"] == "70" and task["source"] == "textwrap.wrap"


# --- scoring --------------------------------------------------------------------------


def test_normalise_and_f1_by_hand():
    assert normalise("  `shutil.copytree()`. ") == "shutil.copytree"
    assert normalise("'strict'") == normalise("strict") == "strict"
    # "copytree" against "shutil.copytree": precision 1/1, recall 1/2, F1 = 2 * 1 * 0.5 / 1.5
    assert token_f1("copytree", "shutil.copytree") == pytest.approx(2 / 3)
    # "the default is True" against "True": precision 1/4, recall 1, F1 = 2 * 0.25 / 1.25 = 0.4
    assert token_f1("The default is True", "True") == pytest.approx(0.4)
    assert token_f1("False", "True") == 0.0


def test_restating_the_question_earns_no_partial_credit(env):
    task = task_by_id(env, "search/name/logging.basicConfig")
    assert "logging" in task["prompt"]
    # without the question, an echo shares "logging" with the answer: precision 1/n, recall 1/2
    assert token_f1(task["prompt"], task["answer"]) > 0
    assert token_f1(task["prompt"], task["answer"], task["prompt"]) == 0.0
    # the module alone was given away by the question; the right name still scores in full
    assert token_f1("logging.NullHandler", task["answer"], task["prompt"]) == 0.0
    assert token_f1("logging.basicConfig", task["answer"], task["prompt"]) == 1.0
    assert token_f1("basicConfig", task["answer"], task["prompt"]) == 1.0
    state = env.reset(task)
    state.answer = task["prompt"]
    assert env.score(state)["answer_f1"] == 0.0
    # a question that holds every word of its answer falls back to plain F1
    assert token_f1("json dumps", "json.dumps", "what does json.dumps do?") == 1.0


def test_search_read_answer_scores_full_marks(env, policy):
    task = task_by_id(env, "search/described_default/calendar.TextCalendar/firstweekday")
    result = play(policy, env, task, [call("search", query="plain text calendar like the UNIX program cal", k=3),
                                      call("read", doc_id="calendar.TextCalendar"), call("answer", text="0")])
    assert result.metadata["env_scores"] == {"exact": 1.0, "answer_f1": 1.0, "read_source": 1.0, "searched": 1.0,
                                             "format": 1.0}
    state = result.metadata["state"]
    assert state["data"] == {"searches": ["plain text calendar like the UNIX program cal"],
                             "reads": ["calendar.TextCalendar"]}
    assert state["finish"] == "answer" and state["turns"] == 3
    tool_replies = [m for m in result.messages if m["role"] == "tool"]
    assert json.loads(tool_replies[0]["content"])[0]["doc_id"] == "calendar.TextCalendar"
    assert "firstweekday=0" in tool_replies[1]["content"]
    assert sum(result.completion_mask) > 0 and 0 in result.completion_mask  # env tokens carry no gradient


def test_answering_without_reading_and_wrong_answers_score_lower(env, policy):
    task = task_by_id(env, "search/name/shutil.copytree")
    unread = play(policy, env, task, [call("search", query="copy a directory tree"),
                                      call("answer", text="shutil.copytree")])
    assert unread.metadata["env_scores"]["exact"] == 1.0
    assert unread.metadata["env_scores"]["read_source"] == 0.0
    wrong = play(policy, env, task, [call("read", doc_id="shutil.copytree"), "copytree"])  # plain text answers too
    scores = wrong.metadata["env_scores"]
    assert scores["exact"] == 0.0 and scores["answer_f1"] == pytest.approx(2 / 3)
    assert scores["read_source"] == 1.0 and scores["searched"] == 0.0
    sloppy = play(policy, env, task, ['<tool_call>{"name": "search", "arguments": </tool_call>',
                                      call("find", query="copy"), call("answer", text="shutil.copytree")])
    assert sloppy.metadata["env_scores"]["format"] == pytest.approx(1 / 3)  # 1 of 3 attempts well formed
    blind = play(policy, env, task, ["shutil.copytree"])
    assert blind.metadata["env_scores"] == {"exact": 1.0, "answer_f1": 1.0, "read_source": 0.0, "searched": 0.0,
                                            "format": 0.0}


def test_out_of_turns_scores_zero_answer(env, policy):
    task = task_by_id(env, "search/default/textwrap.wrap/width")
    env_short = Search(max_turns=2)
    result = play(policy, env_short, task, [call("search", query="wrap"), call("search", query="width")])
    assert result.metadata["state"]["finish"] == "max_turns"
    assert result.metadata["env_scores"]["exact"] == 0.0 and result.metadata["env_scores"]["answer_f1"] == 0.0


# --- bad input ------------------------------------------------------------------------


def reply(env, state, text) -> str:
    (message,) = asyncio.run(env.respond(state, text))
    return message["content"]


def test_bad_input_gets_error_messages_and_the_index_survives(env):
    state = env.reset(task_by_id(env, "search/name/shutil.copytree"))
    try:
        assert match_query('"unbalanced AND OR (') == '"unbalanced" OR "AND" OR "OR"'
        for query in ['"unbalanced AND OR (', "NEAR(", 'title: "x', "a* ^b -c"]:
            assert isinstance(json.loads(reply(env, state, call("search", query=query))), list)
        for query in ["*", "", "((( ))) --"]:
            assert reply(env, state, call("search", query=query)).startswith("error: search failed: ValueError: "
                                                                             "the query has no words")
        for k in (0, 11):
            assert "invalid arguments for search: k:" in reply(env, state, call("search", query="copy", k=k))
        injected = reply(env, state, call("read", doc_id="x'; DROP TABLE docs; --"))
        assert injected.startswith("error: read failed: ValueError: no document")
        assert "did you mean shutil.copytree" in reply(env, state, call("read", doc_id="shutil.copytre"))
        assert state.counters["tool_errors/raised"] == 5 and state.counters["tool_errors/bad_arguments"] == 2
        assert state.data["reads"] == [] and not state.done
        db = env.db(state)
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            db.execute("DELETE FROM docs")
        assert db.execute("SELECT count(*) FROM docs").fetchone()[0] == len(env.corpus)
        assert bm25_search(db, "recursively copy a directory tree", 1)[0]["doc_id"] == "shutil.copytree"
    finally:
        env.close(state)


# --- snapshot and restore -------------------------------------------------------------


def without_call_ids(messages):
    """Tool call ids are random per call; everything else must match."""
    text = json.dumps(messages)
    for message in messages:
        for call_ in message.get("tool_calls", []):
            text = text.replace(call_["id"], "ID")
    return json.loads(text)


def test_snapshot_restore_continue_matches_uninterrupted(env, policy):
    task = task_by_id(env, "search/described_default/calendar.TextCalendar/firstweekday")
    turns = [call("search", query="plain text calendar"), call("read", doc_id="calendar.TextCalendar"),
             call("answer", text="0")]
    straight = start(policy, env, task)
    interrupted = start(policy, env, task)
    generate_a, generate_b = scripted(policy, turns), scripted(policy, turns)
    advance(policy, env, [straight], generate_a, 64)
    advance(policy, env, [interrupted], generate_b, 64)
    snapshot = env.snapshot(interrupted)
    env.close(interrupted)
    assert len(snapshot) < 50_000  # the read-only index is rebuilt from the template, not carried
    resumed = env.restore(snapshot)
    for _ in range(2):
        advance(policy, env, [straight], generate_a, 64)
        advance(policy, env, [resumed], generate_b, 64)
    assert resumed.done and straight.done
    assert resumed.tokens.ids == straight.tokens.ids and resumed.tokens.mask == straight.tokens.mask
    assert resumed.data == straight.data and resumed.counters == straight.counters
    assert without_call_ids(resumed.messages) == without_call_ids(straight.messages)
    assert env.score(resumed) == env.score(straight) == {"exact": 1.0, "answer_f1": 1.0, "read_source": 1.0,
                                                         "searched": 1.0, "format": 1.0}
    env.close(straight)
    env.close(resumed)


# --- baseline and registry ----------------------------------------------------------


def test_bm25_baseline(env):
    assert baseline_answer(env, task_by_id(env, "search/name/shutil.copytree")) == ("shutil.copytree",
                                                                                   "shutil.copytree")
    assert baseline_answer(env, task_by_id(env, "search/default/textwrap.wrap/width"))[0] == "70"
    result = bm25_baseline(env, env.tasks("heldout", 30))
    assert result["n"] == 30
    assert set(result) >= {"exact", "answer_f1", "top1_source", "exact/name", "exact/default"}
    assert 0.0 <= result["exact"] <= result["answer_f1"] <= 1.0


def test_registered_by_name():
    assert isinstance(load_env("search"), Search)
