"""ZeRO-Offload and ZeRO-Infinity: model states resting in host memory (host.py: the pinned
buffers, the side stream and the delayed update's worker) or in files (nvme/: the run directories,
files as tensors, the optimizer step streamed sub-group by sub-group, the shard cache).

Offload knows the flat buffers only by the attributes it reads (master, opt_param): it sits below
core, which builds on it.
May import: common, config, comm.
"""
