"""The one build step pyproject.toml cannot declare stably: the fused host copy + xxh3
kernels (gpu_pool/kernels/host_native.py), the per-layer checksums without the GIL
(kvtier/layer_sums.py) and the KV codecs' host kernels (used by kvtier/kv_codecs.py). Optional: where no C compiler is found the install goes on and the
host data path uses its numpy copies, the codecs their torch reference."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvtier.gpu_pool.kernels._host_copy",
            sources=["gpu_pool/kernels/native/host_copy.c"],
            include_dirs=["gpu_pool/kernels/native"],
            depends=["gpu_pool/kernels/native/xxhash.h"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "kvtier._layer_sums",
            sources=["gpu_pool/kernels/native/layer_sums.c"],
            include_dirs=["gpu_pool/kernels/native"],
            depends=["gpu_pool/kernels/native/xxhash.h"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "kvtier._kv_codec",
            sources=["gpu_pool/kernels/native/kv_codec.c"],
            include_dirs=["gpu_pool/kernels/native"],
            depends=["gpu_pool/kernels/native/xxhash.h"],
            # no FP traps or errno: branch-free selects and inlined math (same results)
            extra_compile_args=["-O3", "-fno-trapping-math", "-fno-math-errno"],
            optional=True,
        ),
    ]
)
