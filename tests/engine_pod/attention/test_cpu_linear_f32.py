"""The cpu backend's float32 GEMM (cpu_ops/linear_f32.cpp: AVX2 machines
without AVX-512) against torch's, on the shapes its tiling has edges at:
rows around a 6-row tile and a 120-row pass, k around a 256 slice, output
features that do not fill a 16-wide panel."""

from __future__ import annotations

import pytest
import torch

from engine_pod.attention.cpu_ops.build import load_cpu_ops


@pytest.fixture(scope="module", autouse=True)
def kernels_built():
    assert load_cpu_ops() is None


def supported() -> bool:
    assert load_cpu_ops() is None  # (skip conditions run before fixtures)
    return bool(torch.ops.tessera_cpu.linear_f32_supported())


needs_kernel = pytest.mark.skipif("not supported()", reason="linear_f32 runs on AVX2 machines without AVX-512")


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 119, 120, 121, 250])
@pytest.mark.parametrize("k, n", [(1, 16), (7, 40), (48, 100), (300, 32), (513, 64)])
def test_products_match_torch(rows, k, n):
    gen = torch.Generator().manual_seed(rows * 1000 + k + n)
    x, w, b = (torch.randn(*shape, generator=gen) for shape in ((rows, k), (n, k), (n,)))
    packed = torch.ops.tessera_cpu.pack_linear_f32(w)
    assert packed.shape == ((n + 15) // 16, k, 16)
    for bias in (None, b):
        out = torch.ops.tessera_cpu.linear_f32(x, packed, n, bias)
        assert out.shape == (rows, n) and out.is_contiguous()
        torch.testing.assert_close(out, torch.nn.functional.linear(x, w, bias), rtol=1e-5, atol=1e-4 * k**0.5)


@needs_kernel
def test_leading_dims_strides_and_empty_inputs():
    w = torch.randn(40, 24)
    packed = torch.ops.tessera_cpu.pack_linear_f32(w)
    x = torch.randn(3, 5, 48)[..., ::2]  # [3, 5, 24], every other feature: not contiguous
    torch.testing.assert_close(torch.ops.tessera_cpu.linear_f32(x, packed, 40, None), x @ w.t(),
                               rtol=1e-5, atol=1e-5)
    assert torch.ops.tessera_cpu.linear_f32(torch.empty(0, 24), packed, 40, None).shape == (0, 40)
    empty_k = torch.ops.tessera_cpu.pack_linear_f32(torch.empty(40, 0))
    assert torch.equal(torch.ops.tessera_cpu.linear_f32(torch.empty(2, 0), empty_k, 40, None), torch.zeros(2, 40))


@needs_kernel
@pytest.mark.parametrize("call, message", [
    (lambda p: torch.ops.tessera_cpu.linear_f32(torch.randn(2, 24).double(), p, 40, None), "float32 CPU tensors"),
    (lambda p: torch.ops.tessera_cpu.linear_f32(torch.randn(2, 25), p, 40, None), "x has 25 features"),
    (lambda p: torch.ops.tessera_cpu.linear_f32(torch.randn(2, 24), p, 49, None), "does not match"),
    (lambda p: torch.ops.tessera_cpu.linear_f32(torch.randn(2, 24), p, 32, None), "does not match"),
    (lambda p: torch.ops.tessera_cpu.linear_f32(torch.randn(2, 24), p, 40, torch.randn(39)), "bias must be"),
    (lambda p: torch.ops.tessera_cpu.linear_f32(torch.randn(2, 24), p[:, :, :8], 40, None), "packed by"),
    (lambda p: torch.ops.tessera_cpu.pack_linear_f32(torch.randn(40, 24).half()), "2-d float32 CPU weight"),
])
def test_bad_arguments_are_refused_with_a_message(call, message):
    packed = torch.ops.tessera_cpu.pack_linear_f32(torch.randn(40, 24))
    with pytest.raises(RuntimeError, match=message):
        call(packed)


@pytest.mark.skipif("supported()", reason="this machine runs the kernel")
def test_elsewhere_the_kernel_refuses_to_run():
    packed = torch.ops.tessera_cpu.pack_linear_f32(torch.randn(16, 8))
    with pytest.raises(RuntimeError, match="AVX2 with FMA and without AVX-512 only"):
        torch.ops.tessera_cpu.linear_f32(torch.randn(2, 8), packed, 16, None)
