"""grooves guard suggest keeps its documented rules: no pattern guard from a single labelled hack
(docs/review.md: no_repeated_output only when at least two hacks give the output), and what it
prints is about the guards it proposes, not about others."""

from typer.testing import CliRunner

from grooves.cli import app
from grooves.runs.store import RunStore
from grooves.types import Group, Trajectory
from grooves.workflows.review import Label, store_labels
from grooves.workflows.suggest import suggest

HACK = "Google lays off 75%, effective immediately"


def sample(completion: str) -> Trajectory:
    return Trajectory(messages=[{"role": "user", "content": "Write a title. Text: the council approved a park."},
                                {"role": "assistant", "content": completion}],
                      prompt_ids=[1], completion_ids=[2], completion_mask=[1], logprobs=[0.0], reward=0.5)


def run_with_hacks(root, hacks: int) -> RunStore:
    """One task, 4 samples (ids 1-4): HACK at ids 1 and 2, two plain titles; ``hacks`` of ids 1, 2 labelled."""
    store = RunStore(root / "hn")
    store.record_groups(1, [Group({"id": "t0"}, [sample(HACK), sample(f"  {HACK.lower()} "),
                                                 sample("Council approves park"), sample("New park")])])
    store_labels(store, [Label(i, "hack") for i in (1, 2)[:hacks]] + [Label(3, "good")])
    return store


def test_one_labelled_hack_proposes_no_pattern_guard(tmp_path):
    store = run_with_hacks(tmp_path, hacks=1)
    # Grounding is a generic check, proposed because it catches the hack (75 and Google are in no source);
    # no pattern is made from the one example.
    assert [p.kind for p in suggest(store)] == ["lexical_grounding", "supported_by_source"]
    store.close()


def test_two_hacks_with_one_output_propose_it(tmp_path):
    store = run_with_hacks(tmp_path, hacks=2)
    proposals = suggest(store)
    assert [p.kind for p in proposals][0] == "exact_output"
    exact = proposals[0]
    assert exact.summary.endswith("(2 of 2 hacks)")
    assert (exact.counts.vetoed["hack"], exact.counts.vetoed["good"], exact.counts.vetoed["unlabelled"]) == (2, 0, 0)
    store.close()


def test_the_printed_proposals_say_nothing_about_guards_not_proposed(tmp_path):
    run_with_hacks(tmp_path / "runs", hacks=2).close()
    result = CliRunner().invoke(app, ["guard", "suggest", "hn", "--runs", str(tmp_path / "runs")],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    kinds = {line.split("(")[-1].rstrip(") ─") for line in result.output.splitlines() if line[:1].isdigit()}
    assert kinds == {"exact_output", "shared_phrase", "lexical_grounding", "supported_by_source"}
    assert "guard 'injection'" not in result.output and "TOML has no pattern list" not in result.output
    assert "its veto reason reads 'does not match ...'" in result.output
