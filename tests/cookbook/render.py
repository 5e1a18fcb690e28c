"""Render conversations with a Tinker cookbook renderer (tinker-cookbook 0.6.1), in the cookbook's
virtualenv: the token ids a cookbook loop would send, for grooves' tests to hold against the
model's own chat template.

    python render.py RENDERER TOKENIZER_DIR < conversations.json > rendered.json

Each conversation is rendered twice: as a generation prompt (what ``sample`` gets) and as a
supervised example (the whole conversation, what ``forward_backward`` trains on).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    from tinker_cookbook import renderers
    from transformers import AutoTokenizer

    name, folder = sys.argv[1:3]
    renderer = renderers.get_renderer(name, AutoTokenizer.from_pretrained(folder))
    out = []
    for convo in json.load(sys.stdin):
        model_input, _weights = renderer.build_supervised_example(convo)
        out.append({"prompt": renderer.build_generation_prompt(convo[:-1]).to_ints(),
                    "full": model_input.to_ints()})
    json.dump({"stop": renderer.get_stop_sequences(), "conversations": out}, sys.stdout)


if __name__ == "__main__":
    main()
