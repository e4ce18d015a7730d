"""Block quantization for ZeRO++'s quantized collectives, as pure functions over flat tensors on any
device: qwZ all-gathers weights as int8, qgZ all-to-alls gradients as int4 or int8.

Scheme: symmetric per-block absmax quantization. A 1-D float tensor (fp32, bf16 or fp16; computed in
fp32) is padded with zeros to a whole number of blocks of `block` elements (BLOCK = 256 by default; a
positive multiple of 8). Each block gets one fp32 scale s = absmax(block) / qmax, qmax = 127 (int8)
or 7 (int4), and each value x the code q = clamp(round(x / s), -qmax, qmax) (torch.round: half to
even). An all-zero block has s = 0 and codes 0 and decodes to exact zeros (no 0/0, no NaN). int8 codes
are stored as their bytes; int4 codes are offset by 8 to the nibbles 1..15 and packed two to a byte
(element 2i in the low nibble, 2i+1 in the high one). The payload is ONE flat uint8 tensor, the codes
followed by the scales' bytes, so one all_gather or all_to_all moves both. Its length,
`quantized_nbytes(numel, bits, block)`, is a multiple of 4, so payloads of equal shards laid end to
end (what an all_gather returns) keep every scale 4-byte aligned. Decoding is q * s, in fp32.

Error bound, per element (`error_bound` returns it): |dequantize(quantize(x)) - x| <= absmax/(2*qmax),
half a quantization step of its block, plus fp32's rounding of the scale, the division and the product
(at most 2 * eps_fp32 * absmax), plus fp32's smallest normal (blocks whose scale underflows), plus,
when decoding to bf16/fp16, that dtype's rounding (eps * absmax + its subnormal spacing; the dtype
must hold the values). For int8 that is 1/254 of the block's absmax, for int4 1/14. A value smaller
than half a step (the small values of a block that holds one huge one) decodes to 0.

NaN and inf are refused (`check_finite`): one would make its block's scale, and so every value of the
block, NaN or inf on every rank that receives the payload.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 256  # elements per scale: the scales add 4 bytes per block (1.6% of int8, 3.1% of int4 codes)
BITS = (4, 8)  # int4 (qgZ gradients) and int8 (qwZ weights, qgZ gradients)

_QMAX = {4: 7, 8: 127}
_NIBBLE_OFFSET = 8  # an int4 code q in -7..7 is stored as the nibble q + 8 in 1..15
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_FP32 = torch.finfo(torch.float32)


def _check(bits: int, block: int) -> None:
    if bits not in BITS:
        raise ValueError(f"bits={bits!r}: quantized collectives use int4 or int8 codes, bits in {BITS}")
    if not isinstance(block, int) or block < 8 or block % 8:
        raise ValueError(f"block={block!r}: a block is a positive multiple of 8 elements (default {BLOCK}), "
                         "so int4 packs whole bytes and every payload is whole 4-byte words")


def _blocks(numel: int, block: int) -> int:
    """Blocks covering `numel` elements (the last one zero-padded)."""
    return -(-numel // block)


def _code_nbytes(blocks: int, bits: int, block: int) -> int:
    return blocks * block * bits // 8


def quantized_nbytes(numel: int, bits: int, block: int = BLOCK) -> int:
    """Bytes of `quantize`'s payload for `numel` elements: the codes of numel padded up to whole
    blocks (one byte each for int8, half a byte for int4) plus one fp32 scale per block. Always a
    multiple of 4."""
    _check(bits, block)
    if numel < 0:
        raise ValueError(f"numel={numel}: a tensor has no negative number of elements")
    blocks = _blocks(numel, block)
    return _code_nbytes(blocks, bits, block) + 4 * blocks


def check_finite(x: torch.Tensor, what: str) -> None:
    """Raise ValueError naming `what` if `x` holds NaN or inf (on a GPU, reads one flag back: a sync)."""
    if bool(torch.isfinite(x).all()):
        return
    nan, inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
    raise ValueError(
        f"{what} holds {nan} NaN and {inf} inf of {x.numel()} values: quantized collectives refuse NaN/inf "
        "(one would make its whole block's scale NaN or inf, on every rank). Turn off "
        "zero_quantized_weights / zero_quantized_gradients to move the values unquantized, or find the "
        "overflow that made them (learning rate, loss scale, fp16 range)")


def _as_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """`x` in fp32, zero-padded to whole blocks, as a (blocks, block) matrix (a new tensor or a view
    of x's fp32 copy; x itself is never written)."""
    if x.dim() != 1 or x.dtype not in _FLOATS:
        raise ValueError(f"quantize takes a 1-D fp32, bf16 or fp16 tensor, got {x.dtype} of shape "
                         f"{tuple(x.shape)}")
    blocks = _blocks(x.numel(), block)
    return F.pad(x.float(), (0, blocks * block - x.numel())).reshape(blocks, block)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Flat int8 codes -> bytes: as they are for int8; offset to nibbles and two to a byte for int4."""
    if bits == 8:
        return codes.view(torch.uint8)
    nibbles = (codes + _NIBBLE_OFFSET).to(torch.uint8).view(-1, 2)
    return nibbles[:, 0] | (nibbles[:, 1] << 4)


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Bytes -> flat int8 codes (the inverse of `_pack`)."""
    if bits == 8:
        return packed.view(torch.int8)
    nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=1).flatten()
    return nibbles.to(torch.int8) - _NIBBLE_OFFSET


