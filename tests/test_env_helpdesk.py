"""The helpdesk env: scripted agents on its shop database, with outcomes checked by hand.

The numbers below were read off the database that ``db_seed = 0`` builds: customer 1 is
Sara Chen, whose order 2 is two blue rugs for 83.98 (placed 2024-05-27, a home item: 60 days,
refundable to 2024-07-26), order 3 a green speaker, shipped; customer 4, Sara Patel, has
order 11, a red lamp placed 2024-04-18 (refundable to 2024-06-17, before today 2024-06-30);
order 116 is customer 39's; the seeded database holds 18 refund tickets.
"""

import asyncio
import json

import jsonschema
import pytest

from grooves.envs import load_env
from grooves.envs.helpdesk import Helpdesk
from grooves.envs.rollout import Turn, advance, env_groups, run_states, start
from grooves.policy.policy import Policy

SEEDED_TICKETS = 18
TABLES = ("customers", "refund_policy", "products", "orders", "order_items", "tickets")


@pytest.fixture(scope="module")
def policy():
    return Policy.load("tiny")


@pytest.fixture(scope="module")
def env():
    return Helpdesk()


def task(env, task_id):
    (found,) = [t for t in env.tasks("train") + env.tasks("heldout") if t["id"] == task_id]
    return found


def call(name, **arguments):
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def scripted(policy, *scripts):
    """Script k drives the k-th rollout, one text per turn; a rollout leaves the batch when its
    script is spent (its last turn answers), so the live scripts line up with the prompts."""
    position = [0] * len(scripts)

    def generate(prompts, budgets, pasts=None):
        live = [k for k, script in enumerate(scripts) if position[k] < len(script)]
        assert len(live) == len(prompts)
        turns = []
        for k in live:
            text = scripts[k][position[k]]
            position[k] += 1
            ids = policy.tokenizer.encode(text, add_special_tokens=False) + [policy.end_of_turn_id]
            turns.append(Turn(text, ids, [-0.1] * len(ids), "stop"))
        return turns

    return generate


def play(policy, env, task, script, seed=0):
    state = start(policy, env, task, seed)
    run_states(policy, env, [state], scripted(policy, script), turn_tokens=256)
    return state


def total(env, scores):
    return sum(env.weights[name] * value for name, value in scores.items())


def dump(env, state):
    db = env.db(state)
    return {table: env.rows(db, f"SELECT * FROM {table} ORDER BY 1") for table in TABLES}


SOLVE_REFUND = [call("find_customer", query="Sara Chen"), call("list_orders", customer_id=1),
                call("get_order", order_id=2), call("issue_refund", order_id=2),
                call("reply", message="I have refunded $83.98 for your blue rugs.")]


def test_list_orders_shows_one_row_per_product_with_its_orders_id_newest_first(env):
    from grooves.envs.replay import replay

    rows = json.loads(replay(env, task(env, "helpdesk-refund-1-2"), SOLVE_REFUND[:2]).messages[-1]["content"])
    want = env.rows(env.template, "SELECT p.name AS product, o.id AS order_id, o.placed_on FROM orders o "
                                  "JOIN order_items i ON i.order_id = o.id JOIN products p ON p.id = i.product_id "
                                  "WHERE o.customer_id = 1 ORDER BY o.placed_on DESC, o.id DESC, i.id")
    assert rows == want and len(want) >= 3


def test_a_solved_refund_scores_full_marks_and_changes_exactly_the_order_and_a_ticket(policy, env):
    refund = task(env, "helpdesk-refund-1-2")
    assert refund["expected"]["facts"] == [["83.98"], ["refund"]]
    state = play(policy, env, refund, SOLVE_REFUND)
    try:
        scores = env.score(state)
        assert scores == {"action": 1.0, "reply": 1.0, "customer": 1.0, "order": 1.0, "format": 1.0}
        assert total(env, scores) == pytest.approx(1.0)
        assert state.finish == "answer" and state.answer == "I have refunded $83.98 for your blue rugs."
        assert state.turns == 5 and state.counters["tool_calls"] == 5
        db = env.db(state)
        assert env.row(db, "SELECT status FROM orders WHERE id = 2") == {"status": "refunded"}
        assert env.rows(db, "SELECT * FROM tickets WHERE id > ?", SEEDED_TICKETS) == [
            {"id": 19, "customer_id": 1, "order_id": 2, "kind": "refund", "amount": 83.98}]
        assert set(env.changed_rows(state)) == {"orders", "tickets"}
    finally:
        env.close(state)


