"""``asample``: the request checked at submit, and generation on the worker.

Every field is checked when the request arrives, so a bad one is a 400 that names it, never a
failed future later: the prompt's token ids (in the vocabulary, inside the context), ``num_samples``
(1..64), and each of ``sampling_params`` (``max_tokens`` 1..context, ``temperature`` >= 0,
``top_p`` in (0, 1], ``seed`` 0..2**64-1, ``stop``). ``stop`` takes strings or token ids, as
the Tinker API does; a stop token is kept as the last sampled token, and the end-of-turn token
always stops too.
"""

from __future__ import annotations

import collections
import contextlib
import math
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from grooves.backend.queue import UserError
from grooves.policy.sampler import Sampling

MAX_SAMPLES = 64
MAX_STOPS = 16
MAX_STOP_CHARS = 256
MAX_SEED = 2**64 - 1  # what torch.Generator.manual_seed takes
LOADED_ADAPTERS = 8  # sampler checkpoints kept loaded beside the training adapters


@dataclass(frozen=True)
class SampleJob:
    prompt: list[int]
    n: int
    sampling: Sampling
    stop_ids: frozenset[int]
    prompt_logprobs: bool


def sample_job(req, vocab_size: int, max_context: int) -> SampleJob:
    """A ``tinker.types.SampleRequest`` checked field by field; ``UserError`` names the first bad one."""
    unsupported = [name for name, on in (("topk_prompt_logprobs", req.topk_prompt_logprobs > 0),
                                         ("topk_sample_logprobs", req.topk_sample_logprobs > 0),
                                         ("target_prompt_logprobs", req.target_prompt_logprobs is not None),
                                         ("prompt_alt_tokens_k", req.prompt_alt_tokens_k > 0),
                                         ("prompt_logprobs_last_n", req.prompt_logprobs_last_n is not None),
                                         ("sampling_params.top_k", req.sampling_params.top_k not in (-1, 0))) if on]
    if unsupported:
        raise UserError(f"not supported by this service: {', '.join(unsupported)}")
    if not 1 <= req.num_samples <= MAX_SAMPLES:
        raise UserError(f"num_samples must be 1..{MAX_SAMPLES}, got {req.num_samples}")
    prompt = _prompt(req, vocab_size)
    params = req.sampling_params
    max_tokens = 64 if params.max_tokens is None else params.max_tokens
    if not 1 <= max_tokens <= max_context - len(prompt):
        raise UserError(f"sampling_params.max_tokens must be 1..{max_context - len(prompt)} (the context of "
                        f"{max_context} tokens less the prompt's {len(prompt)}), got {max_tokens}")
    if not (math.isfinite(params.temperature) and params.temperature >= 0):
        raise UserError(f"sampling_params.temperature must be a finite number >= 0, got {params.temperature}")
    if not (math.isfinite(params.top_p) and 0 < params.top_p <= 1):
        raise UserError(f"sampling_params.top_p must be in (0, 1], got {params.top_p}")
    if params.seed is not None and not 0 <= params.seed <= MAX_SEED:
        raise UserError(f"sampling_params.seed must be 0..2**64-1, got {params.seed}")
    strings, ids = _stops(params.stop, vocab_size)
    sampling = Sampling(temperature=params.temperature, top_p=params.top_p, max_new_tokens=max_tokens,
                        stop=strings, seed=params.seed)
    return SampleJob(prompt, req.num_samples, sampling, ids, bool(req.prompt_logprobs))


def _prompt(req, vocab_size: int) -> list[int]:
    try:
        prompt = req.prompt.to_ints()
    except Exception as exc:  # the SDK's image chunks: not text
        raise UserError(f"prompt must be token chunks only: {exc}") from None
    if not prompt:
        raise UserError("prompt needs at least one token")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise UserError(f"prompt: token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    return prompt


def _stops(stop, vocab_size: int) -> tuple[tuple[str, ...], frozenset[int]]:
    """``(stop strings, stop token ids)`` of ``sampling_params.stop``."""
    if stop is None:
        return (), frozenset()
    if isinstance(stop, str):
        stop = [stop]
    if len(stop) == 0:
        raise UserError("sampling_params.stop=[] (no stop at all) is not supported; generation always stops at "
                        "the end-of-turn token")
    if len(stop) > MAX_STOPS:
        raise UserError(f"sampling_params.stop takes at most {MAX_STOPS} entries, got {len(stop)}")
    if all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
        bad = [s for s in stop if not 0 <= s < vocab_size]
        if bad:
            raise UserError(f"sampling_params.stop: token id {bad[0]} is outside the vocabulary "
                            f"(0..{vocab_size - 1})")
        return (), frozenset(stop)
    if not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop):
        raise UserError(f"sampling_params.stop: each stop string must be 1..{MAX_STOP_CHARS} characters")
    return tuple(stop), frozenset()


@contextlib.contextmanager
def extra_stop_ids(policy, ids: frozenset[int]):
    """The policy also stops at ``ids`` inside the block (the worker runs one request at a time)."""
    before = policy.stop_token_ids
    policy.stop_token_ids = before | ids
    try:
        yield
    finally:
        policy.stop_token_ids = before


def prompt_logprobs(causal_lm, prompt: list[int]) -> list[float]:
    """Each prompt token's logprob given the ones before it (the first has none: NaN); 2+ tokens."""
    from grooves.policy.logprobs import TokenBatch, completion_logprobs

    ids = torch.tensor([prompt])  # (1, T)
    batch = TokenBatch(ids, torch.tensor([1]), ids[:, 1:], torch.ones(1, len(prompt) - 1),
                       torch.zeros(1, len(prompt) - 1))
    with torch.no_grad():
        return [float("nan")] + completion_logprobs(causal_lm, batch)[0][0].tolist()


class SamplerAdapters:
    """The sampler checkpoints loaded as named adapters beside the training ones (the newest few)."""

    def __init__(self, keep: int = LOADED_ADAPTERS):
        self.keep = keep
        self._loaded: collections.OrderedDict[tuple, str] = collections.OrderedDict()

    def use(self, policy, checkpoint: Path | None, live: str | None = None):
        """Context: the policy samples as the base (None) or with a checkpoint's adapter: ``live``,
        a loaded adapter that holds the checkpoint's weights, else one loaded from its folder."""
        from peft import PeftModel

        model = policy.model
        if checkpoint is None:
            return model.disable_adapter() if isinstance(model, PeftModel) else contextlib.nullcontext()
        weights = checkpoint / "adapter" / "adapter_model.safetensors"
        if not weights.is_file():
            raise UserError(f"the checkpoint this sampler was made from is gone ({checkpoint.name})", 404)
        if live is not None:
            model.set_adapter(live)
            model.eval()
            return contextlib.nullcontext()
        key = (checkpoint, weights.stat().st_mtime_ns)  # a checkpoint saved again under its name is new
        name = self._loaded.get(key)
        if name is None:
            name = f"sampler-{uuid.uuid4().hex[:12]}"
            if isinstance(model, PeftModel):
                model.load_adapter(str(checkpoint / "adapter"), adapter_name=name)
            else:  # a restarted service that has created no model yet
                policy.model = model = PeftModel.from_pretrained(model, str(checkpoint / "adapter"),
                                                                 adapter_name=name)
            self._loaded[key] = name
            while len(self._loaded) > self.keep:
                _, old = self._loaded.popitem(last=False)
                model.delete_adapter(old)
        self._loaded.move_to_end(key)
        model.set_adapter(name)
        model.eval()
        return contextlib.nullcontext()
