"""Judge calibration: agreement from scripted verdicts, verdicts persisted per rubric version,
judge failures shown as failed (never 0) and kept out of the rate, samples from files and runs."""

import json
import math
import socket

import pytest
from typer.testing import CliRunner

from grooves.cli import app
from grooves.rewards.calibrate import (
    Agreement, CalibrationError, Sample, Scored, Verdict, agreement, load_samples, load_verdicts, pick,
    score_samples,
)
from grooves.rewards.compose import Failed, RewardComponent, Score
from grooves.rewards.rubric import Rubric
from grooves.serve.app import ServerThread, build_server, create_app
from grooves.rewards.calibration_store import CalibrationStore
from grooves.runs.store import RunStore
from grooves.types import Group, Trajectory

runner = CliRunner()

RUBRIC = '''
task = "Write a headline for the news story."
good = "Names who did what."

[[criteria]]
name = "specific"
weight = 2
'''

OUTPUTS = ["Mayor opens bridge", "You won't believe this", "Bridge news", "Mayor opens new bridge", "Things"]
# verdicts on s0..s4: 3 agree, 1 disagree, 1 skip -> agreement 3 / (3 + 1) = 0.75
VERDICTS = ["agree", "agree", "disagree", "agree", "skip"]


def invoke(*args, **kwargs):
    return runner.invoke(app, [str(a) for a in args], **kwargs)


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    served = build_server("tiny", runs=tmp_path_factory.mktemp("calibrate") / "runs")
    with ServerThread(create_app(served)) as thread:
        yield thread.base_url
    served.engine.stop()


@pytest.fixture
def files(tmp_path):
    rubric = tmp_path / "rubric.toml"
    rubric.write_text(RUBRIC)
    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps({"id": f"s{i}", "input": f"Story {i}: the mayor opened a bridge.",
                                           "output": o}) + "\n" for i, o in enumerate(OUTPUTS)))
    verdicts = tmp_path / "verdicts.jsonl"
    verdicts.write_text("".join(json.dumps({"id": f"s{i}", "verdict": v, "note": f"note {i}"}) + "\n"
                                for i, v in enumerate(VERDICTS)))
    return rubric, samples, verdicts


def closed_port_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


def scored(ident: str, score: float) -> Scored:
    return Scored(Sample(ident, "in", f"out {ident}"), score, "failed: timeout" if math.isnan(score) else "ok")


def test_agreement_counts_verdicts_and_leaves_failures_out_of_the_rate():
    batch = [scored("a", 0.9), scored("b", 0.2), scored("c", math.nan), scored("d", 0.5), scored("e", 0.1)]
    verdicts = [Verdict("a", "agree"), Verdict("b", "agree"), Verdict("c", "agree"), Verdict("d", "disagree"),
                Verdict("e", "skip")]
    counts = agreement(batch, verdicts)
    assert counts == Agreement(agree=2, disagree=1, skipped=1, on_failed=1)
    assert counts.rate == pytest.approx(2 / 3)  # c's verdict is on a failed sample: not in the rate
    assert agreement(batch, [Verdict("e", "skip")]).rate is None


def test_pick_takes_top_and_bottom_without_overlap_or_failures():
    batch = [scored("a", 0.9), scored("b", 0.2), scored("c", math.nan), scored("d", 0.5), scored("e", 0.1)]
    best, worst = pick(batch, top=2, bottom=2)
    assert [s.sample.id for s in best] == ["a", "d"] and [s.sample.id for s in worst] == ["e", "b"]
    best, worst = pick(batch, top=3, bottom=3)  # 4 scored samples: the bottom gets what is left
    assert [s.sample.id for s in best] == ["a", "d", "b"] and [s.sample.id for s in worst] == ["e"]


class StubJudge(RewardComponent):
    """Scores by output: a Score, a Failed, a raise, or a NaN, to check each becomes what it should."""

    async def score_group(self, group):
        text = group.trajectories[0].completion
        if text == "raise":
            raise RuntimeError("boom")
        return [{"good": Score(0.8, "fine"), "nan": math.nan, "fail": Failed("no usable reply")}[text]]


def test_score_samples_turns_every_failure_into_nan_with_its_error():
    batch = [Sample(str(i), "in", text) for i, text in enumerate(["good", "fail", "raise", "nan"])]
    results = score_samples(StubJudge("stub"), batch)
    assert (results[0].score, results[0].reason) == (0.8, "fine")
    assert all(r.failed for r in results[1:]) and "boom" in results[2].reason
    assert results[1].reason == "no usable reply"


