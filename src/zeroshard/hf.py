"""`zeroshard.hf`, the public import path of the Hugging Face integration (integrations/hf/):
`zeroshard.hf.ZeroTrainer` (imported on first use, with transformers), `causal_lm_from_config` and
`context_of_file` (the longest sequence a config.json's model takes)."""
from .integrations.hf import __getattr__, causal_lm_from_config, context_of_file  # noqa: F401
