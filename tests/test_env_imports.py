"""The envs room's public names stay where they were after State moved to envs/state.py (the import
circle it broke is guarded, with every other, by tests/test_layers.py)."""

import grooves.envs


def test_the_public_names_stay():
    from grooves.envs import base, state

    assert grooves.envs.State is state.State is base.State
    assert grooves.envs.TokenLog is state.TokenLog is base.TokenLog
    for name in grooves.envs.__all__:
        assert hasattr(grooves.envs, name), name
