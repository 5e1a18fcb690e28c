"""The policy: a causal LM, its tokenizer and (for training) a LoRA adapter on top.

The reference model for KL is the same weights with the adapter disabled, so no second
copy of the model is held in memory.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
from pathlib import Path

import torch

from grooves.policy.checkpoints import CheckpointError, checkpoint_base_spec, is_checkpoint_name, resolve_checkpoint
from grooves.policy.lora import LoRA
from grooves.policy.models import BUNDLED_DEFAULT, load_model
from grooves.policy.rendering import encode_rendered, render_literal, special_pattern, spells_special
from grooves.policy.tools import fallback_messages, template_supports_tools
from grooves.types import Message


_ANCHOR = ({"role": "user", "content": "x"}, {"role": "assistant", "content": "y"})


class Policy:
    """A model to sample from and (when it has an adapter) to train."""

    def __init__(self, model, tokenizer, base_spec: str, device: str | torch.device = "cpu"):
        self.model = model
        self.tokenizer = tokenizer
        self.base_spec = base_spec
        self.device = torch.device(device)
        self.stop_token_ids = _stop_token_ids(model, tokenizer)
        self.pinned: dict[str, torch.Tensor] | None = None  # the adapter ``reference()`` restores, if pinned

    @classmethod
    def load(
        cls,
        spec: str = BUNDLED_DEFAULT,
        *,
        lora: LoRA | None = None,
        adapter: str | Path | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        seed: int = 0,
        runs: str | Path | None = None,
    ) -> Policy:
        """Load a base model (and adapter) by spec.

        ``spec`` is a model spec (see ``grooves.policy.models``) or a checkpoint name
        ``RUN@STEP`` / ``RUN@latest``, which brings its base model and adapter. ``lora``
        adds a fresh trainable adapter (initialised from ``seed``); ``adapter`` continues
        from an existing adapter instead, a PEFT folder or a checkpoint ``RUN@STEP`` (its own
        LoRA settings apply).
        """
        if is_checkpoint_name(spec):
            checkpoint = resolve_checkpoint(spec, runs)
            adapter = adapter or checkpoint / "adapter"
            spec = checkpoint_base_spec(checkpoint)
        elif adapter is not None and is_checkpoint_name(str(adapter)):  # e.g. an SFT run's checkpoint
            checkpoint = resolve_checkpoint(str(adapter), runs)
            if checkpoint_base_spec(checkpoint) != spec:
                raise CheckpointError(f"adapter {adapter} was trained on {checkpoint_base_spec(checkpoint)!r}, "
                                      f"not on {spec!r}")
            adapter = checkpoint / "adapter"
        model, tokenizer = load_model(spec, dtype=dtype, seed=seed)
        model.to(device)
        if adapter is not None:
            from peft import PeftModel

            if not (Path(adapter) / "adapter_config.json").exists():
                raise FileNotFoundError(f"{adapter} is not a PEFT adapter folder (no adapter_config.json)")
            model = PeftModel.from_pretrained(model, str(adapter), is_trainable=True)
        elif lora is not None:
            from peft import get_peft_model

            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = get_peft_model(model, lora.to_peft())
        model.eval()
        return cls(model, tokenizer, spec, device)

    # --- tokens ------------------------------------------------------------------

    def chat_ids(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        """Token ids of a chat prompt, ending with the assistant turn's header.

        ``tools`` are OpenAI-style tool schemas. A template without tool support gets the
        documented fallback rendering of ``grooves.policy.tools`` instead of silently
        losing them.
        """
        rendered, kwargs = self._rendering(messages, tools)
        if self._spells_special(rendered, kwargs.get("tools")):
            return encode_rendered(self.tokenizer, self._specials, self._literal_text(rendered, kwargs.get("tools")))
        return list(self.tokenizer.apply_chat_template(
            rendered, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs
        ))

    def chat_text(self, messages: list[Message], tools: list[dict] | None = None,
                  add_generation_prompt: bool = True) -> str:
        """The chat template's text for ``messages`` (tools rendered as in ``chat_ids``)."""
        rendered, kwargs = self._rendering(messages, tools)
        return self.tokenizer.apply_chat_template(
            rendered, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs)

    def _rendering(self, messages: list[Message], tools: list[dict] | None) -> tuple[list[Message], dict]:
        if self.native_tools:
            return messages, {"tools": tools} if tools else {}
        return fallback_messages(messages, tools), {}

    # Text from users, tools and completions that spells a special token ("<|im_end|>") must
    # stay text: see grooves.policy.rendering. Chats without such text take the plain path.

    @functools.cached_property
    def _specials(self) -> re.Pattern:
        return special_pattern(self.tokenizer)

    def _spells_special(self, messages: list[Message], tools: list[dict] | None) -> bool:
        return spells_special(messages, self._specials) or spells_special(tools, self._specials)

    def _literal_text(self, rendered: list[Message], tools: list[dict] | None):
        """The template's text of already-``_rendering``-ed messages, literal spans marked."""
        def template(messages: list, masked_tools: list | None) -> str:
            kwargs = {"tools": masked_tools} if masked_tools else {}
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **kwargs)

        return render_literal(self._specials, rendered, tools, template)

    @property
    def end_of_turn_id(self) -> int:
        """The token that ends an assistant turn in the chat template (the tokenizer's EOS)."""
        return self.tokenizer.eos_token_id

    def continuation_ids(self, messages: list[Message]) -> list[int]:
        """Tokens the chat template puts after a finished assistant turn for ``messages``
        (tool results, a user turn) up to and including the next assistant header.

        Multi-turn rollouts append these to the model's own tokens instead of re-rendering
        the conversation, so the model's tokens stay exactly as sampled. They are found as
        the template's text for a fixed two-turn chat plus ``messages``, minus the text of
        the fixed chat up to its end-of-turn token.
        """
        rendered, _ = self._rendering(list(_ANCHOR) + list(messages), None)
        literal = self._spells_special(rendered, None)
        if literal:
            marked = self._literal_text(rendered, None)
            after = marked.text
        else:
            after = self.tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False)
        before = self._anchor_text
        if not after.startswith(before):
            raise ValueError("the chat template renders earlier turns differently once more turns follow; "
                             "multi-turn token bookkeeping needs a template that only appends")
        if literal:
            return encode_rendered(self.tokenizer, self._specials, marked, start=len(before))
        return list(self.tokenizer.encode(after[len(before):], add_special_tokens=False))

    @functools.cached_property
    def _anchor_text(self) -> str:
        """The template's text of the fixed chat ``_ANCHOR`` up to its end-of-turn token."""
        before = self.chat_text(list(_ANCHOR), add_generation_prompt=False)
        end = self.tokenizer.decode([self.end_of_turn_id])
        cut = before.rfind(end)
        return before[: cut + len(end)] if cut >= 0 else before

    @functools.cached_property
    def native_tools(self) -> bool:
        """Whether the chat template itself renders tools and tool calls."""
        return template_supports_tools(self.tokenizer)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # --- the adapter -------------------------------------------------------------

    @property
    def has_adapter(self) -> bool:
        from peft import PeftModel

        return isinstance(self.model, PeftModel)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def reference(self):
        """Context in which the model is the reference of a KL term: the adapter as ``pin_reference``
        found it, when pinned; else the base model (adapter disabled)."""
        if self.pinned is not None:
            return self._pinned_adapter()
        return self.model.disable_adapter() if self.has_adapter else contextlib.nullcontext()

    def pin_reference(self) -> None:
        """Make the adapter's weights as they are now the reference (``algorithm.reference =
        'adapter'``): RL from an SFT adapter is then kept near that adapter, not near the base."""
        if not self.has_adapter:
            raise ValueError("pin_reference: this policy has no adapter")
        self.pinned = self._adapter_weights()

    def _adapter_weights(self) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        # Embeddings are never adapted; without the flag PEFT looks for the base's config to check.
        weights = get_peft_model_state_dict(self.model, save_embedding_layers=False)
        return {name: value.detach().clone() for name, value in weights.items()}

    @contextlib.contextmanager
    def _pinned_adapter(self):
        from peft import set_peft_model_state_dict

        now = self._adapter_weights()
        with torch.no_grad():  # copied into the same parameters: the optimizer's state stays theirs
            set_peft_model_state_dict(self.model, self.pinned)
        try:
            yield
        finally:
            with torch.no_grad():
                set_peft_model_state_dict(self.model, now)

    def save_adapter(self, folder: str | Path) -> None:
        """Write the adapter as a plain PEFT folder naming the grooves base spec."""
        if not self.has_adapter:
            raise ValueError("this policy has no adapter to save; load it with lora=LoRA(...)")
        folder = Path(folder)
        # Embeddings are never adapted; without this PEFT looks the base up on the hub to check.
        self.model.save_pretrained(str(folder), save_embedding_layers=False)
        config_path = folder / "adapter_config.json"
        config = json.loads(config_path.read_text())
        config["base_model_name_or_path"] = self.base_spec
        config_path.write_text(json.dumps(config, indent=2))

    # --- pieces the fast paths need ----------------------------------------------

    @property
    def causal_lm(self):
        """The underlying transformers model (LoRA layers, if any, are injected in place)."""
        return self.model.get_base_model() if self.has_adapter else self.model

    def sampler(self):
        from grooves.policy.sampler import Sampler

        return Sampler(self)


def _stop_token_ids(model, tokenizer) -> set[int]:
    ids = set()
    eos = getattr(model.generation_config, "eos_token_id", None) if hasattr(model, "generation_config") else None
    for value in (eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(value)
    return ids
