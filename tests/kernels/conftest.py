"""Kernel tests: Triton kernels run in the CPU interpreter when no CUDA device is present."""

from __future__ import annotations

import os

import torch

# NOTE: Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when a kernel module is
# first imported. loraplex imports its Triton modules lazily, so setting it here, before any
# kernel test runs, is early enough. On a CUDA machine the kernels compile for the GPU instead.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