def test_a_refund_reply_that_also_refuses_gets_no_reply_credit(policy, env):
    script = SOLVE_REFUND[:-1] + [call("reply", message="Refunded 83.98, though I cannot refund it.")]
    state = play(policy, env, task(env, "helpdesk-refund-1-2"), script)
    assert env.score(state)["reply"] == 0.0 and env.score(state)["action"] == 1.0
    env.close(state)


@pytest.mark.parametrize("task_id, script", [
    ("helpdesk-refuse_late-4-11", [call("find_customer", query="Sara Patel"), call("list_orders", customer_id=4),
                                   call("get_order", order_id=11), call("issue_refund", order_id=11),
                                   call("reply", message="Done, refunded $69.99.")]),
    ("helpdesk-refuse_other-1-116", [call("find_customer", query="sara.chen@example.com"),
                                     call("get_order", order_id=116), call("issue_refund", order_id=116),
                                     call("reply", message="Done, refunded $96.98.")]),
])
def test_always_refunding_fails_the_refusals(policy, env, task_id, script):
    state = play(policy, env, task(env, task_id), script)
    scores = env.score(state)
    # the right customer and order were found, but the refund is the wrong change and the reply gives no reason
    assert scores == {"action": 0.0, "reply": 0.0, "customer": 1.0, "order": 1.0, "format": 1.0}
    assert total(env, scores) == pytest.approx(0.4)
    assert env.changed_rows(state)["orders"]["changed"][0][1]["status"] == "refunded"
    env.close(state)


REFUNDED_LOOKUPS = [call("find_customer", query="raj.silva@example.com"), call("list_orders", customer_id=37),
                    call("get_order", order_id=111)]  # order 111 was refunded before


@pytest.mark.parametrize("task_id, script", [
    ("helpdesk-refuse_late-4-11", [call("find_customer", query="Sara Patel"), call("list_orders", customer_id=4),
                                   call("get_order", order_id=11), call(
        "reply", message="Sorry, I can\u2019t refund it: its refund window ended on 2024-06-17.")]),
    # naming the earlier refund is not a claim of one (CLAIMS)
    ("helpdesk-refuse_refunded-37-111", REFUNDED_LOOKUPS + [
        call("reply", message="I cannot refund order #111: it has already been refunded.")]),
])
def test_a_correct_refusal_scores_full_marks_and_changes_nothing(policy, env, task_id, script):
    state = play(policy, env, task(env, task_id), script)
    assert env.score(state) == {"action": 1.0, "reply": 1.0, "customer": 1.0, "order": 1.0, "format": 1.0}
    assert env.changed_rows(state) == {}
    env.close(state)


def test_a_status_question_leaves_the_database_alone_and_a_plain_answer_ends_it(policy, env):
    status = task(env, "helpdesk-status-1-3")
    assert status["expected"]["facts"] == [["shipped"]] and status["expected"]["changes"] == {}
    script = [call("find_customer", query="sara.chen@example.com"), call("list_orders", customer_id=1),
              call("get_order", order_id=3), call("get_order", order_id=2), "Your green speaker has shipped."]
    state = play(policy, env, status, script)
    assert state.finish == "answer" and state.answer == "Your green speaker has shipped."
    assert env.changed_rows(state) == {}
    # two orders opened for one that was needed: half the order credit
    assert env.score(state) == {"action": 1.0, "reply": 1.0, "customer": 1.0, "order": 0.5, "format": 1.0}
    env.close(state)


def test_doing_nothing_is_not_a_free_action_score(policy, env):
    state = play(policy, env, task(env, "helpdesk-status-1-3"), ["Hello! How can I help?"])
    scores = env.score(state)
    assert scores == {"action": 0.0, "reply": 0.0, "customer": 0.0, "order": 0.0, "format": 0.0}
    env.close(state)


def test_a_refusal_by_inaction_earns_no_action_credit(policy, env):
    """What RL learned when a look-up was enough: find the customer, then break every call."""
    refusal = task(env, "helpdesk-refuse_late-4-11")
    broken = '<tool_call>{"name": "reply", "arguments": {"message\': "I cannot refund it."}}</tool_call>'
    lazy = play(policy, env, refusal, [call("find_customer", query="Sara Patel")] + [broken] * 7)
    assert lazy.finish == "max_turns" and env.changed_rows(lazy) == {} and env.score(lazy)["action"] == 0.0
    env.close(lazy)
    unread = play(policy, env, refusal, [call("find_customer", query="Sara Patel"),
                                         call("reply", message="Sorry, I can't refund it.")])
    assert env.score(unread)["action"] == 0.0  # the order was never opened: a guess, not a decision
    env.close(unread)


