"""Which form of the W8A8 FP8 GEMM runs, and which gives the right product? CUTLASS's (QWEN_RT_FP8_GEMM=cutlass), and
cuBLASLt's in every orientation (w8a8 / w8a8t) and order of the block scales (QWEN_RT_FP8_SCALES), against numpy on
the same quantized values; prints each form's relative error (~2.5e-2 means the dequantizing fallback ran; ~1e-3 is
right).
  python tools/fp8_gemm_probe.py        (needs a Hopper GPU)"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main() -> int:
    from qwen_rt import _core
    from test_cuda_ops import fp8_weights, quantize_rows_e4m3, rel, rand

    cpu, gpu = _core.OpHarness("cpu", "float32"), _core.OpHarness("cuda:0", "bfloat16")
    os.environ["QWEN_RT_GEMV_ROWS"] = "0"
    os.environ["QWEN_RT_GEMM_VERBOSE"] = "1"  # each declined plan prints cuBLASLt's reason
    rng = np.random.default_rng(0)
    for m, n, k in [(64, 1024, 4096), (200, 384, 512), (9, 256, 1024)]:
        q, s = fp8_weights(cpu, rng, n, k, 7)
        w = q.astype(np.float64) * np.repeat(np.repeat(s, 128, 0)[:n], 128, 1)[:, :k]
        x = rand(rng, (m, k), -1, 1, "bfloat16")
        ref = quantize_rows_e4m3(x) @ w.T
        for form, orders in (("cutlass", ("-",)), ("w8a8", ("mn,k", "k,k", "mn,mn", "k,mn")),
                             ("w8a8t", ("mn,k", "k,k", "mn,mn", "k,mn"))):
            for order in orders:
                os.environ["QWEN_RT_FP8_GEMM"], os.environ["QWEN_RT_FP8_SCALES"] = form, order
                try:
                    out = np.asarray(gpu.fp8_linear("linear", x, q, s, 7))
                    print(f"m {m} n {n} k {k} {form} scales {order}: rel {rel(out, ref):.2e}", flush=True)
                except Exception as exc:  # a form cuBLASLt refuses, or non-finite output
                    print(f"m {m} n {n} k {k} {form} scales {order}: {type(exc).__name__}: {exc}"[:300], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
