"""grooves review (selection, labels) and grooves guard suggest, on run folders built by hand."""

from __future__ import annotations

import json
import math
import re
import tomllib

import pytest
import typer
from typer.testing import CliRunner

from grooves.cli.review import register
from grooves.rewards import InjectionGuard
from grooves.workflows.review import (
    Label, ReviewError, read_labels_file, review, store_labels, summarise_labels, value_text,
)
from grooves.runs.store import RunStore
from grooves.workflows.suggest import SuggestError, append_proposal, suggest
from grooves.types import Group, Trajectory

NAN = math.nan
runner = CliRunner()


def sample(completion: str, reward: float, components: dict | None = None, reasons: dict | None = None,
           vetoes: dict | None = None, user: str = "Write a title.") -> Trajectory:
    metadata = {k: v for k, v in (("reasons", reasons), ("vetoes", vetoes)) if v}
    return Trajectory(messages=[{"role": "user", "content": user}, {"role": "assistant", "content": completion}],
                      prompt_ids=[1], completion_ids=[2, 3], completion_mask=[1, 1], logprobs=[-0.1, -0.2],
                      reward=reward, components=components or {"quality": reward}, metadata=metadata)


def group(task: str, *trajectories: Trajectory) -> Group:
    return Group(task={"id": task}, trajectories=list(trajectories))


@pytest.fixture
def run(tmp_path):
    """runs/r1: step 1 (ids 1-8), step 2 (ids 9-14) and val at step 2 (ids 15-16), plus alerts."""
    store = RunStore(tmp_path / "runs" / "r1")
    vetoed = sample("Invented headline", 0.0, {"quality": 0.95, "supported": 0.0},
                    {"quality": "catchy", "supported": "no such event"}, {"supported": "no such event"})
    store.record_groups(1, [
        group("a", sample("a0", 0.9, reasons={"quality": "clear and short"}),
              sample("a1", NAN, {"quality": NAN}, {"quality": "judge timed out"}),
              sample("a2", 0.1), sample("a3", 0.5)),
        group("b", sample("b0", 0.7), sample("b1", 0.9), vetoed, sample("b3", NAN, {"quality": NAN})),
    ])
    store.record_groups(2, [group("a", sample("c0", 0.2), sample("c1", 0.4), sample("c2", 0.6)),
                            group("b", sample("d0", 0.8), sample("d1", NAN, {"quality": NAN}), sample("d2", 0.3))])
    store.record_groups(2, [group("v", sample("v0", 0.5), sample("v1", 0.6))], split="val")
    store.record_alert(1, "collapse", "warn", "5 of 8 outputs are the same", {"text": "Invented headline"})
    store.record_alert(2, "judge_directed", "critical", "outputs address the judge", {"ids": ["b#1"]})
    yield store
    store.close()


def ids(samples) -> list[int]:
    return [s.id for s in samples]


def test_top_bottom_random_and_failed_samples(run):
    (step,) = review(run, [1], k=2, seed=0)
    assert (step.count, step.failed) == (8, 2)
    # 0.9 ties between ids 1 and 6: the lower id first; the bottom lists the lowest first.
    assert ids(step.top) == [1, 6]
    assert ids(step.bottom) == [7, 3]
    assert ids(step.random) == [4, 8]  # random.Random(0).sample([2, 4, 5, 8], 2), listed by id
    assert ids(review(run, [1], k=2, seed=0)[0].random) == [4, 8]  # the same seed draws the same
    assert ids(review(run, [1], k=2, seed=1)[0].random) == [4, 5]
    (wide,) = review(run, [1], k=5)
    # Six scored samples: five on top, the sixth alone at the bottom; the failures only at random.
    assert ids(wide.top) == [1, 6, 5, 4, 3]
    assert ids(wide.bottom) == [7]
    assert ids(wide.random) == [2, 8]
    assert all(s.failed for s in wide.random) and value_text(wide.random[0].reward) == "failed"
    assert value_text(wide.random[0].components["quality"]) == "failed"


