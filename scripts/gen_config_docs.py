"""Regenerate docs/config.md from the config models: python scripts/gen_config_docs.py"""

from pathlib import Path

from grooves.training.config import config_reference

Path(__file__).resolve().parent.parent.joinpath("docs", "config.md").write_text(config_reference() + "\n")
