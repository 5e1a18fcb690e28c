"""Batched sampling that returns exact token ids and per-token logprobs.

Bookkeeping rules (training relies on them):

- ``logprobs[t] = log_softmax(logits_t / T)[token_t]``, taken *before* top-p truncation,
  so they are the log-probabilities a training forward at temperature ``T`` recomputes.
  At ``T = 0`` (greedy) they are ``log_softmax(logits_t)``.
- A completion that ends on a stop token or a stop string keeps the token that ended it
  in ``token_ids``; its ``text`` leaves the stop token/string out (as OpenAI does).
- Padding is tracked by lengths and an attention mask, never by ``pad_token_id``
  (for SmolLM2 pad == eos, so a pad-id test would cut real tokens).

Each prompt is prefilled once; its KV cache is then repeated for the ``n`` samples, and
rows that finish are dropped from the batch so they cost nothing more.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from grooves.types import Message

Prompt = str | list[Message] | list[int]


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop: tuple[str, ...] = field(default_factory=tuple)
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (stop token or string) or "length"
    prompt_ids: list[int]


class Sampler:
    """Generates completions for many prompts x ``n`` samples in one batch."""

    def __init__(self, policy, max_batch_rows: int = 64):
        self.policy = policy
        self.max_batch_rows = max_batch_rows

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if prompt and isinstance(prompt[0], dict):
            return self.policy.chat_ids(prompt)
        return list(prompt)

    def generate(
        self,
        prompts: list[Prompt],
        n: int = 1,
        sampling: Sampling = Sampling(),
        generator: torch.Generator | None = None,
    ) -> list[list[Completion]]:
        """``n`` completions for each prompt, as one list per prompt."""
        if generator is None and sampling.seed is not None:
            generator = torch.Generator(device=self.policy.device).manual_seed(sampling.seed)
        encoded = [self.encode(p) for p in prompts]
        # Chunks of similar length waste less on left padding; results go back in prompt order.
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
        per_chunk = max(1, self.max_batch_rows // n)
        results: list[list[Completion]] = [[] for _ in encoded]
        model = self.policy.model
        was_training = model.training
        model.eval()
        try:
            for start in range(0, len(order), per_chunk):
                chunk = order[start : start + per_chunk]
                flat = self._generate_chunk([encoded[i] for i in chunk], n, sampling, generator)
                for j, i in enumerate(chunk):
                    results[i] = flat[j * n : (j + 1) * n]
        finally:
            model.train(was_training)
        return results

    @torch.inference_mode()
    def _generate_chunk(self, prompt_ids, n, sampling, generator) -> list[Completion]:
        lm = self.policy.causal_lm
        device = self.policy.device
        cache, logits, attention, next_position = self._prefill(lm, prompt_ids, n)
        rows = list(range(logits.shape[0]))  # original row of each active row
        tokens: list[list[int]] = [[] for _ in rows]
        logprobs: list[list[float]] = [[] for _ in rows]
        finish = ["length"] * len(rows)
        stop_ids = self.policy.stop_token_ids

        for _ in range(sampling.max_new_tokens):
            token, token_logprob = pick_tokens(logits, sampling, generator)  # (A,), (A,)
            keep = []
            for i, (row, t, lp) in enumerate(zip(rows, token.tolist(), token_logprob.tolist())):
                tokens[row].append(t)
                logprobs[row].append(lp)
                if t in stop_ids or self._hits_stop_string(tokens[row], sampling.stop):
                    finish[row] = "stop"
                elif len(tokens[row]) < sampling.max_new_tokens:
                    keep.append(i)
            if not keep:
                break
            if len(keep) < len(rows):  # drop finished rows from the batch and the cache
                index = torch.tensor(keep, device=device)
                cache.batch_select_indices(index)
                attention, token, next_position = attention[index], token[index], next_position[index]
                rows = [rows[i] for i in keep]
            attention = torch.cat([attention, attention.new_ones(len(rows), 1)], dim=1)
            out = lm(input_ids=token[:, None], attention_mask=attention,
                     position_ids=next_position[:, None], cache=cache, use_cache=True)
            logits = out.logits[:, -1, :]
            next_position = next_position + 1

        return [
            Completion(
                text=self._text(tokens[r], sampling.stop),
                token_ids=tokens[r],
                logprobs=logprobs[r],
                finish_reason=finish[r],
                prompt_ids=list(prompt_ids[r // n]),
            )
            for r in range(len(tokens))
        ]

    def _prefill(self, lm, prompt_ids: list[list[int]], n: int):
        """Run the prompts once (left-padded) and repeat each one's cache for its n samples."""
        from transformers import DynamicCache

        device = self.policy.device
        lengths = torch.tensor([len(p) for p in prompt_ids], device=device)
        if int(lengths.min()) == 0:
            raise ValueError("a prompt has no tokens")
        width = int(lengths.max())
        ids = torch.zeros(len(prompt_ids), width, dtype=torch.long, device=device)
        attention = torch.zeros(len(prompt_ids), width, dtype=torch.long, device=device)
        for row, p in enumerate(prompt_ids):  # left padding: every prompt ends at the same column
            ids[row, width - len(p):] = torch.tensor(p, device=device)
            attention[row, width - len(p):] = 1
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=lm.config)
        out = lm(input_ids=ids, attention_mask=attention, position_ids=positions, cache=cache,
                 use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1, :]  # (B, V)
        if n > 1:
            cache.batch_repeat_interleave(n)
            logits = logits.repeat_interleave(n, dim=0)
            attention = attention.repeat_interleave(n, dim=0)
            lengths = lengths.repeat_interleave(n)
        return cache, logits, attention, lengths.clone()  # next position of each row = its length

    def _hits_stop_string(self, token_ids: list[int], stop: tuple[str, ...]) -> bool:
        if not stop:
            return False
        text = self.policy.decode(token_ids)
        return any(s in text for s in stop)

    def _text(self, token_ids: list[int], stop: tuple[str, ...]) -> str:
        text = self.policy.decode(token_ids)
        cuts = [text.find(s) for s in stop if s in text]
        return text[: min(cuts)] if cuts else text


def pick_tokens(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None):
    """Choose one token per row; return it and its logprob before top-p truncation."""
    logits = logits.float()  # (A, V)
    if sampling.temperature == 0:
        logp = F.log_softmax(logits, dim=-1)
        token = logp.argmax(dim=-1)
    else:
        logp = F.log_softmax(logits / sampling.temperature, dim=-1)
        probs = top_p_filter(logp.exp(), sampling.top_p)
        token = sample_from(probs, generator)
    return token, logp.gather(1, token[:, None]).squeeze(1)


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row from unnormalised ``probs`` ``(A, V)`` by inverting the CDF.

    Cheaper here than ``torch.multinomial`` (one cumsum instead of an exponential per
    vocabulary entry); ``right=True`` never lands on a zero-probability token.
    """
    cdf = probs.cumsum(dim=-1)  # (A, V)
    total = cdf[:, -1:]
    u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # rounding must not reach the total
    return torch.searchsorted(cdf, u, right=True).squeeze(1)


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token outside the smallest set whose mass reaches ``top_p`` (unnormalised)."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)  # the top token always stays
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)
