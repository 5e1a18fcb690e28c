"""The Tinker cookbook's own loops against ``grooves backend serve`` (issue 34, part 4).

``tinker-cookbook`` 0.6.1, installed from the registry into a virtualenv of its own
(``.venv-cookbook``, made by ``make install``), runs its ``rl_loop`` and ``sl_loop`` for 2 steps
each against the service on the tiny model, through ``tests/cookbook/run_loop.py`` (the loops'
code unchanged; it sets the URL, the model name, the data and, for RL, the grader). And the
cookbook renderer docs/backend.md names, ``qwen3_instruct``, is held token for token against the
bundled model's chat template.
"""

from __future__ import annotations

import json
import math
import os
import re
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
tinker = pytest.importorskip("tinker")

ROOT = Path(__file__).resolve().parent.parent
COOKBOOK = ROOT / ".venv-cookbook" / "bin" / "python"
SCRIPTS = Path(__file__).resolve().parent / "cookbook"
KEY = "tml-alice-0000000000"
TINY_VOCAB = 3 + 256  # the byte tokenizer: three ChatML specials and the 256 bytes

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not COOKBOOK.exists(), reason="no cookbook virtualenv at .venv-cookbook: `make install` "
                       "makes it (tinker-cookbook 0.6.1 from the registry)"),
]


def grooves_cli(*args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-c", "from grooves.cli import main; main()", *args],
                            text=True, env=env, **kwargs)


def start_service(runs: Path, keys: Path) -> tuple[subprocess.Popen, str]:
    proc = grooves_cli("backend", "serve", "--model", "tiny", "--port", "0", "--keys", str(keys), "--runs", str(runs),
                   stderr=subprocess.PIPE)
    deadline, seen = time.monotonic() + 240, ""
    while time.monotonic() < deadline and proc.poll() is None:
        line = proc.stderr.readline()
        seen += line
        if match := re.search(r"http://127\.0\.0\.1:(\d+)", line):
            url = f"http://127.0.0.1:{match.group(1)}"
            while time.monotonic() < deadline:  # the socket is bound before the model loads
                try:
                    if httpx.get(url + "/api/v1/healthz", headers={"X-API-Key": KEY}).status_code == 200:
                        # keep reading the log, or a full pipe would stall the service
                        threading.Thread(target=proc.stderr.read, daemon=True).start()
                        return proc, url
                except httpx.HTTPError:
                    time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"grooves backend serve did not start: {seen}")


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    root = tmp_path_factory.mktemp("cookbook")
    keys = root / "keys.toml"
    keys.write_text(f'[tenants.alice]\nkey = "{KEY}"\n')
    # the tokenizer the user copies to the client machine: the base model's exported folder
    assert grooves_cli("base", "export", "--model", "tiny", str(root / "tiny")).wait(timeout=300) == 0
    proc, url = start_service(root / "runs", keys)
    try:
        yield {"url": url, "root": root, "tokenizer": root / "tiny",
               "ledger": root / "runs" / "backend" / "ledger.sqlite"}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def run_loop(service, loop: str) -> Path:
    log = service["root"] / loop
    env = {**os.environ, "TINKER_API_KEY": KEY, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run([str(COOKBOOK), str(SCRIPTS / "run_loop.py"), loop, "--base-url", service["url"],
                           "--model", "tiny", "--tokenizer", str(service["tokenizer"]), "--log-path", str(log)],
                          capture_output=True, text=True, env=env, timeout=540, cwd=service["root"])
    assert done.returncode == 0, done.stderr[-4000:]
    return log


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def trained(service, loop_log: Path) -> tuple[str, dict]:
    """The final checkpoint's training run and that run's ledger totals (tokens by kind)."""
    final = read_jsonl(loop_log / "checkpoints.jsonl")[-1]
    run = final["state_path"][len("tinker://"):].split("/")[0]
    with sqlite3.connect(service["ledger"]) as db:
        rows = db.execute("SELECT kind, SUM(prompt_tokens), SUM(sampled_tokens), SUM(trained_tokens), COUNT(*) "
                          "FROM usage WHERE model IN (?, ?) GROUP BY kind", (run, run.replace(":", "-"))).fetchall()
    return final, {kind: rest for kind, *rest in rows}


def check_checkpoint(service, final: dict) -> None:
    """The loop's final save is a checkpoint the service can describe: a rank-4 LoRA on tiny."""
    assert final["name"] == "final" and final["batch"] == 2
    rest = tinker.RestClient(base_url=service["url"], api_key=KEY)
    for path in (final["state_path"], final["sampler_path"]):
        info = rest.get_weights_info_by_tinker_path(path).result()
        assert (info.base_model, info.is_lora, info.lora_rank) == ("tiny", True, 4)


def test_the_cookbooks_sl_loop_trains_two_steps(service):
    log = run_loop(service, "sl")
    metrics = read_jsonl(log / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1]
    # a random tiny model is close to uniform over its vocabulary: nll = ln(259) = 5.557
    assert metrics[0]["train_mean_nll"] == pytest.approx(math.log(TINY_VOCAB), abs=0.15)
    assert all(math.isfinite(m["train_mean_nll"]) and math.isfinite(m["grad_norm:mean"]) for m in metrics)
    assert [m["num_sequences"] for m in metrics] == [2, 2]
    final, usage = trained(service, log)
    # the service charged exactly the tokens the cookbook says it sent in its two batches
    assert usage["forward_backward"][2] == sum(m["num_tokens"] for m in metrics)
    assert usage["forward_backward"][3] == 2  # one forward_backward per step
    check_checkpoint(service, final)


def test_the_cookbooks_rl_loop_samples_and_trains_two_steps(service):
    log = run_loop(service, "rl")
    metrics = read_jsonl(log / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1]
    assert all(0.0 <= m["reward/total"] <= 1.0 and math.isfinite(m["grad_norm:mean"]) for m in metrics)
    final, usage = trained(service, log)
    prompt, sampled, _, samples = usage["sample"]
    # 2 steps x 2 questions, each one sample call for 4 replies of at most 16 tokens
    assert samples == 4 and 0 < sampled <= 2 * 2 * 4 * 16
    # each trained datum is its prompt (less one token) and its reply, so training saw more than was sampled
    assert usage["forward_backward"][3] == 2 and usage["forward_backward"][2] > sampled
    check_checkpoint(service, final)


# --- the renderer ---------------------------------------------------------------------------

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
CONVERSATIONS = [
    [{"role": "system", "content": DEFAULT_SYSTEM}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4."}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi there"},
     {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Name a fruit.\n"},
     {"role": "assistant", "content": "An apple."}],
    [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}],
]


