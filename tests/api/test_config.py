"""Config parsing: DeepSpeed keys accepted, everything else refused by name with the fix."""
from __future__ import annotations

import json

import pytest

from zeroshard import Config, ConfigError

DEEPSPEED_STYLE = {
    "train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0, "steps_per_print": 10, "wall_clock_breakdown": False,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
    "bf16": {"enabled": False}, "fp16": {"enabled": False},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8,
                          "stage3_param_persistence_threshold": 1e4, "contiguous_gradients": True,
                          "overlap_comm": False, "reduce_scatter": True, "allgather_partitions": True},
}


def test_deepspeed_style_config_is_accepted(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(DEEPSPEED_STYLE))
    cfg = Config.load(str(path))
    assert cfg.stage == 3 and cfg.zero.reduce_bucket_size == 500_000_000
    assert cfg.zero.stage3_param_persistence_threshold == 10_000
    assert Config.load({"zero_optimization": {"sub_group_size": 1e9}}).zero.sub_group_size == 10**9
    assert cfg.optimizer.type == "AdamW" and cfg.optimizer.params["lr"] == 3e-4
    cfg.check_batch_sizes(world_size=4)


def test_deepspeed_keys_that_change_nothing_here_are_accepted():
    """What a ported DeepSpeed config often carries, switched off or meaningless here: no edit needed."""
    Config.load({"zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
                 "prescale_gradients": False,
                 "checkpoint": {"tag_validation": "Warn", "load_universal": False},
                 **{name: {"enabled": False, "output_path": "x"} for name in (
                     "amp", "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comms_logger")}})
    # DeepSpeed's defaults spelled out, at the values that say what zeroshard does anyway ...
    config = Config.load({"gradient_predivide_factor": 1.0, "sparse_gradients": False, "dump_state": False,
                          "fp16": {"enabled": True, "auto_cast": False, "consecutive_hysteresis": False},
                          "zero_optimization": {"stage": 2, "ignore_unused_parameters": True,
                                                "elastic_checkpoint": False, "zero_quantized_weights": False,
                                                "offload_optimizer": {"device": "cpu", "ratio": 1.0}}})
    assert config.precision == "fp16" and config.stage == 2 and config.zero.offload_optimizer
    # ... and at any other value refused, naming what is accepted: never a feature silently absent.
    for raw, said in [({"gradient_predivide_factor": 2.0}, "'gradient_predivide_factor': 2.0 asks for"),
                      ({"zero_optimization": {"ignore_unused_parameters": False}}, "it accepts true"),
                      ({"zero_optimization": {"round_robin_gradients": True}}, "it accepts false"),
                      ({"fp16": {"enabled": True, "auto_cast": True}}, "'fp16.auto_cast': true asks for"),
                      ({"fp16": {"enabled": True, "consecutive_hysteresis": True}}, "it accepts false")]:
        with pytest.raises(ConfigError, match=said):
            Config.load(raw)


@pytest.mark.parametrize("section, kind, decay", [
    ({"type": "Adam"}, "AdamW", 0.0),      # DeepSpeed: adam_w_mode defaults to true
    ({"type": "adamw"}, "AdamW", 0.0),     # its FusedAdam's weight_decay, not torch AdamW's 0.01
    ({"type": "Adam", "params": {"adam_w_mode": False, "bias_correction": True}}, "Adam", 0.0),
    ({"type": "AdamW", "params": {"adam_w_mode": False, "weight_decay": 0.1}}, "AdamW", 0.1),
    ({"type": "AdamW", "params": {"torch_adam": True}}, "AdamW", None),  # torch's own default then
])
def test_adam_sections_mean_what_deepspeed_builds(section, kind, decay):
    optimizer = Config.load({"optimizer": section}).optimizer
    assert optimizer.type == kind and optimizer.params.get("weight_decay") == decay
    assert not {"adam_w_mode", "torch_adam", "bias_correction"} & set(optimizer.params)
    with pytest.raises(ConfigError, match="bias_correction': false is not supported"):
        Config.load({"optimizer": {"type": "Adam", "params": {"bias_correction": False}}})


