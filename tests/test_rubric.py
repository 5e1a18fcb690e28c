"""Rubric files (load, save, validation, version), `grooves rubric show`, and the interview:
scripted answers against the tiny-model server, and a closed port (plain questions, one warning)."""

import hashlib
import json
import socket

import pytest
from typer.testing import CliRunner

from grooves.cli import app
from grooves.rewards.interview import SKELETON, Stated, merge_criteria, parse_criteria, parse_example, read_answers
from grooves.rewards.judges import rubric_text
from grooves.rewards.rubric import Criterion, Rubric, RubricError
from grooves.serve.app import ServerThread, build_server, create_app

runner = CliRunner()

RUBRIC = '''
task = "Write a headline for the news story."
good = "Names who did what, in plain words."
bad = "Clickbait, or vague words like 'things'."

[[criteria]]
name = "specific"
description = "names the actor and the action"
weight = 3

[[criteria]]
name = "short"

[[examples]]
kind = "bad"
output = "You won't believe this!"
note = "clickbait"
'''

ANSWERS = """A news story of a few paragraphs; the output is one headline under 12 words.

It names who did what, in plain words.

Clickbait, questions, or vague words like "things".

specific: 3 - names the actor and the action
no clickbait: 2
plain words

bad: You won't believe what the mayor did!
why: clickbait, hides the news
"""


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    served = build_server("tiny", runs=tmp_path_factory.mktemp("rubric") / "runs")
    with ServerThread(create_app(served)) as thread:
        yield thread.base_url
    served.engine.stop()


def closed_port_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"  # nothing listens once the probe socket is closed


def write(path, text):
    path.write_text(text)
    return path


def test_load_save_round_trip_is_atomic_and_keeps_content(tmp_path):
    rubric = Rubric.load(write(tmp_path / "r.toml", RUBRIC))
    assert [(c.name, c.weight) for c in rubric.criteria] == [("specific", 3.0), ("short", 1.0)]
    saved = rubric.save(tmp_path / "copy" / "r.toml")
    assert Rubric.load(saved) == rubric
    assert sorted(p.name for p in saved.parent.iterdir()) == ["r.toml"]  # no temp file left behind
    assert "[[criteria]]" in saved.read_text() and "description" not in saved.read_text().split("short")[1]


def test_prompt_lists_criteria_with_their_share_and_the_examples(tmp_path):
    rubric = Rubric.load(write(tmp_path / "r.toml", RUBRIC))
    prompt = rubric.as_prompt()
    # weights 3 and 1: shares 75% and 25%
    assert "- specific (75%): names the actor and the action" in prompt and "- short (25%)" in prompt
    assert "A bad output: You won't believe this! Why: clickbait" in prompt
    assert prompt.startswith("Task: Write a headline") and rubric_text(rubric) == prompt


def test_version_is_a_hash_of_the_judges_text_and_changes_with_content(tmp_path):
    rubric = Rubric.load(write(tmp_path / "r.toml", RUBRIC))
    content = json.dumps(rubric.model_dump(mode="json"), sort_keys=True)
    assert rubric.version == hashlib.sha256(f"{content}\n{rubric.as_prompt()}".encode()).hexdigest()[:12]
    # the task moved below good/bad, padded with spaces, and a comment: the content is the same
    reordered = "# a comment\n" + RUBRIC.replace('task = "Write a headline for the news story."\n', "").replace(
        "[[criteria]]", 'task = "  Write a headline for the news story.  "\n\n[[criteria]]', 1)
    assert Rubric.load(write(tmp_path / "s.toml", reordered)).version == rubric.version
    edited = Rubric.load(write(tmp_path / "e.toml", RUBRIC.replace("weight = 3", "weight = 2")))
    assert edited.version != rubric.version
    assert Rubric.load(write(tmp_path / "n.toml", RUBRIC.replace('"clickbait"', '"bait"'))).version != rubric.version