def test_review_shows_reasons_vetoes_and_defaults_to_the_last_step(run):
    (step,) = review(run, k=1)
    assert step.step == 2 and ids(step.top) == [12] and ids(step.bottom) == [9]
    (one,) = review(run, [1], k=5)
    vetoed = next(s for s in one.top + one.bottom if s.id == 7)
    assert vetoed.vetoes == {"supported": "no such event"} and vetoed.components == {"quality": 0.95,
                                                                                      "supported": 0.0}
    assert one.top[0].reasons == {"quality": "clear and short"} and one.top[0].task_id == "a"
    (val,) = review(run, split="val", k=1)
    assert (val.step, ids(val.top), ids(val.bottom)) == (2, [16], [15])
    with pytest.raises(ReviewError, match="step 7; recorded steps: 1-2"):
        review(run, [7])
    assert [a["detector"] for a in run.read_alerts()] == ["collapse", "judge_directed"]
    assert [a["evidence"] for a in run.read_alerts([2])] == [{"ids": ["b#1"]}]


def write_labels(path, rows) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_labels_from_a_file_are_stored_summarised_and_replaced(run, tmp_path):
    path = tmp_path / "labels.jsonl"
    write_labels(path, [{"id": 7, "label": "hack", "note": "invented"}, {"id": 1, "label": "good"},
                        {"id": 3, "label": "bad"}, {"id": 9, "label": "hack"}, {"id": 15, "label": "good"}])
    assert store_labels(run, read_labels_file(path)) == (5, 0)
    summary = summarise_labels(run)
    assert summary.per_step == {(1, "train"): {"hack": 1, "good": 1, "bad": 1},
                                (2, "train"): {"hack": 1, "good": 0, "bad": 0},
                                (2, "val"): {"hack": 0, "good": 1, "bad": 0}}
    assert summary.total == {"hack": 2, "good": 2, "bad": 1} and summary.count == 5
    assert store_labels(run, [Label(7, "bad", "on second thought"), Label(10, "good")]) == (2, 1)
    assert run.read_labels()[7]["label"] == "bad" and run.read_labels()[7]["note"] == "on second thought"
    assert summarise_labels(run).total == {"hack": 1, "good": 3, "bad": 2}
    (step,) = review(run, [1], k=5)
    assert next(s for s in step.bottom if s.id == 7).label == Label(7, "bad", "on second thought")


@pytest.mark.parametrize(("row", "message"), [
    ({"id": 1, "label": "cheat"}, "label must be one of hack, good, bad; got 'cheat'"),
    ({"id": "1", "label": "hack"}, "id must be a trajectory id"),
    ({"id": 1, "label": "hack", "why": "x"}, "unknown key 'why'"),
    ({"id": 1, "label": "hack", "note": 3}, "note must be a string"),
])
def test_bad_label_lines_name_the_line(tmp_path, row, message):
    path = tmp_path / "labels.jsonl"
    write_labels(path, [{"id": 2, "label": "good"}, row])
    with pytest.raises(ReviewError, match=f"line 2: {re.escape(message)}"):
        read_labels_file(path)


def test_labels_of_unknown_rows_are_refused(run):
    with pytest.raises(ReviewError, match="no trajectory with id 99"):
        store_labels(run, [Label(1, "good"), Label(99, "hack")])
    assert run.read_labels() == {}  # nothing of a refused batch is stored


def test_labels_survive_truncation_and_never_move_to_new_rows(run):
    store_labels(run, [Label(2, "hack"), Label(9, "good"), Label(13, "hack"), Label(15, "bad")])
    run.truncate_after(1)  # a resume from the step-1 checkpoint
    assert sorted(run.read_labels()) == [2]
    # The resumed run records step 2 again; SQLite hands out the freed ids 9-16 once more.
    run.record_groups(2, [group("a", sample("new0", 0.1), sample("new1", 0.2), sample("new2", 0.3),
                                      sample("new3", 0.4), sample("new4", 0.5))])
    assert [r.id for r in run.trajectory_records(steps=[2])] == [9, 10, 11, 12, 13]
    assert sorted(run.read_labels()) == [2]
    assert summarise_labels(run).per_step == {(1, "train"): {"hack": 1, "good": 0, "bad": 0}}


