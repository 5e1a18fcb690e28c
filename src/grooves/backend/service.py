"""The service behind the routes: one frozen base model, one LoRA adapter and AdamW state per
training client (PEFT named adapters on the same base), run through the queue's one worker
thread (``grooves.backend.queue``) so operations never race. Files and ``tinker://`` paths are
``grooves.backend.storage``'s; sampling requests are ``grooves.backend.sampling``'s.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from grooves.backend import positions, storage
from grooves.backend.ledger import Ledger, Prices
from grooves.backend.queue import Future, Ordered, UserError, WorkQueue
from grooves.backend.sampling import SampleJob, SamplerAdapters, extra_stop_ids, prompt_logprobs
from grooves.backend.storage import ATTN, MLP, UNEMBED, SharedBasePolicy
from grooves.policy.lora import LoRA
from grooves.policy.openmp import release_pool
from grooves.training.datums import AdamParams
from grooves.training.trainer import Trainer

__all__ = ["ATTN", "MLP", "UNEMBED", "Backend", "Future", "TrainingModel", "UserError"]


@dataclass
class TrainingModel:
    model_id: str
    tenant: str
    lora: LoRA
    trainer: Trainer
    run_dir: Path
    stream: Ordered = field(default_factory=Ordered)  # its operations, in seq_id order
    last_request: float = field(default_factory=time.time)
    version: int = 0  # bumped whenever its adapter's weights change (optim_step, load)


class Backend(WorkQueue):
    """All state of a running service; every model operation runs on the queue's worker thread."""

    def __init__(self, spec: str, root: str | Path, *, max_queue: int = 256, device: str = "cpu",
                 prices: Prices = Prices(), budgets: dict[str, float | None] | None = None):
        from grooves.policy.models import load_model, model_names

        self.spec = spec
        self.names = model_names(spec)  # the spec, and the hub id of a bundled model
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
        self.ledger = Ledger(self.root / "ledger.sqlite")
        self.prices = prices
        self.budgets = budgets or {}
        self.adapters = SamplerAdapters()
        self.saved: dict[Path, tuple[str, int]] = {}  # checkpoint -> (model_id, version) it was saved at
        # this thread loaded the model, the worker computes, and an idle worker gives its threads
        # back: one pool of OpenMP threads at a time (grooves.policy.openmp)
        release_pool()
        super().__init__(max_queue, self._check_budget, on_idle=release_pool)

    # --- sessions, metering ---------------------------------------------------------

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

    def _check_budget(self, tenant: str) -> None:
        budget = self.budgets.get(tenant)
        if budget is not None and self.ledger.spent(tenant, self.prices) >= budget:
            raise UserError(f"tenant {tenant!r} has spent its budget of {budget} USD", 402)

    def charge(self, model: str, kind: str, *, prompt: int = 0, sampled: int = 0, trained: int = 0,
               future: Future | None = None) -> None:
        """Record a request's tokens (once per request id): ``future``'s, else the running one's."""
        future = future or self.current
        self.ledger.record(future.request_id, future.tenant, model, kind, prompt=prompt, sampled=sampled,
                           trained=trained)

    def submit_for(self, model: TrainingModel, seq_id: int | None, op, *, metered: bool = False) -> Future:
        """``submit_ordered`` in the model's own ``seq_id`` order."""
        return self.submit_ordered(model.tenant, model.stream, seq_id, op, metered=metered, name=model.model_id)

    def close(self) -> None:
        super().close()
        self.ledger.close()

    # --- models ---------------------------------------------------------------------------

    def restorable(self, tenant: str, model_id: str) -> bool:
        """A model of the caller's that an earlier run of the service created (it is not loaded now)."""
        return (model_id not in self.models and bool(storage.MODEL_ID.match(model_id or ""))
                and (storage.run_folder(self.root, tenant, model_id) / "model.json").is_file())

    def restore(self, tenant: str, model_id: str) -> str:
        """Runs on the worker: bring a model back from its newest saved state (weights and optimizer)."""
        if model_id in self.models:
            return model_id
        run_dir = storage.run_folder(self.root, tenant, model_id)
        saved = sorted((f for f in (run_dir / "weights").glob("*") if (f / "trainer.pt").is_file()),
                       key=lambda f: f.stat().st_mtime_ns) if (run_dir / "weights").is_dir() else []
        if not saved:
            raise UserError(f"model {model_id} was lost when the service restarted: it had no saved state "
                            "(save_state) to come back from", 410)
        lora = LoRA(**json.loads((run_dir / "model.json").read_text())["lora"])
        session, _, seq = model_id.split(":")
        model = self.models[self.create_model(tenant, session, int(seq), lora, seed=0)]
        self.load(model, saved[-1], with_optimizer=True)
        model.stream.next_seq = None
        return model_id

    def model(self, tenant: str, model_id: str) -> TrainingModel:
        model = self.models.get(model_id)
        if model is None or model.tenant != tenant:
            raise UserError(f"no model {model_id!r} for this API key", 404)
        model.last_request = time.time()
        return model

    def check_base(self, base_model: str) -> None:
        if base_model not in self.names:
            raise UserError(f"this service trains {' or '.join(map(repr, self.names))} only, not {base_model!r}")

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
        run_dir = storage.run_folder(self.root, tenant, model_id)
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
            out = positions.forward_backward(trainer, datums, loss_fn, config, backward=not forward_only)
        except ValueError as exc:
            raise UserError(str(exc)) from exc
        tokens = sum(len(d.tokens) for d in datums)
        if forward_only:
            self.charge(model.model_id, "forward", prompt=tokens)
        else:
            self.charge(model.model_id, "forward_backward", trained=tokens)
        return out

    def optim_step(self, model: TrainingModel, params) -> dict[str, float]:
        """Runs on the worker: one AdamW step with the SDK's ``AdamParams``."""
        adam = AdamParams(params.learning_rate, params.beta1, params.beta2, params.eps, params.weight_decay,
                          params.grad_clip_norm)
        trainer = self.activate(model)
        grad_norm = trainer.optim_step(adam)
        trainer.step += 1
        model.version += 1
        if grad_norm is None:
            return {"skipped_nonfinite:sum": 1.0}
        return {"grad_norm:mean": grad_norm}

    # --- checkpoints ------------------------------------------------------------------------

    def resolve(self, tenant: str, path: str) -> Path:
        return storage.resolve(self.root, tenant, path)

    def list_checkpoints(self, tenant: str, run_id: str) -> list[dict]:
        return storage.list_checkpoints(self.root, tenant, run_id)

    def training_run(self, tenant: str, run_id: str) -> dict:
        loaded = self.models.get(run_id)
        last = loaded.last_request if loaded is not None and loaded.tenant == tenant else None
        return storage.training_run(self.root, tenant, run_id, self.spec, last)

    def training_runs(self, tenant: str) -> list[str]:
        return storage.training_runs(self.root, tenant)

    def weights_info(self, tenant: str, path: str) -> dict:
        return storage.weights_info(self.root, tenant, path, self.spec)

    def delete_checkpoint(self, tenant: str, path: str) -> None:
        shutil.rmtree(self.resolve(tenant, path))

    def save(self, model: TrainingModel, kind: str, name: str, with_optimizer: bool) -> str:
        """Runs on the worker: the adapter (and optimizer) into ``RUN/KIND/NAME``; its tinker:// path."""
        if not storage.SAFE_NAME.match(name or ""):
            raise UserError(f"checkpoint name {name!r} must be 1-128 letters, digits, '.', '_' or '-' "
                            "and start with a letter or digit")
        trainer = self.activate(model)
        storage.save(self.policy, trainer, model.model_id, model.lora, self.spec, model.run_dir / kind / name,
                     with_optimizer)
        self.saved[model.run_dir / kind / name] = (model.model_id, model.version)
        return f"tinker://{model.model_id}/{kind}/{name}"

    def load(self, model: TrainingModel, folder: Path, with_optimizer: bool) -> None:
        trainer = self.activate(model)
        storage.load(self.policy, trainer, model.model_id, model.lora, folder, with_optimizer)
        model.version += 1

    def publish(self, model: TrainingModel) -> Path:
        """Runs on the worker: the adapter as a grooves checkpoint ``RUN@STEP`` for sampling."""
        from grooves.policy.checkpoints import step_dirname

        trainer = self.activate(model)
        trainer.publish(model.run_dir)
        checkpoint = model.run_dir / "checkpoints" / step_dirname(trainer.step)
        self.saved[checkpoint] = (model.model_id, model.version)
        return checkpoint

    def live_adapter(self, checkpoint: Path | None) -> str | None:
        """The training adapter whose weights a checkpoint still holds (saved by this service, no
        step or load since): sampling it needs no second copy loaded from disk."""
        model_id, version = self.saved.get(checkpoint, (None, None))
        model = self.models.get(model_id) if model_id is not None else None
        return model_id if model is not None and model.version == version else None

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

    def sample(self, checkpoint: Path | None, futures: list[Future], jobs: list[SampleJob]) -> list[tuple]:
        """Runs on the worker: each job's ``n`` completions (and its prompt's logprobs), every job's
        rows in one decode; jobs of one batch share the checkpoint and the stop token ids.

        Each job draws from its own seeded generator in row order, as it would alone."""
        from grooves.policy.rows import Row
        from grooves.policy.sampler import Completion

        rows, spans = [], []
        for job in jobs:
            s = job.sampling
            generator = None if s.seed is None else torch.Generator(device=self.policy.device).manual_seed(s.seed)
            spans.append(len(rows))
            rows += [Row(list(job.prompt), s.temperature, s.top_p, s.max_new_tokens, tuple(s.stop), generator)
                     for _ in range(job.n)]
        results = []
        with self.adapters.use(self.policy, checkpoint, self.live_adapter(checkpoint)), extra_stop_ids(self.policy, jobs[0].stop_ids):
            outputs = self.policy.sampler().decode_rows(rows)
            for future, job, at in zip(futures, jobs, spans, strict=True):
                completions = [Completion(o.text, o.token_ids, o.logprobs, o.finish_reason, list(job.prompt))
                               for o in outputs[at: at + job.n]]
                self.charge(storage.sampler_name(checkpoint), "sample", prompt=len(job.prompt),
                            sampled=sum(len(c.token_ids) for c in completions), future=future)
                scored = None
                if job.prompt_logprobs and len(job.prompt) > 1:
                    scored = prompt_logprobs(self.policy.causal_lm, job.prompt)
                results.append((completions, scored))
        return results


class _NoAlgorithm:
    """The service's trainers are driven by forward_backward / optim_step only, never train_step."""

    beta = 0.0
    num_iterations = 1


_NO_ALGORITHM = _NoAlgorithm()