def test_refusing_a_status_question_earns_no_action_credit(policy, env):
    """What RL learned when any reply after the look-ups counted as the action of a task without a
    change: refuse every request, the status questions too (docs/agents.md, issue 28 part 2)."""
    status = task(env, "helpdesk-status-1-3")
    looked_up = [call("find_customer", query="sara.chen@example.com"), call("list_orders", customer_id=1),
                 call("get_order", order_id=3)]
    refused = play(policy, env, status, looked_up + [
        call("reply", message="I cannot refund order #3: it does not belong to your account.")])
    assert env.score(refused) == {"action": 0.0, "reply": 0.0, "customer": 1.0, "order": 1.0, "format": 1.0}
    env.close(refused)
    told = play(policy, env, status, looked_up + [call("reply", message="Your order #3 is shipped.")])
    assert env.score(told)["action"] == 1.0 and env.solved(env.score(told))
    env.close(told)


@pytest.mark.parametrize("task_id, script", [
    ("helpdesk-refuse_refunded-37-111", REFUNDED_LOOKUPS + [
        call("reply", message="I have issued a refund for order #111.")]),
    ("helpdesk-refund-1-2", SOLVE_REFUND[:3] + [call("reply", message="I've refunded $83.98 for order #2.")]),
    ("helpdesk-address-16-address", [call("find_customer", query="ana.silva@example.com"), call(
        "reply", message="I have changed your address to 16 High Street, Fairview.")]),
])
def test_a_reply_reporting_a_change_never_made_scores_nothing(policy, env, task_id, script):
    """What RL learned from a 128-demo warm start (docs/agents.md, issue 28): look everything up,
    then tell the customer of a refund never issued. The score paid the look-ups (0.4 to 0.6)."""
    state = play(policy, env, task(env, task_id), script)
    assert env.changed_rows(state) == {} and state.finish == "answer"
    assert env.score(state) == {"action": 0.0, "reply": 0.0, "customer": 0.0, "order": 0.0, "format": 0.0}
    env.close(state)


def test_run_states_reports_each_round(policy, env):
    """Validation of 40 agent rollouts takes minutes: each round says how many have finished."""
    refusal = task(env, "helpdesk-refuse_late-4-11")
    states = [start(policy, env, refusal, 0) for _ in range(2)]
    rounds = []
    run_states(policy, env, states, scripted(policy, [call("find_customer", query="Sara Patel"), "Bye."], ["Hi."]),
               turn_tokens=64, on_round=lambda *args: rounds.append(args))
    assert rounds == [(1, 1, 2), (2, 2, 2)]
    for state in states:
        env.close(state)


def test_rollouts_run_in_waves_each_to_its_end_before_the_next(policy, env):
    """192 helpdesk validation rollouts advanced together held 18 GB of KV caches: with a wave, at
    most that many tasks' rollouts are in a batch; every task still gets its group, in order, and
    progress counts the rounds and rollouts of all the waves as one run's."""
    tasks = env.tasks("heldout", n=5)
    batches, rounds = [], []

    def generate(prompts, budgets, pasts=None):  # look someone up, then reply
        batches.append(len(prompts))
        texts = [call("find_customer", query="nobody") if policy.tokenizer.decode(p).count("assistant") < 2
                 else call("reply", message="Done.") for p in prompts]
        return [Turn(t, policy.tokenizer.encode(t, add_special_tokens=False) + [policy.end_of_turn_id],
                     [-0.1] * (len(policy.tokenizer.encode(t, add_special_tokens=False)) + 1), "stop") for t in texts]

    groups = env_groups(policy, env, tasks, 1, generate, 64, wave=2, on_round=lambda *args: rounds.append(args))
    assert batches == [2, 2, 2, 2, 1, 1]  # waves of 2, 2 and 1 tasks, two turns each
    assert [g.task["id"] for g in groups] == [t["id"] for t in tasks]
    assert {t.metadata["state"]["finish"] for g in groups for t in g.trajectories} == {"answer"}
    assert rounds == [(1, 0, 5), (2, 2, 5), (3, 2, 5), (4, 4, 5), (5, 4, 5), (6, 5, 5)]
    batches.clear()
    env_groups(policy, env, tasks, 1, generate, 64)
    assert batches == [5, 5]


