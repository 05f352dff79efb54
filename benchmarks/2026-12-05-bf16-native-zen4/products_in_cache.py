import time, torch
from viasd.kernels import bf16_native
w = torch.randn(256, 1536).bfloat16()  # 768 KB: L2
for rows in (1, 4, 8, 16):
    x = torch.randn(rows, 1536).bfloat16()
    for f, name in ((bf16_native.product, "kernel"), (lambda a, b: torch.nn.functional.linear(a, b), "torch")):
        t0 = time.perf_counter()
        for _ in range(2000): f(x, w)
        dt = (time.perf_counter() - t0) / 2000
        print(f"rows {rows:2d} {name}: {dt*1e6:7.1f} us, {256*1536*rows/dt/1e9:6.1f} GMAC/s")
