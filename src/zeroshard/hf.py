"""`zeroshard.hf`, the public import path of the Hugging Face integration (integrations/hf/):
`zeroshard.hf.ZeroTrainer` (imported on first use, with transformers) and `causal_lm_from_config`."""
from .integrations.hf import __getattr__, causal_lm_from_config  # noqa: F401
