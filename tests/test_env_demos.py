"""Scripted rollouts and expert demonstrations: replayed through the env, scored by its own score()."""

import json
from pathlib import Path

import pytest

from grooves.envs import load_env
from grooves.envs.base import call_text
from grooves.envs.replay import demonstrations, replay


@pytest.fixture(scope="module")
def helpdesk():
    return load_env("helpdesk")


@pytest.fixture(scope="module")
def search():
    return load_env("search")


def test_every_helpdesk_demo_earns_every_score(helpdesk):
    tasks = helpdesk.tasks("train", 60, seed=1)
    kept, counts = demonstrations(helpdesk, tasks)
    assert counts == {"kept": 60, "no_demo": 0, "imperfect": 0}
    kinds = {r.task["kind"] for r in kept}
    assert kinds == {"refund", "refuse_late", "refuse_refunded", "refuse_other", "status", "address"}
    refund = next(r for r in kept if r.task["kind"] == "refund")
    roles = [m["role"] for m in refund.messages]
    assert roles == ["system", "user"] + ["assistant", "tool"] * 5  # find, list, get, refund, reply
    call = refund.messages[2]["tool_calls"][0]["function"]
    assert call["name"] == "find_customer" and json.loads(call["arguments"])["query"] in refund.task["prompt"]


def test_a_helpdesk_demo_decides_a_refund_next_to_the_fields_it_rests_on(helpdesk):
    kept, _ = demonstrations(helpdesk, helpdesk.tasks("train"))
    verdicts = {"refund": "I can refund it.", "refuse_late": "Window closed", "refuse_refunded": "Refunded already",
                "refuse_other": "Not your order"}
    for result in kept:
        kind, opened = result.task["kind"], [i for i, m in enumerate(result.messages) if m["role"] == "tool"
                                             and '"refund_window_open"' in m["content"]]
        if kind not in verdicts:
            continue
        order = json.loads(result.messages[opened[0]]["content"])
        decision = result.messages[opened[0] + 1]  # the turn right after get_order's result
        assert decision["content"].startswith(
            f"Order #{order['id']}: customer_id {order['customer_id']} (you are {result.task['expected']['customer_id']}), "
            f"status {order['status']}, refund_window_open {json.dumps(order['refund_window_open'])}.")
        assert verdicts[kind] in decision["content"]
        assert decision["tool_calls"][0]["function"]["name"] == ("issue_refund" if kind == "refund" else "reply")


def test_search_demos_read_a_source_their_search_showed(search):
    tasks = search.tasks("train", 60, seed=1)
    kept, counts = demonstrations(search, tasks)
    assert counts["imperfect"] == 0 and counts["kept"] >= 55
    for result in kept:
        shown = json.loads(result.messages[3]["content"])  # the search tool's result
        assert result.task["source"] in [hit["doc_id"] for hit in shown]
        assert result.scores["exact"] == result.scores["read_source"] == 1.0


def test_a_helpdesk_demo_quotes_the_purchase_row_of_the_product_named_before_opening_its_order(helpdesk):
    kept, _ = demonstrations(helpdesk, helpdesk.tasks("train"))
    listed = [r for r in kept if r.task["kind"] not in ("address", "refuse_other")]
    assert len(listed) >= 100
    for result in listed:
        rows = json.loads(result.messages[5]["content"])  # list_orders' result
        named = [row for row in rows if row["product"] in result.task["prompt"]]
        assert len(named) == 1 and named[0]["order_id"] == result.task["expected"]["order_id"]
        opening = result.messages[6]
        assert json.loads(opening["content"]) == {k: named[0][k] for k in ("product", "order_id")}
        assert opening["tool_calls"][0]["function"]["name"] == "get_order"


def test_a_search_demo_writes_the_default_as_the_signature_it_read_shows_it(search):
    kept, _ = demonstrations(search, search.tasks("train", 120, seed=2))
    defaults = [r for r in kept if r.task["kind"] != "name"]
    assert len(defaults) >= 20
    for result in defaults:
        read, last = result.messages[5]["content"], result.messages[6]
        written = f"{result.task['param']}={result.task['answer']}"
        assert last["content"] == f"In the signature: {written}." and written in read.splitlines()[1]
        assert json.loads(last["tool_calls"][0]["function"]["arguments"]) == {"text": result.task["answer"]}
    for result in (r for r in kept if r.task["kind"] == "name"):
        assert result.messages[6]["content"] == ""  # a name is answered straight from the read


def test_a_scripted_policy_violation_loses_the_action_score(helpdesk):
    task = next(t for t in helpdesk.tasks("train", 200) if t["kind"] == "refuse_late")
    good = helpdesk.demonstrate(task)
    bad = good[:-1] + [call_text("issue_refund", order_id=task["expected"]["order_id"]),
                       call_text("reply", message="I have refunded your order.")]
    result = replay(helpdesk, task, bad)
    assert result.finish == "answer" and result.scores["action"] == 0.0 and result.scores["reply"] == 0.0
    assert result.scores["customer"] == 1.0  # what it did right still counts


