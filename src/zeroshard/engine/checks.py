"""Checks made before any buffer is built: is the model usable, and did every rank build the same
model with the same config? (Ranks that disagree would hang in, or be corrupted by, collectives.)"""
from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parameter import UninitializedTensorMixin

from ..comm.collectives import Comm
from ..comm.topology import Topology
from ..comm.zeropp import check_zeropp
from ..config import Config, ConfigError


class ModelMismatchError(RuntimeError):
    """Ranks built different models or configs: training them together would corrupt or hang."""


def check_module_type(module: object) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"initialize() needs a torch.nn.Module, got {type(module).__name__}")
    if getattr(module, "_zeroshard_wrapped", False):
        raise ValueError("this model is already wrapped by a zeroshard engine (its parameters now live "
                         "in that engine's buffers); keep using that engine, or build a fresh model")


def check_model(module: nn.Module, config: Config) -> None:
    _refuse_lazy(module)
    _refuse_sparse_gradients(module)
    params = dict(module.named_parameters())
    if not any(p.requires_grad for p in params.values()):
        raise ValueError("the model has no trainable parameter (all have requires_grad=False); "
                         "there is nothing to optimize. zeroshard shards models that train: a frozen "
                         "model used alongside (a reference or teacher model) runs as a plain module, "
                         "in eval mode and under torch.no_grad()")
    for name, p in params.items():
        if p.is_meta:
            raise ValueError(f"parameter '{name}' is on the meta device; materialize the model "
                             f"(e.g. model.to_empty(device=...) and initialize it) first")
    dtypes = {p.dtype for p in params.values()}
    complex_ = [name for name, p in params.items() if p.is_complex()]
    if complex_:  # (model.float() keeps them complex: no conversion to advise)
        raise ValueError(f"parameter '{complex_[0]}' is {params[complex_[0]].dtype}: zeroshard trains real "
                         f"floating parameters only; keep a complex weight as two real parameters, its real "
                         f"and imaginary parts, and combine them in forward with torch.complex(real, imag)")
    if len(dtypes) > 1 or not next(iter(dtypes)).is_floating_point:
        raise ValueError(f"all parameters must share one floating dtype, got {sorted(map(str, dtypes))}; "
                         f"convert the model with model.float() (for mixed precision, keep it fp32 "
                         f"and enable \"bf16\" or \"fp16\" in the config)")
    # The CPU may mix with one other device: initialize() moves CPU parameters to the group's device
    # (tensor parallelism leaves the replicated ones on the CPU when it moves the split ones).
    devices = {p.device for p in params.values() if p.device.type != "cpu"}
    if len(devices) > 1:
        raise ValueError(f"all parameters must be on one device (or the CPU), got "
                         f"{sorted(map(str, devices))}; build the model on the CPU: initialize() moves it")
    dtype = next(iter(dtypes))
    if dtype != torch.float32 and config.precision == "fp32":
        raise ValueError(f"the parameters are {dtype} but the config trains in fp32 (it would silently "
                         f"upcast them); enable \"bf16\" or \"fp16\" in the config (fp32 master weights, "
                         f"{dtype} compute), or convert the model with model.float()")


def _refuse_lazy(module: nn.Module) -> None:
    """A lazy module's tensors have no shape until its first forward: nothing to lay out yet."""
    for kind, named in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, t in named:
            if isinstance(t, UninitializedTensorMixin):
                raise ValueError(f"{kind} '{name}' is uninitialized (a lazy module such as nn.LazyLinear); "
                                 f"run one forward pass on a sample batch before initialize(), so that its "
                                 f"shape is known")


def _refuse_sparse_gradients(module: nn.Module) -> None:
    for name, m in module.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad:
            where = f"module '{name}'" if name else "the model"
            raise ValueError(f"{where} is nn.{type(m).__name__}(sparse=True): its gradients are sparse, "
                             f"but ZeRO reduces and shards dense flat gradient buffers; build it with "
                             f"sparse=False")


def _shape(t: torch.Tensor) -> object:
    return "uninitialized" if isinstance(t, UninitializedTensorMixin) else tuple(t.shape)


def _signature(module: nn.Module, config: Config, world_size: int) -> list[str]:
    entries = [f"config {json.dumps(config.raw, sort_keys=True, default=str)}", f"world size {world_size}"]
    entries += [f"parameter {n} {_shape(p)} {p.dtype} {p.device.type} requires_grad={p.requires_grad}"
                for n, p in module.named_parameters(remove_duplicate=False)]
    entries += [f"buffer {n} {_shape(b)} {b.dtype}" for n, b in module.named_buffers()]
    return entries


def verify_same_on_every_rank(comm: Comm, module: nn.Module, config: Config) -> None:
    """Refuse to start if ranks disagree on the model or config (they would hang or corrupt)."""
    _agree(comm, _signature(module, config, comm.world_size), "the model or config",
           "Build the same model with the same config on every rank.")


def verify_same_optimizer(comm: Comm, optimizer: torch.optim.Optimizer) -> None:
    """Refuse to start if ranks built the optimizer differently: each would update its shard with its
    own learning rate (say), silently; at stage 0 the replicas would drift apart."""
    signature = [f"optimizer {type(optimizer).__name__}"] + [
        f"param group {i}: {key}={value.tolist() if isinstance(value, torch.Tensor) else value!r}"
        for i, group in enumerate(optimizer.param_groups) for key, value in sorted(group.items())
        if key != "params"]
    _agree(comm, signature, "the optimizer", "Build it with the same options on every rank.")


def _agree(comm: Comm, signature: list[str], what: str, fix: str) -> None:
    """Collective: raise ModelMismatchError naming the first entry where a rank differs from rank 0."""
    digest = hashlib.sha256("\n".join(signature).encode()).hexdigest()
    digests = comm.all_gather_objects(digest)
    if len(set(digests)) == 1:
        return
    signatures = comm.all_gather_objects(signature)
    rank = next(r for r, d in enumerate(digests) if d != digests[0])
    ours, theirs = signatures[0], signatures[rank]
    diff = next(((a, b) for a, b in zip(ours, theirs) if a != b), None)
    detail = (f"rank 0 has '{diff[0]}', rank {rank} has '{diff[1]}'" if diff else
              f"rank 0 has {len(ours)} entries, rank {rank} has {len(theirs)}")
    raise ModelMismatchError(f"ranks disagree on {what}: {detail}. {fix}")


def check_zeropp_layout(config: Config, axes, topology: Topology) -> None:
    """ZeRO++ runs over the whole world in nodes (local checks, alike on every rank, before any
    collective): not beside tensor parallelism or a given mesh, hpZ's partition inside a node."""
    z = config.zero
    if z.zero_hpz_partition_size <= 1 and not z.zero_quantized_weights and not z.zero_quantized_gradients:
        return
    if axes.dp_group is not None or axes.tp_size > 1:
        raise ConfigError("ZeRO++ (zero_hpz_partition_size, zero_quantized_weights, "
                          "zero_quantized_gradients) "
                          "runs over every rank: it is not built for a mesh= or process_group= given to "
                          "initialize (tensor parallelism, MiCS); remove the ZeRO++ keys or the mesh")
    check_zeropp(z.zero_hpz_partition_size, topology, dist.get_world_size())