@pytest.mark.parametrize("edit, expected", [
    (("weight = 3", "weight = 0"), "criteria.0.weight: Input should be greater than 0"),
    (('task = "Write a headline for the news story."', ""), "task: Field required"),
    (('kind = "bad"', 'kind = "meh"'), "examples.0.kind: Input should be 'good' or 'bad'"),
    (('name = "short"', 'name = "short"\ncolour = "red"'), "criteria.1.colour: Extra inputs are not permitted"),
    (('name = "short"', 'name = "Specific"'), "criteria: Value error, criterion 'Specific' appears twice"),
    (("weight = 3", "weight = [3"), "not valid TOML"),
])
def test_invalid_rubric_exits_2_naming_the_field(tmp_path, edit, expected):
    path = write(tmp_path / "r.toml", RUBRIC.replace(*edit, 1))
    with pytest.raises(RubricError, match="r.toml"):
        Rubric.load(path)
    result = invoke("rubric", "show", path)
    assert result.exit_code == 2, result.output
    assert expected in " ".join(result.output.split())


def test_show_renders_the_rubric_and_its_prompt(tmp_path):
    path = write(tmp_path / "r.toml", RUBRIC)
    rubric = Rubric.load(path)
    result = invoke("rubric", "show", path)
    assert result.exit_code == 0, result.output
    for text in ("specific", "75%", "names the actor", "clickbait", rubric.version):
        assert text in result.output
    result = invoke("rubric", "show", path, "--prompt")
    assert result.output.strip() == rubric.as_prompt()
    assert invoke("rubric", "show", tmp_path / "nope.toml").exit_code == 2


def test_the_users_criteria_are_parsed_from_the_usual_shapes():
    assert parse_criteria("specific: 3 - names who did what\nshort: 1\nno clickbait") == [
        Stated("specific", "names who did what", 3.0), Stated("short", "", 1.0), Stated("no clickbait")]
    assert parse_criteria("accuracy (3), brevity (1)") == [Stated("accuracy", "", 3.0), Stated("brevity", "", 1.0)]
    assert parse_criteria("accuracy; tone: 0.5") == [Stated("accuracy"), Stated("tone", "", 0.5)]
    assert parse_criteria("specific: 2 - names who, what and where") == [
        Stated("specific", "names who, what and where", 2.0)]
    assert parse_criteria("length: 12 words max") == [Stated("length", "12 words max")]
    prose = "It matters most that the headline gets every fact of the story right"
    assert parse_criteria(prose) == [Stated("It matters most that the", prose)]  # words kept, never dropped
    assert parse_criteria("") == []


def test_merge_keeps_the_users_criteria_first_and_dedupes_by_name():
    stated = [Stated("No clickbait", weight=2.0), Stated("specific")]
    drafted = [Criterion(name="specific", description="who did what", weight=4),
               Criterion(name="no-clickbait", description="the draft's words", weight=1),
               Criterion(name="grammar", weight=1)]
    merged = merge_criteria(stated, drafted)
    assert [(c.name, c.weight, c.description) for c in merged] == [
        ("No clickbait", 2.0, "the draft's words"),  # the user's weight wins; the draft fills the gap
        ("specific", 4.0, "who did what"),  # no weight stated: the draft's
        ("grammar", 1.0, "")]


def test_example_answers_keep_the_users_words():
    example = parse_example("bad: You won't believe this! / why: clickbait")
    assert (example.kind, example.output, example.note) == ("bad", "You won't believe this!", "clickbait")
    assert parse_example("Mayor opens bridge").kind == "good" and parse_example("") is None


def test_a_why_note_after_a_space_is_the_note_as_the_docs_summary_shows():
    """docs/rubrics.md: ``[good:|bad:] OUTPUT [why: NOTE]``; on one line the note is split off, never
    folded into the output; without its colon a "why" or "because" is part of the output."""
    example = parse_example("bad: You won't believe this! why: clickbait, hides the news")
    assert (example.kind, example.output) == ("bad", "You won't believe this!")
    assert example.note == "clickbait, hides the news"
    assert parse_example("Mayor opens bridge Because: names who and what").note == "names who and what"
    for output in ("Mayor explains why the bridge closed", "Mayor resigns because of the audit"):
        assert (parse_example(output).output, parse_example(output).note) == (output, "")


def test_answers_files_json_toml_and_text_read_the_same(tmp_path):
    text = read_answers(write(tmp_path / "a.txt", ANSWERS))
    assert len(text) == len(SKELETON) and text[3].splitlines()[1] == "no clickbait: 2"
    assert read_answers(write(tmp_path / "a.json", json.dumps(text))) == text
    toml = "answers = [\n" + ",\n".join(json.dumps(a) for a in text) + "\n]\n"
    assert read_answers(write(tmp_path / "a.toml", toml)) == text
    result = invoke("rubric", "interview", "--task", "t", "--out", tmp_path / "r.toml",
                    "--answers", write(tmp_path / "short.json", '["one", "two"]'))
    assert result.exit_code == 2 and "has 2 answers; the interview asks 5" in " ".join(result.output.split())


