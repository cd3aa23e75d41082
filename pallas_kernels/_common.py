"""Shared pieces of the kernels: the impl names, the trace-time choice, padding."""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as pl_triton

# Every public kernel takes `impl=` from this list.
#   naive             materialise everything; the plain-JAX reference the others must equal
#   xla               chunked plain JAX with a hand-written VJP; the CPU default
#   pallas            the Pallas kernel, compiled on GPU/TPU (interpreted on CPU, the only
#                     way it runs there)
#   pallas_interpret  the Pallas kernel in interpret mode on any backend (tests, debugging)
#   auto              the fastest measured on this backend (AUTO), "xla" where nothing was
IMPLS = ("auto", "naive", "xla", "pallas", "pallas_interpret")

# auto's choice by (backend, kernel), from the measurements in docs/kernels.md. A Pallas kernel is
# the default only where it was measured to win: nowhere yet. On an H200 (bf16) the fused
# cross-entropy kernel took 4.0x naive's time at 16384 x 768 x 50,304 and 6.5x at 8192 x 2048 x
# 200,064, against xla's 0.86x and 1.25x; codebook mixing 1.5x naive's. TPU: not measured.
AUTO = {("gpu", "codebook_mix"): "naive"}

# fp32 inputs must not silently drop to TF32 / bf16 passes on GPU/TPU: the kernels promise
# fp32 logits. On CPU this costs nothing; for bf16 inputs it changes nothing.
PRECISION = lax.Precision.HIGHEST

# A finite "minus infinity" for masked logits: exp() of it underflows to 0 like -inf, but
# 0 * MASK is 0 rather than NaN, so masked columns can go through weighted sums unguarded.
MASK = -0.7 * float(jnp.finfo(jnp.float32).max)


_TARGET = contextvars.ContextVar("target_backend", default=None)


@contextlib.contextmanager
def target_backend(platform: str):
  """Trace for `platform` ("cpu", "gpu", "tpu") instead of this host's backend: what "auto"
  picks and how kernels compile, for a program compiled ahead of time for devices this host
  does not have (latent_jax.plan)."""
  token = _TARGET.set(platform)
  try:
    yield
  finally:
    _TARGET.reset(token)


def backend() -> str:
  """The backend kernels are traced for: target_backend's, else jax.default_backend()."""
  return _TARGET.get() or jax.default_backend()


def device_kind() -> str:
  """The kind of device kernels are traced for ("NVIDIA H200", ...); "" when tracing for another
  platform than this host's (target_backend), whose devices this host cannot name."""
  return jax.devices()[0].device_kind if backend() == jax.default_backend() else ""


def resolve_impl(impl: str, kernel: str) -> tuple[str, bool]:
  """Map a user-facing impl name to (family, interpret) at trace time; "auto" takes AUTO's entry
  for this backend and `kernel` ("cross_entropy", "codebook_mix"), else "xla"."""
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  backend_ = backend()
  if impl == "auto":
    impl = AUTO.get((backend_, kernel), "xla")
  if impl == "pallas_interpret":
    return "pallas", True
  if impl == "pallas":
    # A Pallas kernel cannot be compiled for CPU; interpreting is the only way to run it.
    return "pallas", backend_ == "cpu"
  return impl, False


def compiler_params(interpret: bool):
  """Triton on GPU: the kernels are written for it (grid over owned blocks, reduction
  loops inside, whole operands sliced with pl.ds). jax's GPU default is now Mosaic GPU,
  which would stage whole operands in shared memory. Backend defaults elsewhere."""
  if interpret or backend() != "gpu":
    return None
  return pl_triton.CompilerParams(num_warps=4, num_stages=2)


def round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def next_pow2(x: int) -> int:
  return 1 << max(0, (x - 1).bit_length())


def pad_to(x: jax.Array, shape: tuple[int, ...], value=0) -> jax.Array:
  """Pad each axis of `x` at its end up to `shape` (no-op when already that shape)."""
  widths = [(0, t - s) for s, t in zip(x.shape, shape)]
  if all(w == (0, 0) for w in widths):
    return x
  return jnp.pad(x, widths, constant_values=value)


def matmul(a: jax.Array, b: jax.Array, contract: tuple[int, int] = (1, 0)) -> jax.Array:
  """2-D a @ b contracting a's axis contract[0] with b's contract[1], accumulated in fp32."""
  dims = (((contract[0],), (contract[1],)), ((), ()))
  # HIGHEST only for fp32 operands: bf16 has nothing to lose, and Mosaic (TPU) refuses fp32
  # contract precision on bf16 operands.
  precision = PRECISION if jnp.float32 in (a.dtype, b.dtype) else None
  return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)
