"""ZeroTrainer: Hugging Face's Trainer, training through a zeroshard engine.

    trainer = ZeroTrainer(model=model, args=TrainingArguments(...), train_dataset=data,
                          zero_config={"zero_optimization": {"stage": 3}})   # dict, JSON path or Config
    trainer.train(); trainer.save_model("out")    # an ordinary HF checkpoint: config + safetensors, fp32

Trainer keeps its own loop (data, sampler, accumulation windows, loss scaling for accumulation, lr
schedule, logging, evaluation, checkpoint rotation); only the parts that touch parameters or
gradients are routed to the engine, through the smallest set of overrides:
  create_optimizer  builds the engine (once per model) and gives Trainer `EngineOptimizer`, whose
                    step() is engine.step(); the lr scheduler Trainer builds over it moves the engine
                    optimizer's own param_groups;
  create_scheduler  zero_config's DeepSpeed "scheduler" section, if any, "auto" filled (schedules.py);
  _wrap_model       returns `EngineModule` (the engine as an nn.Module) instead of DDP, for training
                    and evaluation alike (stage 3 needs the engine's forward to gather parameters);
  training_step     Trainer's own, with its one accelerator.backward(loss) call sent to engine.backward;
  _clip_grad_norm, _get_grad_norm, _maybe_log_save_evaluate: the engine clips inside step(), and the
                    norm it measured there is what is logged;
  save_model, _save_optimizer_and_scheduler, _load_from_checkpoint, _load_optimizer_and_scheduler,
  _load_best_model  full weights from engine.full_state_dict(); sharded state via the engine's
                    checkpoints (in `checkpoint-N/zeroshard`), which load at any world size.
Invariants: the engine's own accumulation is 1 (Trainer calls engine.backward per micro-batch with the
loss it already scaled, and engine.step() once per accumulation window), so its global_steps is
Trainer's global_step; a checkpoint resumes only with the global batch it was written with, so the
sampler's position (a function of the step) means the same samples.
"""
from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

try:
    from transformers import Trainer
except ImportError:  # transformers is optional: pip install 'zeroshard[hf]'
    raise ImportError("zeroshard.hf.ZeroTrainer needs transformers and accelerate: "
                      "pip install 'zeroshard[hf]'") from None

from ... import ensure_process_group, initialize, rank_and_world_size
from ...config import Config
from ...config.sections import OPTIMIZERS
from ...core.schedules import DeepSpeedSchedule
from ...engine.engine import Engine
from .adapters import EngineModule, EngineOptimizer
from .config import check_arguments, fill_scheduler, resolve_config

_STATE_DIR = "zeroshard"  # the engine's sharded checkpoint, inside Trainer's checkpoint-N folder


