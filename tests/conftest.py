"""Shared pytest setup.

Without CUDA, the Triton kernels run in Triton's interpreter; it must be chosen before any
kernel module is imported (the variable counts when ``@triton.jit`` decorates), hence here,
before any kvtier import.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