def test_a_script_that_runs_out_before_an_answer_ends_as_such(helpdesk):
    task = helpdesk.tasks("train", 1)[0]
    result = replay(helpdesk, task, helpdesk.demonstrate(task)[:2])
    assert result.finish == "script_ended" and result.turns == 2 and not result.full_score


def test_a_script_longer_than_max_turns_is_cut_there():
    env = load_env("helpdesk", max_turns=2)
    task = env.tasks("train", 1)[0]
    result = replay(env, task, env.demonstrate(task))
    assert result.finish == "max_turns" and result.turns == 2


@pytest.mark.parametrize("name", ["helpdesk", "search"])
def test_no_heldout_task_appears_in_a_demo_set(name, request):
    env = request.getfixturevalue(name)
    heldout = env.tasks("heldout")
    kept, _ = demonstrations(env, env.tasks("train"))
    demo_ids = {r.task["id"] for r in kept}
    demo_prompts = {r.task["prompt"] for r in kept}
    assert not demo_ids & {t["id"] for t in heldout}
    assert not demo_prompts & {t["prompt"] for t in heldout}
    if name == "search":  # held-out questions come from documents no demo reads
        read = {json.loads(m["tool_calls"][0]["function"]["arguments"]).get("doc_id")
                for r in kept for m in r.messages if m.get("tool_calls")}
        assert not read & {t["source"] for t in heldout}
    else:  # held-out customers are never looked up by a demo
        assert not {r.task["expected"]["customer_id"] for r in kept} & {t["expected"]["customer_id"] for t in heldout}


def test_a_demo_record_is_an_openai_chat(helpdesk):
    task = helpdesk.tasks("train", 1)[0]
    record = replay(helpdesk, task, helpdesk.demonstrate(task)).record()
    assert record["task_id"] == task["id"] and set(record["scores"]) == set(helpdesk.weights)
    for message in record["messages"]:
        assert "raw" not in message
        if message["role"] == "tool":
            assert message["tool_call_id"].startswith("call_")
    json.dumps(record)  # one JSON line


def test_demos_collected_from_a_served_model_keep_only_good_enough_rollouts():
    import asyncio

    from grooves.envs.replay import collect, endpoint_chat
    from grooves.serve.app import ServerThread, build_server, create_app
    from test_env_contract import Shop  # a small env: its prompt fits the tiny model's context

    env = Shop(max_turns=2)
    tasks = env.tasks() * 2
    with ServerThread(create_app(build_server("tiny"))) as server:
        chat = endpoint_chat(server.base_url, "tiny", max_tokens=12)
        kept, counts = collect(env, tasks, chat, min_score=0.0)
        assert counts == {"kept": 2, "below_min_score": 0}
        first = kept[0].messages[1]
        assert first["role"] == "assistant"
        again = asyncio.run(endpoint_chat(server.base_url, "tiny", max_tokens=12)(env.prompt(tasks[0]),
                                                                                   env.tool_schemas()))
        assert first["raw"] == again  # what the served model said
        strict, counts = collect(env, tasks, chat, min_score=1.0)  # a random tiny model moves nobody
        assert strict == [] and counts == {"kept": 0, "below_min_score": 2}


def test_env_demos_writes_chats_that_grooves_sft_renders(tmp_path):
    from typer.testing import CliRunner

    from grooves.cli import app
    from grooves.policy import Policy
    from grooves.training.sft_data import load_examples

    out = tmp_path / "demos.jsonl"
    result = CliRunner().invoke(app, ["env", "demos", "helpdesk", "--n", "6", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "6 of 6 train tasks written" in result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6 and all(r["tools"] and r["messages"][0]["role"] == "system" for r in rows)
    train, _ = load_examples(Policy.load("tiny"), str(out), heldout_fraction=0.01)
    assert train and all(sum(e.completion_mask) > 0 for e in train)


def test_env_replay_prints_the_scores_of_a_script_and_env_bugs_loudly(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from grooves.cli import app

    monkeypatch.setenv("COLUMNS", "200")
    env = load_env("helpdesk")
    task = env.tasks("train", 1)[0]
    script = tmp_path / "turns.json"
    script.write_text(json.dumps(env.demonstrate(task)))
    result = CliRunner().invoke(app, ["env", "replay", "helpdesk", "--task", task["id"], "--turns", str(script)])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "ended by its answer after 3 turns" in text and "│ total │ 1.000 │" in text  # find, get, reply
    script.write_text(json.dumps(["hello"]))
    short = CliRunner().invoke(app, ["env", "replay", "helpdesk", "--task", task["id"], "--turns", str(script)])
    assert "ended by its answer after 1 turn " in " ".join(short.output.split())
    script.write_text(json.dumps([call_text("broken"), "done"]))  # a tool whose function cannot be called
    contract = Path(__file__).parent / "test_env_contract.py"
    buggy = CliRunner().invoke(app, ["env", "replay", f"{contract}:Shop", "--task", "t1", "--turns", str(script)])
    assert buggy.exit_code == 0, buggy.output
    assert "bug in the env's own code" in buggy.output and "missing a required argument" in buggy.output
    script.write_text("{not json")
    bad = CliRunner().invoke(app, ["env", "replay", "helpdesk", "--task", task["id"], "--turns", str(script)])
    assert bad.exit_code == 2 and "--turns" in bad.output
