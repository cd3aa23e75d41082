"""Every attention implementation against the dense reference and the NumPy one, values and
gradients; memory of the blocked one; whole models with each."""
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import numpy_ref as ref
from conftest import ROOT, TINY_OVERRIDES
from latent_jax import build_model, load_config
from latent_jax.config import ConfigError
from latent_jax.ops import attention as A
from latent_jax.ops.transformer import NO_WINDOW

rng = np.random.default_rng(0)


def rows(t, bounds):
  """Segment ids and positions of rows: row r holds documents [bounds[r][i], bounds[r][i+1]),
  then padding (segment 0, positions 0) from its last bound to t."""
  seg, pos = np.zeros((len(bounds), t), np.int32), np.zeros((len(bounds), t), np.int32)
  for r, row in enumerate(bounds):
    for d, (a, b) in enumerate(zip(row[:-1], row[1:])):
      seg[r, a:b], pos[r, a:b] = d + 1, np.arange(b - a)
  return seg, pos


def qkv(b, t, h, kh, d):
  return (rng.normal(size=(b, t, h, d)), rng.normal(size=(b, t, kh, d)), rng.normal(size=(b, t, kh, d)))


def value_and_grads(impl, q, k, v, seg, pos, window, block, cot):
  f = lambda q, k, v: A.attention(q, k, v, seg, pos, window, impl, block)
  out, vjp = jax.vjp(f, *(jnp.asarray(a, jnp.float32) for a in (q, k, v)))
  return (out, *vjp(jnp.asarray(cot, jnp.float32)))


# T = 45 with 16-token blocks: 3 blocks, the last padded; documents start mid-block; row 1 ends
# in padding (segment 0), row 2 is one document. Windows below and above the block size.
T_LEN, BLOCK = 45, 16
SEG, POS = rows(T_LEN, [[0, 5, 21, 30, 45], [0, 13, 38], [0, 45]])
REAL = SEG > 0  # padding queries may see other padding keys (ops/attention.py); no loss reads them


@pytest.mark.parametrize("window", [3, 20, NO_WINDOW])
def test_blocked_matches_dense_and_numpy(window):
  q, k, v = qkv(3, T_LEN, 4, 2, 8)
  cot = np.where(REAL[..., None, None], rng.normal(size=q.shape), 0)
  dense = value_and_grads("dense", q, k, v, SEG, POS, window, BLOCK, cot)
  blocked = value_and_grads("xla_blocked", q, k, v, SEG, POS, window, BLOCK, cot)
  np.testing.assert_allclose(np.asarray(blocked[0])[REAL], np.asarray(dense[0])[REAL], rtol=1e-5, atol=1e-5)
  want = ref.attention(q, k, v, POS, SEG, window)
  np.testing.assert_allclose(np.asarray(blocked[0])[REAL], want[REAL], rtol=1e-4, atol=1e-5)
  for got, exp, name in zip(blocked[1:], dense[1:], "qkv"):
    np.testing.assert_allclose(np.asarray(got), np.asarray(exp), rtol=1e-4, atol=1e-5, err_msg=f"d{name}")


def test_gradients_match_numpy_finite_differences():
  """The dense reference's gradients are JAX autodiff; check the blocked ones against float64
  central differences of the NumPy reference too, on a few entries."""
  q, k, v = qkv(1, 20, 2, 1, 4)
  seg, pos = rows(20, [[0, 7, 20]])
  cot = rng.normal(size=q.shape)
  _, dq, dk, dv = value_and_grads("xla_blocked", q, k, v, seg, pos, 5, 8, cot)
  loss = lambda q, k, v: np.sum(ref.attention(q, k, v, pos, seg, 5) * cot)
  eps = 1e-5
  for arrays, grad, i in [((q, k, v), dq, 0), ((q, k, v), dk, 1), ((q, k, v), dv, 2)]:
    for idx in [(0, 3, 0, 1), (0, 9, 0, 2), (0, 19, 0, 0)]:
      idx = idx if i == 0 else idx[:2] + (0, idx[3])
      plus, minus = [a.copy() for a in arrays], [a.copy() for a in arrays]
      plus[i][idx] += eps
      minus[i][idx] -= eps
      assert float(grad[idx]) == pytest.approx((loss(*plus) - loss(*minus)) / (2 * eps), rel=1e-3, abs=1e-4)


