"""Which adapters the server can serve, by name, and loading them onto the one base model.

A model name is the base model's spec, a checkpoint ``RUN@STEP`` / ``RUN@latest`` under
the runs root, or an alias registered at start-up or through ``POST /v1/adapters``.
Checkpoints are found only under the runs root (run names are plain folder names, so no
path can escape it). ``RUN@latest`` is resolved on every request, so a run that is still
training is followed without a restart. Adapters load on first use; when more than
``max_loaded`` are loaded the least recently used is unloaded.

Only the engine's worker thread calls ``acquire`` and ``remove`` (they change the model);
name checks and listings only read the file system.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from grooves.policy.checkpoints import CheckpointError, list_checkpoints, resolve_checkpoint, runs_root
from grooves.policy.decoding import BASE_ADAPTER

_ALIAS = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class UnknownModel(LookupError):
    """A model name the server cannot serve; the message says what it can."""


@dataclass(frozen=True)
class Resolved:
    name: str  # as requested
    checkpoint: Path | None  # None: the base model
    step: int | None


class AdapterRegistry:
    def __init__(self, policy, runs: str | Path | None = None, aliases: dict[str, str] | None = None,
                 max_loaded: int = 8):
        self.policy = policy
        self.runs = runs_root(runs)
        self.base_name = policy.base_spec
        self.max_loaded = max_loaded
        self.aliases: dict[str, str] = {}
        self._loaded: OrderedDict[tuple[str, float], str] = OrderedDict()  # (folder, mtime) -> PEFT name
        self._counter = 0
        for alias, checkpoint in (aliases or {}).items():
            self.add_alias(alias, checkpoint)

    # --- names (any thread) -------------------------------------------------------

    def resolve(self, name: str) -> Resolved:
        if name == self.base_name:
            return Resolved(name, None, None)
        target = self.aliases.get(name, name)
        if "@" not in target:
            raise UnknownModel(f"model {name!r} does not exist; GET /v1/models lists the models served here")
        try:
            checkpoint = resolve_checkpoint(target, self.runs)
        except CheckpointError as error:
            raise UnknownModel(f"model {name!r}: {error}") from None
        return Resolved(name, checkpoint, int(checkpoint.name.removeprefix("step-")))

    def add_alias(self, alias: str, checkpoint: str) -> Resolved:
        if not _ALIAS.match(alias) or alias == self.base_name:
            raise ValueError(f"alias {alias!r} must be 1-64 letters, digits, '.', '_' or '-' and not the base name")
        if "@" not in checkpoint:
            raise ValueError(f"{checkpoint!r} is not a checkpoint name; use RUN@STEP or RUN@latest")
        resolved = self.resolve(checkpoint)  # raises UnknownModel when it does not exist
        self.aliases[alias] = checkpoint
        return resolved

    def model_ids(self) -> list[str]:
        names = [self.base_name, *self.aliases]
        if self.runs.is_dir():
            for run in sorted(p for p in self.runs.iterdir() if p.is_dir()):
                steps = [step for step, _ in list_checkpoints(run)]
                names += [f"{run.name}@{step}" for step in steps] + ([f"{run.name}@latest"] if steps else [])
        return names

    # --- loading (the worker thread only) ---------------------------------------------

    def acquire(self, resolved: Resolved, in_use: set[str]) -> str:
        """The PEFT adapter name for a resolved model, loading it if needed."""
        if resolved.checkpoint is None:
            return BASE_ADAPTER
        folder = resolved.checkpoint / "adapter"
        key = (str(folder), (resolved.checkpoint / "state.json").stat().st_mtime)
        if key in self._loaded:
            self._loaded.move_to_end(key)
            return self._loaded[key]
        self._evict(in_use)
        self._counter += 1
        peft_name = f"adapter{self._counter}"  # PEFT names become module keys: no '@' or '.'
        self._load(folder, peft_name)
        self._loaded[key] = peft_name
        return peft_name

    def remove(self, name: str) -> None:
        """Forget an alias, or unload the adapters a checkpoint name refers to."""
        if name in self.aliases:
            del self.aliases[name]
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
        model = self.policy.model
        if len(model.peft_config) == 1:  # the last one: back to the plain base model
            self.policy.model = model.unload()
            return
        if model.active_adapter == peft_name:
            model.set_adapter(next(n for n in model.peft_config if n != peft_name))
        model.delete_adapter(peft_name)
