"""Learned reward models on the tiny random backbone: metrics, save/load, the component, the CLI.

The synthetic set: short texts from a small vocabulary; half contain "excellent" and get
target 3 + N(0, 0.5), the others 0 + N(0, 0.5). Even random-weight features separate texts
that contain a word from texts that do not, so a ridge head should come close to the best
possible correlation, sqrt(var(3 * good) / var(target)) = sqrt(2.25 / 2.5) = 0.949.
"""

import csv
import math
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from grooves.cli import app
from grooves.policy.models import load_model
from grooves.rewards import Reward
from grooves.rewards.models import (RewardModel, RewardModelComponent, RewardModelError, comparison_pairs,
                                    embed, pearson, read_csv, spearman, train_reward_model)
from grooves.types import Group, Trajectory

WORDS = "the a cat dog runs fast slow red blue green house tree river stone light dark".split()
HN = Path(__file__).resolve().parents[2] / "shared" / "data" / "hn" / "hacker_news.csv"


def synthetic(n=600, seed=0):
    rng = np.random.default_rng(seed)
    texts, targets = [], []
    for _ in range(n):
        words = list(rng.choice(WORDS, size=rng.integers(3, 7)))
        good = rng.random() < 0.5
        if good:
            words.insert(rng.integers(0, len(words) + 1), "excellent")
        texts.append(" ".join(words))
        targets.append(3.0 * good + rng.normal(0, 0.5))
    return texts, targets


def write_csv(path, rows, header=("text", "score")):
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return path


@pytest.fixture(scope="module")
def trained():
    texts, targets = synthetic()
    return train_reward_model(texts, targets, backbone="tiny", heldout_fraction=0.1, seed=0)


def test_pearson_and_spearman_match_hand_values():
    assert pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert pearson([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert math.isnan(pearson([1, 1, 1], [1, 2, 3]))  # a constant predictor has no correlation
    # ranks of [1, 10, 100] are [0, 1, 2], of [1, 2, 2] are [0, 1.5, 1.5]: r = 0.866
    assert spearman([1, 10, 100], [1, 2, 2]) == pytest.approx(math.sqrt(3) / 2)


def test_frozen_ridge_reaches_a_correlation_near_the_ceiling(trained):
    metrics = trained.config["metrics"]
    assert (metrics["n_train"], metrics["n_heldout"]) == (540, 60)
    assert 0.8 < metrics["pearson"] <= 0.95  # ceiling 0.949 (module docstring)
    assert metrics["spearman"] > 0.6  # targets are two noisy clusters: ranks inside a cluster are noise
    assert trained.config["mode"] == "frozen" and trained.config["head"] == "ridge"


def test_save_load_round_trip_gives_identical_scores(trained, tmp_path):
    texts = ["the excellent cat", "a slow dog", "", "excellent"]
    before = trained.score(texts)
    folder = trained.save(tmp_path / "rm")
    assert sorted(p.name for p in folder.iterdir()) == ["head.safetensors", "reward_model.json"]
    loaded = RewardModel.load(folder)
    assert loaded.score(texts) == before
    assert before[0] - before[1] > 1.5  # the word is worth about 3 points
    trained.save(folder)  # overwriting an RM folder is allowed; no temp folders are left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rm"]


def test_loading_a_folder_that_is_not_a_reward_model_is_a_clear_error(tmp_path):
    with pytest.raises(RewardModelError, match="is not a reward model folder"):
        RewardModel.load(tmp_path)
    with pytest.raises(RewardModelError, match="does not exist"):
        RewardModel.load(tmp_path / "nope")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("x")
    with pytest.raises(RewardModelError, match="refusing to overwrite"):
        RewardModel({}, {}).save(tmp_path / "other")


def test_component_scores_a_group_into_its_components(trained):
    group = Group(task={"id": "t", "topic": "excellent"}, trajectories=[
        Trajectory(messages=[{"role": "assistant", "content": c}], prompt_ids=[1], completion_ids=[2],
                   completion_mask=[1], logprobs=[0.0]) for c in ("the cat", "the dog")])
    plain = RewardModelComponent("rm", trained)
    with_topic = RewardModelComponent("rm_topic", trained, weight=0.5, input="{completion} {topic}")
    report = Reward([plain, with_topic]).score([group])
    assert report.errors == {}
    expected = trained.score(["the cat", "the dog"])
    assert [t.components["rm"] for t in group] == expected
    topical = [t.components["rm_topic"] for t in group]
    assert topical == trained.score(["the cat excellent", "the dog excellent"])
    assert min(topical) - max(expected) > 1.5  # the task column reached the text
    assert group.trajectories[0].reward == pytest.approx(expected[0] + 0.5 * topical[0])
    assert report.counters["rm"]["texts"] == 2


def test_component_input_naming_a_missing_column_fails_as_nan(trained):
    group = Group(task={"id": "t"}, trajectories=[
        Trajectory(messages=[{"role": "assistant", "content": "x"}], prompt_ids=[1], completion_ids=[2],
                   completion_mask=[1], logprobs=[0.0])])
    report = Reward([RewardModelComponent("rm", trained, input="{label}")]).score([group])
    assert math.isnan(group.trajectories[0].components["rm"]) and report.errors == {"rm": 1}
    assert "'label'" in report.first_error["rm"] and "completion" in report.first_error["rm"]


def test_a_peft_wrapped_base_in_training_mode_gives_the_plain_base_scores(trained):
    """The trainer's own model can be the backbone: adapters off and no dropout while scoring."""
    from peft import LoraConfig, get_peft_model

    model, tokenizer = load_model("tiny")  # the same seeded weights as the RM's backbone
    wrapped = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.5,
                                               init_lora_weights=False))  # random B: the adapter matters
    wrapped.train()
    texts = ["the excellent cat", "a dog"]
    plain = embed(load_model("tiny")[0], tokenizer, texts)
    assert not np.allclose(embed(wrapped.get_base_model(), tokenizer, texts), plain)  # adapter on
    assert RewardModelComponent("rm", trained, base=(wrapped, tokenizer))._score(texts) == trained.score(texts)
    assert wrapped.training and trained.base[0] is not wrapped


