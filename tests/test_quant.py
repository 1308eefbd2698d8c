import pytest
import torch

from sglang_diffkv.quant import (
    SCALE_EPS,
    dequantize,
    error_bound,
    pack,
    quantize,
    unpack,
)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_error_within_half_a_step(bits, groups, dtype):
    g = torch.Generator().manual_seed(bits * 10 + groups)
    x = (torch.randn(257, 128, generator=g) * 3 + torch.randn(257, 1, generator=g)).to(dtype)
    q = quantize(x, bits, groups)
    assert q.codes.dtype == torch.uint8 and int(q.codes.max()) <= 2**bits - 1
    assert q.scale.dtype == torch.float16 and q.scale.shape == (257, groups)
    err = (dequantize(*q) - x.float()).abs()
    assert torch.all(err <= error_bound(q.scale, 128))
    # the bound is a real one: half the range step of each group
    span = x.float().unflatten(-1, (groups, -1)).aminmax(dim=-1)
    step = (span.max - span.min) / (2**bits - 1)
    assert torch.all(q.scale.float() >= step * (1 - 1e-3))
    assert torch.all(q.scale.float() <= step * (1 + 2e-3) + SCALE_EPS)


def test_constant_groups_and_outliers():
    x = torch.full((4, 64), 1.2345)
    x[1] = -7.0
    x[2, :32] = 0.0
    x[2, 32:] = 3.0  # two constant groups of different value
    x[3] = torch.linspace(-1, 1, 64)
    x[3, 5] = 900.0  # outlier widens the group range
    for bits in (2, 4, 8):
        q = quantize(x, bits, groups=2)
        assert torch.all(torch.isfinite(q.scale.float())) and torch.all(q.scale.float() > 0)
        y = dequantize(*q)
        assert torch.all((y[:3] - x[:3]).abs() <= 2e-3 * x[:3].abs().clamp_min(1))
        assert torch.all((y[3] - x[3]).abs() <= error_bound(q.scale[3], 64))
        assert abs(float(y[3, 5]) - 900.0) <= float(q.scale[3, 0]) / 2 + 0.5


def test_values_beyond_fp16_range_saturate():
    x = torch.tensor([[1e6, -1e6, 0.0, 1.0]])
    q = quantize(x, 8)
    y = dequantize(*q)
    assert torch.all(torch.isfinite(y))
    assert torch.all((y - x.clamp(-65504, 65504)).abs() <= error_bound(q.scale, 4))


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_pack_is_little_end_first_and_invertible(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (7, 128), generator=g, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.shape == (7, 128 * bits // 8)
    assert torch.equal(unpack(packed, bits), codes)
    # element 1 of byte 0 sits at bit offset `bits`
    first = sum(int(codes[0, i]) << (i * bits) for i in range(8 // bits))
    assert int(packed[0, 0]) == first


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="bits=3"):
        quantize(torch.randn(2, 8), 3)
    with pytest.raises(ValueError, match="groups=3 does not divide"):
        quantize(torch.randn(2, 8), 4, 3)
