"""What training changed: ``grooves drift A B`` on two checkpoints (either may be the base).

Three measures, each small enough to check by hand:

- **weights**: per adapted module, ``‖W_B - W_A‖_F / ‖W_A‖_F`` where ``W_X = W_0 + ΔW_X`` and
  ``ΔW_X = scale · B_X A_X`` is the effective LoRA update (``scale = alpha / r``, or
  ``alpha / sqrt(r)`` with rsLoRA). The base has ``ΔW = 0``. The totals are the same ratio
  over all modules (root of summed squares), overall and per module kind (``q_proj``, ...).
- **KL to the base** on held-out prompts: the mean, over completion tokens, of the exact
  ``KL(π_X(·|prefix) ‖ π_base(·|prefix))`` over the vocabulary, on the model's own greedy
  completions. Greedy keeps it deterministic; it is the KL along the path the model takes,
  not an average over its samples.
- **forgetting**: mean negative log-likelihood per token of the reference answers of a task
  the run did not train on (default: the bundled ``general_qa.jsonl``, short general
  questions), teacher-forced; a rise from A to B is knowledge lost.

The held-out prompts are the run's recorded held-out (``val``) prompts, or a JSONL file.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch
import torch.nn.functional as F

BASE = "base"
_LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<side>[AB])\.weight$")


class DriftError(ValueError):
    """A drift that cannot be measured (an unknown checkpoint, unlike bases, no prompts)."""


@dataclass(frozen=True)
class Side:
    """One end of a comparison: the base, or an adapter (a checkpoint or a PEFT folder)."""

    name: str  # as given: "base", "RUN@STEP" or a folder
    adapter: Path | None = None
    base_spec: str | None = None
    run_dir: Path | None = None  # the run a checkpoint belongs to (for its held-out prompts)

    @property
    def is_base(self) -> bool:
        return self.adapter is None


def resolve_side(name: str, runs: str | Path | None = None) -> Side:
    """``base``, ``RUN@STEP``/``RUN@latest`` or a PEFT adapter folder."""
    from grooves.policy.checkpoints import checkpoint_base_spec, is_checkpoint_name, resolve_checkpoint

    if name == BASE:
        return Side(name)
    if is_checkpoint_name(name):
        checkpoint = resolve_checkpoint(name, runs)
        return Side(name, checkpoint / "adapter", checkpoint_base_spec(checkpoint), checkpoint.parent.parent)
    folder = Path(name)
    config = folder / "adapter_config.json"
    if not config.is_file():
        raise DriftError(f"{name!r} is not 'base', a checkpoint RUN@STEP or a PEFT adapter folder "
                         "(with adapter_config.json)")
    return Side(name, folder, json.loads(config.read_text()).get("base_model_name_or_path"))


def common_base(a: Side, b: Side, base: str | None = None) -> str:
    """The base model both sides sit on; ``base`` names it when both sides are the base."""
    specs = {s.base_spec for s in (a, b) if not s.is_base}
    if len(specs) > 1:
        raise DriftError(f"{a.name} and {b.name} adapt different base models ({' and '.join(sorted(map(str, specs)))})")
    spec = specs.pop() if specs else base
    if spec is None:
        raise DriftError("both sides are the base: name a checkpoint, or pass --base MODEL")
    if base is not None and base != spec:
        raise DriftError(f"--base {base} differs from the checkpoints' base model {spec}")
    return spec


# --- weights ------------------------------------------------------------------------


def lora_deltas(adapter: Path) -> dict[str, torch.Tensor]:
    """The effective update ``scale · B A`` of every adapted module of a PEFT LoRA folder,
    keyed by the base weight's name (``model.layers.0.self_attn.q_proj.weight``)."""
    from safetensors.torch import load_file

    config = json.loads((adapter / "adapter_config.json").read_text())
    if config.get("use_dora") or config.get("rank_pattern") or config.get("alpha_pattern"):
        raise DriftError(f"{adapter}: DoRA and per-module ranks or alphas are not supported by grooves drift")
    rank, alpha = config["r"], config["lora_alpha"]
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(adapter / "adapter_model.safetensors")).items():
        match = _LORA_KEY.match(key)
        if match is None:
            raise DriftError(f"{adapter}: weight {key!r} is not a LoRA A or B matrix; drift cannot read it")
        pairs.setdefault(match["module"], {})[match["side"]] = tensor.float()
    deltas = {}
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise DriftError(f"{adapter}: module {module} lacks its lora_{'B' if 'A' in pair else 'A'} matrix")
        delta = scale * pair["B"] @ pair["A"]  # (out, r) @ (r, in) -> (out, in)
        deltas[f"{module}.weight"] = delta.T if config.get("fan_in_fan_out") else delta
    return deltas


