"""The service behind the routes: one frozen base model, one LoRA adapter and AdamW state per
training client (PEFT named adapters on the same base), and one worker thread that runs every
operation that touches the model, so operations never race.

A training client's operations run in the order of their ``seq_id`` (the SDK numbers them from
1; creating the model is 0), whatever order they arrive in; a request whose ``seq_id`` was
already accepted gets the first one's future back, so a retry is never applied twice. Work is
taken from tenants in turn (round robin), so one tenant's long queue does not starve another.

Files: a tenant's models live under ``ROOT/<tenant>/<run>/`` (``run`` is the model id with ``:``
made ``-``). ``save_state`` writes ``weights/<name>/``, a named ``save_weights_for_sampler``
writes ``sampler_weights/<name>/``, and an unnamed one publishes ``checkpoints/step-000N/``,
which ``grooves serve --runs ROOT/<tenant>`` serves as ``<run>@N``. A ``tinker://`` path is only
ever looked up under the caller's own tenant folder.
"""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from grooves.backend.ledger import Ledger, Prices
from grooves.policy.lora import LoRA
from grooves.policy.policy import Policy
from grooves.training.trainer import AdamParams, Trainer

_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_MODEL_ID = re.compile(r"^[0-9a-f]{32}:train:[0-9]{1,9}$")
_KINDS = {"weights": "weights", "sampler_weights": "sampler_weights"}

# Llama-style module names for Tinker's train_attn / train_mlp / train_unembed.
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
UNEMBED = ["lm_head"]


