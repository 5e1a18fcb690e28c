"""``grooves learn`` and ``grooves serve --capture`` refuse bad input with one clear line (exit 2),
before any model is loaded."""

from __future__ import annotations

from typer.testing import CliRunner

from grooves.cli import app

runner = CliRunner()

BASE = '''name = "learner"
[model]
spec = "tiny"
[tasks]
source = "builtin:titles"
'''


def learn(tmp_path, text: str, *args: str):
    path = tmp_path / "learn.toml"
    path.write_text(text)
    return runner.invoke(app, ["learn", str(path), "--runs", str(tmp_path / "runs"), *args])


def test_learn_needs_a_server(tmp_path):
    result = learn(tmp_path, BASE + '[learn]\ncapture = "c"\n')
    assert result.exit_code == 2
    assert "grooves learn samples through the server: give [sampler] url" in " ".join(result.output.split())


def test_learn_names_an_unknown_key_and_a_bad_bound(tmp_path):
    server = '[sampler]\nurl = "http://127.0.0.1:9/v1"\n'
    result = learn(tmp_path, BASE + server + '[learn]\ncapture = "c"\nevery_prompt = 3\n')
    assert result.exit_code == 2 and "learn.every_prompt" in result.output
    result = learn(tmp_path, BASE + server + '[learn]\ncapture = "c"\nevery_prompts = 20\nmax_prompts_per_step = 4\n')
    assert result.exit_code == 2 and "every_prompts = 20 is more than max_prompts_per_step = 4" in result.output


def test_learn_without_a_capture_store_or_a_run_to_roll_back(tmp_path):
    text = BASE + '[sampler]\nurl = "http://127.0.0.1:9/v1"\n[learn]\ncapture = "' + str(tmp_path / "none") + '"\n'
    result = learn(tmp_path, text)
    assert result.exit_code == 2 and "no capture store at" in result.output
    result = learn(tmp_path, text, "--rollback")
    assert result.exit_code == 2 and "holds no grooves learn run" in " ".join(result.output.split())


def test_serve_refuses_a_capture_folder_it_cannot_write(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    result = runner.invoke(app, ["serve", "--model", "tiny", "--port", "0", "--capture", str(blocker / "sub")])
    assert result.exit_code == 2 and "cannot open the capture store" in " ".join(result.output.split())
