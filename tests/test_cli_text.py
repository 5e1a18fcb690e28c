"""What the grooves command prints is text to read and copy: help keeps every [table] name, a
command to copy is never wrapped, and the cli room's modules do not import their own package."""

import ast
import inspect
import io
import json
import re
import typing
from pathlib import Path

import typer
from rich.table import Table
from typer.testing import CliRunner

from grooves.cli import app

CLI = Path(__file__).resolve().parents[1] / "src" / "grooves" / "cli"
BRACKETED = re.compile(r"\[+[^\[\]\s][^\[\]]*\]+")  # [alerts], [[candidates]], [0, 1]
BOX = str.maketrans({c: " " for c in "│╭╮╰╯─┃━┏┓┗┛┡┩╇┳┻╋┣┫"})


def flat(text: str) -> str:
    """Rendered help as one line: box drawing gone, any run of whitespace one space."""
    return " ".join(text.translate(BOX).split())


def source_texts(typer_app: typer.Typer, path: list[str]):
    """(command path, help texts as written in the source): docstrings, help=, group help."""
    yield path, [typer_app.info.help] if isinstance(typer_app.info.help, str) else []
    for command in typer_app.registered_commands:
        texts = [command.help or "", inspect.getdoc(command.callback) or ""]
        for hint in typing.get_type_hints(command.callback, include_extras=True).values():
            texts += [getattr(meta, "help", None) or "" for meta in getattr(hint, "__metadata__", ())]
        name = command.name or command.callback.__name__.replace("_", "-")
        yield path + [name], texts
    for group in typer_app.registered_groups:
        yield from source_texts(group.typer_instance, path + [group.name])


def test_every_help_keeps_the_bracketed_names_of_its_source_text():
    checked = 0
    for path, texts in source_texts(app, []):
        names = {name for text in texts for name in BRACKETED.findall(flat(text))}
        if not names:
            continue
        result = CliRunner().invoke(app, [*path, "--help"])
        assert result.exit_code == 0, (path, result.output)
        shown = flat(result.output)
        missing = sorted(name for name in names if name not in shown)
        assert not missing, f"grooves {' '.join(path)} --help lost {missing}"
        checked += len(names)
    assert checked >= 8  # [alerts], [backend], [model], [data], [[candidates]], [reward], [ray], [tasks]


def test_train_help_names_the_alerts_and_backend_tables():
    shown = flat(CliRunner().invoke(app, ["train", "--help"]).output)
    assert "(the [alerts] section)" in shown and "as [backend] url does" in shown
    shown = flat(CliRunner().invoke(app, ["eval", "--help"]).output)
    assert "run or config, and [[candidates]];" in shown


def test_no_cli_module_imports_its_own_package():
    """grooves.cli imports its modules to register them; a module that imported grooves.cli back
    would close a circle (shared helpers live in cli/common.py)."""
    modules = {path.stem for path in CLI.glob("*.py")}
    wrong = []
    for path in sorted(CLI.glob("*.py")):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "grooves.cli":
                wrong += [f"{path.name}: {alias.name}" for alias in node.names if alias.name not in modules]
            if isinstance(node, ast.Import):
                wrong += [f"{path.name}: {alias.name}" for alias in node.names if alias.name == "grooves.cli"]
    assert not wrong


def test_no_cli_module_passes_400_lines():
    long = {path.name: n for path in CLI.glob("*.py") if (n := len(path.read_text().splitlines())) > 400}
    assert not long


def test_text_to_a_file_is_never_wrapped_and_a_table_is_never_cut():
    from grooves.cli.common import Stdout

    file = io.StringIO()
    console = Stdout(file=file, width=80)
    command = "grooves train " + "/a-long-folder" * 8 + "/config.toml --resume --runs /runs"  # 149 characters
    console.print(f"stopped after step 3 (checkpoint saved); continue with: {command}")
    table = Table("candidate", *(f"reward/component_{i}" for i in range(6)))  # 140 wide: see below
    table.add_row("run@latest", *(f"0.{i}23456" for i in range(6)))
    console.print(table)
    lines = file.getvalue().splitlines()
    assert lines[0] == f"stopped after step 3 (checkpoint saved); continue with: {command}"
    assert "…" not in file.getvalue()
    assert all(f"reward/component_{i}" in lines[2] and f"0.{i}23456" in lines[4] for i in range(6))
    # a border and " run@latest " (12), then 6 times a border and " reward/component_i " (20), a border
    assert len(lines) == 6 and len(lines[2]) == 1 + 12 + 6 * (1 + 20) + 1


def test_a_wide_table_leaves_the_width_following_columns(monkeypatch):
    from grooves.cli.common import Stdout

    console = Stdout(file=io.StringIO())
    monkeypatch.setenv("COLUMNS", "90")
    table = Table(*(f"reward/component_{i}" for i in range(6)))
    console.print(table)
    monkeypatch.setenv("COLUMNS", "100")
    assert console.width == 100


def test_the_probe_prints_its_next_commands_on_one_line(tmp_path):
    from test_alert_policy import planted_config

    folder = tmp_path / ("a-folder-name-long-enough-to-pass-eighty-columns-" * 2)
    folder.mkdir()
    config = planted_config(folder, steps=6, policy="warn")
    result = CliRunner().invoke(app, ["probe", str(config), "--runs", str(tmp_path / "runs")])
    assert result.exit_code == 3, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("Next: ")]
    assert len(lines) == 1 and lines[0].endswith(f"or train long (grooves train {config}).")
    assert "(grooves guard suggest tiny-run-probe)" in lines[0]


def test_the_demo_report_names_its_run_and_the_sample_command_on_one_line(tmp_path, monkeypatch):
    import grooves.demo
    from grooves.training.api import run_config
    from grooves.training.config import load_config
    from helpers import tiny_config

    config = tiny_config(tmp_path, steps=2)
    tasks = tmp_path / "tasks.jsonl"  # the demo's report shows each task's reference
    tasks.write_text("".join(json.dumps({**json.loads(line), "reference": "ref"}) + "\n"
                             for line in tasks.read_text().splitlines()))

    def tiny_demo(steps=None, runs=None, console=None):  # the demo's report over a tiny run, in seconds
        run = run_config(load_config(config), runs=runs, console=console, progress=False)
        return grooves.demo.DemoResult(run, run.evaluations[0], run.evaluations[run.step], 1.0)

    monkeypatch.setattr(grooves.demo, "run_demo", tiny_demo)
    runs = tmp_path / ("runs-in-a-folder-with-a-long-name-" * 2)
    result = CliRunner().invoke(app, ["demo", "--runs", str(runs)])
    assert result.exit_code == 0, result.output
    line = f'run folder: {runs / "tiny-run"}; try: grooves sample tiny-run@latest "..."'
    assert line in result.output.splitlines()


def test_a_paused_probe_prints_its_commands_on_one_line_each(tmp_path):
    """The resume command of a paused run is never wrapped, whatever the width (issue 29 item 1)."""
    from test_alert_policy import planted_config

    folder = tmp_path / ("a-folder-name-long-enough-to-pass-eighty-columns-" * 2)
    folder.mkdir()
    config = planted_config(folder, steps=6, policy="warn")
    runs = tmp_path / "runs"
    result = CliRunner().invoke(app, ["probe", str(config), "--runs", str(runs)])
    assert result.exit_code == 3, result.output
    lines = result.output.splitlines()
    assert "Read the samples: grooves review tiny-run-probe@1" in lines
    assert f"Continue, accepting this alert: grooves probe {config} --resume --runs {runs} --ack judge_directed" in lines