# --- guard suggest ----------------------------------------------------------------------------

HACK = "Google lays off 75%, effective immediately"


def planted(root) -> RunStore:
    """7 tasks x 4 samples (ids 4t+1 .. 4t+4): 5 hacks (ids 1, 5, 9, 13, 17), 3 good, 20 unlabelled.

    Unlabelled: two variants of the hack (ids 21, 25), one exact copy in other case and spacing
    (id 22), three titles with invented numbers (ids 23, 27, 28) and fourteen grounded titles.
    """
    store = RunStore(root / "hn")
    groups = []
    for t in range(7):
        user = f"Write a title.\n\nText: The council of town {t} approved a new park budget on Monday."
        outputs = [HACK, "Council approves park budget", "New park for the town", "Park budget approved on Monday"]
        if t == 5:
            outputs = ["BREAKING: Google lays off 75%, effective immediately!",
                       "  google lays off 75%,  effective   immediately ", "Council approves 12 parks",
                       "New park budget"]
        if t == 6:
            outputs = ["google lays off 75% effective immediately", "Council approves the budget",
                       "Council approves 40 parks", "Town gets 3 parks"]
        groups.append(Group({"id": f"t{t}"}, [sample(o, 0.9 if "oogle" in o else 0.5, user=user) for o in outputs]))
    store.record_groups(1, groups)
    store_labels(store, [Label(i, "hack", "fake headline") for i in (1, 5, 9, 13, 17)]
                 + [Label(i, "good") for i in (2, 6, 10)])
    return store


def counts(proposal) -> dict[str, str]:
    return {c: f"{proposal.counts.vetoed[c]}/{proposal.counts.total[c]}" for c in proposal.counts.vetoed}


def test_suggest_on_planted_hacks_reports_exact_veto_counts(tmp_path):
    store = planted(tmp_path)
    proposals = suggest(store)
    assert [p.kind for p in proposals] == ["exact_output", "shared_phrase", "lexical_grounding",
                                           "supported_by_source"]
    exact, phrase, grounding, judge = proposals
    assert counts(exact) == {"hack": "5/5", "good": "0/3", "bad": "0/0", "unlabelled": "1/20"}
    assert counts(phrase) == {"hack": "5/5", "good": "0/3", "bad": "0/0", "unlabelled": "3/20"}
    # 75 is in no source; 12, 40 and 3 are invented too.
    assert counts(grounding) == {"hack": "5/5", "good": "0/3", "bad": "0/0", "unlabelled": "6/20"}
    assert judge.counts is None and 'endpoint = "frozen"' in judge.toml
    assert "'google lays off 75 effective immediately' (in 5 of 5 hacks)" in phrase.summary
    assert exact.counts.missed_hacks == [] and exact.counts.vetoed_good == []
    table = tomllib.loads(phrase.toml)["reward"]["components"][0]
    assert table == {"kind": "guard", "guard": "format", "name": "no_shared_phrase",
                     "pattern": r"(?is)(?!.*?\bgoogle\W+lays\W+off\W+75\W+effective\W+immediately\b).*"}
    # The Python form (an InjectionGuard) vetoes the same samples as the TOML form.
    pattern = re.search(r"patterns=\((.*),\)\)", phrase.python).group(1)
    injection = InjectionGuard("p", patterns=(eval(pattern),))
    rows = store.trajectory_records()
    caught = [r.id for r in rows if not injection.check(r.trajectory, group("x", r.trajectory))[0]]
    assert caught == [1, 5, 9, 13, 17, 21, 22, 25]
    store.close()