def test_an_address_change(policy, env):
    change = task(env, "helpdesk-address-2-address")
    assert change["prompt"].endswith("change my address to 92 Oak Street, Lakeside.")
    script = [call("find_customer", query="eva.silva@example.com"),
              call("update_address", customer_id=2, address=" 92 Oak Street,  Lakeside"),
              call("reply", message="Your address is now 92 Oak Street, Lakeside.")]
    state = play(policy, env, change, script)
    assert env.score(state) == {"action": 1.0, "reply": 1.0, "customer": 1.0, "order": 1.0, "format": 1.0}
    moved = env.row(env.db(state), "SELECT address FROM customers WHERE id = 2")
    assert moved == {"address": "92 Oak Street, Lakeside"}  # the tool collapses the model's stray spaces
    env.close(state)


def test_concurrent_rollouts_have_private_databases(policy, env, monkeypatch):
    refusal = [call("find_customer", query="sara.chen@example.com"), call("list_orders", customer_id=1),
               call("get_order", order_id=2), call("get_product", product_id=6),
               call("reply", message="I cannot refund that.")]
    seen = []
    close = env.close
    monkeypatch.setattr(env, "close", lambda state: (seen.append(env.changed_rows(state)), close(state)))
    (group,) = env_groups(policy, env, [task(env, "helpdesk-refund-1-2")], n=2,
                          generate=scripted(policy, SOLVE_REFUND, refusal), turn_tokens=256)
    refunded, refused = [t.metadata["env_scores"] for t in group.trajectories]
    assert refunded["action"] == 1.0 and refused["action"] == 0.0 and refused["reply"] == 0.0
    assert set(seen[0]) == {"orders", "tickets"} and seen[1] == {}
    assert env.row(env.template, "SELECT status FROM orders WHERE id = 2") == {"status": "delivered"}
    assert env.row(env.template, "SELECT count(*) AS n FROM tickets") == {"n": SEEDED_TICKETS}


def test_snapshot_restore_continue_matches_an_uninterrupted_rollout(policy, env):
    refund = task(env, "helpdesk-refund-1-2")
    whole = play(policy, env, refund, SOLVE_REFUND, seed=7)
    first = start(policy, env, refund, seed=7)
    generate = scripted(policy, SOLVE_REFUND[:2])
    for _ in range(2):
        advance(policy, env, [first], generate, turn_tokens=256)
    blob = env.snapshot(first)
    env.close(first)
    resumed = env.restore(blob)
    run_states(policy, env, [resumed], scripted(policy, SOLVE_REFUND[2:]), turn_tokens=256)

    assert dump(env, resumed) == dump(env, whole)
    assert resumed.messages == whole.messages  # tool-call ids included: they are numbered by turn
    assert vars(resumed.tokens) == vars(whole.tokens)
    assert (resumed.data, resumed.counters, resumed.answer) == (whole.data, whole.counters, whole.answer)
    assert resumed.rng.getstate() == whole.rng.getstate()
    assert env.score(resumed) == env.score(whole) == {"action": 1.0, "reply": 1.0, "customer": 1.0,
                                                      "order": 1.0, "format": 1.0}
    env.close(resumed)
    env.close(whole)


def test_bad_input_is_answered_and_counted_and_sql_stays_a_string(env):
    state = env.reset(task(env, "helpdesk-refund-1-2"))
    injection = "x' OR 1=1; DROP TABLE customers; --"
    turns = [call("find_customer", query=injection), call("get_order", order_id="twelve"),
             call("get_order", order_id=9999), call("list_orders", customer_id=1, limit=5),
             '<tool_call>{"name": "get_order", "arguments": {</tool_call>', call("delete_everything")]
    replies = [asyncio.run(env.respond(state, text))[0]["content"] for text in turns]
    assert replies[0] == f"error: find_customer failed: ValueError: no customer with email or name {injection!r}"
    assert replies[1].startswith("error: invalid arguments for get_order: order_id:")
    assert replies[2] == "error: get_order failed: ValueError: no order with id 9999"
    assert replies[3].startswith("error: invalid arguments for list_orders: limit:")
    assert "not valid JSON" in replies[4] and "unknown tool 'delete_everything'" in replies[5]
    assert env.row(env.db(state), "SELECT count(*) AS n FROM customers") == {"n": 64}
    assert env.changed_rows(state) == {} and not state.done
    # 5 calls + 1 malformed; malformed, unknown tool and 2 bad arguments are format errors, not-found is not
    assert env.score(state)["format"] == pytest.approx(1 - 4 / 6)
    assert env.score(state)["reply"] == 0.0  # no answer yet
    env.close(state)


