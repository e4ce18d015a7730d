"""Composition with torch tensor parallelism (2-D meshes) and ZeRO-R activation checkpoints.

May import: common, config, comm (the flat buffers are core's: parallel knows only DTensors).
"""
from .mesh import Axes, check_heads, mics_mesh, split
from .plan import model_plan, plan_styles, tensor_parallel

__all__ = ["Axes", "check_heads", "mics_mesh", "model_plan", "plan_styles", "split", "tensor_parallel"]