def test_shared_phrase_prefers_the_phrase_most_hacks_share(tmp_path):
    store = RunStore(tmp_path / "varied")
    store.record_groups(1, [group("a", sample("Breaking: Google lays off 75% of staff", 0.9),
                                  sample("Google lays off 75% of staff, sources say", 0.9),
                                  sample("Shock as Google lays off workers", 0.9), sample("Park budget", 0.5))])
    store_labels(store, [Label(1, "hack"), Label(2, "hack"), Label(3, "hack")])
    proposals = suggest(store)
    # No output repeats; "google lays off 75 of staff" is longer but in 2 hacks, "google lays off" in all 3.
    assert [p.kind for p in proposals] == ["shared_phrase", "lexical_grounding", "supported_by_source"]
    assert proposals[0].summary == "the output contains 'google lays off' (in 3 of 3 hacks)"
    assert counts(proposals[0]) == {"hack": "3/3", "good": "0/0", "bad": "0/0", "unlabelled": "0/1"}
    store.close()


def test_suggest_without_hacks_and_with_a_source_column(tmp_path):
    store = RunStore(tmp_path / "plain")
    store.record_groups(1, [group("a", sample("Park budget", 0.5), sample("Google lays off 75%", 0.9))])
    with pytest.raises(SuggestError, match="no samples are labelled 'hack'"):
        suggest(store)
    store_labels(store, [Label(2, "hack")])
    with pytest.raises(SuggestError, match="source column 'text' is missing for task id a"):
        suggest(store, {}, source="text")
    proposals = suggest(store, {"a": {"id": "a", "text": "Google lays off 75% of staff"}}, source="text")
    # One hack: no output repeats and no phrase is shared by two (docs/review.md); grounding catches nothing.
    assert [p.kind for p in proposals] == ["supported_by_source"]
    assert 'source = "text"' in proposals[0].toml
    store.close()


def test_append_proposal_checks_the_config(tmp_path):
    store = planted(tmp_path)
    exact = suggest(store)[0]
    store.close()
    config = tmp_path / "run.toml"
    config.write_text('name = "hn"\n\n[[reward.components]]\nfunction = "r.py:votes"\n')
    append_proposal(config, exact)
    components = tomllib.loads(config.read_text())["reward"]["components"]
    assert [c.get("name") for c in components] == [None, "no_repeated_output"]
    with pytest.raises(SuggestError, match="already has a reward component named 'no_repeated_output'"):
        append_proposal(config, exact)
    mixed = tmp_path / "mix.toml"
    mixed.write_text('[[mix]]\nname = "a"\n')
    with pytest.raises(SuggestError, match=r"\[\[mix\]\]"):
        append_proposal(mixed, exact)
    with pytest.raises(SuggestError, match="does not exist"):
        append_proposal(tmp_path / "nope.toml", exact)


# --- the commands ---------------------------------------------------------------------------------


@pytest.fixture
def cli():
    app = typer.Typer()
    register(app)
    return app


def test_review_command_shows_samples_alerts_and_takes_labels(run, cli, tmp_path):
    runs = str(tmp_path / "runs")
    result = runner.invoke(cli, ["review", "r1", "--step", "1", "--k", "1", "--runs", runs])
    assert result.exit_code == 0, result.output
    assert "top 1/1 · id 1 · task a · total 0.900" in result.output
    assert "bottom 1/1 · id 7 · task b · total 0.000" in result.output
    assert "vetoed by supported" in result.output and "alert: collapse (step 1, warn)" in result.output
    assert "judge_directed" not in result.output  # only the chosen step's alerts
    assert "no labels yet" in result.output
    labels = tmp_path / "labels.jsonl"
    write_labels(labels, [{"id": 7, "label": "hack"}, {"id": 3, "label": "bad"}])
    result = runner.invoke(cli, ["review", "r1@1", "--k", "1", "--labels", str(labels), "--runs", runs])
    assert result.exit_code == 0, result.output
    assert "stored 2 labels" in result.output and "labelled hack" in result.output
    # Interactive: id 1 (top) good with a note, id 7 (bottom) skipped, id 5 (random) bad.
    result = runner.invoke(cli, ["review", "r1", "--step", "1", "--k", "1", "--label", "--runs", runs],
                           input="g\nclear\ns\nb\n\n")
    assert result.exit_code == 0, result.output
    assert "stored 2 labels" in result.output
    assert {i: g["label"] for i, g in run.read_labels().items()} == {1: "good", 3: "bad", 5: "bad", 7: "hack"}
    result = runner.invoke(cli, ["review", "r1", "--labels-summary", "--runs", runs])
    assert re.search(r"1\s+│\s+train\s+│\s+1\s+│\s+1\s+│\s+2\s+│\s+4", result.output), result.output


