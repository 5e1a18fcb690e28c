import math

import pytest

from grooves.types import Group, Trajectory


def make(reward=1.0, **kw):
    return Trajectory(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                      prompt_ids=[1, 2], completion_ids=[3, 4], completion_mask=[1, 1], logprobs=[-0.5, -1.0],
                      reward=reward, **kw)


def test_group_json_round_trip_keeps_nan_as_nan():
    group = Group(task={"id": "t1", "text": "x"}, trajectories=[
        make(components={"ok": 1.0, "judge": math.nan}), make(reward=math.nan)])
    text = group.to_json()
    assert "NaN" not in text  # strict JSON: NaN is written as null
    back = Group.from_json(text)
    assert math.isnan(back.trajectories[1].reward)
    assert math.isnan(back.trajectories[0].components["judge"])
    assert back.trajectories[0].completion_ids == [3, 4]
    assert back.trajectories[0].completion == "a"


def test_trajectory_lengths_must_agree():
    with pytest.raises(ValueError, match="same length"):
        Trajectory(messages=[], prompt_ids=[1], completion_ids=[2, 3], completion_mask=[1], logprobs=[0.0, 0.0])