def quantize(x: torch.Tensor, bits: int, block: int = BLOCK, what: str = "tensor",
             refuse_nonfinite: bool = True) -> torch.Tensor:
    """Quantize the 1-D float tensor `x` to `bits`-bit codes with one fp32 absmax scale per `block`
    elements, on x's device. Returns one flat uint8 tensor of exactly quantized_nbytes(x.numel(),
    bits, block) bytes: the packed codes, then the scales' bytes. Raises ValueError naming `what` if
    x holds NaN or inf, unless `refuse_nonfinite` is False: then such a block's scale is NaN and every
    value of it decodes to NaN (the engine's collectives: a rank must not leave its peers waiting,
    and the non-finite check after the step reports the NaN). `dequantize` inverts it within
    `error_bound`."""
    _check(bits, block)
    if refuse_nonfinite:
        check_finite(x, what)
    qmax = _QMAX[bits]
    blocks = _as_blocks(x, block)
    scale = blocks.abs().amax(dim=1) / qmax
    if not refuse_nonfinite:
        scale = torch.where(torch.isfinite(scale), scale, torch.full_like(scale, float("nan")))
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block: 0 / 1
    codes = torch.round(blocks / divisor[:, None]).clamp_(-qmax, qmax).to(torch.int8)
    return torch.cat([_pack(codes.flatten(), bits), scale.view(torch.uint8)])


def dequantize(payload: torch.Tensor, numel: int, bits: int, block: int = BLOCK,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode `quantize`'s payload (1-D uint8, quantized_nbytes(numel, bits, block) bytes, on any
    device) to a new 1-D tensor of `numel` elements in `dtype`: code * scale in fp32, then converted.
    An all-zero block decodes to exact zeros."""
    nbytes = quantized_nbytes(numel, bits, block)
    if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() != nbytes:
        raise ValueError(f"a payload of {numel} elements at {bits} bits, block {block}, is 1-D uint8 of "
                         f"{nbytes} bytes; got {payload.dtype} of shape {tuple(payload.shape)}")
    blocks = _blocks(numel, block)
    split = _code_nbytes(blocks, bits, block)
    codes = _unpack(payload[:split], bits).view(blocks, block)
    scale_bytes = payload[split:]
    if scale_bytes.storage_offset() % 4:  # a slice at an odd byte: fp32 cannot view it in place
        scale_bytes = scale_bytes.clone()
    values = codes.float() * scale_bytes.view(torch.float32)[:, None]
    # 127 * fl(absmax / 127) can round past fp32's largest value: keep such a block finite
    return values.clamp_(-_FP32.max, _FP32.max).flatten()[:numel].to(dtype)


def error_bound(x: torch.Tensor, bits: int, block: int = BLOCK,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per element of `x`, the fp32 bound on |dequantize(quantize(x), ..., dtype) - x|: half a step,
    absmax(block) / (2 * qmax), plus fp32 rounding (2 * eps_fp32 * absmax + fp32's smallest normal),
    plus, for a bf16/fp16 `dtype`, its rounding (eps * absmax + its subnormal spacing)."""
    _check(bits, block)
    absmax = _as_blocks(x, block).abs().amax(dim=1)
    bound = absmax / (2 * _QMAX[bits]) + 2 * _FP32.eps * absmax + _FP32.tiny
    if dtype != torch.float32:
        out = torch.finfo(dtype)
        bound = bound + out.eps * absmax + out.tiny * out.eps
    return bound.repeat_interleave(block)[:x.numel()]