@pytest.mark.parametrize("raw, words", [
    ({"zero_optimisation": {}}, ["zero_optimisation", "accepted top-level keys", "zero_optimization"]),
    ({"zero_optimization": {"stage": 4}}, ["zero_optimization.stage", "0, 1, 2 or 3"]),
    ({"zero_optimization": {"stage": "3"}}, ["zero_optimization.stage", "integer"]),
    ({"zero_optimization": {"stage": True}}, ["zero_optimization.stage", "integer"]),
    ({"zero_optimization": {"reduce_bucket_size": 0}}, ["reduce_bucket_size", ">= 1"]),
    ({"zero_optimization": {"reduce_bucket_size": 1.5}}, ["reduce_bucket_size", "integer"]),
    ({"zero_optimization": {"sub_group_size": 0}}, ["sub_group_size", ">= 1"]),
    ({"zero_optimization": {"round_robin_gradients": True}},
     ["round_robin_gradients", "does not implement"]),
    ({"zero_optimization": {"stage3_max_reuse_distance": -1}},
     ["stage3_max_reuse_distance", "integer >= 0"]),
    ({"zero_optimization": {"stage3_prefetch_bucket_size": -1}}, ["stage3_prefetch_bucket_size", ">= 0"]),
    ({"zero_optimization": {"stage": 3}, "zeroshard": {"defer_param_gather": True}},
     ["defer_param_gather", "stages 1 and 2"]),
    ({"zeroshard": {"defer_param_gather": 1}}, ["defer_param_gather", "true or false"]),
    ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme"}}},
     ["offload_optimizer.device", "needs zero_optimization.offload_optimizer.nvme_path"]),
    ({"zero_optimization": {"offload_optimizer": {"device": "disk"}}},
     ["offload_optimizer.device", "\"cpu\", \"nvme\" or \"none\""]),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
     ["offload_optimizer.ratio", "does not implement"]),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
     ["offload_param needs", "stage 3", "got stage 2"]),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
     ["offload_param.device", "needs zero_optimization.offload_param.nvme_path"]),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pipeline_read": True}}},
     ["offload_param.pipeline_read", "does not implement"]),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin": True}}},
     ["offload_param.pin", "accepted: device, pin_memory, nvme_path"]),
    ({"zero_optimization": {"stage": 2}, "zeroshard": {"delayed_param_update": True}},
     ["delayed_param_update", "needs zero_optimization.offload_optimizer"]),
    ({"zeroshard": {"delayed_param_update": "on"}}, ["delayed_param_update", "true or false"]),
    ({"zero_optimization": {"stage": 2}, "zeroshard": {"offload_casts": "device"}},
     ["offload_casts", "offload_optimizer is off"]),
    ({"zeroshard": {"offload_casts": "gpu"}}, ["offload_casts", "host", "device"]),
    ({"zeroshard": {"release_host_memory": "yes"}}, ["zeroshard.release_host_memory", "true or false"]),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
     ["offload_optimizer needs", "stage >= 1"]),
    ({"zero_optimization": {"overlap_comm": "yes"}}, ["overlap_comm", "true or false"]),
    ({"zero_optimization": {"reduce_scatter": False}}, ["reduce_scatter", "set it to true"]),
    ({"zero_optimization": {"stagee": 1}}, ["zero_optimization.stagee", "accepted", "stage"]),
    ({"zero_optimization": 3}, ["zero_optimization", "object"]),
    ({"scheduler": {"type": "OneCycle"}}, ["scheduler.type", "lr_scheduler="]),
    ({"flops_profiler": {"enabled": True}}, ["flops_profiler.enabled", "does not implement"]),
    ({"tensorboard": {"enabled": "yes"}}, ["tensorboard.enabled", "true or false"]),
    ({"prescale_gradients": True}, ["prescale_gradients", "averaged in the reduction"]),
    ({"checkpoint": {"tag_validation": "Maybe"}}, ["checkpoint.tag_validation", "Ignore"]),
    ({"checkpoint": {"load_universal": True}}, ["checkpoint.load_universal", "any world size"]),
    ({"checkpoint": {"parallel_write": {}}}, ["checkpoint.parallel_write", "does not implement"]),
    ({"pipeline": {}}, ["pipeline", "does not implement"]),
    ({"optimizer": {"type": "Adafactor"}}, ["optimizer.type", "adamw"]),
    ({"optimizer": {"type": "Adam", "param": {}}}, ["optimizer.param", "type, params"]),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, ["both fp16 and bf16"]),
    ({"bf16": {"enabled": "yes"}}, ["bf16.enabled", "true or false"]),
    ({"bf16": {"enabled": True, "immediate_grad_update": True}},
     ["bf16.immediate_grad_update", "accepts false (what it does anyway)"]),
    ({"fp16": {"enabled": True, "loss_scale": -1}}, ["fp16.loss_scale", ">= 0"]),
    ({"fp16": {"enabled": True, "loss_scale_window": 0}}, ["fp16.loss_scale_window", ">= 1"]),
    ({"fp16": {"enabled": True, "consecutive_hysteresis": True}},
     ["fp16.consecutive_hysteresis", "does not implement"]),
    ({"fp16": {"enabled": True, "scale": 2}}, ["fp16.scale", "accepted", "initial_scale_power"]),
    ({"communication_data_type": "fp8"}, ["communication_data_type", "fp32, bf16, fp16"]),
    ({"gradient_accumulation_steps": 0}, ["gradient_accumulation_steps", ">= 1"]),
    ({"gradient_clipping": -1}, ["gradient_clipping", ">= 0"]),
    ({"train_batch_size": 0}, ["train_batch_size", ">= 1"]),
    ({"zeroshard": {"unit_modules": []}}, ["zeroshard.unit_modules", "list"]),
    ({"zeroshard": {"units": "auto"}}, ["zeroshard.units", "unit_modules"]),
    ({"model_type": "llama", "hidden_size": 64}, ["Hugging Face model config", "'llama'", "--hf-config"]),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"pin_memory": True}}},  # offloads nothing
     ["zero_optimization.offload_optimizer", "pin_memory but no 'device'", "\"device\": \"cpu\""]),
    ({"zero_optimization": {"stage": 3, "offload_param": {"pin_memory": True}}},
     ["zero_optimization.offload_param", "no 'device'"]),
])
def test_bad_values_are_named(raw, words):
    with pytest.raises(ConfigError) as err:
        Config.load(raw)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_precision_sections():
    cfg = Config.load({"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "hysteresis": 1},
                       "gradient_accumulation_steps": 4, "gradient_clipping": 1.0,
                       "communication_data_type": "fp32",
                       "zero_optimization": {"stage": 1,
                                             "offload_optimizer": {"device": "cpu", "pin_memory": True}}})
    assert cfg.precision == "fp16" and cfg.scaler.initial_scale_power == 8 and cfg.scaler.hysteresis == 1
    assert cfg.gradient_accumulation_steps == 4 and cfg.gradient_clipping == 1.0
    assert cfg.zero.offload_optimizer and cfg.zero.offload_pin_memory
    offloaded = Config.load({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                                   "offload_param": {"device": "cpu", "pin_memory": True}},
                             "zeroshard": {"delayed_param_update": True}})
    assert offloaded.zero.offload_param and offloaded.zero.offload_param_pin_memory
    assert offloaded.delayed_param_update and not offloaded.zero.offload_pin_memory
    assert Config.load({"bf16": {"enabled": True}}).precision == "bf16"
    assert Config.load({"fp16": {"enabled": False, "loss_scale": 128}}).scaler is None


