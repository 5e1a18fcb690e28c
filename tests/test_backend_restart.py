"""A kill -9 of ``grooves backend serve`` mid-run: after a restart on the same runs root, a client
that creates its training client from the last saved state (with the optimizer), and the training
client made before the kill (its model comes back from its last saved state), both end at the same
adapter as a run that was never interrupted; a request pending at the kill answers 410."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

tinker = pytest.importorskip("tinker")
httpx = pytest.importorskip("httpx")

from safetensors.torch import load_file  # noqa: E402
from tinker import types  # noqa: E402

KEY = "tml-alice-0000000000"
DATUM = types.Datum(model_input=types.ModelInput.from_ints(list(range(60, 75))),
                    loss_fn_inputs={"target_tokens": list(range(61, 76)), "weights": [1.0] * 15})
ADAM = types.AdamParams(learning_rate=1e-2, grad_clip_norm=1.0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(runs, keys, port) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-c", "from grooves.cli import main; main()", "backend", "serve",
                             "--model", "tiny", "--port", str(port), "--keys", str(keys), "--runs", str(runs)],
                            stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 240
    seen = ""
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        seen += line
        match = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        if match:
            url = f"http://127.0.0.1:{match.group(1)}"
            while True:  # the socket is bound before the model loads; wait for answers
                try:
                    if httpx.get(url + "/api/v1/healthz", headers={"X-API-Key": KEY}).status_code == 200:
                        return proc, url
                except httpx.HTTPError:
                    time.sleep(0.1)
        if proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"grooves backend serve did not start: {seen}")


def steps(training, n):
    for _ in range(n):
        training.forward_backward([DATUM], "cross_entropy").result()
        training.optim_step(ADAM).result()


def adapter(runs, sampler_path: str):
    run, kind, name = sampler_path[len("tinker://"):].split("/")
    return load_file(str(runs / "backend" / "alice" / run.replace(":", "-") / kind / name / "adapter"
                         / "adapter_model.safetensors"))


@pytest.mark.slow
def test_kill_9_then_restart_and_load_state_continues_to_the_same_adapter(tmp_path):
    keys = tmp_path / "keys.toml"
    keys.write_text(f'[tenants.alice]\nkey = "{KEY}"\n')
    runs = tmp_path / "runs"
    port = free_port()
    proc, url = start(runs, keys, port)
    try:
        first_client = client = tinker.ServiceClient(base_url=url, api_key=KEY)
        straight = client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
        steps(straight, 4)
        straight_path = straight.save_weights_for_sampler("straight").result().path

        interrupted = client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
        steps(interrupted, 2)
        state = interrupted.save_state("mid").result().path
        steps(interrupted, 1)  # trained after the last save: lost with the process
        with httpx.Client(base_url=url, headers={"X-API-Key": KEY}) as raw:
            pending = raw.post("/api/v1/save_weights", json={"model_id": interrupted.model_id, "seq_id": 99,
                                                             "path": "never"}).json()["request_id"]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    proc, url = start(runs, keys, port)  # the same port: the clients made before the kill carry on
    try:
        with httpx.Client(base_url=url, headers={"X-API-Key": KEY}) as raw:
            gone = raw.post("/api/v1/retrieve_future", json={"request_id": pending})
            assert gone.status_code == 410 and "restarted" in gone.json()["detail"]
        client = tinker.ServiceClient(base_url=url, api_key=KEY)
        resumed = client.create_training_client_from_state_with_optimizer(state).result()
        steps(resumed, 2)
        resumed_path = resumed.save_weights_for_sampler("resumed").result().path
        client.close("success").result(timeout=60)  # a close that never answers fails, not hangs
        # the client from before the kill: its model comes back from "mid" (the step after it is lost)
        steps(interrupted, 2)
        continued_path = interrupted.save_weights_for_sampler("continued").result().path
        first_client.close("success").result(timeout=60)  # a close that never answers fails, not hangs  # its heartbeats would outlive the test
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    want = adapter(runs, straight_path)
    for got in (adapter(runs, resumed_path), adapter(runs, continued_path)):
        assert want.keys() == got.keys() and want
        for name in want:
            assert (want[name] - got[name]).abs().max().item() < 1e-5, name
    assert any((w != 0).any() for n, w in want.items() if "lora_B" in n)  # it did train