def test_z_scale_centres_the_training_scores(trained):
    component = RewardModelComponent("rm", trained, scale="z")
    texts, _ = synthetic(200, seed=1)
    z = np.array(component._score(texts))
    assert abs(z.mean()) < 0.2 and 0.8 < z.std() < 1.2  # fresh texts from the same distribution


def separable_pairs(n_groups=200):
    """Each group: one text with the word (target 1) and one without (target 0)."""
    texts, targets, groups = [], [], []
    rng = np.random.default_rng(1)
    for g in range(n_groups):
        for good in (0, 1):
            words = list(rng.choice(WORDS, size=rng.integers(3, 7)))
            texts.append(" ".join(words + ["excellent"] * good))
            targets.append(float(good))
            groups.append(f"g{g}")
    return texts, targets, groups


def test_pairwise_mode_ranks_a_separable_set():
    texts, targets, groups = separable_pairs()
    model = train_reward_model(texts, targets, backbone="tiny", groups=groups, seed=0)
    metrics = model.config["metrics"]
    assert (metrics["n_heldout_pairs"], metrics["n_train_pairs"]) == (20, 180)  # one pair per group
    assert metrics["pairwise_accuracy"] >= 0.9
    assert model.config["objective"] == "bradley_terry"


def test_comparison_pairs_put_the_winner_first_and_skip_ties():
    targets = np.array([1.0, 3.0, 2.0, 5.0, 5.0])
    pairs = comparison_pairs(targets, ["a", "a", "a", "b", "b"], np.arange(5))
    assert pairs.tolist() == [[1, 0], [2, 0], [1, 2]]


def test_bad_csv_input_is_explained(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_csv(tmp_path / "none.csv", "text", "score")
    path = write_csv(tmp_path / "d.csv", [["a", "1"], ["b", "lots"]])
    with pytest.raises(RewardModelError, match=r"'title' is not in .*columns are: text, score"):
        read_csv(path, "title", "score")
    with pytest.raises(RewardModelError, match=r"data row 2 \(line 3\) has score = 'lots'"):
        read_csv(path, "text", "score")
    with pytest.raises(RewardModelError, match="too few rows for a split: 5 rows"):
        train_reward_model(["a"] * 5, [1.0] * 5, backbone="tiny")
    with pytest.raises(RewardModelError, match="log1p needs targets above -1; data row 2"):
        train_reward_model(["a", "b"], [1.0, -3.0], backbone="tiny", transform="log1p")


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_cli_trains_scores_and_fails_clearly(tmp_path):
    texts, targets = synthetic(300)
    data = write_csv(tmp_path / "d.csv", [[t, max(0.0, y) * 10] for t, y in zip(texts, targets)])
    result = invoke("rm", "train", data, "--text-col", "text", "--target-col", "score", "--transform", "log1p",
                    "--backbone", "tiny", "--out", tmp_path / "rm", "--quiet")
    assert result.exit_code == 0, result.output
    assert "held-out pearson 0." in result.output and "n_heldout 30" in result.output
    scored = invoke("rm", "score", tmp_path / "rm", "the excellent cat", "a dog")
    assert scored.exit_code == 0, scored.output
    values = [float(line.split("\t")[0]) for line in scored.stdout.splitlines()]
    assert len(values) == 2 and values[0] > values[1]  # log1p(~30) vs log1p(~0)
    missing = invoke("rm", "train", data, "--text-col", "title", "--target-col", "score", "--out", tmp_path / "x")
    assert missing.exit_code == 2 and "'title' is not in" in missing.output and "text, score" in missing.output
    not_rm = invoke("rm", "score", tmp_path, "text")
    assert not_rm.exit_code == 2 and "is not a reward model folder" in not_rm.output


def test_cli_trains_a_pairwise_model(tmp_path):
    texts, targets, groups = separable_pairs(100)
    data = write_csv(tmp_path / "p.csv", zip(groups, texts, targets), header=("pair", "text", "preferred"))
    result = invoke("rm", "train", data, "--text-col", "text", "--target-col", "preferred", "--pair-col", "pair",
                    "--backbone", "tiny", "--out", tmp_path / "rm", "--quiet")
    assert result.exit_code == 0, result.output
    assert "held-out pairwise accuracy" in result.output and "held-out pairs 10)" in result.output


def test_cli_scores_a_csv_column(tmp_path, trained):
    trained.save(tmp_path / "rm")
    data = write_csv(tmp_path / "t.csv", [["excellent stone", "0"], ["stone", "0"]])
    result = invoke("rm", "score", tmp_path / "rm", "--file", data, "--column", "text")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert [line.split("\t")[1] for line in lines] == ["excellent stone", "stone"]


def test_real_hn_titles_train_and_predict_near_the_mean():
    """Tiny random features say little about HN points; predictions stay near the mean log1p."""
    rows = read_csv(HN, "title", "num_points", limit=1000)
    model = train_reward_model(rows.texts, rows.targets, backbone="tiny", transform="log1p")
    metrics = model.config["metrics"]
    assert (metrics["n_train"], metrics["n_heldout"]) == (900, 100)
    assert -1 <= metrics["pearson"] <= 1 and math.isfinite(metrics["rmse"])
    mean = float(np.log1p(rows.targets).mean())
    assert abs(np.mean(model.score(rows.texts[:50])) - mean) < 0.5
