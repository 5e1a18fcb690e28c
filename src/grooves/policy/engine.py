"""An inference engine as the sampler: rollouts sampled through an OpenAI-compatible server.

The boundary is vLLM's server API, which ``grooves serve`` speaks too: ``POST /v1/completions``
with the prompt as token ids and ``return_token_ids`` (vLLM's name) so the reply carries the
prompt's and each sample's exact ids, ``logprobs = 0`` for each sampled token's logprob, and a
``seed`` per prompt (the server seeds sample i with ``seed + i`` in grooves; vLLM seeds the request).
Sending ids, not messages, means the server never renders a chat template: the trainer's template
is the only one, and a multi-turn rollout's next prompt is the previous prompt plus the previous
turn's ids plus the env's reply, token for token.

What the server says it read is checked: a reply whose ``prompt_token_ids`` differ from the ids
sent (a server that re-tokenised or added a BOS) is a *prefix break*; the output carries the ids
the server did read (``prompt_ids``), and the rollout trains only up to the break.

A server that is down (connection refused, a timeout, a 5xx) is retried with backoff for up to
``max_wait`` seconds, then the sampler raises ``EngineError``; a 404 for the model (a restarted
server that lost its runtime adapters) calls ``on_missing(model, engine)`` once and retries.
Given several engines (clients), the sampler sends each request to the next one in turn.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from grooves.policy.decoding import _text
from grooves.policy.rows import Past, Row
from grooves.policy.sampler import Completion, Prompt, Sampling, encode_prompt


class EngineError(RuntimeError):
    """The engine could not sample: it stayed down past ``max_wait``, or refused a request."""


@dataclass
class EngineOutput:
    """One sample, in the shape of ``RowOutput`` (``decode_rows``) plus the ids the server read."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    prompt_ids: list[int]
    prefix_break: bool = False  # the server read other prompt ids than the ones sent
    past: Past | None = None  # never: the engine keeps its own (prefix) cache


class EngineSampler:
    """``Sampler.generate`` and ``decode_rows`` over an engine (or several, taking requests in turn).
    ``model`` is the served name to sample (``RUN@STEP`` for a runtime-loaded adapter); ``policy``
    gives the tokenizer and chat template."""

    def __init__(self, policy, client, model: str, *, max_concurrency: int = 8, max_wait: float = 300.0,
                 on_missing: Callable[[str, int], None] | None = None):
        self.policy = policy
        # openai.OpenAI clients with max_retries=0 (the waiting is ours), one per engine
        self.clients = list(client) if isinstance(client, Sequence) else [client]
        self._turn = itertools.count()
        self.model = model
        self.max_concurrency = max_concurrency
        self.max_wait = max_wait
        self.on_missing = on_missing

    def encode(self, prompt: Prompt) -> list[int]:
        return encode_prompt(self.policy, prompt)

    def generate(self, prompts: list[Prompt], n: int = 1, sampling: Sampling = Sampling(),
                 generator: torch.Generator | None = None) -> list[list[Completion]]:
        """``n`` completions for each prompt; a seed per prompt from ``generator`` (or ``sampling.seed``)."""
        if generator is None and sampling.seed is not None:
            generator = torch.Generator().manual_seed(sampling.seed)
        jobs = [(self.encode(p), n, sampling.temperature, sampling.top_p, sampling.max_new_tokens,
                 tuple(sampling.stop), _seed(generator)) for p in prompts]
        return [[Completion(o.text, o.token_ids, o.logprobs, o.finish_reason, o.prompt_ids, o.prefix_break)
                 for o in outputs]
                for outputs in self._all(jobs)]

    def decode_rows(self, rows: list[Row]) -> list[EngineOutput]:
        """One sample per row (a multi-turn rollout's next turn); ``past`` and ``keep_past`` are not used."""
        jobs = [(list(r.prompt_ids), 1, r.temperature, r.top_p, r.max_new_tokens, tuple(r.stop), _seed(r.generator))
                for r in rows]
        return [outputs[0] for outputs in self._all(jobs)]

    def _all(self, jobs: list[tuple]) -> list[list[EngineOutput]]:
        if len(jobs) <= 1 or self.max_concurrency == 1:
            return [self._request(*job) for job in jobs]
        with ThreadPoolExecutor(min(self.max_concurrency, len(jobs))) as pool:
            return list(pool.map(lambda job: self._request(*job), jobs))

    def _request(self, ids: list[int], n: int, temperature: float, top_p: float, max_tokens: int,
                 stop: tuple[str, ...], seed: int | None) -> list[EngineOutput]:
        reply = self._call(dict(model=self.model, prompt=ids, n=n, temperature=temperature, top_p=top_p,
                                max_tokens=max_tokens, stop=list(stop) or None, logprobs=0, seed=seed,
                                extra_body={"return_token_ids": True}))
        outputs = []
        for choice in sorted(reply.choices, key=lambda c: c.index):
            extra = choice.model_extra or {}
            token_ids, read = extra.get("token_ids"), extra.get("prompt_token_ids") or reply.model_extra.get(
                "prompt_token_ids")
            if token_ids is None or read is None or choice.logprobs is None:
                raise EngineError(f"sampler.url: the server's reply lacks token ids or logprobs (it must answer "
                                  f"vLLM's return_token_ids and logprobs); model {self.model!r}")
            logprobs = [float(x) for x in choice.logprobs.token_logprobs]
            if len(logprobs) != len(token_ids):
                raise EngineError(f"sampler.url: {len(logprobs)} logprobs for {len(token_ids)} tokens")
            finish = "length" if choice.finish_reason == "length" else "stop"
            outputs.append(EngineOutput(_text(self.policy, token_ids, stop), list(token_ids), logprobs, finish,
                                        list(read), prefix_break=list(read) != ids))
        return outputs

    def _call(self, request: dict, engine: int | None = None):
        """One request to ``engine`` (default: the next in turn), retried while it is down (up to
        ``max_wait``); a lost model is reloaded once."""
        import openai

        engine = next(self._turn) % len(self.clients) if engine is None else engine
        deadline, delay, reloaded = time.monotonic() + self.max_wait, 0.5, False
        while True:
            try:
                return self.clients[engine].completions.create(**request)
            except openai.NotFoundError as error:
                if reloaded or self.on_missing is None:
                    raise EngineError(f"sampler.url: the server has no model {request['model']!r}: {error}") from None
                self.on_missing(request["model"], engine)
                reloaded = True
            except (openai.APIConnectionError, openai.APITimeoutError, openai.InternalServerError,
                    openai.RateLimitError) as error:
                if time.monotonic() + delay > deadline:
                    raise EngineError(f"sampler.url: the server did not answer for {self.max_wait:.0f} s "
                                      f"({type(error).__name__}: {error})") from None
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
            except openai.APIStatusError as error:  # a 4xx: the request itself is wrong, waiting will not help
                raise EngineError(f"sampler.url: the server refused the request ({error.status_code}): "
                                  f"{error.message}") from None


class EnginePolicy:
    """The trainer's policy as rollouts see it when an engine samples: the tokenizer and chat
    template of ``policy``, and ``sampler()`` the engine."""

    def __init__(self, policy, sampler: EngineSampler):
        self.policy = policy
        self._sampler = sampler

    def sampler(self, *args, **kwargs) -> EngineSampler:
        return self._sampler

    def __getattr__(self, name: str):
        return getattr(self.policy, name)


def _seed(generator: torch.Generator | None) -> int | None:
    """A request seed from the run's generator, so a rerun asks for the same samples."""
    return None if generator is None else int(torch.randint(2**31 - 1, (1,), generator=generator))
