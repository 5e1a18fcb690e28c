"""LoRA adapter settings, mapped onto PEFT's ``LoraConfig``."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class LoRA(BaseModel):
    """A LoRA adapter: ``W x + (alpha / rank) * B A x`` on the target modules (PEFT format)."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(8, ge=1, description="LoRA rank r (1 and up).")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha; the update is scaled by alpha / rank.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input during training.")
    target_modules: Literal["all-linear"] | list[str] = Field(
        "all-linear",
        description="Module names to adapt (e.g. ['q_proj', 'v_proj']), or 'all-linear' for every "
        "linear layer except the output head.",
    )

    def to_peft(self):
        from peft import LoraConfig

        return LoraConfig(
            r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
            target_modules=self.target_modules, task_type="CAUSAL_LM",
        )
