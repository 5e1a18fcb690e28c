"""An Ollama ``Modelfile`` beside an exported GGUF.

Ollama renders prompts with a Go template, not the model's Jinja chat template, so the
Modelfile spells out the prompt format the model was trained with. For a ChatML tokenizer
(SmolLM2, grooves' tiny model) that is checked by rendering the chat template, and a system
message the template inserts when none is given becomes ``SYSTEM`` (Ollama's default system
message); any other template is left to Ollama's reading of the GGUF.
"""

from __future__ import annotations

import re
from pathlib import Path

# One line per message, as the ChatML Jinja templates render them; system messages are
# taken from .System (the request's, else SYSTEM below), so the range skips them.
CHATML_OLLAMA = (
    '{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}'
    '{{ range .Messages }}{{ if ne .Role "system" }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n'
    '{{ end }}{{ end }}<|im_start|>assistant\n'
)


def modelfile_path(gguf: Path) -> Path:
    """``model.gguf`` -> ``model.Modelfile`` (a merged file and a LoRA file can share a folder)."""
    return gguf.with_suffix(".Modelfile")


def write_modelfile(gguf: Path, tokenizer, base: Path | None = None) -> Path:
    """Write the Modelfile for a merged GGUF, or for a LoRA GGUF over ``base``."""
    path = modelfile_path(gguf)
    lines = [f"# Ollama: ollama create NAME -f {path.name}   (written by grooves)"]
    if base is None:
        lines.append(f"FROM ./{gguf.name}")
    else:
        lines += [f"FROM ./{base.name}", f"ADAPTER ./{gguf.name}"]
    chatml, system = chatml_default_system(tokenizer)
    if chatml:
        lines.append(f'TEMPLATE """{CHATML_OLLAMA}"""')
        if system:
            lines.append(f'SYSTEM """{system}"""')
        lines.append('PARAMETER stop "<|im_end|>"')
    else:
        lines.append("# the chat template is not ChatML: Ollama reads it from the GGUF's tokenizer.chat_template")
    path.write_text("\n".join(lines) + "\n")
    return path


def chatml_default_system(tokenizer) -> tuple[bool, str | None]:
    """Whether the chat template renders ChatML, and the system message it adds when none is given."""
    if not getattr(tokenizer, "chat_template", None):
        return False, None

    def render(messages):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    turn = "<|im_start|>{}\n{}<|im_end|>\n"
    with_system = render([{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                          {"role": "assistant", "content": "A"}, {"role": "user", "content": "V"}])
    expected = "".join(turn.format(r, c) for r, c in [("system", "S"), ("user", "U"), ("assistant", "A"),
                                                         ("user", "V")]) + "<|im_start|>assistant\n"
    if with_system != expected:
        return False, None
    user_only = render([{"role": "user", "content": "U"}])
    tail = turn.format("user", "U") + "<|im_start|>assistant\n"
    if user_only == tail:
        return True, None
    default = re.fullmatch(r"<\|im_start\|>system\n(.*)<\|im_end\|>\n", user_only.removesuffix(tail), re.S)
    if default is None or not user_only.endswith(tail) or '"""' in default.group(1):
        return False, None
    return True, default.group(1)
