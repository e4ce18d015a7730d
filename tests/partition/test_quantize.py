"""ZeRO++ block quantization (comm/quantize.py): the round trip stays within the stated per-element
bound for odd lengths, every input dtype and both bit widths; adversarial blocks (all zeros, one huge
value, exactly representable values, NaN/inf, fp32's largest value) behave as documented; the
payload is exactly quantized_nbytes long, int4 halves the code bytes, and the int8 codes match an
independent per-element computation."""
from __future__ import annotations

import struct

import pytest
import torch

from zeroshard.comm.quantize import (BITS, BLOCK, check_finite, dequantize, error_bound, quantize,
                                     quantized_nbytes)

QMAX = {4: 7, 8: 127}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _round_trip(x: torch.Tensor, bits: int, block: int = BLOCK, dtype=torch.float32) -> torch.Tensor:
    payload = quantize(x, bits, block)
    assert payload.dtype == torch.uint8 and payload.numel() == quantized_nbytes(x.numel(), bits, block)
    return dequantize(payload, x.numel(), bits, block, dtype)


def _plain_bound(x: torch.Tensor, bits: int, block: int = BLOCK) -> torch.Tensor:
    """absmax(block) / (2 * qmax) per element, computed independently of the module (in fp64)."""
    blocks = [x[i:i + block].double() for i in range(0, x.numel(), block)]
    return torch.cat([torch.full((len(b),), float(b.abs().max()) / (2 * QMAX[bits])) for b in blocks])


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [1, 255, 256, 257, 1000])
def test_round_trip_within_the_bound(numel, dtype, bits):
    x = (torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3).to(dtype)
    got = _round_trip(x, bits)
    assert got.shape == (numel,) and got.dtype == torch.float32
    error = (got.double() - x.double()).abs()
    bound = error_bound(x, bits)
    assert bool((error <= bound.double()).all()), float((error - bound).max())
    plain = _plain_bound(x, bits)
    # the stated bound is half a step plus fp32 rounding only: within 2 eps_fp32 * absmax of absmax/(2 qmax)
    assert bool((bound.double() >= plain).all()) and bool((bound.double() <= plain * (1 + 1e-4)).all())
    assert bool((error <= plain * (1 + 1e-4)).all())


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decoding_to_a_half_dtype_adds_only_its_rounding(dtype, bits):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    got = _round_trip(x, bits, dtype=dtype)
    assert got.dtype == dtype and got.shape == (1000,)
    assert bool(((got.double() - x.double()).abs() <= error_bound(x, bits, dtype=dtype).double()).all())


@pytest.mark.parametrize("bits", BITS)
def test_an_all_zero_block_decodes_to_exact_zeros(bits):
    x = torch.cat([torch.zeros(BLOCK), torch.randn(BLOCK), torch.zeros(10)])
    payload = quantize(x, bits)
    scales = payload[-12:].view(torch.float32)
    assert scales[0] == 0 and scales[2] == 0 and scales[1] > 0
    got = dequantize(payload, x.numel(), bits)
    assert not bool(got.isnan().any())
    assert bool((got[:BLOCK] == 0).all()) and bool((got[2 * BLOCK:] == 0).all())
    assert bool((_round_trip(torch.zeros(7), bits) == 0).all())


@pytest.mark.parametrize("bits", BITS)
def test_one_huge_value_zeroes_the_small_ones_within_the_bound(bits):
    x = torch.randn(300, generator=torch.Generator().manual_seed(2))
    x[17] = 1e30
    got = _round_trip(x, bits)
    assert got[17] == pytest.approx(1e30, rel=1e-6)
    assert bool((got[:BLOCK][torch.arange(BLOCK) != 17] == 0).all())  # below half a step: 0
    assert bool(((got - x).abs() <= error_bound(x, bits)).all())
    rest = x[BLOCK:]  # the next block has its own scale, set by its own values
    assert bool(((got[BLOCK:] - rest).abs() <= rest.abs().max() / (2 * QMAX[bits]) * (1 + 1e-4)).all())


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("scale", [2.0 ** -10, 0.125, 1.0, 2.0 ** 20])
def test_multiples_of_the_scale_round_trip_exactly(scale, bits):
    qmax = QMAX[bits]
    k = torch.arange(-qmax, qmax + 1, dtype=torch.float32).repeat(40)[:BLOCK + 100]
    k[BLOCK] = qmax  # the second block's absmax is qmax * scale too
    x = k * scale
    assert bool((_round_trip(x, bits) == x).all())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_inf_are_refused_by_name(bad):
    x = torch.ones(10)
    x[3] = bad
    for bits in BITS:
        message = r"layer\.7\.grad holds .*refuse NaN/inf.*zero_quantized_gradients.*overflow"
        with pytest.raises(ValueError, match=message):
            quantize(x, bits, what="layer.7.grad")
    with pytest.raises(ValueError, match=r"^tensor holds"):
        quantize(x, 8)
    with pytest.raises(ValueError, match="1 NaN and 0 inf" if bad != bad else "0 NaN and 1 inf"):
        check_finite(x, "w")
    check_finite(torch.ones(3), "w")  # finite: no error


