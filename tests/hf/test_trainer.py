"""zeroshard.hf.ZeroTrainer against transformers.Trainer with DDP, launched alike on gloo ranks.

One 2-rank run (a module fixture) trains a tiny BERT sequence classifier and a tiny GPT-2 LM, both
built from configs (nothing downloaded), with Trainer + DDP and with ZeroTrainer at stages 0-3, from
the same TrainingArguments: fp32, AdamW, warmup + linear schedule, accumulation 2, clipping, weight
decay, evaluation every 3 steps, 2 epochs (GPT-2 with activation checkpointing). Rank 0 stores what
each run logged and its final weights; the tests compare them here. A 3-rank run resumes the stage-3
GPT-2 run from its step-4 checkpoint at the same global batch. The error cases run in this process.

Tolerances. Without clipping, ZeroTrainer's weights equal Trainer's bit for bit at every stage
(measured, accumulation 1; and at stages 0-1 with accumulation 2). Two things change the last bits
of the gradients: zeroshard computes the clipping norm over flat shards in another order than
clip_grad_norm_ (gradient norms differ by at most 1.2e-7 relative), and stages 2-3 reduce each
micro-batch and add, where DDP reduces the sum. AdamW's normalisation carries such differences into
the weights: at most 1.1e-6 measured after 6 steps (GPT-2, stages 2-3; BERT 5.4e-7), so PARAM_ATOL
leaves a margin of 9x. The logged losses and eval losses came out equal; LOSS_RTOL allows rounding.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import zeroshard  # noqa: E402
from helpers import ROOT  # noqa: E402
from helpers.margins import close  # noqa: E402
from helpers.spawn import free_port, spawn  # noqa: E402

LOSS_RTOL, GRAD_NORM_RTOL, PARAM_ATOL = 1e-6, 1e-6, 1e-5
STEPS = 6  # 36 samples, global batch 12 (2 ranks x 3 x 2 micro-batches), 2 epochs
SEED_CONFIG = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}  # as written


def _model(kind: str):
    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    if kind == "bert":
        return BertForSequenceClassification(BertConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            num_labels=3))
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _data(kind: str, n: int, seed: int) -> list[dict]:
    """Sequences of 8 tokens with 4-8 real ones (padding masked, and -100 in GPT-2's labels)."""
    g = torch.Generator().manual_seed(seed)
    ids, lengths = torch.randint(1, 64, (n, 8), generator=g), torch.randint(4, 9, (n,), generator=g)
    mask = (torch.arange(8) < lengths[:, None]).long()
    if kind == "bert":
        labels = torch.randint(0, 3, (n,), generator=g)
        return [{"input_ids": i * m, "attention_mask": m, "labels": y} for i, m, y in zip(ids, mask, labels)]
    return [{"input_ids": i * m, "attention_mask": m, "labels": torch.where(m.bool(), i, -100)}
            for i, m in zip(ids, mask)]


def _args(out: str, per_device: int = 3, **overrides):
    from transformers import TrainingArguments
    options = dict(output_dir=out, use_cpu=True, per_device_train_batch_size=per_device,
                   per_device_eval_batch_size=2, gradient_accumulation_steps=2, num_train_epochs=2,
                   learning_rate=5e-3, weight_decay=0.1, warmup_steps=2, lr_scheduler_type="linear",
                   max_grad_norm=0.5, logging_steps=1, eval_strategy="steps", eval_steps=3,
                   save_strategy="no", report_to="none", disable_tqdm=True, seed=0, optim="adamw_torch")
    return TrainingArguments(**{**options, **overrides})


def _logged(trainer) -> dict:
    history = trainer.state.log_history
    return {key: [h[key] for h in history if key in h]
            for key in ("loss", "eval_loss", "grad_norm", "learning_rate")}


def _two_ranks(rank: int, world_size: int, out: str) -> None:
    """Every run of the parity tests, on 2 ranks; rank 0 saves the results to out/results.pt."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, Trainer
    from zeroshard.hf import ZeroTrainer
    transformers.logging.set_verbosity_error()
    results: dict = {}
    for kind in ("bert", "gpt2"):
        train, evals = _data(kind, 36, seed=1), _data(kind, 12, seed=2)
        extra = {"gradient_checkpointing": True} if kind == "gpt2" else {}
        ddp = Trainer(model=_model(kind), args=_args(f"{out}/{kind}-ddp", **extra), train_dataset=train,
                      eval_dataset=evals)
        ddp.train()
        results[kind, "ddp"] = {**_logged(ddp), "weights": {k: v.detach().clone()
                                                           for k, v in ddp.model.state_dict().items()}}
        for stage in range(4):
            saves = stage == 3 and kind == "gpt2"  # checkpoints for the resume test, rotated to 2
            args = _args(f"{out}/{kind}-stage{stage}", **extra, **(
                {"save_strategy": "steps", "save_steps": 2, "save_total_limit": 2} if saves else {}))
            trainer = ZeroTrainer(model=_model(kind), args=args, train_dataset=train, eval_dataset=evals,
                                  zero_config={"zero_optimization": {"stage": stage}})
            trainer.train()
            weights = trainer.engine.full_state_dict()
            results[kind, stage] = {**_logged(trainer), "weights": weights}
            if stage == 3:
                trainer.save_model(f"{out}/{kind}-saved")
                if rank == 0:
                    auto = AutoModelForCausalLM if kind == "gpt2" else AutoModelForSequenceClassification
                    loaded = auto.from_pretrained(f"{out}/{kind}-saved")
                    results[kind, "loaded"] = {k: v.clone() for k, v in loaded.state_dict().items()}
                    results[kind, "loaded_dtype"] = next(loaded.parameters()).dtype
                    if kind == "gpt2":
                        results[kind, "tied"] = loaded.lm_head.weight is loaded.transformer.wte.weight
                if kind == "gpt2":  # ranks that stop at different lengths: every forward still gathers
                    trainer.model.eval()
                    ids = trainer.model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2 + 3 * rank,
                                                 do_sample=False, pad_token_id=0)
                    results["generated"] = ids.shape[1]
    # A config "optimizer" section whose params are "auto" (TrainingArguments' weight decay), beside
    # Trainer's no-decay group (biases and norms): trains as Trainer's own AdamW over those groups.
    section = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "betas": "auto",
                                           "eps": "auto", "torch_adam": True}}
    trainer = ZeroTrainer(model=_model("bert"), args=_args(f"{out}/section"),
                          train_dataset=_data("bert", 36, 1), eval_dataset=_data("bert", 12, 2),
                          zero_config={"optimizer": section, "zero_optimization": {"stage": 2}})
    trainer.train()
    results["section"] = {**_logged(trainer), "weights": trainer.engine.full_state_dict(),
                          "decay": [g["weight_decay"] for g in trainer.engine.optimizer.param_groups]}
    # The seed replication's config as written: stage 3, offload, no batch keys. And an "optimizer"
    # section, which wins over TrainingArguments.optim (its "auto" lr takes learning_rate).
    train = _data("bert", 36, seed=1)
    seed = ZeroTrainer(model=_model("bert"), args=_args(f"{out}/seed", eval_strategy="no"),
                       train_dataset=train, zero_config=SEED_CONFIG)
    seed.train()
    results["seed"] = {**_logged(seed), "optimizer": type(seed.engine.optimizer).__name__,
                       "fused": seed.engine.optimizer.defaults.get("fused"),
                       "pipelined": seed.engine.pipeline.started, "steps": seed.engine.global_steps,
                       "weights": seed.engine.full_state_dict()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sgd = ZeroTrainer(model=_model("bert"), args=_args(f"{out}/sgd", eval_strategy="no", max_steps=2),
                          train_dataset=train, zero_config={"optimizer": {"type": "SGD", "params": {
                              "lr": "auto", "momentum": 0.9}}, "zero_optimization": {"stage": 1}})
    sgd.train()
    results["sgd"] = {"optimizer": type(sgd.engine.optimizer).__name__,
                      "warnings": [str(w.message) for w in caught],
                      "lr": sgd.engine.optimizer.param_groups[0]["initial_lr"]}
    # Without clipping, Trainer still logs grad_norm (DDP's is clip_grad_norm_ with an infinite max).
    for name, cls in (("noclip-ddp", Trainer), ("noclip-zero", ZeroTrainer)):
        extra = {"zero_config": {"zero_optimization": {"stage": 3}}} if cls is ZeroTrainer else {}
        run = cls(model=_model("bert"), train_dataset=train, **extra, args=_args(
            f"{out}/{name}", eval_strategy="no", max_steps=2, max_grad_norm=0.0))
        run.train()
        results[name] = _logged(run)["grad_norm"]
    # fp16 whose loss scale overflows every step: each step is skipped, and the lr schedule waits.
    fp16 = ZeroTrainer(model=_model("bert"), train_dataset=train, args=_args(
        f"{out}/fp16", eval_strategy="no", max_steps=3, warmup_steps=0, fp16=True), zero_config={
            "fp16": {"enabled": "auto", "initial_scale_power": 127, "hysteresis": 1},
            "zero_optimization": {"stage": 0}})
    fp16.train()
    results["fp16"] = {**_logged(fp16), "skipped": fp16.engine.skipped_steps}
    if rank == 0:
        torch.save(results, f"{out}/results.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("hf"))
    spawn(_two_ranks, 2, out)
    return out, torch.load(f"{out}/results.pt", weights_only=False)


def test_matches_trainer_ddp(runs):
    _, results = runs
    for kind in ("bert", "gpt2"):
        ddp = results[kind, "ddp"]
        assert len(ddp["loss"]) == STEPS and len(ddp["eval_loss"]) == STEPS // 3
        assert max(ddp["grad_norm"]) > 0.5  # clipping is active
        for stage in range(4):
            zero, what = results[kind, stage], f"{kind} stage {stage}"
            assert len(zero["loss"]) == STEPS and zero["weights"].keys() == ddp["weights"].keys()
            close(zero["loss"], ddp["loss"], rtol=LOSS_RTOL, what=f"{what} losses")
            close(zero["eval_loss"], ddp["eval_loss"], rtol=LOSS_RTOL, what=f"{what} eval losses")
            close(zero["grad_norm"], ddp["grad_norm"], rtol=GRAD_NORM_RTOL, what=f"{what} gradient norms")
            assert zero["learning_rate"] == ddp["learning_rate"], what  # warmup, then linear decay
            for name, value in ddp["weights"].items():
                close(zero["weights"][name], value, atol=PARAM_ATOL, what=f"{what} {name}")


def test_a_config_optimizer_section_keeps_trainers_no_decay_group(runs):
    """The section's "auto" weight decay applies to Trainer's decay group only: biases and norms
    (whose decay would move them by lr x 0.1 each step, far past PARAM_ATOL) are left undecayed."""
    _, results = runs
    zero, ddp = results["section"], results["bert", "ddp"]
    assert zero["decay"] == [0.1, 0.0]
    close(zero["loss"], ddp["loss"], rtol=LOSS_RTOL, what="section losses")
    for name, value in ddp["weights"].items():
        close(zero["weights"][name], value, atol=PARAM_ATOL, what=f"section {name}")


def test_save_model_is_an_ordinary_checkpoint(runs):
    out, results = runs
    assert results["generated"] == 3 + 2  # rank 0's own length, after waiting for rank 1's 3 + 5
    for kind in ("bert", "gpt2"):
        loaded, full = results[kind, "loaded"], results[kind, 3]["weights"]
        assert results[kind, "loaded_dtype"] == torch.float32
        assert loaded.keys() == full.keys()
        for name, value in full.items():
            assert torch.equal(loaded[name], value), f"{kind}: {name} differs after from_pretrained"
        assert {"config.json", "model.safetensors"} <= set(os.listdir(f"{out}/{kind}-saved"))
    assert results["gpt2", "tied"]  # lm_head tied to the embedding again, saved once
    # Checkpoints during training are ordinary ones too, plus the sharded state; two kept.
    assert sorted(os.listdir(f"{out}/gpt2-stage3")) == ["checkpoint-4", "checkpoint-6"]
    kept = set(os.listdir(f"{out}/gpt2-stage3/checkpoint-4"))
    assert {"model.safetensors", "config.json", "zeroshard", "trainer_state.json"} <= kept
    # `zeroshard consolidate` takes the Trainer folder itself (its zeroshard/ inside): the same weights
    from safetensors.torch import load_file
    saved = load_file(f"{out}/gpt2-stage3/checkpoint-4/model.safetensors")
    whole = zeroshard.consolidate(f"{out}/gpt2-stage3/checkpoint-4")
    assert saved and all(torch.equal(whole[name], value) for name, value in saved.items())
    with pytest.raises(zeroshard.CheckpointError, match=r"is a Trainer output_dir: give one of its "
                                                          r"checkpoints \(checkpoint-4, checkpoint-6\)"):
        zeroshard.consolidate(f"{out}/gpt2-stage3")  # the output_dir: which checkpoint is not its to guess


def test_seed_config_optimizer_section_and_skipped_steps(runs):
    _, results = runs
    seed = results["seed"]
    assert seed["optimizer"] == "AdamW" and seed["fused"]  # adamw_torch, on the host: the fused kernel
    assert seed["pipelined"] == seed["steps"] > 0  # every update overlapped the next forward
    ddp = results["bert", "ddp"]  # the same training, with evaluation: the fused kernel changes nothing
    close(seed["loss"], ddp["loss"], rtol=LOSS_RTOL, what="seed config losses")
    for name, value in ddp["weights"].items():
        close(seed["weights"][name], value, atol=PARAM_ATOL, what=f"seed config {name}")
    sgd = results["sgd"]
    assert sgd["optimizer"] == "SGD" and sgd["lr"] == 5e-3
    assert len(results["noclip-ddp"]) == 2 and all(n > 0 for n in results["noclip-ddp"])
    close(results["noclip-zero"], results["noclip-ddp"], rtol=GRAD_NORM_RTOL, what="unclipped gradient norms")
    assert any("\"optimizer\" section (SGD)" in w and "optim='adamw_torch'" in w for w in sgd["warnings"])
    fp16 = results["fp16"]  # skipped steps hold the lr schedule (no warmup: it decays if it steps)
    assert fp16["skipped"] == 3 and fp16["learning_rate"] == [5e-3] * 3


def _resume(rank: int, world_size: int, out: str) -> None:
    import transformers
    from zeroshard.hf import ZeroTrainer
    transformers.logging.set_verbosity_error()
    train, evals = _data("gpt2", 36, seed=1), _data("gpt2", 12, seed=2)
    checkpoint = f"{out}/gpt2-stage3/checkpoint-4"
    stage3 = {"zero_optimization": {"stage": 3}}
    wrong = ZeroTrainer(model=_model("gpt2"), args=_args(f"{out}/wrong", gradient_checkpointing=True),
                        train_dataset=train, eval_dataset=evals, zero_config=stage3)
    with pytest.raises(ValueError, match="global batch of 12 samples per step, this run has 18"):
        wrong.train(resume_from_checkpoint=checkpoint)
    trainer = ZeroTrainer(model=_model("gpt2"), args=_args(f"{out}/resumed", per_device=2,
                                                           gradient_checkpointing=True),
                          train_dataset=train, eval_dataset=evals, zero_config=stage3)
    trainer.train(resume_from_checkpoint=checkpoint)
    weights = trainer.engine.full_state_dict()
    if rank == 0:
        torch.save({**_logged(trainer), "weights": weights, "steps": trainer.state.global_step},
                   f"{out}/resumed.pt")


def test_resume_at_three_ranks_continues(runs):
    """Saved at 2 ranks x 3 samples x 2 micro-batches, resumed at 3 ranks x 2 x 2: the sampler
    continues at step 4 (mid-epoch), and steps 5-6 match the uninterrupted run."""
    out, results = runs
    spawn(_resume, 3, out)
    resumed, whole = torch.load(f"{out}/resumed.pt", weights_only=False), results["gpt2", 3]
    assert resumed["steps"] == STEPS and len(resumed["loss"]) == STEPS  # 4 from the checkpoint's log
    close(resumed["loss"], whole["loss"], rtol=LOSS_RTOL, what="losses after resuming")
    # (Not the eval loss: Trainer normalises it by the tokens of each global eval batch, which differ
    # between 2 and 3 ranks, with Trainer + DDP alike.)
    for name, value in whole["weights"].items():
        close(resumed["weights"][name], value, atol=PARAM_ATOL, what=f"resumed {name}")


# ---- errors, in this process: nothing here builds an engine ---------------------------------------------
@pytest.fixture
def keep_rng():
    """Trainer seeds the global generators; leave this process's as they were for other tests."""
    python, numpy, torch_state = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    yield
    random.setstate(python)
    np.random.set_state(numpy)
    torch.random.set_rng_state(torch_state)


@pytest.fixture
def own_group():
    """A test that trains here starts a world of one (initialize does); later modules start their own."""
    import torch.distributed as dist
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _trainer(tmp_path, zero_config=None, **overrides):
    from zeroshard.hf import ZeroTrainer
    args = _args(str(tmp_path), eval_strategy="no", **overrides)
    return ZeroTrainer(model=_model("bert"), args=args, train_dataset=_data("bert", 4, 0),
                       zero_config=zero_config)


@pytest.mark.parametrize("config, overrides, named", [
    ({"gradient_accumulation_steps": 4}, {}, ["'gradient_accumulation_steps' is 4",
                                              "TrainingArguments gradient_accumulation_steps is 2"]),
    ({"gradient_clipping": 1.0}, {}, ["'gradient_clipping' is 1.0", "max_grad_norm is 0.5"]),
    ({"bf16": {"enabled": True}}, {}, ["'bf16.enabled' is True", "TrainingArguments bf16 is False"]),
    ({"train_micro_batch_size_per_gpu": 8}, {}, ["'train_micro_batch_size_per_gpu' is 8",
                                                  "per_device_train_batch_size is 3"]),
    ({"train_batch_size": 12}, {}, ["'train_batch_size' is 12", "x world size is 6"]),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.1}}}, {},
     ["'scheduler.params.warmup_max_lr' is 0.1", "TrainingArguments learning_rate is 0.005"]),
    ({"scheduler": {"type": "OneCycle"}}, {}, ["'scheduler.type' is 'OneCycle'", "WarmupDecayLR"]),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}, {},
     ["'optimizer.params.lr' is 0.0001", "TrainingArguments learning_rate is 0.005"]),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.95]}}}, {},
     ["'optimizer.params.betas' is [0.9, 0.95]", "[adam_beta1, adam_beta2] is [0.9, 0.999]"]),
    ({"zeroshard": {"delayed_param_update": True}}, {}, ["delayed_param_update"]),
    ({}, {"optim": "adafactor"}, ["optim='adafactor'", "adamw_torch"]),
    ({"zero_optimization": {"stage": 5}}, {}, ["zero_optimization.stage"]),
    # A wrong type is named as one, not compared with TrainingArguments (nor dropped, as "bf16": true was)
    ({"bf16": True}, {}, ["config key 'bf16' must be an object, got bool"]),
    ({"train_micro_batch_size_per_gpu": "3"}, {}, ["'train_micro_batch_size_per_gpu' must be an integer"]),
])
def test_contradictions_are_named(tmp_path, keep_rng, config, overrides, named):
    with pytest.raises(zeroshard.ConfigError) as error:
        _trainer(tmp_path, config, **overrides)
    for words in named:
        assert words in str(error.value), str(error.value)


