"""A run's store keeps what training and review need of a rollout, not the env's whole data store.

A wrapped benchmark that keeps its database in ``state.data`` (as a plain dict) made each stored
trajectory about as large as the database. ``python tests/test_env_storage.py`` prints the
bytes per trajectory of a one-step run on such an env, with and without its store.
"""

import json
import sqlite3
import sys
from pathlib import Path

from typer.testing import CliRunner

from grooves.cli import app
from grooves.envs import load_env
from grooves.envs.replay import replay
from grooves.envs.rollout import trajectory
from grooves.envs.state import stored_data

LEDGER_PY = '''
from grooves.envs import Env, tool


class Ledger(Env):
    """A benchmark whose data store lives in state.data: ``rows`` orders of about 110 characters."""

    name = "ledger"
    weights = {"found": 1.0}
    rows = 0
    max_turns = 2
    max_tokens = 24

    def tasks(self, split="train", n=None, seed=0):
        tasks = [{"id": f"o{i}", "prompt": f"Status of #{i}?", "order": f"#{i}"} for i in range(4)]
        return [tasks[i % 4] for i in range(n or 4)]

    def setup(self, state):
        state.data["orders"] = {f"#{i}": {"status": "delivered", "note": "x" * 80} for i in range(self.rows)}
        state.data["looked_up"] = []

    @tool
    def status(self, state, order: str) -> str:
        """An order's status."""
        state.data["looked_up"].append(order)
        return state.data["orders"].get(order, {}).get("status", "Error: no such order")

    def score(self, state):
        return {"found": float(state.task["order"] in state.data["looked_up"] and bool(state.data["orders"]))}
'''

RUN_TOML = '''
name = "{name}"
steps = 1
[model]
spec = "tiny"
[env]
name = "{env}"
train_tasks = 4
heldout_tasks = 0
options = {{rows = {rows}}}
[sampling]
max_completion_length = 12
[train]
group_size = 2
tasks_per_step = 2
[log]
tensorboard = false
'''


def run_bytes(folder: Path, rows: int) -> tuple[int, int, int]:
    """A one-step run (4 trajectories) on the ledger env with ``rows`` orders: (trajectories,
    bytes of their stored records, bytes of run.sqlite with its write-ahead log)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ledger.py").write_text(LEDGER_PY)
    name = f"ledger-{rows}"
    config = folder / f"{name}.toml"
    config.write_text(RUN_TOML.format(name=name, env=folder / "ledger.py:Ledger", rows=rows))
    result = CliRunner().invoke(app, ["train", str(config), "--runs", str(folder / "runs"), "--quiet"])
    assert result.exit_code == 0, result.output
    db_path = folder / "runs" / name / "run.sqlite"
    with sqlite3.connect(db_path) as db:
        count, data = db.execute("SELECT count(*), sum(length(data)) FROM trajectories").fetchone()
    files = sum(p.stat().st_size for p in db_path.parent.glob("run.sqlite*"))
    return count, data, files


def test_a_runs_store_grows_by_kilobytes_per_trajectory_not_by_the_envs_data(tmp_path):
    small = run_bytes(tmp_path, 0)
    large = run_bytes(tmp_path, 10_000)  # about 1.1 MB of orders in each rollout's state.data
    assert small[0] == large[0] == 4
    per_trajectory = (large[1] - small[1]) / 4
    assert per_trajectory <= 200  # the orders leave only a digest behind (measured: 102 bytes)
    assert (large[2] - small[2]) / 4 <= 2048  # the file itself: a few pages at most, not 1.1 MB


def test_large_data_is_stored_as_a_digest_and_small_data_as_it_is(tmp_path):
    (tmp_path / "ledger.py").write_text(LEDGER_PY)
    env = load_env(f"{tmp_path / 'ledger.py'}:Ledger", rows=100)
    state = env.reset(env.tasks()[0])
    state.data["looked_up"].append("#0")
    state.messages.append({"role": "assistant", "content": "done"})
    kept = trajectory(env, state).metadata["state"]["data"]
    assert kept["looked_up"] == ["#0"]
    orders = json.dumps(state.data["orders"])
    assert kept["orders"] == {"omitted_chars": len(orders), "sha256": kept["orders"]["sha256"]}
    # each order '"#K": {"status": "delivered", "note": "x...x"}' is 120 characters and K's digits
    # (10 + 180 of them), with 99 ", " between and the two braces
    assert len(orders) == 100 * 120 + 190 + 99 * 2 + 2 == 12_390
    same = load_env(f"{tmp_path / 'ledger.py'}:Ledger", rows=100).reset(env.tasks()[1])
    assert stored_data(same.data, 4000)["orders"] == kept["orders"]  # equal data, equal digest
    assert trajectory(env, state).metadata["env_scores"] == {"found": 1.0}  # score read the whole store


def test_the_budget_replaces_the_largest_values_first_and_keeps_what_the_env_needs():
    data = {"a": "x" * 30, "b": "y" * 50, "c": [1, 2], "env_bugs": ["z" * 100]}
    kept = stored_data(data, 60)
    assert kept["a"] == "x" * 30 and kept["c"] == [1, 2] and kept["env_bugs"] == data["env_bugs"]
    assert kept["b"]["omitted_chars"] == 52  # 50 characters and two quotes; a, b and c (6) were 90 > 60
    assert stored_data(data, 10_000) == data
    assert stored_data({"a": "x" * 30, "b": "y" * 50}, 10)["a"]["omitted_chars"] == 32  # both go over budget


def test_a_replay_keeps_the_whole_data_for_the_env_author(tmp_path):
    (tmp_path / "ledger.py").write_text(LEDGER_PY)
    env = load_env(f"{tmp_path / 'ledger.py'}:Ledger", rows=100)
    assert len(replay(env, env.tasks()[0], ["Done."]).data["orders"]) == 100


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        for rows in (0, 10_000):
            count, data, files = run_bytes(Path(folder), rows)
            print(json.dumps({"rows": rows, "trajectories": count, "record_bytes_per_trajectory": data // count,
                              "run_sqlite_bytes": files}), file=sys.stdout)