def test_blocked_skips_blocks_and_pads():
  """T not a multiple of the block is padded; a one-block T (auto -> dense) agrees too."""
  q, k, v = qkv(1, 7, 2, 2, 4)
  seg, pos = rows(7, [[0, 7]])
  for block in (4, 8):
    got = A.attention(*(jnp.asarray(a, jnp.float32) for a in (q, k, v)), seg, pos, 3, "xla_blocked", block)
    np.testing.assert_allclose(got, ref.attention(q, k, v, pos, seg, 3), rtol=1e-4, atol=1e-5)
  with pytest.raises(ValueError, match="must be one of"):
    A.resolve("flash", 8)


def test_auto_is_dense_for_one_block_then_the_measured_kernel():
  """Beyond one block: splash on TPU; on a GPU the kernel measured fastest for its kind and dtype
  (AUTO_GPU), xla_blocked on a GPU without figures; xla_blocked on CPU."""
  assert [A.resolve("auto", A.BLOCK, jnp.bfloat16, b, "NVIDIA H200") for b in ("cpu", "tpu", "gpu")] == ["dense"] * 3
  long = A.BLOCK + 1
  assert [A.resolve("auto", long, jnp.bfloat16, b, "NVIDIA H200") for b in ("cpu", "tpu")] == ["xla_blocked", "pallas_tpu"]
  for (kind, dtype), impl in A.AUTO_GPU.items():
    assert A.resolve("auto", long, dtype, "gpu", kind) == impl
  assert A.resolve("auto", long, jnp.bfloat16, "gpu", "Tesla T4") == "xla_blocked"
  assert A.resolve("cudnn", long, jnp.bfloat16, "cpu") == "cudnn"  # named impls are taken as they are
  assert [A.block_size(t) for t in (65, 256, 512, 8192)] == [A.MIN_BLOCK, 64, A.BLOCK, A.BLOCK]


def test_blocked_traced_window_under_scan():
  """The window comes in traced (a scan over layers, as in BlockStack) and stays differentiable."""
  q, k, v = (jnp.asarray(a, jnp.float32) for a in qkv(1, 40, 2, 1, 4))
  seg, pos = rows(40, [[0, 40]])
  windows = jnp.array([6, NO_WINDOW], jnp.int32)

  def loss(q, impl):
    def body(x, w):
      return A.attention(x, k, v, seg, pos, w, impl, 8), None
    return jnp.sum(jax.lax.scan(body, q, windows)[0] ** 2)

  for got, want in zip(jax.value_and_grad(loss)(q, "xla_blocked"), jax.value_and_grad(loss)(q, "dense")):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_blocked_memory_far_below_dense():
  """Compiled temp memory of forward + backward at T = 2048 (XLA's buffer assignment)."""
  b, t, h, kh, d = 1, 2048, 4, 2, 32
  q, k, v = jnp.zeros((b, t, h, d)), jnp.zeros((b, t, kh, d)), jnp.zeros((b, t, kh, d))
  seg, pos = jnp.ones((b, t), jnp.int32), jnp.arange(t, dtype=jnp.int32)[None]

  def temp(impl):
    loss = lambda q, k, v: jnp.sum(A.attention(q, k, v, seg, pos, NO_WINDOW, impl))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().memory_analysis().temp_size_in_bytes

  dense, blocked = temp("dense"), temp("xla_blocked")
  assert dense > 4 * h * t * t  # at least one fp32 [H, T, T] score tensor
  assert blocked < dense / 20, (blocked, dense)


