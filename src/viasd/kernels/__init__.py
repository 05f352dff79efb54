"""viasd's C kernels: their sources, how they are built and loaded (`build`), and their Python bindings, one
module per kernel, each with the torch reference it is checked against when loaded and that runs where it
cannot (`w4a8`, `w6a8`, `w8a8`, `bf16`, `bf16_native`, `attention`, `fused_layers`). `VIASD_KERNELS` (`switch`)
turns them off. `packed_attention` is torch's attention of short passes with each group's queries stacked."""
