import json

import pytest

from grooves.tasks import TaskSourceError, TaskStream, load_tasks, render_prompt, split_tasks
from grooves.tasks.sources import BalancedStream
from grooves.tasks import titles


def test_jsonl_and_csv_sources(tmp_path):
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text('{"prompt": "a", "answer": 1}\n\n{"prompt": "b", "answer": 2, "id": "x"}\n')
    assert [(t["id"], t["answer"]) for t in load_tasks(jsonl)] == [("0", 1), ("x", 2)]
    csv = tmp_path / "t.csv"
    csv.write_text("text,label\nhello,1\nworld,0\n")
    tasks = load_tasks(csv)
    assert tasks[1] == {"text": "world", "label": "0", "id": "1"}


def test_bad_sources_name_the_problem(tmp_path):
    with pytest.raises(TaskSourceError, match="does not exist"):
        load_tasks(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(TaskSourceError, match=r"bad.jsonl:2: not valid JSON"):
        load_tasks(bad)
    with pytest.raises(TaskSourceError, match="must end in .jsonl or .csv"):
        load_tasks(tmp_path)
    with pytest.raises(TaskSourceError, match="unknown built-in"):
        load_tasks("builtin:nope")


def test_datasets_object_is_a_source():
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list([{"prompt": "p1", "n": 1}, {"prompt": "p2", "n": 2}])
    assert [t["n"] for t in load_tasks(ds)] == [1, 2]


def test_split_is_stable_under_reordering():
    tasks = [{"id": str(i)} for i in range(200)]
    train, held = split_tasks(tasks, 0.25, seed=3)
    train2, held2 = split_tasks(list(reversed(tasks)), 0.25, seed=3)
    assert {t["id"] for t in held} == {t["id"] for t in held2}
    assert 30 < len(held) < 70 and len(train) + len(held) == 200


def test_render_prompt():
    task = {"id": "1", "text": "hi", "prompt": "raw"}
    assert render_prompt(task) == [{"role": "user", "content": "raw"}]
    assert render_prompt(task, "Say: {text}", system="be brief") == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "Say: hi"}]
    with pytest.raises(TaskSourceError, match="names column 'missing'"):
        render_prompt(task, "{missing}")
    with pytest.raises(TaskSourceError, match="no 'prompt' column"):
        render_prompt({"id": "2", "text": "x"})


def test_task_stream_resumes_in_the_same_order():
    tasks = [{"id": str(i)} for i in range(7)]
    stream = TaskStream(tasks, seed=1)
    first = [t["id"] for t in stream.take(5)]
    state = stream.state()
    rest = [t["id"] for t in stream.take(10)]
    again = TaskStream(tasks, seed=1)
    again.restore(state)
    assert [t["id"] for t in again.take(10)] == rest
    assert sorted(first + rest[:2]) == sorted(t["id"] for t in tasks)  # an epoch covers every task once


def test_a_balanced_stream_draws_every_kind_in_each_round_however_rare_and_resumes():
    tasks = [{"id": f"r{i}", "kind": "refund"} for i in range(20)] + [{"id": "a0", "kind": "address"},
                                                                     {"id": "a1", "kind": "address"},
                                                                     {"id": "s0", "kind": "status"}]
    stream = BalancedStream(tasks, "kind", seed=3)
    drawn = [t for _ in range(5) for t in stream.take(3)]
    for round_ in range(5):  # one of each kind a round, the rare ones over again
        assert sorted(t["kind"] for t in drawn[3 * round_: 3 * round_ + 3]) == ["address", "refund", "status"]
    assert {t["id"] for t in drawn if t["kind"] == "address"} == {"a0", "a1"}
    assert len({t["id"] for t in drawn if t["kind"] == "refund"}) == 5  # refunds not repeated in their epoch
    state = stream.state()
    rest = [t["id"] for t in stream.take(8)]
    again = BalancedStream(tasks, "kind", seed=3)
    again.restore(state)
    assert [t["id"] for t in again.take(8)] == rest
    with pytest.raises(TaskSourceError, match="no column 'topic' to balance by"):
        BalancedStream(tasks, "topic")


def test_a_run_resumed_with_another_balance_by_is_told_so():
    from grooves.training.config import ConfigError
    from grooves.training.tasksets import TaskMix, TaskSet

    tasks = [{"id": f"t{i}", "kind": "ab"[i % 2], "size": "sml"[i % 3]} for i in range(12)]
    sets = [TaskSet(name="", train=tasks, heldout=[], reward=None)]
    plain, balanced = TaskMix(sets), TaskMix(sets, balance_by="kind")
    plain.take(), balanced.take()
    with pytest.raises(ConfigError, match="train.balance_by: the checkpoint's tasks were drawn in one order, without balance_by"):
        TaskMix(sets, balance_by="kind").restore(plain.state())
    with pytest.raises(ConfigError, match=r"drawn in turns over \['a', 'b'\]"):
        TaskMix(sets).restore(balanced.state())
    with pytest.raises(ConfigError, match="in turns over"):
        TaskMix(sets, balance_by="size").restore(balanced.state())
    again = TaskMix(sets, balance_by="kind")
    again.restore(balanced.state())
    assert [again.take()[1]["id"] for _ in range(6)] == [balanced.take()[1]["id"] for _ in range(6)]


def test_builtin_titles_split():
    train, held = titles.tasks("train"), titles.tasks("heldout")
    assert len(held) >= 50 and len(train) > len(held)
    assert not {t["id"] for t in train} & {t["id"] for t in held}
    assert held == titles.tasks("heldout")  # deterministic
    assert held[0]["prompt"][1]["content"].endswith(held[0]["text"])


def test_titles_reward_components_by_hand():
    text = "Return a sorted list of the items, sorting numbers before strings."
    assert titles.format_ok("Sorted items list") == 1.0
    assert titles.format_ok('"Sorted items"') == 0.0
    assert titles.format_ok("Title: Sorted items") == 0.0
    assert titles.format_ok("Sorted\nitems") == 0.0
    assert titles.length_ok("one two three") == 1.0
    assert titles.length_ok("one two") == pytest.approx(0.85)
    assert titles.length_ok(" ".join(["w"] * 12)) == pytest.approx(0.7)
    # content stems: sorted->"sorte", items->"items", quantum->"quant"; 2 of 3 occur in the text
    assert titles.grounded("Sorted items quantum", text) == pytest.approx(2 / 3)
    # reference stems {retur, sorte, list}; title {sorte, list, items}: P = R = 2/3 -> F1 = 2/3
    assert titles.reference_f1("Sorted list items", "Return sorted list") == pytest.approx(2 / 3)
    assert titles.reference_f1("Nothing alike", "Return sorted list") == 0.0
    # shape counts only for a title that uses the text: "A worthy answer" shares no stem with it
    assert titles.format_score("A worthy answer", text) == 0.0 and titles.length_score("A worthy answer", text) == 0.0
    assert titles.format_score("Sorted items list", text) == 1.0 and titles.length_score("Sorted items list", text) == 1.0


def test_titles_data_rows_are_well_formed():
    for row in titles.tasks():
        assert set(row) == {"id", "reference", "text", "prompt"}
        assert 25 <= len(row["text"].split()) <= 80
    json.dumps(titles.tasks()[0])