def model_logits_and_grads(config, impl, batch, with_grads):
  cfg = load_config(f"{ROOT}/configs/{config}", TINY_OVERRIDES + [f"kernels.attention={impl}"])
  graphdef, state = nnx.split(build_model(cfg, nnx.Rngs(0)))
  kwargs = {"impl": "xla"} if cfg.model.name == "concept" else {}

  def loss(params):
    out = nnx.merge(graphdef, params)(batch["inputs"], batch["segment_ids"], batch["positions"], **kwargs)
    real = (batch["segment_ids"] > 0)[..., None]
    return jnp.sum(jnp.where(real, out.logits, 0) * 0.01), out.logits
  params = nnx.to_pure_dict(state)
  if not with_grads:
    return jax.jit(loss)(params)[1], {}
  (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  return logits, grads


# ConceptLM forward only: its backward doubles the compile time (~70 s under load), and the
# blocked gradients are checked op by op above and through the baseline here.
@pytest.mark.parametrize("config,with_grads", [("tiny.py", True), ("tiny_ncp.py", False)])
def test_models_agree_dense_vs_blocked(config, with_grads):
  """Whole models (TINY_OVERRIDES: window 8, every 2nd layer full) at T = 200, two blocks of
  A.BLOCK = 128 (the second padded), documents starting mid-block, a row ending in padding."""
  t = 200
  seg, pos = rows(t, [[0, 100, 150, 200], [0, 60, 170]])
  batch = {"inputs": rng.integers(0, 320, size=(2, t)).astype(np.int32), "segment_ids": seg, "positions": pos}
  dense, blocked = (model_logits_and_grads(config, impl, batch, with_grads) for impl in ("dense", "xla_blocked"))
  real = seg > 0
  np.testing.assert_allclose(np.asarray(blocked[0])[real], np.asarray(dense[0])[real], rtol=1e-4, atol=1e-5)
  for a, b in zip(jax.tree.leaves(dense[1]), jax.tree.leaves(blocked[1])):  # fp32 sums in another order
    assert np.max(np.abs(np.asarray(b) - np.asarray(a))) <= 1e-4 * np.max(np.abs(np.asarray(a)))


# step 3: positions 3 apart inside documents, as TST's positions="token" bags and ConceptLM's
# concept_positions="token" give; there the index masks are wrong under a window.
@pytest.mark.parametrize("impl,step", [("pallas_tpu", 1), ("pallas_gpu", 1), ("pallas_tpu", 3)])
def test_pallas_interpreted_matches_dense(impl, step):
  """The Pallas kernels, interpreted on CPU, under a scan over a traced window as in the model
  (pallas_gpu: its window-5 layer is xla_blocked): values and dq, dk, dv against dense. T = 150
  pads to two 128-blocks; documents start mid-block. With step 3 the windowed layer must fall
  back to xla_blocked and the full-causal one may keep the kernel."""
  t = 150
  q, k, v = (jnp.asarray(a, jnp.float32) for a in qkv(2, t, 4, 2, 8))
  seg, pos = rows(t, [[0, 60, 150], [0, 150]])
  pos = pos * step
  windows = (5, NO_WINDOW)
  assert bool(A.index_masks_exact(seg, pos, 5)) == (step == 1) and A.index_masks_exact(seg, pos, NO_WINDOW)

  def loss(q, k, v, impl):
    def body(x, w):
      return A.attention(x, k, v, seg, pos, w, impl, windows=windows), None
    return jnp.sum(jax.lax.scan(body, q, jnp.array(windows))[0] * jnp.cos(q))

  f = lambda impl: jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), static_argnums=3)(q, k, v, impl)
  for got, want in zip(jax.tree.leaves(f(impl)), jax.tree.leaves(f("dense"))):
    assert np.max(np.abs(np.asarray(got) - np.asarray(want))) <= 1e-5 * np.max(np.abs(np.asarray(want)))


def test_splash_lowers_for_tpu():
  """No TPU here; the Pallas -> Mosaic lowering runs on this host (block rules, op coverage),
  not the Mosaic compiler. Forward and backward, both window kernels, bf16. The values of these
  kernels are checked against dense interpreted (test_pallas_interpreted_matches_dense)."""
  sds = jax.ShapeDtypeStruct
  b, t, h, kh, d = 2, 256, 4, 2, 128

  def grads(q, k, v, seg, window):
    f = lambda q, k, v: A.splash_attention(q, k, v, seg, window, (64, NO_WINDOW), interpret=False).sum()
    return jax.grad(f, argnums=(0, 1, 2))(q, k, v)

  args = (sds((b, t, h, d), jnp.bfloat16), sds((b, t, kh, d), jnp.bfloat16), sds((b, t, kh, d), jnp.bfloat16),
          sds((b, t), jnp.int32), sds((), jnp.int32))
  text = jax.jit(grads).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
  assert text.count("tpu_custom_call") == 6  # per window: forward, dq and dkv kernels