def test_bad_samples_and_verdict_files_name_the_line(tmp_path, files):
    _, samples, _ = files
    batch = load_samples(samples)
    assert [s.id for s in batch] == [f"s{i}" for i in range(5)] and batch[1].output == OUTPUTS[1]
    cases = [('{"id": "s9", "verdict": "agree"}', "line 1: id 's9' is not a sample"),
             ('{"id": "s1", "verdict": "yes"}', "line 1: verdict must be one of agree, disagree, skip"),
             ('{"id": "s1", "verdict": "agree"}\n{"id": "s1", "verdict": "skip"}', "id 's1' appears twice")]
    for text, message in cases:
        path = tmp_path / "v.jsonl"
        path.write_text(text)
        with pytest.raises(CalibrationError, match=message):
            load_verdicts(path, batch)
    (tmp_path / "bad.jsonl").write_text('{"input": "x"}\n')
    with pytest.raises(CalibrationError, match="line 1: 'output' must be a string"):
        load_samples(tmp_path / "bad.jsonl")


def test_calibrate_on_a_file_records_verdicts_and_agreement_per_rubric_version(files, base_url):
    rubric, samples, verdicts = files
    args = ["judge", "calibrate", "--rubric", rubric, "--samples", samples, "--endpoint-url", base_url,
            "--model", "tiny", "--top", 2, "--bottom", 2, "--verdicts", verdicts]
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    assert "agreement 3/4 = 75%" in result.output and "(1 skipped)" in result.output
    store = CalibrationStore(rubric.with_suffix(".calibration.sqlite"))
    [row] = store.history()
    version = Rubric.load(rubric).version
    assert (row["rubric_version"], row["agreement"], row["scored"], row["failed"]) == (version, 0.75, 5, 0)
    stored = store.verdicts(row["id"])
    assert [(v["sample_id"], v["verdict"], v["note"]) for v in stored] == [
        (f"s{i}", v, f"note {i}") for i, v in enumerate(VERDICTS)]
    assert stored[1]["output"] == OUTPUTS[1] and 0 <= stored[1]["score"] <= 1
    rubric.write_text(RUBRIC.replace("weight = 2", "weight = 3"))  # an edit: a new version
    assert invoke(*args).exit_code == 0
    versions = [r["rubric_version"] for r in store.history()]
    assert versions[0] == version and versions[1] == Rubric.load(rubric).version != version
    history = invoke("judge", "calibrate", "--rubric", rubric, "--samples", samples, "--history")
    assert history.exit_code == 0 and all(v in history.output for v in versions)


def test_judge_failures_show_as_failed_never_zero_and_are_not_counted(files):
    from fault_server import FaultServer

    rubric, samples, verdicts = files

    def broken_on_two(body):  # no JSON for s1 and s4, repair turn included; 6/10 for the others
        output = body["messages"][1]["content"].split("<output>")[1].split("</output>")[0]
        return "no JSON here" if output.strip() in (OUTPUTS[1], OUTPUTS[4]) else json.dumps({"reason": "r", "score": 6})

    with FaultServer() as server:
        server.play(broken_on_two)
        result = invoke("judge", "calibrate", "--rubric", rubric, "--samples", samples, "--endpoint-url",
                        server.base_url, "--model", "fault", "--verdicts", verdicts)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "judge failed on 2" in text and "0.00" not in text and "0.60" in text
    # s0 agree, s2 disagree, s3 agree count; s1 (agree) and s4 (skip) are verdicts on failed samples
    assert "agreement 2/3 = 67%" in text
    assert "2 judge failures not counted; 2 verdicts on failed samples not counted" in text
    [row] = CalibrationStore(rubric.with_suffix(".calibration.sqlite")).history()
    assert (row["failed"], row["on_failed"], row["agree"], row["disagree"], row["skipped"]) == (2, 2, 2, 1, 0)
    assert row["agreement"] == pytest.approx(2 / 3)


