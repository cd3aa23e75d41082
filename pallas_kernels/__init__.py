"""Kernels of latent_jax, each beside the plain-JAX reference it must equal.

`impl=` picks the version (see IMPLS); "auto" picks by jax.default_backend() at trace time
(or the platform of `target_backend`, for compiling ahead of time for other devices).
"""

from pallas_kernels._common import IMPLS, target_backend
from pallas_kernels.mixing import codebook_mix
from pallas_kernels.cross_entropy import fused_cross_entropy

__all__ = ["IMPLS", "codebook_mix", "fused_cross_entropy", "target_backend"]