@dataclass(frozen=True)
class ModuleDrift:
    module: str  # the base weight's name
    delta_norm: float  # ‖W_B - W_A‖_F
    weight_norm: float  # ‖W_A‖_F

    @property
    def relative(self) -> float:
        return self.delta_norm / self.weight_norm if self.weight_norm else math.inf

    @property
    def kind(self) -> str:
        """``q_proj`` of ``model.layers.3.self_attn.q_proj.weight``."""
        parts = self.module.split(".")
        return parts[-2] if len(parts) > 1 else parts[0]


def weight_drift(base: dict[str, torch.Tensor], delta_a: dict[str, torch.Tensor],
                 delta_b: dict[str, torch.Tensor]) -> list[ModuleDrift]:
    """Per-module drift from A to B (each a dict of LoRA updates; empty for the base)."""
    missing = sorted((set(delta_a) | set(delta_b)) - set(base))
    if missing:
        raise DriftError(f"the adapter updates {missing[0]}, which the base model does not have")
    rows = []
    for module in sorted(set(delta_a) | set(delta_b)):
        w0 = base[module].float()
        da, db = delta_a.get(module), delta_b.get(module)
        w_a = w0 if da is None else w0 + da
        change = (db if db is not None else 0) - (da if da is not None else 0)
        rows.append(ModuleDrift(module, float(torch.linalg.norm(change)), float(torch.linalg.norm(w_a))))
    return rows


def total_drift(rows: list[ModuleDrift]) -> tuple[float, dict[str, float]]:
    """The relative change over all modules and per module kind: ``sqrt(Σ‖ΔW‖²) / sqrt(Σ‖W‖²)``."""
    def ratio(chosen: list[ModuleDrift]) -> float:
        weight = math.sqrt(sum(r.weight_norm ** 2 for r in chosen))
        return math.sqrt(sum(r.delta_norm ** 2 for r in chosen)) / weight if weight else 0.0

    kinds: dict[str, list[ModuleDrift]] = {}
    for row in rows:
        kinds.setdefault(row.kind, []).append(row)
    return ratio(rows), {kind: ratio(chosen) for kind, chosen in sorted(kinds.items())}


# --- outputs: KL to the base and forgetting ------------------------------------------


def token_kl(logits_p: torch.Tensor, logits_q: torch.Tensor) -> torch.Tensor:
    """Exact ``KL(p ‖ q) = Σ_v p_v (log p_v - log q_v)`` per position, from logits ``(..., V)``."""
    logp, logq = F.log_softmax(logits_p.float(), -1), F.log_softmax(logits_q.float(), -1)
    return (logp.exp() * (logp - logq)).sum(-1)