def test_scripted_interview_against_the_tiny_server_keeps_the_users_criteria(tmp_path, base_url):
    out = tmp_path / "rubric.toml"
    result = invoke("rubric", "interview", "--task", "Write a headline for a news story", "--out", out,
                    "--answers", write(tmp_path / "answers.txt", ANSWERS), "--endpoint-url", base_url,
                    "--model", "tiny")
    assert result.exit_code == 0, result.output
    rubric = Rubric.load(out)
    by_name = {c.name: c for c in rubric.criteria}
    assert by_name["specific"].weight == 3.0 and by_name["specific"].description == "names the actor and the action"
    assert by_name["no clickbait"].weight == 2.0 and "plain words" in by_name
    assert list(by_name)[:3] == ["specific", "no clickbait", "plain words"]
    assert rubric.good == "It names who did what, in plain words."
    assert rubric.task.startswith("Write a headline for a news story\n\nA news story of a few paragraphs")
    assert [(e.kind, e.note) for e in rubric.examples] == [("bad", "clickbait, hides the news")]
    assert "(5/5)" in result.output and rubric.version in result.output
    assert "no usable endpoint" not in result.output


def test_interview_with_endpoint_url_local_serves_the_model_here(tmp_path):
    out = tmp_path / "rubric.toml"
    answers = ANSWERS.replace("bad: You won't believe what the mayor did!\nwhy:", "bad: You won't believe it! why:")
    result = invoke("rubric", "interview", "--task", "Write a headline for a news story", "--out", out,
                    "--answers", write(tmp_path / "answers.txt", answers), "--endpoint-url", "local",
                    "--model", "tiny")
    assert result.exit_code == 0, result.output
    # the tiny model answered (it is reached), though not usefully: a random-weight model
    assert "no usable endpoint" not in result.output and "of the model's replies were unusable" in result.stderr
    rubric = Rubric.load(out)
    assert [(e.kind, e.output, e.note) for e in rubric.examples] == [
        ("bad", "You won't believe it!", "clickbait, hides the news")]


def test_interview_with_no_reachable_endpoint_asks_the_plain_questions(tmp_path):
    out = tmp_path / "rubric.toml"
    answers = write(tmp_path / "answers.txt", ANSWERS)
    result = invoke("rubric", "interview", "--task", "Headlines", "--out", out, "--answers", answers,
                    "--endpoint-url", closed_port_url(), "--model", "tiny")
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning")]
    assert len(warnings) == 1 and "plain questions" in warnings[0]
    for topic in SKELETON:
        assert topic.question.split("?")[0] in " ".join(result.output.split())
    assert [c.name for c in Rubric.load(out).criteria] == ["specific", "no clickbait", "plain words"]
    again = invoke("rubric", "interview", "--task", "Headlines", "--out", out, "--answers", answers)
    assert again.exit_code == 2 and "--overwrite" in again.output  # an existing rubric is not replaced
    plain = invoke("rubric", "interview", "--task", "Headlines", "--out", out, "--answers", answers, "--overwrite")
    assert plain.exit_code == 0 and len([l for l in plain.stderr.splitlines() if l.startswith("warning")]) == 1


def test_interview_in_the_terminal_reads_one_answer_per_question(tmp_path):
    out = tmp_path / "rubric.toml"
    typed = "One headline per story\nNames who did what\nClickbait\naccuracy: 2; brevity\nMayor opens bridge\n"
    result = runner.invoke(app, ["rubric", "interview", "--task", "Headlines", "--out", str(out)], input=typed)
    assert result.exit_code == 0, result.output
    rubric = Rubric.load(out)
    assert [(c.name, c.weight) for c in rubric.criteria] == [("accuracy", 2.0), ("brevity", 1.0)]
    assert (rubric.bad, rubric.examples[0].output) == ("Clickbait", "Mayor opens bridge")
    cut_short = runner.invoke(app, ["rubric", "interview", "--task", "Headlines", "--out", str(tmp_path / "x.toml")],
                              input="only one answer\n")
    assert cut_short.exit_code == 2 and "--answers FILE" in cut_short.output and not (tmp_path / "x.toml").exists()