def test_auto_takes_training_arguments(tmp_path, keep_rng):
    config = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
              "gradient_clipping": "auto", "gradient_accumulation_steps": "auto", "bf16": {"enabled": "auto"},
              "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"},  # no counterpart: default
              "zeroshard": {"unit_modules": "auto"}}  # zeroshard's own "auto"
    resolved = _trainer(tmp_path, config, bf16=True)._engine_config
    assert resolved == {"gradient_accumulation_steps": 1, "gradient_clipping": 0.5, "bf16": {"enabled": True},
                        "zero_optimization": {"stage": 3}, "zeroshard": {"unit_modules": "auto"}}
    assert _trainer(tmp_path, SEED_CONFIG)._engine_config == {**SEED_CONFIG, "gradient_accumulation_steps": 1,
                                                              "gradient_clipping": 0.5}


def test_optimizer_keys_left_out_take_training_arguments_and_a_misspelt_auto_is_named(tmp_path, keep_rng):
    """As "auto" does (docs/huggingface.md): an "optimizer" section without lr or weight_decay trains
    at TrainingArguments' (before, at torch's 1e-3 and no decay); the keys its type does not take
    (SGD's betas) are not added. An "auto" under a misspelt key is refused by name, as any other
    value there is (before, it was dropped with the placeholders: weight decay silently off)."""
    def params(section, **overrides):
        config = {"zero_optimization": {"stage": 2}, "optimizer": section}
        return _trainer(tmp_path, config, learning_rate=5e-3, weight_decay=0.1,
                        **overrides)._engine_config["optimizer"]["params"]

    assert params({"type": "AdamW"}) == {"lr": 5e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1}
    assert params({"type": "SGD", "params": {"momentum": 0.9}}) == {"momentum": 0.9, "lr": 5e-3,
                                                                    "weight_decay": 0.1}
    for config, named in [
        ({"optimizer": {"type": "AdamW", "params": {"lr": "auto", "wieght_decay": "auto"}}},
         "'optimizer.params.wieght_decay' .\"auto\" is filled only for these.; did you mean "
         "'optimizer.params.weight_decay'"),
        ({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_sise": "auto"}},
         "'zero_optimization.stage3_prefetch_bucket_sise'; did you mean"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": "auto"}}},
         "'scheduler.params.warmup_num_step' .\"auto\" is filled only for these.; did you mean"),
    ]:
        with pytest.raises(zeroshard.ConfigError, match=named):
            _trainer(tmp_path, {"zero_optimization": {"stage": 3}, **config})


def test_an_optimizer_section_warns_only_over_an_optim_the_user_chose(tmp_path, keep_rng):
    """TrainingArguments' default optim is no choice of the user's: the section replaces it quietly."""
    import dataclasses
    import warnings

    from transformers import TrainingArguments
    default = next(f.default for f in dataclasses.fields(TrainingArguments) if f.name == "optim")
    section = {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(tmp_path, section, optim=getattr(default, "value", default))
    assert not [w for w in caught if "is ignored" in str(w.message)]
    with pytest.warns(UserWarning, match="optim='sgd' is ignored"):
        _trainer(tmp_path, section, optim="sgd")
    scheduled = {"zero_optimization": {"stage": 2}, "scheduler": {"type": "WarmupLR"}}  # so does a schedule
    with pytest.warns(UserWarning, match="lr_scheduler_type='cosine' is ignored"):
        _trainer(tmp_path, scheduled, lr_scheduler_type="cosine")


def test_auto_stage_is_refused(tmp_path, keep_rng):
    with pytest.raises(zeroshard.ConfigError, match="'zero_optimization.stage' is \"auto\""):
        _trainer(tmp_path, {"zero_optimization": {"stage": "auto"}})


@pytest.mark.parametrize("config", [None, {}, {"bf16": {"enabled": "auto"}},
                                    {"zero_optimization": {"overlap_comm": True}},
                                    {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}])
def test_a_missing_stage_is_refused(tmp_path, keep_rng, config):
    """The default stage, 0, would shard nothing: ZeroTrainer makes the user write it."""
    with pytest.raises(zeroshard.ConfigError, match="zero_config has no 'zero_optimization.stage'"):
        _trainer(tmp_path, config)


def test_auto_is_refused_by_initialize():
    with pytest.raises(zeroshard.ConfigError, match="'bf16.enabled' is \"auto\": a placeholder that "
                                                    "zeroshard.hf.ZeroTrainer fills"):
        zeroshard.initialize(torch.nn.Linear(2, 2), config={"bf16": {"enabled": "auto"}})
    # a config written for the Trainer holds many: all are named at once (zeroshard's own "auto" is a value)
    hf_written = {"bf16": {"enabled": "auto"}, "train_batch_size": "auto",
                  "zeroshard": {"unit_modules": "auto"},
                  "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"}}
    with pytest.raises(zeroshard.ConfigError, match="config keys 'bf16.enabled', 'train_batch_size', "
                                                    "'zero_optimization.stage3_prefetch_bucket_size' are "):
        zeroshard.Config.load(hf_written)


@pytest.mark.parametrize("name, value", [("deepspeed", {"zero_optimization": {"stage": 3}}),
                                         ("fsdp", ["full_shard"]), ("torch_compile", True),
                                         ("optimizers", None)])
def test_other_engines_and_optimizers_are_refused(tmp_path, keep_rng, name, value):
    from zeroshard.hf import ZeroTrainer
    args, model, kwargs = _args(str(tmp_path), eval_strategy="no"), _model("bert"), {}
    if name == "optimizers":  # built over the model's parameters, not zeroshard's shards
        kwargs = {"optimizers": (torch.optim.AdamW(model.parameters()), None)}
        words = "`optimizers=` .* cannot be used"
    else:
        setattr(args, name, value)  # as a DeepSpeed or FSDP launch would leave them
        words = f"TrainingArguments.{name}=.* cannot be used with ZeroTrainer"
    with pytest.raises(ValueError, match=words):
        ZeroTrainer(model=model, args=args, train_dataset=_data("bert", 4, 0), **kwargs)


def test_a_checkpoint_without_zeroshard_state_is_refused(tmp_path, keep_rng):
    other = tmp_path / "checkpoint-2"  # as Trainer + DDP, or save_only_model, would leave it
    other.mkdir()
    with pytest.raises(ValueError, match="holds no zeroshard state"):
        _trainer(tmp_path, SEED_CONFIG).train(resume_from_checkpoint=str(other))
    with pytest.raises(ValueError, match="checkpoint-9' does not exist"):
        _trainer(tmp_path, SEED_CONFIG).train(resume_from_checkpoint=str(tmp_path / "checkpoint-9"))


def test_a_deepspeed_scheduler_section_runs_as_in_deepspeed(tmp_path, keep_rng, own_group):
    # Hugging Face's DeepSpeed configs carry a "scheduler" section with "auto" values. DeepSpeed's
    # WarmupDecayLR over 6 steps, warming up (logarithmically) over 2; Trainer logs the lr each step
    # used. DeepSpeed's step s uses its iteration s - 2 (it sets iteration -1 when built, and steps
    # after each update): warmup_min_lr (0), then log(1) = 0 of the warm-up, the peak at iteration
    # 1, then the linear decay (6 - i) / (6 - 2) of the peak.
    from zeroshard.hf import ZeroTrainer
    args = _args(str(tmp_path), eval_strategy="no", max_steps=6, warmup_steps=2, max_grad_norm=0.0)
    autos = dict.fromkeys(("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps"), "auto")
    config = {"zero_optimization": {"stage": 3}, "scheduler": {"type": "WarmupDecayLR", "params": autos}}
    trainer = ZeroTrainer(model=_model("bert"), args=args, train_dataset=_data("bert", 36, 0),
                          zero_config=config)
    trainer.train()
    close(_logged(trainer)["learning_rate"], [0.0, 0.0, 5e-3, 5e-3, 3.75e-3, 2.5e-3], rtol=1e-12, atol=1e-15,
          what="WarmupDecayLR's learning rates")
    assert trainer.engine.global_steps == 6


HF_ZERO3 = {  # Hugging Face's documented ZeRO-3 DeepSpeed config, as users paste it
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
        "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False}


def test_hugging_faces_own_zero3_config_trains_as_written(tmp_path, keep_rng, own_group):
    from zeroshard.hf import ZeroTrainer
    args = _args(str(tmp_path), eval_strategy="no", max_steps=3, warmup_steps=0)  # TrainingArguments' default
    trainer = ZeroTrainer(model=_model("bert"), args=args, train_dataset=_data("bert", 24, 0),
                          zero_config=HF_ZERO3)
    trainer.train()
    assert trainer.engine.global_steps == 3 and trainer.engine.config.precision == "fp32"
    assert trainer.engine.precision.offload and trainer.engine.precision.offload_params
    # WarmupLR with no warm-up: "auto" takes 1 step (DeepSpeed refuses 0), which DeepSpeed raises to
    # 2: warmup_min_lr (0) first, then log(1) = 0, then the peak
    assert _logged(trainer)["learning_rate"] == [0.0, 0.0, 5e-3]
    # Trainer's flops: 6 x tokens (3 steps x 2 micro-batches x 3 x 8) x non-embedding parameters,
    # counted although stage 3 left the module's tensors empty
    assert trainer.state.total_flos == 6 * 144 * _model("bert").num_parameters(exclude_embeddings=True)


def test_one_process_seeing_several_gpus_keeps_its_micro_batch(tmp_path, keep_rng):
    # Trainer sizes its batches by per_device_train_batch_size x n_gpu (DataParallel); zeroshard runs
    # one rank per process, so the batch stays the per-device one.
    from zeroshard.hf import ZeroTrainer
    args = _args(str(tmp_path), eval_strategy="no")
    args._n_gpu = 2  # as on a machine where one process sees two GPUs
    trainer = ZeroTrainer(model=_model("bert"), args=args, train_dataset=_data("bert", 12, 0),
                          zero_config=SEED_CONFIG)
    assert trainer.args.n_gpu == 1 and trainer._train_batch_size == 3
    assert next(iter(trainer.get_train_dataloader()))["input_ids"].shape[0] == 3


def test_the_group_matches_the_processes_trainer_counts(tmp_path, keep_rng, own_group, monkeypatch):
    from zeroshard.integrations.hf import trainer as hf_trainer
    started = []

    def stop(backend=None):
        started.append(backend)
        raise InterruptedError
    monkeypatch.setattr(hf_trainer, "ensure_process_group", stop)
    with pytest.raises(InterruptedError):  # use_cpu: gloo, even where CUDA would make NCCL the default
        _trainer(tmp_path, SEED_CONFIG).train()
    assert started == ["gloo"]
    monkeypatch.undo()
    # torchrun on the CPU without use_cpu: two ranks, but accelerate counts one process each
    monkeypatch.setattr(hf_trainer, "rank_and_world_size", lambda: (0, 2))
    with pytest.raises(ValueError, match="process group has 2 ranks but TrainingArguments sees 1 "
                                         r"process\(es\).*use_cpu=True"):
        _trainer(tmp_path, SEED_CONFIG).train()


def test_a_bfloat16_config_json_builds_fp32_weights(tmp_path):
    # Real configs record "torch_dtype": "bfloat16"; --precision decides the compute dtype instead.
    import json
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "torch_dtype": "bfloat16", "vocab_size": 256,
                                "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                "num_attention_heads": 2, "max_position_embeddings": 64}))
    from zeroshard.hf import causal_lm_from_config
    model = causal_lm_from_config(str(path), seq_len=32)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_importing_zeroshard_does_not_import_transformers():
    code = ("import sys, zeroshard, zeroshard.hf; assert 'transformers' not in sys.modules; "
            "zeroshard.hf.ZeroTrainer")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_example_fine_tunes_from_a_deepspeed_json(tmp_path):
    example = os.path.join(ROOT, "examples", "hf_trainer.py")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
         example, "--config", os.path.join(ROOT, "examples", "hf_ds_config.json"), "--out", str(tmp_path),
         "--max-steps", "4", "--layers", "1", "--width", "32", "--bf16", "--cpu"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "ZEROSHARD_BACKEND": "gloo", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    trained, reloaded = (float(done.stdout.split(f"{word} ")[1].split()[0].rstrip(","))
                         for word in ("trained", "reloaded without zeroshard"))
    assert abs(trained - reloaded) < 0.02, done.stdout  # the same weights (bf16 against their fp32 masters)
    assert os.path.isfile(tmp_path / "model" / "model.safetensors")
    assert "token_id" not in done.stderr, done.stderr[-3000:]  # no warning about the model's special ids