class ZeroTrainer(Trainer):
    """transformers.Trainer on zeroshard: `zero_config` is a zeroshard/DeepSpeed config (dict, JSON
    path or zeroshard.Config). Its "auto" values take the TrainingArguments value; a value that
    contradicts TrainingArguments is refused, naming both (config.py). Launch with torchrun."""

    def __init__(self, model: Any = None, args: Any = None, *rest: Any,
                 zero_config: "dict | str | os.PathLike | Config | None" = None, **kwargs: Any) -> None:
        self.engine: Engine | None = None
        self._wrapped: EngineModule | None = None
        self._flop_params: int | None = None  # counted before stage 3 leaves the module's tensors empty
        if args is not None:
            check_arguments(args)  # before Trainer sets up a DeepSpeed or FSDP plugin from them
        super().__init__(model, args, *rest, **kwargs)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:  # from the environment (accelerate launch)
            raise ValueError("accelerate is set up for DeepSpeed or FSDP (ACCELERATE_USE_DEEPSPEED / "
                             "ACCELERATE_USE_FSDP): ZeroTrainer is the sharding engine here; unset them")
        if self.optimizer is not None or self.lr_scheduler is not None:
            raise ValueError("ZeroTrainer builds its optimizer over zeroshard's flat shards, so "
                             "`optimizers=` (built over the model's parameters) cannot be used: set "
                             "TrainingArguments.optim, pass optimizer_cls_and_kwargs=(cls, kwargs), or give "
                             "zero_config an \"optimizer\" section")
        custom = self.optimizer_cls_and_kwargs is not None
        self._engine_config = resolve_config(zero_config, self.args, custom_optimizer=custom)
        # DeepSpeed's "scheduler" section: Trainer steps it (not the engine), as DeepSpeed's own would be
        self._schedule = self._engine_config.pop("scheduler", None)
        if self.args.n_gpu > 1:  # one process seeing several GPUs: zeroshard runs one rank, on one GPU
            self.args._n_gpu = 1   # (as Trainer does for model parallelism); launch torchrun for more
            self._train_batch_size = self.args.train_batch_size  # Trainer multiplied it by the GPU count

    # ---- the engine ---------------------------------------------------------------------------------
    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """initialize() moves the model to the group's device itself, one unit at a time."""

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """Build the engine (collective; once per model) with Trainer's parameter groups: weight decay
        for all but biases and norms."""
        if self.engine is None or self.engine.module is not self.model:
            self.engine = self._build_engine(self.model)
            self._wrapped = EngineModule(self.engine, self.label_names)
            self.optimizer = EngineOptimizer(self.engine)
        return self.optimizer

    def _build_engine(self, model: nn.Module) -> Engine:
        config = dict(self._engine_config)
        decay = set(self.get_decay_parameter_names(model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups: list[dict] = [{"params": [p for n, p in named if n in decay]},
                              {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        optimizer = None  # the config's "optimizer" section: with offload, torch's fused host kernel
        if "optimizer" not in config:
            cls, options = self.optimizer_cls_and_kwargs or \
                self.get_optimizer_cls_and_kwargs(self.args, model)
            if cls in OPTIMIZERS.values():  # torch's class as it is ("Adam" alone would mean DeepSpeed's)
                torch_adam = {"torch_adam": True, "adam_w_mode": cls is torch.optim.AdamW} \
                    if cls in (torch.optim.Adam, torch.optim.AdamW) else {}
                config["optimizer"] = {"type": cls.__name__, "params": {**options, **torch_adam}}
            else:  # the user's optimizer_cls_and_kwargs: initialize refuses a non-elementwise one
                optimizer = lambda params: cls(params, **options)
            groups[0]["weight_decay"] = self.args.weight_decay
        # The group on the device TrainingArguments chose (gloo for use_cpu, even with a GPU present),
        # over the processes accelerate counted: torchrun on the CPU without use_cpu leaves accelerate
        # with one process per rank, each of which would read the same batches.
        ensure_process_group(backend="gloo" if self.args.device.type == "cpu" else None)
        count = getattr(model, "num_parameters", None)
        self._flop_params = count(exclude_embeddings=True) if callable(count) else None
        ranks = rank_and_world_size()[1]
        if ranks != self.args.world_size:
            raise ValueError(f"zeroshard's process group has {ranks} ranks but TrainingArguments sees "
                             f"{self.args.world_size} process(es), so each rank would train on the same "
                             f"batches: on the CPU pass TrainingArguments(use_cpu=True) under torchrun")
        engine = initialize(model, optimizer, config, param_groups=groups)
        want = torch.device(self.args.device)
        if want.type != engine.device.type or (want.type != "cpu" and want.index != engine.device.index):
            raise RuntimeError(f"TrainingArguments put the inputs on {want}, but zeroshard's process group "
                               f"works on {engine.device}: on GPUs run one NCCL rank per GPU (torchrun); "
                               f"on the CPU pass TrainingArguments(use_cpu=True)")
        return engine

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        """zero_config's "scheduler" section (DeepSpeed's schedule, its "auto" values filled for these
        steps) where there is one; otherwise Trainer's, from lr_scheduler_type."""
        if self._schedule is None or self.lr_scheduler is not None:
            return super().create_scheduler(num_training_steps, optimizer)
        section = fill_scheduler(self._schedule, self.args, num_training_steps)
        self.lr_scheduler = DeepSpeedSchedule(optimizer or self.optimizer, section)
        self._created_lr_scheduler = True
        return self.lr_scheduler

    def floating_point_ops(self, inputs: dict) -> int:
        """Trainer's estimate (6 x tokens x non-embedding parameters), with the parameters counted
        when the engine was built: at stage 3 the module's own are empty placeholders."""
        main_input = getattr(self.model, "main_input_name", "input_ids")
        if self._flop_params is None or main_input not in inputs:
            return super().floating_point_ops(inputs)
        return 6 * inputs[main_input].numel() * self._flop_params

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        """The engine, for training and evaluation alike; never DDP or DataParallel."""
        self.create_optimizer()
        return self._wrapped

    def training_step(self, model: nn.Module, inputs: dict, num_items_in_batch: Any = None) -> torch.Tensor:
        # Trainer scales the loss for accumulation as it always does, then calls accelerator.backward
        # once: that call goes to the engine (gradients into flat buffers, reduced; fp16 loss scale).
        self.accelerator.backward = lambda loss, **_: self.engine.backward(loss)
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            del self.accelerator.backward  # the class's method again

    def _clip_grad_norm(self, model: nn.Module) -> None:
        """The engine clips inside step(), by the global norm over every shard (gradient_clipping)."""

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> None:
        """Known only once engine.step() ran: see _maybe_log_save_evaluate."""

    def _maybe_log_save_evaluate(self, tr_loss: torch.Tensor, grad_norm: Any, *args: Any, **kw: Any) -> None:
        # The global gradient norm the engine measured in its last step (clipping or not).
        super()._maybe_log_save_evaluate(tr_loss, self.engine.last_grad_norm, *args, **kw)

    # ---- saving and resuming ------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """An ordinary Hugging Face checkpoint of the full fp32 weights, which `from_pretrained` loads
        without zeroshard; tied weights saved once, as save_pretrained does. Collective: every rank
        takes part in the gathers; only rank 0 keeps the full state (on the CPU) and writes it."""
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir or self.args.output_dir
        self.engine.comm.watch.gate("save_model()")  # called on one rank alone: named as this call
        self._save(output_dir, state_dict=self.engine.full_state_dict(rank0_only=True))  # only 0 writes
        config = getattr(self.model, "config", None)
        if self.args.should_save and hasattr(config, "save_pretrained"):
            config.dtype = "float32"  # save_pretrained recorded the module's dtype: bf16/fp16 in 16 bits
            config.save_pretrained(output_dir)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Collective: the engine's sharded checkpoint, with the lr schedule and the global batch."""
        self.engine.save_checkpoint(os.path.join(output_dir, _STATE_DIR), client_state={
            "lr_scheduler": self.lr_scheduler.state_dict(), "global_batch": self._global_batch()})

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Weights come with the engine's state, once the engine exists (_load_optimizer_and_scheduler)."""
        if not os.path.isdir(resume_from_checkpoint):
            raise ValueError(f"resume_from_checkpoint: '{resume_from_checkpoint}' does not exist (give a "
                             f"checkpoint folder ZeroTrainer saved, or True for the newest in output_dir)")
        if not os.path.isdir(os.path.join(resume_from_checkpoint, _STATE_DIR)):
            raise ValueError(f"'{resume_from_checkpoint}' holds no zeroshard state ('{_STATE_DIR}/'): "
                             f"ZeroTrainer resumes from the checkpoints it saved (without save_only_model)")

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Collective. Any world size and stage; the global batch must be the one saved (checked on
        every rank alike, before training goes on)."""
        if checkpoint is None:
            return
        _, saved = self.engine.load_checkpoint(os.path.join(checkpoint, _STATE_DIR))
        if saved["global_batch"] != self._global_batch():
            raise ValueError(f"'{checkpoint}' was saved with a global batch of {saved['global_batch']} "
                             f"samples per step, this run has {self._global_batch()} "
                             f"(per_device_train_batch_size x gradient_accumulation_steps x world size): "
                             f"the sampler resumes by step, so keep the global batch")
        self.lr_scheduler.load_state_dict(saved["lr_scheduler"])

    def _load_best_model(self) -> None:
        """load_best_model_at_end: the best checkpoint's sharded state, weights and optimizer alike."""
        self.engine.load_checkpoint(os.path.join(self.state.best_model_checkpoint, _STATE_DIR))

    def _global_batch(self) -> int:
        args = self.args
        return args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
