"""Continuous learning's end-to-end gain on the bundled model (issue 27 part 3): a ``grooves serve
--capture`` subprocess of SmolLM2-135M-Instruct answers the scripted users (the official ``openai``
client, the demo's title prompts), ``grooves learn`` trains on that traffic with the demo's verifier,
the gate moves ``prod`` to a checkpoint that scores better on held-out tasks, and the next requests
are answered by it. The loop's mechanics (rollback, a refused regression, kill -9 and resume) are
tested on the tiny model in ``tests/test_learn.py``.

The settings are the demo's verifier and model with short completions (16 tokens) at temperature
0.7, 4 prompts x 8 samples a step, lr 1e-3. On this 2-core machine (2026-12-06, quiet) the test took
127 s and the gate's held-out reward rose at every step: 0.575, 0.652, 0.686, 0.711; the paired gain
of step 3 over the base was 0.136 +- 0.034 (4.0 standard errors; the test asks for 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grooves.tasks.titles import tasks as title_tasks
from grooves.workflows.learn import paired
from test_learn import learn, ledger, serve, served_by, users

pytestmark = pytest.mark.slow

BUNDLED = "bundled:smollm2-135m-instruct"
STEPS, PER_STEP, GROUP, TOKENS = 3, 4, 8, 16


@pytest.fixture(scope="module")
def bundled(tmp_path_factory):
    root = tmp_path_factory.mktemp("learn-bundled")
    for url in serve(root, BUNDLED):
        yield root, url


def config(root: Path, url: str) -> Path:
    path = root / "titles.toml"
    path.write_text(f'''name = "titles"
seed = 0
[model]
spec = "{BUNDLED}"
[lora]
rank = 8
alpha = 16
[tasks]
source = "builtin:titles"
[reward]
builtin = "titles"
[algorithm]
preset = "dapo"
dynamic_sampling = false
[sampling]
temperature = 0.7
max_completion_length = {TOKENS}
[optim]
learning_rate = 1e-3
[train]
group_size = {GROUP}
[log]
tensorboard = false
[sampler]
url = "{url}"
max_wait = 120
[learn]
capture = "{root / 'capture'}"
every_prompts = {PER_STEP}
max_prompts_per_step = {PER_STEP}
heldout_size = 24
poll_seconds = 0.2
''')
    return path


def test_the_bundled_model_learns_from_its_traffic_and_prod_moves_to_the_better_checkpoint(bundled):
    root, url = bundled
    prompts = [t["prompt"] for t in title_tasks("train")[:STEPS * PER_STEP]]
    before = users(url, prompts, model=BUNDLED, max_tokens=TOKENS)
    done = learn(root, config(root, url), "--max-steps", str(STEPS), timeout=480)
    assert done.returncode == 0, done.stderr

    gates = ledger(root, "titles", "SELECT step, decision FROM gates ORDER BY step")
    assert [g[0] for g in gates] == list(range(1, STEPS + 1)), done.stderr
    rows = ledger(root, "titles", "SELECT step, heldout FROM alias ORDER BY id")
    start, (step, now) = json.loads(rows[0][1]), (rows[-1][0], json.loads(rows[-1][1]))
    gain, stderr, _, _ = paired(start, now)  # the gate's own paired difference (tests/test_learn_gate.py)
    assert step > 0, done.stderr  # prod moved off the base
    assert gain > 2 * stderr, (gain, stderr, done.stderr)  # to a checkpoint the verifier prefers on held-out tasks

    after = users(url, prompts, model="prod", max_tokens=TOKENS)
    assert {served_by(r) for r in after} == {f"titles@{step}"}  # the next requests: answered by it
    text = [r.parse().choices[0].message.content for r in before], [r.parse().choices[0].message.content for r in after]
    assert text[0] != text[1]  # and with the trained adapter, not the base's greedy replies