def test_tasks_are_deterministic_disjoint_and_a_third_refusals(env):
    train, heldout = env.tasks("train"), env.tasks("heldout")
    assert len(train) == 208 and len(heldout) == 48  # 4 tasks for each of 64 customers; ids 5, 10, ... held out
    bigger = Helpdesk(customers=80)  # the agents example's shop: 16 more people, 64 held-out tasks
    assert len(bigger.tasks("train")) == 256 and len(bigger.tasks("heldout")) == 64
    assert bigger.row(bigger.template, "SELECT count(DISTINCT name) AS n FROM customers") == {"n": 80}
    assert [r["name"] for r in bigger.rows(bigger.template, "SELECT name FROM customers WHERE id IN (1, 80)")] == [
        "Sara Chen", "Omar Patel"]  # as before shops could pass 100 people: the recorded runs' shop
    biggest = Helpdesk(customers=240)  # 192 held-out tasks (docs/agents.md): names from a third list past 100
    assert len(biggest.tasks("train")) == 768 and len(biggest.tasks("heldout")) == 192
    assert biggest.row(biggest.template, "SELECT count(DISTINCT name) AS n FROM customers") == {"n": 240}
    with pytest.raises(ValueError, match="a shop has 1 to 256"):
        Helpdesk(customers=257).tasks("train")
    assert env.tasks("train", n=10, seed=3) == Helpdesk().tasks("train", n=10, seed=3)
    assert env.tasks("train", n=10, seed=3) != env.tasks("train", n=10, seed=4)
    assert sorted(t["id"] for t in env.tasks("train", seed=4)) == sorted(t["id"] for t in train)
    assert {t["expected"]["customer_id"] % 5 for t in heldout} == {0} and 0 not in {
        t["expected"]["customer_id"] % 5 for t in train}
    assert len({t["id"] for t in train + heldout}) == 256
    refusals = sum(t["kind"].startswith("refuse") for t in train) / len(train)
    assert 0.3 <= refusals <= 0.45
    assert {t["kind"] for t in train} == {"refund", "refuse_late", "refuse_refunded", "refuse_other", "status",
                                          "address"}
    assert Helpdesk(db_seed=1).tasks("train", n=5) != env.tasks("train", n=5)
    with pytest.raises(ValueError, match="unknown split"):
        env.tasks("test")


def test_every_task_is_consistent_with_the_database(env):
    db = env.template
    for t in env.tasks("train") + env.tasks("heldout"):
        expected, kind = t["expected"], t["kind"]
        customer = env.row(db, "SELECT * FROM customers WHERE id = ?", expected["customer_id"])
        assert customer["email"] in t["prompt"] or customer["name"] in t["prompt"]
        if kind == "address":
            continue
        order = env._order(db, expected["order_id"])
        assert order["items"][0]["name"] in t["prompt"]
        assert (order["customer_id"] == customer["id"]) == (kind != "refuse_other")
        in_window = order["refund_window_ends"] >= "2024-06-30"
        assert order["refund_window_open"] is in_window  # what get_order shows beside the date
        assert {"refund": in_window and order["status"] == "delivered", "refuse_late": not in_window,
                "refuse_refunded": order["status"] == "refunded", "refuse_other": in_window,
                "status": order["status"] in ("processing", "shipped")}[kind]


def test_tool_schemas_are_openai_function_schemas_with_described_arguments(env):
    schemas = {s["function"]["name"]: s for s in env.tool_schemas()}
    assert set(schemas) == {"find_customer", "list_orders", "get_order", "get_product", "issue_refund",
                            "update_address", "reply"}
    for schema in schemas.values():
        assert schema["type"] == "function" and schema["function"]["description"]
        parameters = schema["function"]["parameters"]
        jsonschema.Draft202012Validator.check_schema(parameters)
        assert parameters["type"] == "object" and parameters["additionalProperties"] is False
        assert set(parameters["required"]) == set(parameters["properties"])
        assert all(p["description"] and p["type"] in ("string", "integer") for p in parameters["properties"].values())
    assert schemas["update_address"]["function"]["parameters"]["properties"] == {
        "customer_id": {"type": "integer", "description": "the customer's id (from find_customer)"},
        "address": {"type": "string", "description": "the new address, as the customer wrote it"}}


def test_registered_under_its_name():
    env = load_env("helpdesk", db_seed=2)
    assert isinstance(env, Helpdesk) and env.db_seed == 2 and sum(env.weights.values()) == pytest.approx(1.0)
