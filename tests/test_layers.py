"""The rooms' import arrows point one way (DESIGN.md): a lower room never loads a higher one."""

import subprocess
import sys

import pytest

FORBIDDEN = {
    "grooves.types": ["grooves.policy", "grooves.rewards", "grooves.monitors", "grooves.training"],
    "grooves.scoring": ["grooves.policy", "grooves.rewards", "grooves.monitors", "grooves.training"],
    "grooves.progress": ["grooves.policy", "grooves.rewards", "grooves.monitors", "grooves.training", "grooves.cli"],
    "grooves.monitors": ["grooves.rewards", "grooves.policy", "grooves.training", "grooves.cli"],
    "grooves.algorithms": ["grooves.policy", "grooves.training", "grooves.cli"],
    "grooves.rewards": ["grooves.training", "grooves.monitors", "grooves.cli"],
}


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_a_room_does_not_load_rooms_above_it(room):
    code = (f"import sys, importlib; importlib.import_module({room!r}); "
            "print('\\n'.join(m for m in sys.modules if m.startswith('grooves.')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    wrong = [m for m in loaded if any(m == f or m.startswith(f + ".") for f in FORBIDDEN[room])]
    assert not wrong, f"{room} loads {wrong}"
