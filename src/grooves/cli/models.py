"""``grooves sample``, ``runs``, ``serve``, ``merge`` and ``export``: using the models and checkpoints a run made."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from grooves.cli.common import RunsOption, _fail, _user_errors, err, num, out


def sample(
    model: Annotated[str, typer.Argument(help="Model spec (bundled:smollm2-135m-instruct, tiny, a folder, a hub "
                                         "id) or a checkpoint RUN@STEP / RUN@latest.")],
    prompt: Annotated[str, typer.Argument(help="User message.")],
    n: Annotated[int, typer.Option("-n", min=1, help="Completions to sample.")] = 1,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy.")] = 0.7,
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0)] = 1.0,
    max_tokens: Annotated[int, typer.Option(min=1, help="New tokens per completion.")] = 128,
    system: Annotated[str | None, typer.Option(help="System message.")] = None,
    seed: Annotated[int | None, typer.Option(help="Sampling seed.")] = None,
    runs: RunsOption = None,
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress lines on stderr.")] = False,
) -> None:
    """Generate completions of PROMPT with a base model or a checkpoint.

    The completions go to stdout; what it is doing (loading, generating) goes to stderr.
    """
    from grooves.policy import Policy, Sampling
    from grooves.progress import Reporter

    progress = Reporter(err, enabled=not quiet)
    try:
        progress.phase("loading", f"model {model}")
        policy = Policy.load(model, runs=runs)
        sampling = Sampling(temperature=temperature, top_p=top_p or 1.0, max_new_tokens=max_tokens, seed=seed)
    except (*_user_errors(), ValueError) as error:
        raise _fail(str(error)) from None
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    progress.phase("generating", f"{n} completion{'s' if n > 1 else ''} of at most {max_tokens} new tokens")
    for i, completion in enumerate(policy.sampler().generate([messages], n=n, sampling=sampling)[0]):
        if n > 1:
            out.print(f"[dim]--- {i + 1} ({completion.finish_reason}, {len(completion.token_ids)} tokens)[/]")
        out.print(completion.text, highlight=False, markup=False)


def list_runs(runs: RunsOption = None) -> None:
    """List runs with their last step, newest checkpoint and rewards.

    "val reward" is the newest held-out evaluation, with the step it was measured at. A
    checkpoint that fails verification (a damaged or truncated file) is marked corrupt, with
    the newest complete one beside it.
    """
    from rich.table import Table

    from grooves.policy.checkpoints import runs_root
    from grooves.runs.store import read_metrics

    root = runs_root(runs)
    folders = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    folders = [p for p in folders if (p / "metrics.jsonl").exists()]
    if not folders:
        out.print(f"no runs under {root}")
        return
    table = Table("run", "last step", "checkpoint", "reward", "val reward (at step)", title=f"runs in {root}")
    for folder in folders:
        rows = read_metrics(folder / "metrics.jsonl")
        last_train = next((r for r in reversed(rows) if r.get("reward/total") is not None), {})
        last_val = next((r for r in reversed(rows) if r.get("val/reward/total") is not None), None)
        val = f"{num(last_val['val/reward/total'])} (step {last_val['step']})" if last_val else "-"
        table.add_row(folder.name, str(rows[-1]["step"] if rows else "-"), _checkpoint_cell(folder),
                      num(last_train.get("reward/total")), val)
    out.print(table)


def _checkpoint_cell(folder: Path) -> str:
    """The newest checkpoint, or which newer ones are corrupt and the newest complete one."""
    from grooves.policy.checkpoints import list_checkpoints, newest_complete

    if not list_checkpoints(folder):
        return "-"
    newest, corrupt = newest_complete(folder)
    complete = f"{folder.name}@{newest[0]}" if newest else "none complete"
    if not corrupt:
        return complete
    steps = ", ".join(str(step) for step, _ in corrupt)
    return f"{complete} (step {steps} corrupt)"


def serve(
    model: Annotated[str, typer.Option(help="Base model spec served, with its adapters.")] = "bundled:smollm2-135m-instruct",
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="TCP port (0: any free port).")] = 8000,
    api_key: Annotated[str | None, typer.Option(envvar="GROOVES_API_KEY",
                                                help="Require 'Authorization: Bearer KEY' on every route but "
                                                     "/health. Prefer $GROOVES_API_KEY: an option shows in ps.")] = None,
    adapter: Annotated[list[str] | None, typer.Option(help="Serve a checkpoint under an alias: "
                                                      "ALIAS=RUN@STEP (repeatable).")] = None,
    max_batch: Annotated[int, typer.Option(min=1, help="Most samples decoded in one batch.")] = 32,
    max_queue: Annotated[int, typer.Option(min=1, help="Queued requests before answering 429.")] = 64,
    max_adapters: Annotated[int, typer.Option(min=1, help="Adapters kept loaded at once.")] = 8,
    max_body_bytes: Annotated[int, typer.Option(min=1024, help="Largest request body accepted (413 beyond).")]
    = 1 << 20,
    lora_root: Annotated[list[Path] | None, typer.Option(help="A folder POST /v1/load_lora_adapter may load "
                                                         "adapters from (repeatable; default: the runs root).")] = None,
    capture: Annotated[Path | None, typer.Option(help="Record every non-streamed chat completion (messages, "
                                                 "prompt and completion token ids) in DIR/capture.sqlite for "
                                                 "grooves learn. Off by default: prompts are user data.")] = None,
    capture_max_mb: Annotated[float, typer.Option(min=0.0625, help="Largest size of the capture store; the "
                                                  "oldest rows go first.")] = 256.0,
    capture_retention_days: Annotated[float, typer.Option(min=0.0001, help="Captured rows older than this are "
                                                          "deleted.")] = 30.0,
    runs: RunsOption = None,
) -> None:
    """Serve the base model and the runs' checkpoints over an OpenAI-compatible HTTP API."""
    import logging

    from grooves.serve.adapters import UnknownModel
    from grooves.serve.app import bind, build_server, serve_forever

    aliases = {}
    for item in adapter or []:
        alias, sep, checkpoint = item.partition("=")
        if not sep:
            raise _fail(f"--adapter {item!r}: use ALIAS=RUN@STEP")
        aliases[alias] = checkpoint
    try:  # the port first: a busy one fails in a second, not after the model has loaded
        sock = bind(host, port)
    except OSError as error:
        raise _fail(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    try:
        store = None
        if capture is not None:
            from grooves.serve.capture_store import CaptureStore

            import sqlite3

            try:
                store = CaptureStore(capture, max_bytes=int(capture_max_mb * (1 << 20)),
                                     retention_s=capture_retention_days * 86400.0)
            except (OSError, sqlite3.Error) as error:
                raise ValueError(f"--capture {capture}: cannot open the capture store ({error})") from None
        server = build_server(model, runs=runs, api_key=api_key, aliases=aliases, max_batch_rows=max_batch,
                              max_queue=max_queue, max_loaded=max_adapters, max_body_bytes=max_body_bytes,
                              lora_roots=lora_root or None, capture=store)
    except (*_user_errors(), UnknownModel, ValueError) as error:
        sock.close()
        raise _fail(str(error)) from None
    handler = logging.StreamHandler()  # stderr: one line per request
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    requests_log = logging.getLogger("grooves.serve")
    requests_log.addHandler(handler)
    requests_log.setLevel(logging.INFO)
    bound_host, bound_port = sock.getsockname()[:2]
    err.print(f"[bold]grooves[/]: serving {model} and the checkpoints under {server.registry.runs} "
              f"on http://{bound_host}:{bound_port}/v1", highlight=False)
    if store is not None:
        err.print(f"capturing chat completions into {store.path}", highlight=False)
    serve_forever(server, sock)


def merge(
    checkpoint: Annotated[str, typer.Argument(help="Checkpoint to merge: RUN@STEP or RUN@latest.")],
    out_dir: Annotated[Path, typer.Option("--out", help="New folder for the merged model.")],
    runs: RunsOption = None,
) -> None:
    """Merge a checkpoint's adapter into its base model: a plain transformers folder."""
    from grooves.serve import ExportError, merge_checkpoint

    try:
        folder = merge_checkpoint(checkpoint, out_dir, runs=runs)
    except (*_user_errors(), ExportError) as error:
        raise _fail(str(error)) from None
    out.print(f"merged {checkpoint} into {folder} (load it with AutoModelForCausalLM.from_pretrained)")


def export(
    checkpoint: Annotated[str, typer.Argument(help="Checkpoint to export: RUN@STEP or RUN@latest.")],
    out_dir: Annotated[Path | None, typer.Option("--out", help="New folder for the PEFT adapter.")] = None,
    with_base: Annotated[Path | None, typer.Option("--with-base", help="Also write the base model as a plain "
                                                   "transformers folder here (reused if it already holds this "
                                                   "base) and point the adapter at it.")] = None,
    gguf: Annotated[Path | None, typer.Option("--gguf", help="Write the merged model as one GGUF file here "
                                              "(for llama.cpp's -m, Ollama's FROM), with a .Modelfile beside "
                                              "it.")] = None,
    gguf_lora: Annotated[Path | None, typer.Option("--gguf-lora", help="Write the adapter alone as a GGUF LoRA "
                                                   "file here (llama.cpp's --lora, Ollama's ADAPTER), its base "
                                                   "beside it (a.gguf: a.base.gguf) and a .Modelfile.")] = None,
    gguf_type: Annotated[str, typer.Option("--gguf-type", help="Float type of the GGUF matrices: f16 or f32 "
                                           "(norms and LoRA files are always f32; nothing is quantised).")]
    = "f16",
    runs: RunsOption = None,
) -> None:
    """Write a checkpoint's adapter as a standard PEFT folder with a model card, or as GGUF.

    The adapter's base_model_name_or_path is a base that plain peft + transformers load: the
    --with-base folder, else the base's own folder or hub id (for the bundled model, grooves'
    cache folder on this machine). The model card names the exact base weights. --gguf and
    --gguf-lora write files llama.cpp and Ollama load (llama-architecture bases).
    """
    from grooves.policy.checkpoints import resolve_checkpoint
    from grooves.serve.export import ExportError, export_adapter
    from grooves.serve.gguf_export import export_gguf, export_gguf_lora

    if out_dir is None and gguf is None and gguf_lora is None:
        raise _fail("nothing to write: give --out DIR (PEFT folder), --gguf FILE or --gguf-lora FILE")
    if with_base is not None and out_dir is None:
        raise _fail("--with-base goes with --out (the PEFT folder that points at it)")
    try:
        if out_dir is not None:
            folder = export_adapter(checkpoint, out_dir, runs=runs, with_base=with_base)
            base = json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]
            step = resolve_checkpoint(checkpoint, runs).name.removeprefix("step-").lstrip("0") or "0"
            out.print(f"exported {checkpoint} (step {step}) to {folder}; its base: {base} "
                      f"(load it with peft.AutoPeftModelForCausalLM.from_pretrained; the card shows how)",
                      highlight=False, soft_wrap=True)
        if gguf is not None:
            done = export_gguf(checkpoint, gguf, runs=runs, gguf_type=gguf_type)
            out.print(f"wrote {checkpoint} (step {done.step}) merged as {gguf_type} GGUF {done.gguf} and "
                      f"{done.modelfile}: llama-cli -m {done.gguf}; ollama create NAME -f {done.modelfile}",
                      highlight=False, soft_wrap=True)
        if gguf_lora is not None:
            done = export_gguf_lora(checkpoint, gguf_lora, runs=runs, gguf_type=gguf_type)
            out.print(f"wrote {checkpoint} (step {done.step}) as GGUF LoRA {done.gguf}, its base {done.base} "
                      f"and {done.modelfile}: llama-cli -m {done.base} --lora {done.gguf}; "
                      f"ollama create NAME -f {done.modelfile}", highlight=False, soft_wrap=True)
    except (*_user_errors(), ExportError) as error:
        raise _fail(str(error)) from None