def _completion_logits(causal_lm, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    """Logits ``(T, V)`` predicting each completion token (position ``P + t - 1`` predicts ``t``)."""
    ids = torch.tensor([prompt_ids + completion_ids], device=causal_lm.device)
    logits = causal_lm(input_ids=ids, use_cache=False).logits[0]  # (P + T, V)
    return logits[len(prompt_ids) - 1: len(prompt_ids) + len(completion_ids) - 1]


@torch.no_grad()
def kl_to_base(policy, adapter_name: str, prompts: list[list[dict]], max_new_tokens: int = 48) -> float:
    """Mean per-token KL of the adapter ``adapter_name`` to the base on its greedy completions."""
    from grooves.policy.sampler import Sampling

    policy.model.set_adapter(adapter_name)
    completions = policy.sampler().generate(prompts, n=1, sampling=Sampling(temperature=0.0,
                                                                           max_new_tokens=max_new_tokens))
    total, count = 0.0, 0
    for (completion,) in completions:
        if not completion.token_ids:
            continue
        tuned = _completion_logits(policy.causal_lm, completion.prompt_ids, completion.token_ids)
        with policy.model.disable_adapter():
            base = _completion_logits(policy.causal_lm, completion.prompt_ids, completion.token_ids)
        kl = token_kl(tuned, base)  # (T,)
        total, count = total + float(kl.sum()), count + kl.numel()
    return total / count if count else 0.0


@torch.no_grad()
def reference_nll(policy, adapter_name: str | None, tasks: list[dict]) -> float:
    """Mean NLL per token of each task's ``reference`` (plus the end of turn) after its prompt,
    under the adapter ``adapter_name`` (None: the base)."""
    if adapter_name is not None:
        policy.model.set_adapter(adapter_name)
    context = policy.model.disable_adapter() if adapter_name is None else contextlib.nullcontext()
    total, count = 0.0, 0
    with context:
        for task in tasks:
            prompt_ids = policy.chat_ids(task["messages"])
            answer = policy.tokenizer.encode(task["reference"], add_special_tokens=False) + [policy.end_of_turn_id]
            logits = _completion_logits(policy.causal_lm, prompt_ids, answer)  # (T, V)
            nll = F.cross_entropy(logits.float(), torch.tensor(answer, device=logits.device), reduction="sum")
            total, count = total + float(nll), count + len(answer)
    return total / count if count else math.nan


# --- prompts ------------------------------------------------------------------------


def read_prompt_file(path: Path, need_reference: bool = False) -> list[dict]:
    """Rows ``{"prompt": text or messages, "reference"?: text}`` as ``{"messages", "reference"}``."""
    if not path.is_file():
        raise DriftError(f"prompt file {path} does not exist")
    return _prompt_rows(path.read_text(), str(path), need_reference)


def untrained_task() -> list[dict]:
    """The bundled untrained task: short general questions with one-line reference answers."""
    text = resources.files("grooves.tasks").joinpath("data/general_qa.jsonl").read_text()
    return _prompt_rows(text, "general_qa.jsonl", need_reference=True)


def _prompt_rows(text: str, where: str, need_reference: bool) -> list[dict]:
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise DriftError(f"{where} line {number}: not JSON ({error.msg})") from None
        prompt = row.get("prompt") if isinstance(row, dict) else None
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if not (isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m for m in prompt)):
            raise DriftError(f"{where} line {number}: 'prompt' must be a string or a list of chat messages")
        if need_reference and not isinstance(row.get("reference"), str):
            raise DriftError(f"{where} line {number}: 'reference' (the expected answer, a string) is missing")
        rows.append({"messages": prompt, "reference": row.get("reference")})
    if not rows:
        raise DriftError(f"{where} has no prompts")
    return rows


def heldout_prompts(run_dir: Path, limit: int) -> list[list[dict]]:
    """Distinct held-out prompts (the messages before the first reply) recorded in a run."""
    import sqlite3

    db = run_dir / "run.sqlite"
    if not db.is_file():
        return []
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as connection:
        rows = connection.execute("SELECT data FROM trajectories WHERE split = 'val' ORDER BY id").fetchall()
    prompts, seen = [], set()
    for (data,) in rows:
        messages = json.loads(data)["messages"]
        first_reply = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
        prompt = messages[:first_reply]
        key = json.dumps(prompt, sort_keys=True)
        if prompt and key not in seen:
            seen.add(key)
            prompts.append(prompt)
    return prompts[:limit]


# --- the whole report -----------------------------------------------------------------


