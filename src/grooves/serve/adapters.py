"""Which adapters the server can serve, by name, and loading them onto the one base model.

A model name is the base model's spec, a checkpoint ``RUN@STEP`` / ``RUN@latest`` under
the runs root, or an alias registered at start-up or through ``POST /v1/adapters``.
Checkpoints are found only under the runs root (run names are plain folder names, so no
path can escape it). ``RUN@latest`` is resolved on every request, so a run that is still
training is followed without a restart. Adapters load on first use; when more than
``max_loaded`` are loaded the least recently used is unloaded.

A runtime LoRA (vLLM's ``POST /v1/load_lora_adapter``) is a PEFT folder loaded under a name
of the caller's choosing; its path must lie under one of the allowed roots (the runs root
unless the server is given others). Loading it again under the same name (``load_inplace``)
serves the folder's new contents from the next batch on.

Only the engine's worker thread calls ``acquire``, ``remove``, ``load_lora`` and
``unload_lora`` (they change the model); name checks and listings only read the file system.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from grooves.policy.checkpoints import CheckpointError, list_checkpoints, resolve_checkpoint, runs_root
from grooves.policy.decoding import BASE_ADAPTER
from grooves.policy.lora_batch import forget_stacks

_ALIAS = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class UnknownModel(LookupError):
    """A model name the server cannot serve; the message says what it can."""


class LoRAError(Exception):
    """A runtime LoRA request that cannot be done; ``status`` and ``kind`` are vLLM's for the case."""

    def __init__(self, status: int, kind: str, message: str):
        super().__init__(message)
        self.status, self.kind = status, kind


@dataclass(frozen=True)
class Resolved:
    name: str  # as requested
    checkpoint: Path | None  # None: the base model or a runtime LoRA
    step: int | None
    adapter: Path | None = None  # the PEFT folder; None: the base model
    version: object = None  # changes when the folder's contents are to be read again
    served: str = ""  # which weights answer, for the reply: RUN@STEP, a LoRA's name or the base spec


@dataclass(frozen=True)
class RuntimeLoRA:
    path: Path  # the PEFT folder
    generation: int  # 1 on load, +1 on each in-place reload
    step: int | None  # the checkpoint step, when the folder is a checkpoint's adapter


