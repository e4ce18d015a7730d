"""Communication: every collective zeroshard issues, counted in the paper's convention
(collectives.py: `Comm`); flat buffers moved in constant-size buckets (buckets.py, the paper's CB);
gloo's reduce-scatter as an all-to-all summed on arrival (gloo.py); where tensors live and the
process group (devices.py); divergence diagnosis when ranks stop issuing the same collectives
(watch.py, diagnosis.py, peer_store.py); ranks agreeing on an error (agree.py); the helpers a
training script uses instead of torch.distributed (over_ranks.py); which ranks share a node
(topology.py); and ZeRO++'s groups, quantized collectives and block quantization (zeropp.py,
quantized.py, quantize.py).

Owns: the only calls to torch.distributed's collectives (collectives.py and gloo.py).
May import: common, config.
"""
from .collectives import Comm

__all__ = ["Comm"]