@pytest.fixture(scope="module")
def bundled_tokenizer():
    from transformers import AutoTokenizer

    from grooves.policy.models import bundled_folder

    folder = bundled_folder("bundled:smollm2-135m-instruct")
    return folder, AutoTokenizer.from_pretrained(folder)


def test_qwen3_instruct_renders_the_bundled_chat_template_token_for_token(bundled_tokenizer):
    folder, tokenizer = bundled_tokenizer
    done = subprocess.run([str(COOKBOOK), str(SCRIPTS / "render.py"), "qwen3_instruct", str(folder)],
                          input=json.dumps(CONVERSATIONS), capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    rendered = json.loads(done.stdout)

    def template(convo, prompt: bool) -> list[int]:
        return list(tokenizer.apply_chat_template(convo, add_generation_prompt=prompt, tokenize=True,
                                                  return_dict=False))

    end, newline = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.encode("\n", add_special_tokens=False)
    assert rendered["stop"] == [end] == [tokenizer.eos_token_id]  # sampling stops where the template ends a turn
    for convo, out in zip(CONVERSATIONS[:2], rendered["conversations"]):
        assert out["prompt"] == template(convo[:-1], prompt=True)
        # the template closes the last turn with "<|im_end|>\n"; the renderer stops at "<|im_end|>",
        # the token the model samples last, so the newline the sampler never sees is not trained
        assert out["full"] + newline == template(convo, prompt=False)
    # no system message: SmolLM2's template adds its default one, the renderer adds none
    header = tokenizer.encode(f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n", add_special_tokens=False)
    bare = rendered["conversations"][2]
    assert header + bare["prompt"] == template(CONVERSATIONS[2][:-1], prompt=True)
    assert header + bare["full"] + newline == template(CONVERSATIONS[2], prompt=False)
