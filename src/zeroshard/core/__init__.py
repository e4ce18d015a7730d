"""The mechanism: one flat, padded, sharded buffer per (unit, parameter group), and a stage
policy of three booleans that says which model states are sharded (no per-stage code paths).

Owns: partition arithmetic (partition.py), the stage as data (policy.py), flat buffers and their
gradients (flat_param.py, flat_grad.py, placeholders.py), units and their hooks (units.py,
guards.py), prefetching and keeping along the recorded order (prefetch.py, gather_together.py),
gradient reduction in a fixed order (reduce.py), precision and loss scaling (precision.py,
nonfinite.py), the optimizer over flat shards and its step (optim.py, step.py, schedules.py), and
byte accounting (memory.py).
May import: common, config, comm, parallel, offload, construct.
"""