@dataclass
class DriftReport:
    a: str
    b: str
    base: str
    modules: list[ModuleDrift]
    total: float
    by_kind: dict[str, float]
    kl: dict[str, float] = field(default_factory=dict)  # side name -> KL to the base
    prompts: int = 0
    forgetting: dict[str, float] = field(default_factory=dict)  # "base", A, B -> NLL per token
    untrained_tasks: int = 0

    def to_dict(self) -> dict:
        return {"a": self.a, "b": self.b, "base": self.base, "total": self.total, "by_kind": self.by_kind,
                "modules": [{"module": m.module, "delta_norm": m.delta_norm, "weight_norm": m.weight_norm,
                             "relative": m.relative} for m in self.modules],
                "kl_to_base": self.kl, "heldout_prompts": self.prompts,
                "untrained_nll": self.forgetting, "untrained_tasks": self.untrained_tasks}


def measure(a_name: str, b_name: str, *, runs: str | Path | None = None, base: str | None = None,
            prompts_file: Path | None = None, untrained_file: Path | None = None, n_prompts: int = 16,
            max_new_tokens: int = 48, outputs: bool = True) -> DriftReport:
    """Weights, and (``outputs``) KL to the base and forgetting, from A to B."""
    from grooves.policy.models import load_model

    a, b = resolve_side(a_name, runs), resolve_side(b_name, runs)
    spec = common_base(a, b, base)
    model, tokenizer = load_model(spec, seed=_run_seed(a, b))
    weights = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    deltas = {side.name: lora_deltas(side.adapter) if not side.is_base else {} for side in (a, b)}
    modules = weight_drift(weights, deltas[a.name], deltas[b.name])
    total, by_kind = total_drift(modules)
    report = DriftReport(a.name, b.name, spec, modules, total, by_kind)
    if outputs:
        _measure_outputs(report, model, tokenizer, spec, (a, b), prompts_file, untrained_file, n_prompts,
                         max_new_tokens)
    return report


def _run_seed(*sides: Side) -> int:
    """The seed of the run a checkpoint came from: the random-weight ``tiny`` base is built from it."""
    import tomllib

    for side in sides:
        if side.run_dir is not None and (side.run_dir / "config.toml").is_file():
            seed = tomllib.loads((side.run_dir / "config.toml").read_text()).get("seed", 0)
            return seed if isinstance(seed, int) else 0
    return 0


def _measure_outputs(report: DriftReport, model, tokenizer, spec: str, sides: tuple[Side, Side],
                     prompts_file: Path | None, untrained_file: Path | None, n_prompts: int,
                     max_new_tokens: int) -> None:
    from peft import PeftModel

    from grooves.policy import Policy

    adapters = {}  # side name -> PEFT adapter name
    for index, side in enumerate(sides):
        if side.is_base or side.name in adapters:
            continue
        name = f"side{index}"
        if not isinstance(model, PeftModel):
            model = PeftModel.from_pretrained(model, str(side.adapter), adapter_name=name)
        else:
            model.load_adapter(str(side.adapter), adapter_name=name)
        adapters[side.name] = name
    model.eval()
    policy = Policy(model, tokenizer, spec)
    if prompts_file is not None:
        prompts = [row["messages"] for row in read_prompt_file(prompts_file)][:n_prompts]
    else:
        run_dir = next((s.run_dir for s in reversed(sides) if s.run_dir is not None), None)
        prompts = heldout_prompts(run_dir, n_prompts) if run_dir else []
        if not prompts:
            raise DriftError("no held-out prompts: the run recorded no held-out samples; pass --prompts FILE.jsonl")
    report.prompts = len(prompts)
    for side in sides:
        report.kl[side.name] = 0.0 if side.is_base else kl_to_base(policy, adapters[side.name], prompts,
                                                                    max_new_tokens)
    tasks = read_prompt_file(untrained_file, need_reference=True) if untrained_file else untrained_task()
    report.untrained_tasks = len(tasks)
    report.forgetting[BASE] = reference_nll(policy, None, tasks)
    for side in sides:
        if not side.is_base:
            report.forgetting[side.name] = reference_nll(policy, adapters[side.name], tasks)
