"""2-D meshes: ZeRO over the data-parallel axis, torch tensor parallelism over the other; or ZeRO
within shard groups, replicated across them (MiCS, FSDP2's HSDP).

A mesh named ("dp", "tp") splits the world into tp groups (a model's shards, computed together) and
dp groups (replicas of one shard, which ZeRO partitions further). zeroshard runs over mesh["dp"]
exactly as over a 1-D process group; the tp collectives belong to the model (DTensor and its plan).
What crosses tp is only what must agree on every rank of the model: the gradient norm, the
non-finite verdict, and the initial values of replicated parameters.

A mesh named ("replicate", "shard") (built from zero_optimization.mics_shard_size, or given) runs
ZeRO over mesh["shard"], a group that holds one whole copy of the model states, and keeps the
copies alike over mesh["replicate"]: the reduced gradient shards are averaged there at the step,
the initial values broadcast there. Only that average crosses the replicas, so with shard groups
inside nodes the all-gathers and reduce-scatters stay inside them.

Every check here is local and made before any collective, so a bad mesh or model fails alike on
every rank instead of hanging some of them.
"""
from __future__ import annotations

from dataclasses import dataclass
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from ..config import ConfigError
from .dtensor import split_over_tp


DIMS = ("dp", "tp")
MICS_DIMS = ("replicate", "shard")  # FSDP2's HSDP names: replicas of a model sharded within a group
_FIX = "build it with init_device_mesh(device, (dp, tp), mesh_dim_names=(\"dp\", \"tp\"))"


@dataclass(frozen=True)
class Axes:
    """The data-parallel group zeroshard shards over, the tensor-parallel mesh (None: no tp), and,
    with MiCS / HSDP, the group of this rank's replicas (None: the shard group is the world)."""

    dp_group: dist.ProcessGroup | None
    tp_mesh: DeviceMesh | None
    replicate_group: dist.ProcessGroup | None = None

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        return None if self.tp_mesh is None else self.tp_mesh.get_group()

    @property
    def tp_size(self) -> int:
        return 1 if self.tp_mesh is None else self.tp_mesh.size()

    @property
    def tp_rank(self) -> int:
        return 0 if self.tp_mesh is None else self.tp_mesh.get_local_rank()


def split(mesh: DeviceMesh | None, process_group: dist.ProcessGroup | None) -> Axes:
    """The axes of `mesh` (or of a 1-D `process_group`); refuses a mesh it cannot read."""
    if mesh is None:
        return Axes(process_group, None)
    if process_group is not None:
        raise ValueError("initialize() got both mesh= and process_group=: pass one (a 1-D process group "
                         "for data parallelism, or a (\"dp\", \"tp\") mesh)")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    names = mesh.mesh_dim_names
    if mesh.ndim == 1:
        if names not in (None, ("dp",)):
            raise ConfigError(f"a 1-D mesh means data parallelism, but its dimension is named {names[0]!r}; "
                              f"name it \"dp\", or give a 2-D mesh: {_FIX}")
        return Axes(mesh.get_group(), None)
    if mesh.ndim != 2 or names not in (DIMS, MICS_DIMS):
        raise ConfigError(f"zeroshard needs a mesh with dimensions named {DIMS} (tensor parallelism) or "
                          f"{MICS_DIMS} (MiCS / HSDP), got {mesh.ndim} dimension(s) named {names}; {_FIX}")
    if mesh.size() != dist.get_world_size():  # checkpoints are written by every rank of the world
        raise ConfigError(f"the mesh spans {mesh.size()} of the {dist.get_world_size()} ranks; zeroshard "
                          f"takes a {names} mesh over the whole world")
    if names == MICS_DIMS:
        return Axes(mesh["shard"].get_group(), None, mesh["replicate"].get_group())
    return Axes(mesh["dp"].get_group(), mesh["tp"])


def mics_mesh(shard_size: int) -> DeviceMesh:
    """zero_optimization.mics_shard_size: a ("replicate", "shard") mesh of consecutive shard groups
    (collective: every rank builds it; check the layout first, topology.check_mics)."""
    world = dist.get_world_size()
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device, (world // shard_size, shard_size), mesh_dim_names=MICS_DIMS)


def check_parallelized(model: nn.Module, axes: Axes) -> None:
    """The model's DTensor parameters must live on mesh["tp"], and a tp mesh needs a model split over it."""
    dtensors = [(n, p) for n, p in model.named_parameters() if isinstance(p, DTensor)]
    if axes.tp_mesh is None:
        if dtensors:
            raise ConfigError(f"'{dtensors[0][0]}' is a tensor-parallel parameter (a DTensor), but no tp "
                              f"mesh was given: pass initialize(..., mesh=mesh) with a (\"dp\", \"tp\") mesh "
                              f"over which the model was parallelized")
        return
    ranks = axes.tp_mesh.mesh.flatten().tolist()
    for name, p in dtensors:
        if p.device_mesh.ndim != 1 or p.device_mesh.mesh.flatten().tolist() != ranks:
            raise ConfigError(f"'{name}' is a DTensor on ranks {p.device_mesh.mesh.flatten().tolist()}, but "
                              f"this rank's mesh[\"tp\"] is ranks {ranks}: parallelize the model over "
                              f"mesh[\"tp\"] (zeroshard.tensor_parallel(model, mesh[\"tp\"]))")
    sharded = any(split_over_tp(p) for _, p in dtensors)
    if axes.tp_size > 1 and not sharded:
        raise ConfigError(f"the mesh has tp = {axes.tp_size} but no parameter of the model is split over "
                          f"mesh[\"tp\"]: parallelize it first (zeroshard.tensor_parallel(model, "
                          f"mesh[\"tp\"]) "
                          f"or torch's parallelize_module), or use a 1-D data-parallel mesh")
    check_heads(model, axes.tp_size)


def check_heads(model: nn.Module, tp: int) -> None:
    """Where the heads are known (a Hugging Face config, zeroshard's GPT): tp must divide them."""
    for config in (getattr(model, "config", None), getattr(model, "cfg", None)):
        for key in ("num_attention_heads", "num_key_value_heads", "n_head", "heads"):
            heads = getattr(config, key, None)
            if isinstance(heads, int) and heads % tp:
                raise ConfigError(f"tp = {tp} does not divide the model's {key} = {heads}: each tp rank "
                                  f"must hold whole heads; choose a tp size that divides {heads}")