def test_pallas_gpu_lowers_for_gpu():
  """No GPU here; the Pallas -> Triton lowering for CUDA runs on this host (not PTX compilation).
  The compiled kernel's values and gradients are checked against dense on a GPU, in the GPU tier
  (tests/test_gpu.py::test_attention_matches_dense)."""
  sds = jax.ShapeDtypeStruct
  b, t, h, kh, d = 2, 256, 4, 2, 64

  def grads(q, k, v, seg):
    f = lambda q, k, v: A.pallas_gpu_causal(q, k, v, seg, interpret=False).sum()
    return jax.grad(f, argnums=(0, 1, 2))(q, k, v)

  args = (sds((b, t, h, d), jnp.bfloat16), sds((b, t, kh, d), jnp.bfloat16), sds((b, t, kh, d), jnp.bfloat16),
          sds((b, t), jnp.int32))
  text = jax.jit(grads).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("xla.gpu.triton") == 3  # forward, preprocess and fused backward kernels


@pytest.mark.parametrize("window", [3, 20, NO_WINDOW])
def test_cudnn_branches_match_dense_through_the_xla_api(window):
  """cudnn's wrapper (its choice between no mask, a mask with the causal cut and a mask without,
  the window it passes, the odd-length padding) run through jax's XLA version of
  dot_product_attention on the CPU: packed rows, one-document rows, TST-like positions stepping
  by 2, positions that repeat (where only the whole mask is exact), a window not in `windows`."""
  q, k, v = (jnp.asarray(a, jnp.float32) for a in qkv(3, T_LEN, 4, 2, 8))
  one_seg, one_pos = rows(T_LEN, [[0, 45], [0, 45], [0, 30]])
  cases = {"packed": (SEG, POS), "one document": (one_seg, one_pos), "steps of 2": (SEG, 2 * POS),
           "repeats": (SEG, POS // 2)}
  for name, (seg, pos) in cases.items():
    real = seg > 0
    cot = jnp.asarray(np.where(real[..., None, None], rng.normal(size=q.shape), 0), jnp.float32)
    for windows in ((window, NO_WINDOW), (7,)):
      f = lambda impl: lambda q, k, v: (A.attention(q, k, v, seg, pos, window, "dense") if impl == "dense" else
                                        A.cudnn_attention(q, k, v, seg, pos, window, windows, "xla"))
      (want, want_vjp), (got, got_vjp) = (jax.vjp(f(impl), q, k, v) for impl in ("dense", "cudnn"))
      msg = f"{name}, windows {windows}"
      np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], rtol=1e-5, atol=1e-5, err_msg=msg)
      for g, w in zip(got_vjp(cot), want_vjp(cot)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=msg)