@pytest.mark.parametrize("numel", [0, 1, 255, 256, 257, 1000])
def test_payload_length_and_int4_halves_the_codes(numel):
    blocks = -(-numel // BLOCK)
    assert quantized_nbytes(numel, 8) == blocks * BLOCK + 4 * blocks
    assert quantized_nbytes(numel, 4) == blocks * BLOCK // 2 + 4 * blocks
    assert quantized_nbytes(numel, 8, block=16) == -(-numel // 16) * 20
    for bits in BITS:
        assert quantized_nbytes(numel, bits) % 4 == 0
        assert quantize(torch.randn(numel), bits).numel() == quantized_nbytes(numel, bits)


def test_int4_packs_two_codes_per_byte():
    x = torch.tensor([7.0, -7.0, 0.0, 1.0, -1.0, 3.0, 0.0, 0.0])  # scale 1: codes are the values
    payload = quantize(x, 4, block=8)
    assert payload.numel() == 4 + 4  # 8 codes in 4 bytes, one fp32 scale
    nibbles = [c + 8 for c in (7, -7, 0, 1, -1, 3, 0, 0)]
    assert payload[:4].tolist() == [nibbles[i] | nibbles[i + 1] << 4 for i in range(0, 8, 2)]
    assert payload[4:].view(torch.float32).item() == 1.0
    assert dequantize(payload, 8, 4, block=8).tolist() == x.tolist()


def _reference_int8(values: list[float], block: int) -> tuple[list[int], list[float]]:
    """Per element, in Python floats: scale = fp32(absmax / 127), code = round(x / scale) clamped."""
    to_fp32 = lambda v: struct.unpack("f", struct.pack("f", v))[0]
    codes, scales = [], []
    for start in range(0, len(values), block):
        chunk = values[start:start + block] + [0.0] * (block - len(values[start:start + block]))
        scale = to_fp32(max(abs(v) for v in chunk) / 127)
        scales.append(scale)
        codes += [0 if scale == 0 else max(-127, min(127, round(v / scale))) for v in chunk]
    return codes, scales


def test_int8_codes_match_an_independent_computation():
    x = torch.randn(37, generator=torch.Generator().manual_seed(3))
    x[20:] *= 1000
    x[32:] = 0.0  # the last block (32..39, padded) is all zeros
    codes, scales = _reference_int8(x.tolist(), block=8)
    payload = quantize(x, 8, block=8)
    assert payload[:40].view(torch.int8).tolist() == codes
    assert payload[40:].view(torch.float32).tolist() == scales
    assert scales[-1] == 0.0


def test_dequantize_reads_a_payload_from_the_middle_of_a_gathered_buffer():
    shards = [torch.randn(300, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    gathered = torch.cat([quantize(s, 4) for s in shards])  # what an all_gather of payloads returns
    n = quantized_nbytes(300, 4)
    for r, shard in enumerate(shards):
        got = dequantize(gathered[r * n:(r + 1) * n], 300, 4)
        assert bool(((got - shard).abs() <= error_bound(shard, 4)).all())
    odd = torch.cat([torch.zeros(1, dtype=torch.uint8), quantize(shards[0], 8)])[1:]  # misaligned slice
    assert torch.equal(dequantize(odd, 300, 8), _round_trip(shards[0], 8))


def test_the_largest_fp32_value_decodes_finite():
    x = torch.tensor([torch.finfo(torch.float32).max, 1.0, -torch.finfo(torch.float32).max])
    for bits in BITS:
        got = _round_trip(x, bits)
        assert bool(got.isfinite().all())
        assert bool(((got.double() - x.double()).abs() <= error_bound(x, bits).double()).all())


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="bits=2"):
        quantize(torch.ones(4), 2)
    with pytest.raises(ValueError, match="block=12"):
        quantized_nbytes(4, 8, block=12)
    with pytest.raises(ValueError, match="1-D"):
        quantize(torch.ones(2, 3), 8)
    with pytest.raises(ValueError, match="1-D"):
        quantize(torch.ones(4, dtype=torch.float64), 8)
    with pytest.raises(ValueError, match="260 bytes"):
        dequantize(torch.zeros(10, dtype=torch.uint8), 256, 8)
