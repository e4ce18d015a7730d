"""Composition with torch tensor parallelism (2-D meshes) and ZeRO-R activation checkpoints."""
from .mesh import Axes, check_heads, split
from .plan import tensor_parallel

__all__ = ["Axes", "check_heads", "split", "tensor_parallel"]