TENSOR_SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, ml_collections, numpy as np
    from jax.sharding import NamedSharding
    import pallas_kernels
    from latent_jax import objectives
    from latent_jax.ops import attention as A
    from latent_jax.ops.transformer import NO_WINDOW
    from latent_jax import sharding

    B, T, H, K, D = 4, 128, 4, 2, 8
    AXES = {"q": ("batch", "length", "heads", "head_dim"), "kv": ("batch", "length", "kv_heads", "head_dim")}
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((B, T, H, D), (B, T, K, D), (B, T, K, D)))
    seg = np.zeros((B, T), np.int32); pos = np.zeros((B, T), np.int32)
    for r, cuts in enumerate([[0, 60, 128], [0, 128], [0, 30, 100, 128], [0, 7, 128]]):  # packed, no padding
      for d, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        seg[r, a:b], pos[r, a:b] = d + 1, np.arange(b - a)
    mesh_of = lambda data, tensor: sharding.make_mesh(ml_collections.ConfigDict(dict(data=data, fsdp=1, tensor=tensor)))

    def loss(q, k, v, impl, constrain):
      if constrain:  # the model's activations: heads over the tensor axis
        q, k, v = (sharding.constrain(x, AXES[n]) for x, n in ((q, "q"), (k, "kv"), (v, "kv")))
      return jnp.sum(A.attention(q, k, v, seg, pos, NO_WINDOW, impl) * jnp.cos(q))

    def grads(impl, mesh=None):
      f = jax.value_and_grad(loss, argnums=(0, 1, 2))
      if mesh is None:
        return jax.jit(f, static_argnums=(3, 4))(q, k, v, impl, False)
      def g(q, k, v):
        with sharding.use_mesh(mesh):
          return f(q, k, v, impl, True)
      put = lambda x, axes: jax.device_put(x, NamedSharding(mesh, sharding.logical_spec(axes, x.shape, mesh)))
      return jax.jit(g)(put(q, AXES["q"]), put(k, AXES["kv"]), put(v, AXES["kv"]))

    want = grads("dense")
    # tensor=2 splits the 4 query and 2 KV heads; tensor=4 does not divide the KV heads: heads stay whole.
    # (Both kernels go through the same per_head_shard; one case each keeps the test short.)
    for impl, data, tensor in (("pallas_tpu", 2, 2), ("pallas_gpu", 1, 4)):
      got = grads(impl, mesh_of(data, tensor))
      for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        err = np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b)))
        assert err <= 1e-5, (impl, data, tensor, err)

    # Each device runs the kernel on its own rows and heads.
    seen = []
    def record(rows, w):
      seen.append(tuple(x.shape for x in rows))
      return rows[0]
    mesh = mesh_of(2, 2)
    with sharding.use_mesh(mesh):
      jax.jit(lambda *rows: sharding.per_head_shard(record, rows, (2, 2, 2, None, None), 5)).trace(q, k, v, seg, pos)
    assert seen == [((2, T, 2, D), (2, T, 1, D), (2, T, 1, D), (2, T), (2, T))], seen

    # Lowered for a TPU (Mosaic; no TPU needed): splash lowers with tensor=2, forward and both
    # backward kernels per window. The Pallas cross-entropy does not (what config.validate refuses).
    sds = lambda x, axes, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(
        x.shape, dtype, sharding=NamedSharding(mesh, sharding.logical_spec(axes, x.shape, mesh)))
    def splash(q, k, v):
      with sharding.use_mesh(mesh):
        out = A.attention(q, k, v, seg, pos, 5, "pallas_tpu", windows=(5, NO_WINDOW))
      return jnp.sum(out.astype(jnp.float32) ** 2)
    def cross_entropy(h, w):
      with sharding.use_mesh(mesh):
        return objectives.token_cross_entropy(h, w, jnp.zeros((B, T), jnp.int32), "pallas")[0].sum()
    with pallas_kernels.target_backend("tpu"):
      lowered = jax.jit(jax.grad(splash, argnums=(0, 1, 2))).trace(
          sds(q, AXES["q"]), sds(k, AXES["kv"]), sds(v, AXES["kv"])).lower(lowering_platforms=("tpu",))
      assert lowered.as_text().count("tpu_custom_call") == 6
      try:
        jax.jit(jax.grad(cross_entropy, argnums=(0, 1))).trace(
            sds(jnp.zeros((B, T, 128)), ("batch", "length", "act_embed")),
            sds(jnp.zeros((128, 256)), ("embed", "vocab"))).lower(lowering_platforms=("tpu",))
        raise AssertionError("the Pallas cross-entropy lowered with tensor=2: lift the refusal in config.validate")
      except NotImplementedError as e:
        assert "cannot be automatically partitioned" in str(e), e
    print("OK")
""")


def test_pallas_attention_with_tensor_parallel_heads():
  """mesh.tensor > 1 on 4 fake CPU devices: the interpreted kernels against dense (values, dq, dk,
  dv) with heads split over the tensor axis, and with KV heads that do not divide it; each device
  gets its own heads; splash lowers for TPU sharded so, the Pallas cross-entropy does not."""
  result = subprocess.run([sys.executable, "-c", TENSOR_SCRIPT], capture_output=True, text=True, timeout=900,
                          cwd=ROOT)
  assert result.returncode == 0, result.stdout + result.stderr[-5000:]
  assert "OK" in result.stdout


@pytest.mark.parametrize("impl", ["pallas", "pallas_interpret"])
def test_pallas_cross_entropy_with_tensor_parallelism_is_refused(impl):
  for tensor in ("2", "-1"):  # -1 may fill the tensor axis with every device
    with pytest.raises(ConfigError, match=rf"kernels\.impl: .* mesh\.tensor={tensor}, .* kernels\.impl='auto' .* mesh\.tensor=1"):
      load_config(f"{ROOT}/configs/tiny.py", [f"kernels.impl={impl}", "mesh.data=1", f"mesh.tensor={tensor}"])
  for ok in (["kernels.impl=auto", "mesh.tensor=2", "kernels.attention=pallas_tpu"], [f"kernels.impl={impl}"]):
    load_config(f"{ROOT}/configs/tiny.py", ok)
