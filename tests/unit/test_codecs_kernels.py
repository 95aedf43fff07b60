"""The fused int8/int4 kernels (Triton) give the eager path's bytes and values.

On a GPU, ``test_codecs_device.py`` checks them against the CPU's bytes and bits. Without one,
Triton's interpreter runs the same kernels on the CPU here, where Triton is installed (a CUDA
torch ships it; a CPU-only install has none, and then this test skips).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

CHECK = textwrap.dedent(
    """
    import torch
    from swarmgrad.compression import decode, get_codec, kernels, quantization

    quantization._DEVICE_PART_VALUES = 1 << 12  # several parts
    for name in ("int8", "int4"):
        for block in (None, 6, 1000):
            for numel in (3, 5000, 9077):
                options = {} if block is None else {"block_size": block}
                codec = get_codec(name, **options)
                x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
                x[10:300] = 0.0  # whole blocks of zeros
                x *= torch.logspace(-3, 2, numel)
                expected, meta = codec.encode(x)
                payload = torch.empty(len(expected), dtype=torch.uint8)
                # A strided view (every other value of a longer tensor) codes as its copy does.
                strided = torch.stack((x, torch.full_like(x, 1e9)), dim=1)[:, 0]
                codec._encode_fused(strided, payload, None)
                assert payload.numpy().tobytes() == expected, (name, block, numel, "strided")
                reported = []
                codec._encode_fused(x, payload, lambda _p, a, b: reported.append(b - a))
                assert payload.numpy().tobytes() == expected, (name, block, numel)
                assert sum(reported) == len(expected)
                b, nb = meta.params["block_size"], -(-numel // meta.params["block_size"])
                out = torch.empty(numel)
                kernels.decode_values(
                    payload[4 * nb :].view(codec._code_dtype()),
                    payload[: 4 * nb].view(torch.float32), out, b, codec.bits
                )
                assert torch.equal(out, decode(expected, meta).reshape(-1)), (name, block)
                for bad in (float("nan"), float("-inf")):
                    y = x.clone()
                    y[numel // 2] = bad
                    try:
                        codec._encode_fused(y, payload, None)
                    except ValueError as error:
                        assert "NaN or Inf" in str(error)
                    else:
                        raise AssertionError(f"{name}: {bad} was quantized")
    print("kernels match")
    """
)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_fused_kernels_give_the_eager_bytes_and_values_under_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", CHECK],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "kernels match" in result.stdout