def test_batch_sizes_must_agree_with_world_size():
    cfg = Config.load({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
                       "gradient_accumulation_steps": 1})
    cfg.check_batch_sizes(4)
    with pytest.raises(ConfigError, match="train_batch_size=16 != train_micro_batch_size_per_gpu=4"):
        cfg.check_batch_sizes(3)
    # Both batch sizes alone set the accumulation, as in DeepSpeed: 16 = 4 x 2 x 2 ranks.
    cfg = Config.load({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4})
    cfg.check_batch_sizes(2)
    assert cfg.gradient_accumulation_steps == 2
    cfg.check_batch_sizes(4)
    assert cfg.gradient_accumulation_steps == 1
    with pytest.raises(ConfigError, match="train_batch_size=16 is not a whole number of micro-batches"):
        cfg.check_batch_sizes(3)


def test_bad_sources(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        Config.load(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        Config.load(str(tmp_path / "bad.json"))
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        Config.load(str(tmp_path / "list.json"))
    with pytest.raises(ConfigError, match="dict, a path"):
        Config.load(42)


def test_prefetch_bucket_accepts_null_and_defer_gather_its_stages():
    cfg = Config.load({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": None,
                                             "stage3_max_live_parameters": 5e6,
                                             "stage3_max_reuse_distance": None}})
    assert cfg.zero.stage3_prefetch_bucket_size is None and cfg.zero.stage3_max_live_parameters == 5_000_000
    assert cfg.zero.stage3_max_reuse_distance is None  # null: the backend's (prefetch.gathering_limits)
    cfg = Config.load({"zero_optimization": {"stage": 2, "overlap_comm": False},
                       "zeroshard": {"defer_param_gather": True}})
    assert cfg.defer_param_gather and not cfg.overlap_comm  # independent of overlap_comm


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_overlap_comm_is_on_by_default_and_false_is_honoured(stage):
    assert Config.load({"zero_optimization": {"stage": stage}}).overlap_comm
    assert not Config.load({"zero_optimization": {"stage": stage, "overlap_comm": False}}).overlap_comm