class UserError(ValueError):
    """A request the service refuses; the message goes back to the client (HTTP 4xx)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class Future:
    request_id: str
    tenant: str
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None  # ("json", dict) or ("proto", bytes)
    error: tuple[str, str] | None = None  # (message, "user" | "server")


@dataclass
class TrainingModel:
    model_id: str
    tenant: str
    lora: LoRA
    trainer: Trainer
    run_dir: Path
    next_seq: int | None = 1  # None: restored after a restart, the next request's seq_id is taken
    accepted: dict[int, str] = field(default_factory=dict)  # seq_id -> request_id
    waiting: dict[int, Callable] = field(default_factory=dict)  # seq_id -> op, until its turn


class SharedBasePolicy(Policy):
    """A ``Policy`` over a PEFT model holding many named adapters; it saves the active one alone."""

    def save_adapter(self, folder: str | Path) -> None:
        folder = Path(folder)
        name = self.model.active_adapter
        staging = folder.with_name(folder.name + ".staging")
        shutil.rmtree(staging, ignore_errors=True)
        self.model.save_pretrained(str(staging), selected_adapters=[name], save_embedding_layers=False)
        source = staging if name == "default" else staging / name
        shutil.move(str(source), str(folder))
        shutil.rmtree(staging, ignore_errors=True)
        config_path = folder / "adapter_config.json"
        config = json.loads(config_path.read_text())
        config["base_model_name_or_path"] = self.base_spec
        config_path.write_text(json.dumps(config, indent=2))


class Backend:
    """All state of a running service; every model operation runs on one worker thread."""

    def __init__(self, spec: str, root: str | Path, *, max_queue: int = 256, device: str = "cpu",
                 prices: Prices = Prices(), budgets: dict[str, float | None] | None = None):
        from grooves.policy.models import load_model

        self.spec = spec
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        model, tokenizer = load_model(spec)
        model.to(device).eval()
        for param in model.parameters():
            param.requires_grad_(False)
        self.policy = SharedBasePolicy(model, tokenizer, spec, device)
        self.vocab_size = int(model.config.vocab_size)
        self.max_context = int(getattr(model.config, "max_position_embeddings", 2048))
        self.tokenizer_dir = self.root / ".tokenizer"
        tokenizer.save_pretrained(str(self.tokenizer_dir))  # get_info names it: the SDK loads it offline
        self.sessions: dict[str, str] = {}  # session id -> tenant
        self.models: dict[str, TrainingModel] = {}
        self.creating: dict[str, str] = {}  # model id -> tenant, between create_model and its creation
        self.samplers: dict[str, tuple[str, Path | None]] = {}  # sampling session -> (tenant, checkpoint)
        self.futures: collections.OrderedDict[str, Future] = collections.OrderedDict()
        self.max_queue = max_queue
        self.ledger = Ledger(self.root / "ledger.sqlite")
        self.prices = prices
        self.budgets = budgets or {}
        self.current: Future | None = None  # the request the worker runs now (for charging)
        self._ready: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self._lock = threading.Condition()
        self._loaded: collections.OrderedDict[tuple, str] = collections.OrderedDict()  # sampler adapters
        self._stop = False
        self._worker = threading.Thread(target=self._work, name="grooves-backend", daemon=True)
        self._worker.start()

    # --- sessions, futures, the queue ------------------------------------------------

    def create_session(self, tenant: str) -> str:
        session = uuid.uuid4().hex
        self.sessions[session] = tenant
        marker = self.root / tenant / ".sessions" / session  # sessions outlive a restart
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
        return session

    def check_session(self, tenant: str, session: str) -> None:
        if self.sessions.get(session) == tenant:
            return
        if re.fullmatch(r"[0-9a-f]{32}", session or "") and (self.root / tenant / ".sessions" / session).is_file():
            self.sessions[session] = tenant
            return
        raise UserError(f"no session {session!r} for this API key", 404)

    def new_future(self, tenant: str) -> Future:
        future = Future(uuid.uuid4().hex, tenant)
        with self._lock:
            self.futures[future.request_id] = future
            while len(self.futures) > 100_000:
                self.futures.popitem(last=False)
        return future

    def future(self, tenant: str, request_id: str) -> Future:
        """A request's future; 410 when unknown (expired, or the service restarted: the SDK resubmits)."""
        future = self.futures.get(request_id)
        if future is None or future.tenant != tenant:
            raise UserError(f"no pending request {request_id!r} for this API key (expired, or the service "
                            "restarted); submit it again", 410)
        return future

    def queued(self) -> int:
        with self._lock:
            waiting = sum(len(m.waiting) for m in self.models.values())
            return waiting + sum(len(q) for q in self._ready.values())

    def submit(self, tenant: str, op: Callable[[], Any], *, metered: bool = False) -> Future:
        """Run ``op`` on the worker when the tenant's turn comes; its return value is the result.

        ``metered`` work (it costs tokens) is refused with 402 once the tenant's budget is spent."""
        if metered:
            self._check_budget(tenant)
        future = self.new_future(tenant)
        with self._lock:
            self._check_room()
            self._ready[tenant].append((future, op))
            self._lock.notify()
        return future

    def submit_ordered(self, model: TrainingModel, seq_id: int | None, op: Callable[[], Any], *,
                       metered: bool = False) -> Future:
        """Like ``submit``, in ``seq_id`` order within the model; a repeated ``seq_id`` is the same request."""
        with self._lock:
            if seq_id is None:
                seq_id = max([model.next_seq - 1, *model.waiting, *model.accepted]) + 1
            if seq_id in model.accepted:
                return self.futures.get(model.accepted[seq_id]) or self._gone(model.tenant, seq_id)
            if model.next_seq is None:  # restored after a restart: the client's next request sets the count
                model.next_seq = seq_id
            if metered:
                self._check_budget(model.tenant)
            if seq_id < model.next_seq:
                raise UserError(f"seq_id {seq_id} of model {model.model_id} was already run; it cannot run again")
            self._check_room()
            future = self.new_future(model.tenant)
            model.accepted[seq_id] = future.request_id
            model.waiting[seq_id] = (future, op)
            while model.next_seq in model.waiting:  # its turn has come: hand it to the tenant's queue
                self._ready[model.tenant].append(model.waiting.pop(model.next_seq))
                model.next_seq += 1
            self._lock.notify()
        return future

    def _gone(self, tenant: str, seq_id: int) -> Future:
        raise UserError(f"the result of seq_id {seq_id} has expired", 410)

    def _check_budget(self, tenant: str) -> None:
        budget = self.budgets.get(tenant)
        if budget is not None and self.ledger.spent(tenant, self.prices) >= budget:
            raise UserError(f"tenant {tenant!r} has spent its budget of {budget} USD", 402)

    def charge(self, model: str, kind: str, *, prompt: int = 0, sampled: int = 0, trained: int = 0) -> None:
        """Record the running request's tokens (once per request id)."""
        future = self.current
        self.ledger.record(future.request_id, future.tenant, model, kind, prompt=prompt, sampled=sampled,
                           trained=trained)

    def _check_room(self) -> None:
        if self.queued() >= self.max_queue:
            raise UserError(f"the service queue is full ({self.max_queue} operations); retry later", 429)

    def _next(self) -> tuple[Future, Callable] | None:
        tenants = sorted(t for t, q in self._ready.items() if q)
        if not tenants:
            return None
        # round robin: the tenant after the one served last
        last = getattr(self, "_last_tenant", None)
        later = [t for t in tenants if last is None or t > last]
        tenant = (later or tenants)[0]
        self._last_tenant = tenant
        return self._ready[tenant].popleft()

    def _work(self) -> None:
        while True:
            with self._lock:
                item = self._next()
                while item is None and not self._stop:
                    self._lock.wait()
                    item = self._next()
                if item is None:
                    return
            future, op = item
            self.current = future
            try:
                future.result = op()
            except UserError as exc:
                future.error = (str(exc), "user")
            except Exception as exc:  # a bug or a broken model: the client gets it, the service stays up
                future.error = (f"{type(exc).__name__}: {exc}", "server")
            future.done.set()

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        self._worker.join(timeout=30)
        self.ledger.close()

    # --- models ---------------------------------------------------------------------------

    def restorable(self, tenant: str, model_id: str) -> bool:
        """A model of the caller's that an earlier run of the service created (it is not loaded now)."""
        return (model_id not in self.models and bool(_MODEL_ID.match(model_id or ""))
                and (self.root / tenant / model_id.replace(":", "-") / "model.json").is_file())

    def restore(self, tenant: str, model_id: str) -> str:
        """Runs on the worker: bring a model back from its newest saved state (weights and optimizer)."""
        if model_id in self.models:
            return model_id
        run_dir = self.root / tenant / model_id.replace(":", "-")
        saved = sorted((f for f in (run_dir / "weights").glob("*") if (f / "trainer.pt").is_file()),
                       key=lambda f: f.stat().st_mtime_ns) if (run_dir / "weights").is_dir() else []
        if not saved:
            raise UserError(f"model {model_id} was lost when the service restarted: it had no saved state "
                            "(save_state) to come back from", 410)
        lora = LoRA(**json.loads((run_dir / "model.json").read_text())["lora"])
        session, _, seq = model_id.split(":")
        model = self.models[self.create_model(tenant, session, int(seq), lora, seed=0)]
        self.load(model, saved[-1], with_optimizer=True)
        model.next_seq = None
        return model_id

    def model(self, tenant: str, model_id: str) -> TrainingModel:
        model = self.models.get(model_id)
        if model is None or model.tenant != tenant:
            raise UserError(f"no model {model_id!r} for this API key", 404)
        return model

    def check_base(self, base_model: str) -> None:
        if base_model != self.spec:
            raise UserError(f"this service trains {self.spec!r} only, not {base_model!r}")

    def create_model(self, tenant: str, session: str, model_seq_id: int, lora: LoRA, seed: int | None) -> str:
        """Runs on the worker: a new named adapter on the shared base and its optimizer."""
        model_id = f"{session}:train:{model_seq_id}"
        if model_id in self.models:
            return model_id  # a retried create
        tied = getattr(self.policy.causal_lm.config, "tie_word_embeddings", False)
        if tied and isinstance(lora.target_modules, list):
            # the output head shares the input embedding: PEFT cannot keep a LoRA on it tied (merging
            # and export would break), so train_unembed adapts nothing on such a model
            targets = [m for m in lora.target_modules if m not in UNEMBED]
            if not targets:
                raise UserError("this base model ties its output head to its embeddings: train_unembed alone "
                                "adapts nothing; enable train_attn or train_mlp")
            lora = lora.model_copy(update={"target_modules": targets})
        self._add_adapter(model_id, lora, seed)
        trainer = Trainer(self.policy, _NO_ALGORITHM, temperature=1.0)
        run_dir = self.root / tenant / model_id.replace(":", "-")
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "model.json").write_text(json.dumps({"model_id": model_id, "base_model": self.spec,
                                                        "lora": lora.model_dump(), "created": time.time()}))
        with self._lock:
            self.models[model_id] = TrainingModel(model_id, tenant, lora, trainer, run_dir)
        return model_id

    def create_from(self, tenant: str, session: str, model_seq_id: int, checkpoint: Path) -> TrainingModel:
        """Runs on the worker: a new model with the LoRA settings a checkpoint was saved with."""
        lora = LoRA(**json.loads((checkpoint / "state.json").read_text())["lora"])
        return self.models[self.create_model(tenant, session, model_seq_id, lora, seed=0)]

    def _add_adapter(self, name: str, lora: LoRA, seed: int | None) -> None:
        from peft import PeftModel, get_peft_model

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))
            if isinstance(self.policy.model, PeftModel):
                self.policy.model.add_adapter(name, lora.to_peft())
            else:
                self.policy.model = get_peft_model(self.policy.model, lora.to_peft(), adapter_name=name)
        self.policy.model.set_adapter(name)
        self.policy.model.eval()

    def activate(self, model: TrainingModel) -> Trainer:
        self.policy.model.set_adapter(model.model_id)
        return model.trainer

    def forward_backward(self, model: TrainingModel, datums, loss_fn: str, config, forward_only: bool):
        trainer = self.activate(model)
        for index, datum in enumerate(datums):
            bad = [t for t in (*datum.tokens, *datum.target_tokens) if not 0 <= t < self.vocab_size]
            if bad:
                raise UserError(f"datum {index}: token id {bad[0]} is outside the vocabulary "
                                f"(0..{self.vocab_size - 1})")
            if len(datum.tokens) > self.max_context:
                raise UserError(f"datum {index}: {len(datum.tokens)} tokens exceed the context of {self.max_context}")
        try:
            out = trainer.forward_backward(datums, loss_fn, config, backward=not forward_only)
        except ValueError as exc:
            raise UserError(str(exc)) from exc
        tokens = sum(len(d.tokens) for d in datums)
        if forward_only:
            self.charge(model.model_id, "forward", prompt=tokens)
        else:
            self.charge(model.model_id, "forward_backward", trained=tokens)
        return out

    def optim_step(self, model: TrainingModel, adam: AdamParams) -> dict[str, float]:
        trainer = self.activate(model)
        grad_norm = trainer.optim_step(adam)
        trainer.step += 1
        if grad_norm is None:
            return {"skipped_nonfinite:sum": 1.0}
        return {"grad_norm:mean": grad_norm}

    # --- checkpoints ------------------------------------------------------------------------

    def tinker_path(self, model: TrainingModel, kind: str, name: str) -> str:
        return f"tinker://{model.model_id}/{kind}/{name}"

    def resolve(self, tenant: str, path: str) -> Path:
        """The folder a ``tinker://RUN/KIND/NAME`` path names, under the caller's own tenant only."""
        if not isinstance(path, str) or not path.startswith("tinker://"):
            raise UserError(f"{path!r} is not a tinker:// path")
        parts = path[len("tinker://"):].split("/")
        if len(parts) != 3 or not _MODEL_ID.match(parts[0]) or parts[1] not in _KINDS or not _SAFE_NAME.match(parts[2]):
            raise UserError(f"{path!r} is not a checkpoint path of this service (tinker://MODEL_ID/weights/NAME "
                            "or tinker://MODEL_ID/sampler_weights/NAME)")
        folder = self.root / tenant / parts[0].replace(":", "-") / parts[1] / parts[2]
        if not (folder / "adapter" / "adapter_config.json").is_file():
            raise UserError(f"no checkpoint {path} for this API key", 404)
        return folder

    def list_checkpoints(self, tenant: str, run_id: str) -> list[dict]:
        """The checkpoints of one of the caller's models, as the SDK's ``Checkpoint``."""
        if not _MODEL_ID.match(run_id):
            raise UserError(f"{run_id!r} is not a model id of this service")
        run_dir = self.root / tenant / run_id.replace(":", "-")
        if not (run_dir / "model.json").is_file():
            raise UserError(f"no model {run_id!r} for this API key", 404)
        found = []
        for kind, label in (("weights", "training"), ("sampler_weights", "sampler")):
            for folder in sorted((run_dir / kind).glob("*")) if (run_dir / kind).is_dir() else []:
                if not folder.name.startswith(".") and (folder / "state.json").is_file():
                    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
                    found.append({"checkpoint_id": f"{kind}/{folder.name}", "checkpoint_type": label,
                                  "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(folder.stat().st_mtime)),
                                  "tinker_path": f"tinker://{run_id}/{kind}/{folder.name}", "size_bytes": size})
        return found

    def delete_checkpoint(self, tenant: str, path: str) -> None:
        shutil.rmtree(self.resolve(tenant, path))

    def save(self, model: TrainingModel, kind: str, name: str, with_optimizer: bool) -> str:
        """Runs on the worker: the adapter (and optimizer) into ``RUN/KIND/NAME``, atomically."""
        if not _SAFE_NAME.match(name or ""):
            raise UserError(f"checkpoint name {name!r} must be 1-128 letters, digits, '.', '_' or '-' "
                            "and start with a letter or digit")
        trainer = self.activate(model)
        final = model.run_dir / kind / name
        tmp = final.with_name(f".tmp-{name}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self.policy.save_adapter(tmp / "adapter")
        if with_optimizer:
            torch.save(trainer.state_dict(), tmp / "trainer.pt")
        (tmp / "state.json").write_text(json.dumps({"model_id": model.model_id, "base_model": self.spec,
                                                    "step": trainer.step, "lora": model.lora.model_dump()}))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        return self.tinker_path(model, kind, name)

    def load(self, model: TrainingModel, folder: Path, with_optimizer: bool) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        trainer = self.activate(model)
        saved = json.loads((folder / "state.json").read_text())
        if LoRA(**saved["lora"]) != model.lora:
            raise UserError(f"the checkpoint's LoRA ({saved['lora']}) differs from this model's "
                            f"({model.lora.model_dump()})")
        weights = load_file(str(folder / "adapter" / "adapter_model.safetensors"))
        set_peft_model_state_dict(self.policy.model, weights, adapter_name=model.model_id)
        if with_optimizer:
            if not (folder / "trainer.pt").is_file():
                raise UserError("this checkpoint has no optimizer state (it was saved for sampling)")
            trainer.load_state_dict(torch.load(folder / "trainer.pt", weights_only=False))
        else:
            trainer.step = saved["step"]

    def publish(self, model: TrainingModel) -> Path:
        """Runs on the worker: the adapter as a grooves checkpoint ``RUN@STEP`` for sampling."""
        trainer = self.activate(model)
        trainer.publish(model.run_dir)
        from grooves.policy.checkpoints import step_dirname

        return model.run_dir / "checkpoints" / step_dirname(trainer.step)

    # --- sampling ---------------------------------------------------------------------------

    def create_sampler(self, tenant: str, checkpoint: Path | None) -> str:
        sampler = f"{uuid.uuid4().hex}:sample"
        self.samplers[sampler] = (tenant, checkpoint)
        return sampler

    def sampler(self, tenant: str, sampler: str) -> Path | None:
        owner, checkpoint = self.samplers.get(sampler, (None, None))
        if owner != tenant:
            raise UserError(f"no sampling session {sampler!r} for this API key", 404)
        return checkpoint

    def sample(self, checkpoint: Path | None, prompt: list[int], n: int, sampling, prompt_logprobs: bool):
        """Runs on the worker: ``n`` completions of token ids (and the prompt's logprobs)."""
        from grooves.policy.logprobs import TokenBatch, completion_logprobs

        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if not prompt or bad:
            raise UserError("the prompt needs at least one token" if not prompt else
                            f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        if len(prompt) + sampling.max_new_tokens > self.max_context:
            raise UserError(f"prompt plus max_tokens exceed the context of {self.max_context} tokens")
        with self._sampling_adapter(checkpoint):
            completions = self.policy.sampler().generate([prompt], n=n, sampling=sampling)[0]
            self.charge(sampler_name(checkpoint), "sample", prompt=len(prompt),
                        sampled=sum(len(c.token_ids) for c in completions))
            scored = None
            if prompt_logprobs and len(prompt) > 1:
                ids = torch.tensor([prompt])
                batch = TokenBatch(ids, torch.tensor([1]), ids[:, 1:], torch.ones(1, len(prompt) - 1),
                                   torch.zeros(1, len(prompt) - 1))
                with torch.no_grad():
                    scored = [float("nan")] + completion_logprobs(self.policy.causal_lm, batch)[0][0].tolist()
        return completions, scored

    def _sampling_adapter(self, checkpoint: Path | None):
        """Context: the model samples as the base (None) or with a checkpoint's adapter."""
        import contextlib

        from peft import PeftModel

        model = self.policy.model
        if checkpoint is None:
            return model.disable_adapter() if isinstance(model, PeftModel) else contextlib.nullcontext()
        weights = checkpoint / "adapter" / "adapter_model.safetensors"
        if not weights.is_file():
            raise UserError(f"the checkpoint this sampler was made from is gone ({checkpoint.name})", 404)
        key = (checkpoint, weights.stat().st_mtime_ns)  # a checkpoint saved again under its name is new
        name = self._loaded.get(key)
        if name is None:
            name = f"sampler-{uuid.uuid4().hex[:12]}"
            if isinstance(model, PeftModel):
                model.load_adapter(str(checkpoint / "adapter"), adapter_name=name)
            else:  # a restarted service that has created no model yet
                self.policy.model = model = PeftModel.from_pretrained(model, str(checkpoint / "adapter"),
                                                                      adapter_name=name)
            self._loaded[key] = name
            while len(self._loaded) > 8:
                _, old = self._loaded.popitem(last=False)
                model.delete_adapter(old)
        self._loaded.move_to_end(key)
        model.set_adapter(name)
        model.eval()
        return contextlib.nullcontext()


def sampler_name(checkpoint: Path | None) -> str:
    """The ledger's model column for sampling: the run the checkpoint belongs to, or "base"."""
    if checkpoint is None:
        return "base"
    inside = checkpoint.parent.name in ("weights", "sampler_weights", "checkpoints")
    return (checkpoint.parent.parent if inside else checkpoint).name


class _NoAlgorithm:
    """The service's trainers are driven by forward_backward / optim_step only, never train_step."""

    beta = 0.0
    num_iterations = 1


_NO_ALGORITHM = _NoAlgorithm()