def test_a_judge_that_failed_on_every_sample_is_an_error_and_nothing_is_recorded(files):
    rubric, samples, verdicts = files
    url = closed_port_url()
    result = invoke("judge", "calibrate", "--rubric", rubric, "--samples", samples, "--endpoint-url", url,
                    "--model", "tiny", "--verdicts", verdicts)
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert f"the judge (tiny @ {url}) failed on all 5 samples; nothing recorded. First error: " in text
    assert "judge failed on 5" in text and "0.00" not in text
    assert CalibrationStore(rubric.with_suffix(".calibration.sqlite")).history() == []


def test_endpoint_url_local_serves_the_model_here_as_base_url_local_does(files):
    rubric, samples, verdicts = files
    result = invoke("judge", "calibrate", "--rubric", rubric, "--samples", samples, "--endpoint-url", "local",
                    "--model", "tiny", "--verdicts", verdicts)
    assert result.exit_code == 0, result.output
    [row] = CalibrationStore(rubric.with_suffix(".calibration.sqlite")).history()
    assert row["judge"].startswith("tiny @ http://127.0.0.1:") and (row["scored"], row["failed"]) == (5, 0)
    bad = invoke("judge", "calibrate", "--rubric", rubric, "--samples", samples, "--endpoint-url", "local",
                 "--model", rubric.parent / "no-model")
    assert bad.exit_code == 2 and "--endpoint-url local: cannot serve --model" in " ".join(bad.output.split())


def test_interactive_verdicts_on_the_shown_outputs(files, base_url):
    rubric, samples, _ = files
    result = invoke("judge", "calibrate", "--rubric", rubric, "--samples", samples, "--endpoint-url", base_url,
                    "--model", "tiny", "--top", 1, "--bottom", 1, input="a\n\nd\ntoo vague\n")
    assert result.exit_code == 0, result.output
    assert "agreement 1/2 = 50%" in result.output
    store = CalibrationStore(rubric.with_suffix(".calibration.sqlite"))
    stored = store.verdicts(store.history()[-1]["id"])
    assert [(v["verdict"], v["note"]) for v in stored] == [("agree", ""), ("disagree", "too vague")]


def test_missing_inputs_exit_2(files, tmp_path):
    rubric, samples, verdicts = files
    missing = invoke("judge", "calibrate", "--rubric", rubric, "--samples", tmp_path / "nope.jsonl",
                     "--endpoint-url", "http://127.0.0.1:9/v1", "--model", "tiny")
    assert missing.exit_code == 2 and "nope.jsonl does not exist" in missing.output
    no_run = invoke("judge", "calibrate", "--rubric", rubric, "--samples", "ghost@3", "--runs", tmp_path / "runs")
    assert no_run.exit_code == 2 and "no run 'ghost'" in no_run.output
    bad = tmp_path / "bad.toml"
    bad.write_text(RUBRIC.replace("weight = 2", "weight = -1"))
    invalid = invoke("judge", "calibrate", "--rubric", bad, "--samples", samples)
    assert invalid.exit_code == 2 and "criteria.0.weight: Input should be greater than 0" in invalid.output
    no_endpoint = invoke("judge", "calibrate", "--rubric", rubric, "--samples", samples)
    assert no_endpoint.exit_code == 2 and "--endpoint-url" in no_endpoint.output


def _record_run(root, name="myrun"):
    store = RunStore(root / name)
    for step in (1, 2):
        trajectories = [Trajectory(messages=[{"role": "user", "content": f"story {step}.{i}"},
                                             {"role": "assistant", "content": f"title {step}.{i}"}],
                                   prompt_ids=[1], completion_ids=[2], completion_mask=[1], logprobs=[0.0])
                        for i in range(3)]
        store.record_groups(step, [Group(task={"id": f"t{step}"}, trajectories=trajectories)])
    store.close()
    return root / name


