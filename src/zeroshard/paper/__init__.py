"""The paper's analytic model: its memory formulas (formulas.py) and Tables 1 and 2 (estimate.py),
and the planner built on them (plan.py, plan_memory.py, plan_time.py, plan_shapes.py). Pure
arithmetic: nothing here touches torch.distributed or the engine.

May import: nothing of zeroshard (`zeroshard plan` and `estimate` read it from the app).
"""
from .formulas import BYTES_PER_PARAM, paper_model_state_bytes

__all__ = ["BYTES_PER_PARAM", "paper_model_state_bytes"]
