#!/usr/bin/env bash
# Build the bf16 kernel with other prefetch hints and distances and time them the way a model uses them (28 layers
# of distinct weights, product_timings.py). Run from this folder, the repo's .venv active, on a quiet machine.
set -euo pipefail
work=$(mktemp -d)
src=../../src/viasd/kernels
cp "$src/bf16_native.c" "$src/viasd_kernels.h" product_timings.py "$work"
cd "$work"
sed -i 's/^#define PREFETCH 8192/#ifndef PREFETCH\n#define PREFETCH 8192\n#endif\n#ifndef HINT\n#define HINT _MM_HINT_T1\n#endif/; s/_MM_HINT_T1);/HINT);/' bf16_native.c
for variant in "t0_8k:-DHINT=_MM_HINT_T0" "t0_4k:-DHINT=_MM_HINT_T0 -DPREFETCH=4096" "nta_8k:-DHINT=_MM_HINT_NTA" \
    "t1_2k:-DPREFETCH=2048" "t1_4k:-DPREFETCH=4096" "t1_8k:" "t1_12k:-DPREFETCH=12288" "t1_16k:-DPREFETCH=16384"; do
    name=${variant%%:*}
    gcc -O3 -shared -fPIC -fopenmp -ffp-contract=off -march=native ${variant#*:} -o "lib_$name.so" bf16_native.c
done
python product_timings.py t0_8k,t1_8k,t1_16k,nta_8k,t0_4k
python product_timings.py t1_8k,t1_4k,t1_12k,t1_2k,t0_8k