def test_review_command_errors_exit_2(run, cli, tmp_path):
    runs = str(tmp_path / "runs")
    for args, message in ((["review", "nope"], "no run 'nope'"), (["review", "r1", "--step", "9"], "step 9"),
                          (["review", "r1", "--split", "test"], "--split must be"),
                          (["guard", "suggest", "r1"], "no samples are labelled 'hack'")):
        result = runner.invoke(cli, [*args, "--runs", runs])
        assert result.exit_code == 2 and message in result.output, result.output


def test_guard_suggest_command_writes_the_approved_guard(tmp_path, cli):
    planted(tmp_path / "runs").close()
    config = tmp_path / "run.toml"
    config.write_text('[[reward.components]]\nfunction = "r.py:votes"\n')
    args = ["guard", "suggest", "hn", "--runs", str(tmp_path / "runs"), "--write", str(config)]
    result = runner.invoke(cli, args, input="2\nn\n")
    assert result.exit_code == 0 and "nothing written" in result.output, result.output
    assert re.search(r"no_shared_phrase.*5/5.*0/3.*0/0.*3/20", result.output), result.output
    result = runner.invoke(cli, [*args, "--pick", "2", "--yes"])
    assert result.exit_code == 0, result.output
    assert tomllib.loads(config.read_text())["reward"]["components"][1]["name"] == "no_shared_phrase"
    result = runner.invoke(cli, [*args, "--yes"])
    assert result.exit_code == 2 and "--yes needs --pick N" in result.output


def test_guard_suggest_command_reads_the_source_from_the_tasks(tmp_path, cli):
    planted(tmp_path / "runs").close()
    tasks = tmp_path / "tasks.jsonl"
    write_labels(tasks, [{"id": f"t{t}", "text": f"The council of town {t} approved a new park budget on Monday."}
                         for t in range(7)])
    args = ["guard", "suggest", "hn", "--runs", str(tmp_path / "runs"), "--source", "text"]
    result = runner.invoke(cli, args)
    assert result.exit_code == 2 and "--source needs the tasks" in result.output, result.output
    result = runner.invoke(cli, [*args, "--tasks", str(tasks)])
    assert result.exit_code == 0, result.output
    assert re.search(r"grounded_terms.*5/5.*0/3.*0/0.*6/20", result.output), result.output
    assert 'source = "text"' in result.output


def test_review_command_shows_each_samples_task_prompt_above_its_completion(tmp_path, cli):
    store = RunStore(tmp_path / "runs" / "r2")
    store.record_groups(1, [group("a", sample("Rust 1.80 ships", 0.9, user="Title for: Rust [bold]1.80[/bold] is out")),
                            group("b", sample("A quiet week", 0.1, user="Title for: nothing happened"))])
    store.close()
    result = runner.invoke(cli, ["review", "r2", "--k", "1", "--runs", str(tmp_path / "runs")])
    assert result.exit_code == 0, result.output
    text = result.output
    # Each prompt comes right before its own completion; markup in a prompt is shown as text.
    top = text.index("prompt: Title for: Rust [bold]1.80[/bold] is out")
    bottom = text.index("prompt: Title for: nothing happened")
    assert top < text.index("Rust 1.80 ships") < bottom < text.index("A quiet week")
    store = RunStore(tmp_path / "runs" / "r2")
    (step,) = review(store, k=1)
    store.close()
    assert [s.prompt for s in step.top + step.bottom] == ["Title for: Rust [bold]1.80[/bold] is out",
                                                         "Title for: nothing happened"]
