"""Models, LoRA adapters, chat formatting, the sampler and training log-probabilities."""

import warnings

# PEFT still calls transformers' deprecated is_gradient_checkpointing; the warning is not actionable here.
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

from grooves.policy.lora import LoRA
from grooves.policy.models import BUNDLED_DEFAULT, ModelSpecError
from grooves.policy.policy import Policy
from grooves.policy.sampler import Completion, Sampler, Sampling

__all__ = ["BUNDLED_DEFAULT", "Completion", "LoRA", "ModelSpecError", "Policy", "Sampler", "Sampling"]
