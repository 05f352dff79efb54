"""Milliseconds for the products of 28 layers of the default target's shape (every matrix distinct), per kernel build
named on the command line (lib_NAME.so here) and tokens per pass; built by prefetch_variants.sh."""
import ctypes, sys, time, torch
HIDDEN, INTER, KV, L = 1536, 8960, 256, 28
torch.manual_seed(0)
shapes = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER)]
layers = [[torch.randn(n, k).bfloat16() for n, k in shapes] for _ in range(L)]
names = sys.argv[1].split(",")
libs = {n: ctypes.CDLL(f"./lib_{n}.so") for n in names}
for lib in libs.values():
    lib.bf16_native_linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
def run(lib, rows):
    for layer in layers:
        for w in layer:
            x = xs[(rows, w.shape[1])]
            out = outs[(rows, w.shape[0])]
            lib.bf16_native_linear(x.data_ptr(), rows, w.shape[1], w.data_ptr(), w.shape[0], out.data_ptr(), 2)
res = {}
for rows in (1, 4, 8):
    xs = {(rows, k): torch.randn(rows, k).bfloat16() for k in (HIDDEN, INTER)}
    outs = {(rows, n): torch.empty(rows, n) for n in (HIDDEN, KV, INTER)}
    best = {n: 1e9 for n in names}
    for rep in range(4):
        for n in names:
            t = time.perf_counter(); run(libs[n], rows); best[n] = min(best[n], time.perf_counter() - t)
    print(rows, "  ".join(f"{n} {1000*b:6.1f}ms" for n, b in best.items()), flush=True)
