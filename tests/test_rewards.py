import math

import pytest

from grooves.rewards import Component, Reward, RewardReport, as_reward, import_object
from grooves.types import Group, Trajectory


def group_of(*completions, task=None):
    return Group(task=task or {"id": "t", "answer": "42"}, trajectories=[
        Trajectory(messages=[{"role": "assistant", "content": c}], prompt_ids=[1], completion_ids=[2],
                   completion_mask=[1], logprobs=[0.0]) for c in completions])


def test_arguments_are_passed_by_name_including_task_columns():
    def exact(completion, answer):
        return float(completion.strip() == answer)

    def sees_all(completion, task, group, **rest):
        return float(len(group) == 2 and task["id"] == "t" and "answer" in rest)

    reward = Reward([Component("exact", exact), Component("all", sees_all, weight=0.5)])
    group = group_of("42", "41")
    reward.score([group])
    assert [t.components["exact"] for t in group] == [1.0, 0.0]
    assert [t.reward for t in group] == [1.5, 0.5]


def test_failures_are_nan_and_counted_never_zero():
    def flaky(completion):
        if completion == "boom":
            raise RuntimeError("judge down")
        return 1.0

    def infinite(completion):
        return math.inf if completion == "inf" else 0.5

    reward = Reward([Component("flaky", flaky), Component("inf", infinite, required=False)])
    group = group_of("fine", "boom", "inf")
    report = reward.score([group])
    fine, boom, inf = group.trajectories
    assert fine.reward == 1.5
    assert math.isnan(boom.components["flaky"]) and math.isnan(boom.reward)  # required component failed
    assert math.isnan(inf.components["inf"]) and inf.reward == 1.0  # optional: left out of the total
    assert report.errors == {"flaky": 1, "inf": 1}
    assert "RuntimeError: judge down" in report.first_error["flaky"]


def test_weight_zero_is_logged_only():
    reward = Reward([Component("real", lambda completion: 1.0), Component("metric", lambda: 7.0, weight=0)])
    group = group_of("x")
    reward.score([group])
    assert group.trajectories[0].reward == 1.0 and group.trajectories[0].components["metric"] == 7.0


def test_a_failing_metric_only_component_does_not_cost_the_trajectory():
    def broken():
        raise RuntimeError("down")

    group = group_of("x")
    report = Reward([Component("real", lambda completion: 1.0), Component("metric", broken, weight=0)]).score([group])
    assert group.trajectories[0].reward == 1.0 and math.isnan(group.trajectories[0].components["metric"])
    assert report.errors == {"metric": 1}


def test_missing_argument_is_an_error_with_the_columns():
    reward = Reward([Component("needs", lambda label: 1.0)])
    group = group_of("x")
    report = reward.score([group], RewardReport())
    assert "asks for ['label']" in report.first_error["needs"]


def test_as_reward_and_names():
    def alpha(completion):
        return 1.0

    assert [c.name for c in as_reward(alpha).components] == ["alpha"]
    assert [c.name for c in as_reward({"a": alpha, "b": alpha}).components] == ["a", "b"]
    with pytest.raises(ValueError, match="unique"):
        Reward([Component("a", alpha), Component("a", alpha)])
    with pytest.raises(ValueError, match="reserved"):
        Component("total", alpha)


def test_import_object(tmp_path):
    file = tmp_path / "my_reward.py"
    file.write_text("def score(completion):\n    return 2.0\n")
    assert import_object(f"{file}:score")("x") == 2.0
    assert import_object("grooves.tasks.titles:format_ok")("A title") == 1.0
    with pytest.raises(ValueError, match="has no attribute"):
        import_object("grooves.tasks.titles:nope")
    with pytest.raises(ValueError, match="must look like"):
        import_object("no_colon")


@pytest.mark.parametrize("make_async", [False, True])
def test_keyboard_interrupt_in_a_verifier_reaches_the_caller_and_the_loop_survives(make_async):
    def stop(completion):
        raise KeyboardInterrupt

    async def stop_async(completion):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Reward([Component("stop", stop_async if make_async else stop)]).score([group_of("x")])
    group = group_of("x")
    Reward([Component("fine", lambda completion: 1.0)]).score([group])  # the rewards' loop still runs
    assert group.trajectories[0].reward == 1.0
