"""The one build step pyproject.toml cannot declare stably: the fused host copy + xxh3
kernels (gpu_pool/kernels/host_native.py). Optional: where no C compiler is found the
install goes on and the host data path uses its numpy copies."""

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
        )
    ]
)
