"""The bundled model's cache folder names its architecture, and old caches are repaired."""

import json

from grooves.policy.models import bundled_folder, bundled_gguf, save_plain, tiny_model


def test_save_plain_names_the_architecture(tmp_path):
    model, tokenizer = tiny_model()
    save_plain(model, tokenizer, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"


def test_a_cache_with_null_architectures_is_repaired_on_load(tmp_path, monkeypatch):
    """A cache written by an older grooves says "architectures": null; loading names it."""
    monkeypatch.setenv("GROOVES_CACHE", str(tmp_path))
    _, gguf = bundled_gguf("bundled")
    folder = tmp_path / "models" / f"{gguf.stem}-{gguf.stat().st_size}"
    folder.mkdir(parents=True)
    old = {"architectures": None, "model_type": "llama", "hidden_size": 576, "tie_word_embeddings": True}
    (folder / "config.json").write_text(json.dumps(old))

    assert bundled_folder("bundled:smollm2-135m-instruct") == folder
    assert json.loads((folder / "config.json").read_text()) == {**old, "architectures": ["LlamaForCausalLM"]}
    assert [p.name for p in folder.iterdir()] == ["config.json"]  # no temporary file left behind