class AdapterRegistry:
    def __init__(self, policy, runs: str | Path | None = None, aliases: dict[str, str] | None = None,
                 max_loaded: int = 8, lora_roots: list[str | Path] | None = None):
        self.policy = policy
        self.runs = runs_root(runs)
        self.base_name = policy.base_spec
        self.max_loaded = max_loaded
        self.lora_roots = [Path(r).resolve() for r in (lora_roots if lora_roots is not None else [self.runs])]
        self.aliases: dict[str, str] = {}
        self.loras: dict[str, RuntimeLoRA] = {}
        self._loaded: OrderedDict[tuple[str, float], str] = OrderedDict()  # (folder, mtime) -> PEFT name
        self._counter = 0
        for alias, checkpoint in (aliases or {}).items():
            self.add_alias(alias, checkpoint)

    # --- names (any thread) -------------------------------------------------------

    def resolve(self, name: str) -> Resolved:
        if name == self.base_name:
            return Resolved(name, None, None, served=self.base_name)
        if (lora := self.loras.get(name)) is not None:
            return Resolved(name, None, lora.step, lora.path, ("lora", name, lora.generation), served=name)
        target = self.aliases.get(name, name)
        if "@" not in target:
            raise UnknownModel(f"model {name!r} does not exist; GET /v1/models lists the models served here")
        try:
            checkpoint = resolve_checkpoint(target, self.runs)
        except CheckpointError as error:
            raise UnknownModel(f"model {name!r}: {error}") from None
        step = int(checkpoint.name.removeprefix("step-"))
        return Resolved(name, checkpoint, step, checkpoint / "adapter", (checkpoint / "state.json").stat().st_mtime,
                        served=f"{checkpoint.parent.parent.name}@{step}")

    def add_alias(self, alias: str, checkpoint: str) -> Resolved:
        if not _ALIAS.match(alias) or alias == self.base_name:
            raise ValueError(f"alias {alias!r} must be 1-64 letters, digits, '.', '_' or '-' and not the base name")
        if "@" not in checkpoint:
            raise ValueError(f"{checkpoint!r} is not a checkpoint name; use RUN@STEP or RUN@latest")
        resolved = self.resolve(checkpoint)  # raises UnknownModel when it does not exist
        self.aliases[alias] = checkpoint
        return resolved

    def lora_folder(self, name: str, path: str) -> Path:
        """The PEFT folder a load request names, checked: under an allowed root, with an adapter in it.

        A checkpoint folder (``.../step-000N``) stands for its ``adapter/`` folder."""
        if not name or not path:
            raise LoRAError(400, "InvalidUserInput", "Both 'lora_name' and 'lora_path' must be provided.")
        if name == self.base_name:
            raise LoRAError(400, "InvalidUserInput", f"'{name}' is the base model's name; choose another lora_name.")
        folder = Path(path).resolve()
        if not any(folder.is_relative_to(root) for root in self.lora_roots):
            roots = ", ".join(str(r) for r in self.lora_roots)
            raise LoRAError(403, "PermissionDeniedError",
                            f"lora_path '{path}' is outside the folders this server loads adapters from ({roots})")
        if not (folder / "adapter_config.json").is_file() and (folder / "adapter" / "adapter_config.json").is_file():
            folder = folder / "adapter"
        if not (folder / "adapter_config.json").is_file():  # vLLM's LoRAAdapterNotFoundError
            raise LoRAError(404, "NotFoundError", f"Loading lora {name} failed: No adapter found for {path}")
        return folder

    def model_ids(self) -> list[str]:
        names = [self.base_name, *self.aliases, *self.loras]
        if self.runs.is_dir():
            for run in sorted(p for p in self.runs.iterdir() if p.is_dir()):
                steps = [step for step, _ in list_checkpoints(run)]
                names += [f"{run.name}@{step}" for step in steps] + ([f"{run.name}@latest"] if steps else [])
        return names

    # --- loading (the worker thread only) ---------------------------------------------

    def acquire(self, resolved: Resolved, in_use: set[str]) -> str:
        """The PEFT adapter name for a resolved model, loading it if needed."""
        if resolved.adapter is None:
            return BASE_ADAPTER
        key = (str(resolved.adapter), resolved.version)
        if key in self._loaded:
            self._loaded.move_to_end(key)
            return self._loaded[key]
        self._evict(in_use)
        self._counter += 1
        peft_name = f"adapter{self._counter}"  # PEFT names become module keys: no '@' or '.'
        self._load(resolved.adapter, peft_name)
        self._loaded[key] = peft_name
        return peft_name

    def load_lora(self, name: str, folder: Path, inplace: bool) -> None:
        """Load a PEFT folder now under ``name`` (vLLM validates by loading); a failed load changes nothing."""
        old = self.loras.get(name)
        if old is not None and not inplace:
            raise LoRAError(400, "InvalidUserInput",
                            f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
                            "in place, set 'load_inplace' to True.")
        step = int(folder.parent.name.removeprefix("step-")) if _is_checkpoint_adapter(folder) else None
        lora = RuntimeLoRA(folder, old.generation + 1 if old else 1, step)
        self.loras[name] = lora
        try:
            self.acquire(self.resolve(name), set())
        except Exception:
            self._restore(name, old)
            raise
        if old is not None:
            self._unload_key((str(old.path), ("lora", name, old.generation)))

    def unload_lora(self, name: str) -> None:
        if name not in self.loras:
            raise LoRAError(404, "NotFoundError", f"The lora adapter '{name}' cannot be found.")
        lora = self.loras.pop(name)
        self._unload_key((str(lora.path), ("lora", name, lora.generation)))

    def _restore(self, name: str, old: RuntimeLoRA | None) -> None:
        if old is None:
            self.loras.pop(name, None)
        else:
            self.loras[name] = old

    def _unload_key(self, key: tuple) -> None:
        if key in self._loaded:
            self._unload(self._loaded.pop(key))

    def remove(self, name: str) -> None:
        """Forget an alias or a runtime LoRA, or unload the adapters a checkpoint name refers to."""
        if name in self.aliases:
            del self.aliases[name]
            return
        if name in self.loras:
            self.unload_lora(name)
            return
        resolved = self.resolve(name)
        if resolved.checkpoint is None:
            raise ValueError("the base model cannot be removed")
        folder = str(resolved.checkpoint / "adapter")
        for key in [k for k in self._loaded if k[0] == folder]:
            self._unload(self._loaded.pop(key))

    def loaded(self) -> list[str]:
        return list(self._loaded.values())

    def _load(self, folder: Path, peft_name: str) -> None:
        from peft import PeftModel

        forget_stacks(self.policy)  # the batched LoRA's stacks are made again for the new set
        if self.policy.has_adapter:
            self.policy.model.load_adapter(str(folder), adapter_name=peft_name)
        else:
            self.policy.model = PeftModel.from_pretrained(self.policy.model, str(folder), adapter_name=peft_name)
        self.policy.model.eval()

    def _evict(self, in_use: set[str]) -> None:
        while len(self._loaded) >= self.max_loaded:
            victim = next((k for k, v in self._loaded.items() if v not in in_use), None)
            if victim is None:
                return  # everything loaded is needed by this batch
            self._unload(self._loaded.pop(victim))

    def _unload(self, peft_name: str) -> None:
        forget_stacks(self.policy)
        model = self.policy.model
        if len(model.peft_config) == 1:  # the last one: back to the plain base model
            self.policy.model = model.unload()
            return
        if model.active_adapter == peft_name:
            model.set_adapter(next(n for n in model.peft_config if n != peft_name))
        model.delete_adapter(peft_name)


def _is_checkpoint_adapter(folder: Path) -> bool:
    return folder.name == "adapter" and folder.parent.name.startswith("step-") \
        and folder.parent.name.removeprefix("step-").isdigit() and (folder.parent / "state.json").is_file()
