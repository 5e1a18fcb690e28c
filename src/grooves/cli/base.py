"""``grooves base export``: a base model spec as a plain transformers folder.

The bundled model lives in grooves' cache as de-quantised GGUF weights; this writes it (or
any other spec) where plain ``transformers``, ``peft`` and vLLM can load it, with a card
that names the exact weights. ``grooves export --with-base`` does the same for one adapter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from grooves.cli.common import _fail, _user_errors, out

app = typer.Typer(help="Base models: write one as a plain transformers folder.", no_args_is_help=True)


@app.command("export")
def export_base_command(
    folder: Annotated[Path, typer.Argument(help="New folder for the base model.")],
    model: Annotated[str, typer.Option(help="Model spec: bundled:smollm2-135m-instruct, tiny, a folder, "
                                       "a hub id.")] = "bundled:smollm2-135m-instruct",
    dtype: Annotated[str, typer.Option(help="Weights dtype: float32, bfloat16 or float16.")] = "float32",
) -> None:
    """Write MODEL as a plain transformers folder (safetensors, config, tokenizer, a card naming
    its exact weights) that AutoModelForCausalLM.from_pretrained loads; config.json names the
    architecture, as vLLM needs."""
    from grooves.serve.export import ExportError, export_base

    try:
        written = export_base(model, folder, dtype=dtype, flag="folder")
    except (*_user_errors(), ExportError) as error:
        raise _fail(str(error)) from None
    out.print(f"wrote {model} to {written} (load it with AutoModelForCausalLM.from_pretrained)", highlight=False)
