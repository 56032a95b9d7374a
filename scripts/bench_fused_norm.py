"""Host time of an inference norm's fused pass (``sparseconv.ops.features.norm_affine`` with its residual and
ReLU), with the launch kept (what a BatchNorm module passes, ``kept=``) and without: microseconds a call to issue,
median of 5 rounds of 200 calls, after the kernel compiled; and whether the two results are equal. CUDA only.

    python scripts/bench_fused_norm.py
"""

import statistics
import time

import torch

import sparseconv
from sparseconv.ops import features


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench_fused_norm.py needs a CUDA device")
    device = torch.device("cuda")
    for rows, channels in ((2000, 64), (186000, 64)):
        x = torch.randn(rows, channels, device=device, dtype=torch.float16)
        residual = torch.randn_like(x)
        mean, weight, bias = (torch.randn(channels, device=device) for _ in range(3))
        var = torch.rand(channels, device=device) + 0.1
        kept: dict = {}

        def call(kept_launches):
            return features.norm_affine(x, mean, var, weight, bias, 1e-5, residual, True, kept_launches)

        for _ in range(2):
            for launches in (None, kept):
                for _ in range(50):
                    call(launches)
            sparseconv.tune.wait_for_compiles()
        torch.cuda.synchronize()
        seen: dict[str, list[float]] = {"none": [], "kept": []}
        for _ in range(5):
            for name, launches in (("none", None), ("kept", kept)):
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(200):
                    call(launches)
                seen[name].append((time.perf_counter() - start) / 200 * 1e6)
                torch.cuda.synchronize()
        a, b = call(kept), call(None)
        equal = a is not None and b is not None and torch.equal(a, b)
        print(f"{rows}x{channels} fp16: host us a call, median of 5x200: without kept launches "
              f"{statistics.median(seen['none']):.1f}, kept {statistics.median(seen['kept']):.1f}; results equal: {equal}")


if __name__ == "__main__":
    main()
