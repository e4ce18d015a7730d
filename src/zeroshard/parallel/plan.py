"""zeroshard.tensor_parallel: a model's own tensor-parallel plan, applied through torch's API.

Hugging Face models ship their plan (`config.base_model_tp_plan`: "layers.*.self_attn.q_proj":
"colwise", "...o_proj": "rowwise"), relative to the base model; zeroshard's GPT carries `tp_plan`.
Both are Megatron's pattern: a column-parallel layer's output stays split (each rank holds whole
heads), the row-parallel layer after it sums the partial outputs over tp, so a block's input and
output are replicated. Only those two styles are taken: the others HF names (colwise_rep,
local_rowwise, sequence_parallel, ...) change what a block's input looks like, and the ZeRO-R
partitioning of block inputs assumes they are replicated.
"""
from __future__ import annotations

from fnmatch import fnmatch

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ..config import ConfigError
from ..construct import is_deferred
from .mesh import check_heads

STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def model_plan(model: nn.Module) -> tuple[nn.Module, dict[str, str]]:
    """(the module the plan is relative to, the plan) that the model itself carries."""
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_tp_plan", None)
    if isinstance(plan, dict) and plan:  # HF: the base model's plan (its model.tp_plan adds lm_head)
        prefix = getattr(model, "base_model_prefix", "")
        base = getattr(model, prefix, model) if prefix else model
        return base, plan
    own = getattr(model, "tp_plan", None)
    if isinstance(own, dict) and own:
        return model, own
    raise ConfigError(f"{type(model).__name__} carries no tensor-parallel plan (no "
                      f"config.base_model_tp_plan, "
                      f"no tp_plan attribute): pass one, e.g. tensor_parallel(model, mesh['tp'], "
                      f"plan={{'layers.*.attn.q': 'colwise', 'layers.*.attn.out': 'rowwise'}})")


def _split_size(module: nn.Module, style: str) -> int | None:
    """The size a style splits: a Linear's outputs (colwise) or inputs (rowwise); None for a module
    of another kind (an Embedding's rows, for one, DTensor may split unevenly)."""
    if isinstance(module, nn.Linear):
        return module.out_features if style == "colwise" else module.in_features
    return None


def check_split_sizes(root: nn.Module, plan: dict[str, str], tp: int) -> None:
    """Every size the plan splits is a multiple of tp (torch would split it unevenly, and the first
    forward fail deep inside DTensor); patterns match as parallelize_module matches them, a name
    part at a time with fnmatch."""
    for name, module in root.named_modules():
        parts = name.split(".")
        for pattern, style in plan.items():
            atoms = pattern.split(".")
            if len(atoms) != len(parts) or not all(fnmatch(p, a) for p, a in zip(parts, atoms)):
                continue
            size = _split_size(module, style)
            if size is not None and size % tp:
                raise ConfigError(f"tensor-parallel plan entry {pattern!r} ({style}) splits '{name}', of "
                                  f"size {size}, which tp = {tp} does not divide; choose a tp size that "
                                  f"divides it")


def plan_styles(plan: dict[str, str]) -> dict[str, ColwiseParallel | RowwiseParallel]:
    """{pattern: torch's style} of a plan; ConfigError naming the first entry of a style not taken."""
    styles = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ConfigError(f"tensor-parallel plan entry {pattern!r}: {style!r} is not supported; "
                              f"zeroshard takes {sorted(STYLES)} (block inputs must stay replicated)")
        styles[pattern] = STYLES[style]()
    return styles


def tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, str] | None = None) -> nn.Module:
    """Split `model` over `tp_mesh` by its own plan (or `plan`, {module pattern: "colwise" |
    "rowwise"}, patterns relative to `model`, "*" matching one name). Returns the model, changed
    in place: its split parameters become DTensors. Then zeroshard.initialize(model, ..., mesh=mesh)."""
    if tp_mesh.ndim != 1:
        raise ConfigError(f"tensor_parallel takes the 1-D tp mesh (mesh['tp']), got {tp_mesh.ndim} "
                          f"dimensions")
    if is_deferred(model):
        raise ConfigError("tensor_parallel() of a model built under zeroshard.init(): splitting deferred "
                          "tensors is not supported yet. Build it without zeroshard.init() (each rank "
                          "holds it whole until the split), or call zeroshard.materialize(model) first")
    root, plan = (model, plan) if plan is not None else model_plan(model)
    styles = plan_styles(plan)
    check_heads(model, tp_mesh.size())
    check_split_sizes(root, plan, tp_mesh.size())
    before = {id(p) for p in root.parameters()}
    parallelize_module(root, tp_mesh, styles)
    if {id(p) for p in root.parameters()} == before:
        raise ConfigError(f"the tensor-parallel plan {sorted(plan)} matched no module of "
                          f"{type(root).__name__}: check the patterns against model.named_modules()")
    return model
