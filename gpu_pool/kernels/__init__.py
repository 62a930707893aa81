"""Pool kernels: KV write, paged attention, block gather/scatter (Triton on CUDA, torch reference on CPU)."""