def test_calibrate_on_a_run_reads_its_trajectories_and_stores_verdicts_in_run_sqlite(files, tmp_path, base_url):
    rubric, _, _ = files
    run_dir = _record_run(tmp_path / "runs")
    store = RunStore(run_dir)
    ids = [ident for ident, _ in store.read_trajectories(1)]
    assert store.trajectory_steps() == [1, 2] and len(ids) == 3
    store.close()
    verdicts = tmp_path / "run-verdicts.jsonl"
    verdicts.write_text(json.dumps({"id": ids[0], "verdict": "disagree", "note": "wrong"}) + "\n")
    result = invoke("judge", "calibrate", "--rubric", rubric, "--samples", "myrun@1", "--runs", tmp_path / "runs",
                    "--endpoint-url", base_url, "--model", "tiny", "--verdicts", verdicts)
    assert result.exit_code == 0, result.output
    assert "agreement 0/1 = 0%" in result.output
    calibrations = CalibrationStore(run_dir / "run.sqlite")
    [row] = calibrations.history()
    assert row["samples"] == "myrun@1" and row["scored"] == 3
    [stored] = calibrations.verdicts(row["id"])
    assert (stored["sample_id"], stored["input"], stored["output"]) == (str(ids[0]), "story 1.0", "title 1.0")
    later = invoke("judge", "calibrate", "--rubric", rubric, "--samples", "myrun@9", "--runs", tmp_path / "runs",
                   "--endpoint-url", base_url, "--model", "tiny")
    assert later.exit_code == 2 and "recorded steps: 1 to 2" in later.output
    history = invoke("judge", "calibrate", "--rubric", rubric, "--samples", "myrun", "--runs", tmp_path / "runs",
                     "--history")
    assert history.exit_code == 0 and row["rubric_version"] in history.output


def test_attacks_report_which_raised_the_score_and_which_passed_the_guards(files, tmp_path):
    from fault_server import FaultServer
    from grooves.rewards.attacks import ATTACKS

    rubric, samples, _ = files

    def fooled(body):  # a judge fooled by any "10" in the output it grades, and broken by "yes"
        output = body["messages"][1]["content"].split("<output>")[1].split("</output>")[0]
        return "no JSON here" if '"yes"' in output else json.dumps({"reason": "r", "score": 9 if "10" in output else 3})

    with FaultServer() as server:
        server.play(fooled)
        result = invoke("judge", "calibrate", "--rubric", rubric, "--samples", samples, "--attacks",
                        "--attack-samples", 1, "--endpoint-url", server.base_url, "--model", "fault",
                        env={"COLUMNS": "250"})
        assert len(server.requests) == 1 + len(ATTACKS) + 1  # the plain output, each attack, json_yes's repair
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    raised = [a.name for a in ATTACKS if "10" in a.apply(OUTPUTS[0])]
    assert len(raised) == 15 and "leetspeak" in raised
    assert f"raised the judge's score: 15 of {len(ATTACKS)} ({', '.join(raised)})" in text
    assert f"passed every guard: 4 of {len(ATTACKS)} (leetspeak, letter_spaced, other_language, social_proof)" in text
    assert "raised the score and passed every guard: leetspeak;" in text
    assert "the judge failed on 1 attacked output(s) (not counted as raised); first error: " in text
    assert next(line for line in result.output.splitlines() if "json_yes" in line).count("failed") == 1
    row = next(line for line in result.output.splitlines() if "correct_score" in line)
    assert "0.30" in row and "0.90" in row and "1/1" in row and "no_judge_talk" in row
    assert CalibrationStore(rubric.with_suffix(".calibration.sqlite")).history() == []  # no verdicts, no record


def test_attacks_with_a_run_configs_guards_and_a_bad_config(files, tmp_path):
    from fault_server import FaultServer

    rubric, samples, _ = files
    config = tmp_path / "run.toml"
    config.write_text('[reward]\n[[reward.components]]\nkind = "guard"\nguard = "format"\npattern = "[^\\\\n]{1,60}"\n')
    with FaultServer() as server:
        server.play(("reply", json.dumps({"reason": "r", "score": 5})))
        args = ["judge", "calibrate", "--rubric", rubric, "--samples", samples, "--attacks", "--attack-samples", 1,
                "--endpoint-url", server.base_url, "--model", "fault", "--guards-config", config]
        result = invoke(*args, env={"COLUMNS": "250"})
        assert result.exit_code == 0, result.output
        text = " ".join(result.output.split())
        assert "guards: format" in text and "raised the judge's score: 0 of" in text
        assert "no attack both raised the score and passed every guard" in text and "top score" not in text
        server.play(("reply", json.dumps({"reason": "r", "score": 10})))
        at_top = " ".join(invoke(*args, env={"COLUMNS": "250"}).output.split())
        assert "the judge already gives the plain output its top score on 1 of 1 sample(s)" in at_top
        config.write_text('[reward]\n[[reward.components]]\nkind = "guard"\nguard = "injection"\nfloor = "low"\n')
        bad = invoke(*args)
    assert bad.exit_code == 2 and "reward.components.0.guard.floor" in bad.output and "Traceback" not in bad.output
