"""DeepSpeed keys zeroshard does not implement, accepted at the values that say what it does anyway.

A ported config often spells out DeepSpeed's defaults (`"ignore_unused_parameters": true`,
`"sparse_gradients": false`). Refusing those would make users delete lines that change nothing;
accepting any value would let a feature they asked for (`"zero_quantized_weights": true`) be
silently absent. So each such key is accepted at the values that describe zeroshard's own behaviour,
and any other value is refused by name, with the values that are accepted.
"""
from __future__ import annotations

import json
from typing import Any

from .sections import ConfigError

# section ("" for the top level) -> key -> the values that describe what zeroshard does anyway
NO_OP_VALUES: dict[str, dict[str, tuple[Any, ...]]] = {
    "": {
        "gradient_predivide_factor": (1, 1.0),  # gradients are averaged once, in the reduction
        "sparse_gradients": (False,),
        "dump_state": (False,),
        "memory_breakdown": (False,),
        "seq_parallel_communication_data_type": ("fp32",),  # no sequence parallelism here
    },
    "zero_optimization": {
        "ignore_unused_parameters": (True,),  # an unused parameter gets a zero gradient
        "round_robin_gradients": (False,),
        "elastic_checkpoint": (True, False),  # checkpoints load at any world size either way
        "load_from_fp32_weights": (True,),    # the fp32 masters are what a checkpoint restores
        "mics_hierarchical_params_gather": (False,),
        "legacy_stage1": (False,),
        "cpu_offload": (False,),               # the old spelling of offload_optimizer
        "memory_efficient_linear": (True, False),  # DeepSpeed's own linear: a memory detail
        "use_multi_rank_bucket_allreduce": (True, False),
        "log_trace_cache_warnings": (True, False),
        "pipeline_loading_checkpoint": (False,),
        "override_module_apply": (True, False),
        "module_granularity_threshold": (0,),
        "stage3_module_granularity_threshold": (0,),
    },
    "zero_optimization.offload_optimizer": {  # DeepSpeed's partial offload and host pipeline
        "ratio": (1, 1.0), "fast_init": (False,), "pipeline": (False,), "pipeline_read": (False,),
        "pipeline_write": (False,)},
    "fp16": {"auto_cast": (False,), "fp16_master_weights_and_grads": (False,),
             "consecutive_hysteresis": (False,)},  # the tolerance comes back when the scale grows
    "bf16": {"immediate_grad_update": (False,)},  # DeepSpeed's BF16_Optimizer (none here), as by default
}


def accept_no_op(section: str, key: str, value: Any) -> bool:
    """True if `key` of `section` is a DeepSpeed key at a value that changes nothing here; False if
    it is no such key; a ConfigError naming the accepted values if it asks for something else."""
    allowed = NO_OP_VALUES.get(section, {}).get(key)
    if allowed is None:
        return False
    if any(type(value) is type(a) and value == a for a in allowed):  # (true is not 1 here)
        return True
    name = f"{section}.{key}" if section else key
    raise ConfigError(f"config key '{name}': {_json(value)} asks for a DeepSpeed feature that zeroshard does "
                      f"not implement; it accepts {' or '.join(map(_json, allowed))} (what it does anyway), "
                      f"or remove the key")


def _json(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (bool, int, float, str)) else repr(value)
