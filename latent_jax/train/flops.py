"""FLOPs per token (matmuls plus causal, window-aware attention) and the peak they are measured against.

Counting follows the usual convention: a multiply-add is 2 FLOPs, the backward pass costs
twice the forward, embedding gathers are free, and attention over a causal mask counts only
the keys each query can see (so a sliding window costs less than full attention).
"""
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

# Dense bf16 peak FLOP/s per device, from vendor data sheets.
KNOWN_PEAK_FLOPS = {
    "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12, "TPU v6 lite": 918e12,
    "TPU v6e": 918e12, "NVIDIA H100": 989e12, "NVIDIA H200": 989e12, "NVIDIA A100": 312e12,
    "NVIDIA B200": 2250e12, "NVIDIA GB200": 2500e12,
}


def mean_visible_keys(seq_len, window):
  """Average over query positions t of min(t+1, window): keys a causal query attends to."""
  t = np.arange(1, seq_len + 1)
  return float(np.minimum(t, window).mean())


def block_flops_per_token(m, seq_len, window, sparse=False):
  """Forward FLOPs of one transformer block for one token at training length seq_len. `sparse` (model.moe):
  the MLP's are the active experts' (top_k routed + shared, each of width expert_dim) and the router's."""
  d, h, k, hd, f = m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim
  mlp = 3 * d * f
  if sparse:
    e = m.moe
    mlp = 3 * d * e.expert_dim * (e.top_k + e.shared_experts) + d * e.num_experts
  matmul = 2 * (d * h * hd + 2 * d * k * hd + h * hd * d + mlp)
  attention = 4 * h * hd * mean_visible_keys(seq_len, window)  # q k^T and probs v
  return matmul + attention


def stack_flops_per_token(m, num_layers, seq_len):
  """Forward FLOPs per token of `num_layers` blocks under the config's window pattern (and model.moe's sparse layers)."""
  from latent_jax.config import moe_enabled
  from latent_jax.ops.moe import sparse_layers
  from latent_jax.ops.transformer import layer_windows
  windows = np.asarray(layer_windows(num_layers, m.window, m.full_attention_every))
  sparse = sparse_layers(num_layers, m.moe.every, m.moe.first_dense) if moe_enabled(m) else (False,) * num_layers
  return sum(block_flops_per_token(m, seq_len, int(w), s) for w, s in zip(windows, sparse))


def parameter_counts(abstract_params, axes, model_cfg):
  """(active, total) non-embedding parameters (the token embedding and LM head left out): of a routed
  expert's weights (logical axes ("expert", ...) and a matrix each) a token uses top_k / num_experts."""
  from latent_jax.config import moe_enabled
  share = model_cfg.moe.top_k / model_cfg.moe.num_experts if moe_enabled(model_cfg) else 1.0
  active = total = 0
  for path, axes_leaf in jax.tree_util.tree_flatten_with_path(axes, is_leaf=lambda x: isinstance(x, tuple))[0]:
    if getattr(path[0], "key", None) in ("embed", "lm_head"):
      continue
    size = int(np.prod(leaf_at(abstract_params, path).shape))
    total += size
    active += size * share if len(axes_leaf) == 3 and axes_leaf[0] == "expert" else size
  return int(round(active)), total


def leaf_at(tree, path):
  for key in path:
    tree = tree[key.key]
  return tree


def baseline_flops_per_token(m, seq_len):
  """Training FLOPs per token (forward + backward = 3x forward) of the baseline decoder."""
  forward = stack_flops_per_token(m, m.num_layers, seq_len) + 2 * m.d_model * m.vocab_size
  return 3 * forward


def residual_flops_per_position(m, num_layers, source_depths):
  """IRC (weight MLP + history mixture) and CRC (weight MLP + source mixture) of one module, per position."""
  d, h = m.d_model, m.residual_hidden
  irc = num_layers * (2 * d * h + 2 * h * (num_layers + 1) + 2 * (num_layers + 1) * d) if m.irc else 0
  crc = sum(num_layers * (2 * d * h + 2 * h * k + 2 * k * d) for k in source_depths)
  return irc + crc


def concept_forward_flops(m, seq_len):
  """Forward FLOPs per token of ConceptLM by part (NCP Table 2 / Appendix D).

  Encoder and decoder run on every token; the concept module, prediction heads, codebook
  mixture and PQ assignment run once per chunk, so they cost M/T ~ 1/k of their per-position
  FLOPs per token. The concept module's window counts concepts, like its positions.
  """
  e, c, dl, k = m.encoder_layers, m.concept_layers, m.decoder_layers, m.chunk_size
  d, s, n = m.d_model, m.num_segments, m.codebook_size
  per_concept = (seq_len // k) / seq_len
  return {
      "encoder": stack_flops_per_token(m, e, seq_len) + residual_flops_per_position(m, e, ()),
      "concept": per_concept * (stack_flops_per_token(m, c, seq_len // k)
                                + residual_flops_per_position(m, c, (e,) if m.crc_encoder_concept else ())),
      "decoder": stack_flops_per_token(m, dl, seq_len) + residual_flops_per_position(
          m, dl, [x for x, on in [(e, m.crc_encoder_decoder), (c, m.crc_concept_decoder)] if on]),
      "heads": per_concept * 2 * d * s * n,                # d -> S*N logits
      "codebook": per_concept * 2 * (2 * n * d),           # mixture (Eq. 9) + PQ distances (Eq. 4)
      "lm_head": 2 * d * m.vocab_size,
  }


def peak_flops(configured=0.0, dtype=jnp.float32):
  """Per-device peak: the configured value, else the data sheet for the device, else measured once on
  this machine and kept (kept_peak)."""
  if configured:
    return float(configured), "config"
  kind = jax.devices()[0].device_kind
  for name, value in KNOWN_PEAK_FLOPS.items():
    if kind.startswith(name):
      return value, kind
  return kept_peak(dtype)


def processor():
  """The CPU model (where /proc/cpuinfo says) and core count, or the accelerator kind."""
  if jax.default_backend() != "cpu":
    return jax.devices()[0].device_kind
  try:
    with open("/proc/cpuinfo") as f:
      name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    name = platform.processor() or platform.machine()
  return f"{name}, {os.cpu_count()} cores"


def peak_cache():
  return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "latent_jax", "peak_flops.json")


def kept_peak(dtype=jnp.float32):
  """(FLOP/s, where it comes from) of a device with no data sheet: measured the first time on this machine
  (processor, cores, backend, dtype, jax version), then read from peak_cache(), so that every run here
  divides by the same figure (measured at each start-up, it moved 2.5x between runs of one machine, and
  MFU with it). Delete the file to measure again, or set train.peak_flops."""
  path = peak_cache()
  key = f"{processor()} | {jax.default_backend()} | {jnp.dtype(dtype).name} | jax {jax.__version__}"
  try:
    with open(path) as f:
      kept = json.load(f)
  except (OSError, ValueError):
    kept = {}
  if key not in kept:
    kept[key] = measure_matmul_peak(dtype, repeats=20)
    try:
      os.makedirs(os.path.dirname(path), exist_ok=True)
      tmp = f"{path}.{os.getpid()}.tmp"
      with open(tmp, "w") as f:
        json.dump(kept, f, indent=1)
      os.replace(tmp, path)
    except OSError:  # a read-only home: measured for this run only
      return kept[key], f"measured {key} matmul (not kept: {path} is not writable)"
  return kept[key], f"{key} matmul, measured once and kept in {path}"


def measure_matmul_peak(dtype=jnp.float32, n=None, repeats=5):
  """FLOP/s of a jitted square matmul on the default device, its fastest of `repeats`: this machine's
  practical peak (the fastest run is the least disturbed by other work on the machine).

  n: 1024 on a CPU (measured at every start-up there), 8192 on an accelerator, which a smaller
  product leaves far from its peak (a 1,536 one ran an H200 at 24-55 of its 989 TFLOP/s)."""
  n = n or (1024 if jax.default_backend() == "cpu" else 8192)
  a = jnp.ones((n, n), dtype)
  matmul = jax.jit(lambda x: x @ x)
  matmul(a).block_until_ready()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a).block_until_ready()
    times.append(time.perf_counter() - start)
  return 2 * n**3 / float(np.min(times))


def aux_forward_flops(cfg, seq_len):
  """Forward FLOPs per token of the training-only heads the whole config enables, by head.

  NITP: the SwiGLU projector d -> 4d -> d (the target is a state the model computes anyway).
  MTP: W (2d -> d), one full-attention block, and the shared LM head's matmul once more.
  """
  from latent_jax.config import mtp_enabled, nitp_enabled
  from latent_jax.ops.transformer import NO_WINDOW
  m, d = cfg.model, cfg.model.d_model
  parts = {}
  if nitp_enabled(cfg) and cfg.nitp.projector:
    parts["nitp_projector"] = 2 * 3 * d * 4 * d
  if mtp_enabled(cfg):
    parts["mtp"] = 2 * 2 * d * d + block_flops_per_token(m, seq_len, NO_WINDOW) + 2 * d * m.vocab_size
  return parts


def drafter_flops_per_token(cfg, seq_len):
  """Training FLOPs of a drafter run's block drafter per data token (forward + backward = 3x forward).

  Each of `drafter.anchors` anchors a row of seq_len tokens runs W + K positions through the
  drafter's blocks (full attention), W context states through its projection, and K block
  positions through the LM head."""
  from latent_jax.ops.transformer import NO_WINDOW
  m, dr = cfg.model, cfg.drafter
  n = dr.context + dr.block_size
  per_anchor = (dr.num_layers * n * block_flops_per_token(m, n, NO_WINDOW) + dr.context * 2 * m.d_model ** 2
                + dr.block_size * 2 * m.d_model * m.vocab_size)
  return 3 * per_anchor * dr.anchors / seq_len


def flops_per_token(cfg, seq_len):
  """Training FLOPs per token: of the model alone (pass `cfg.model`), or, given the whole config,
  with the NITP / MTP heads it enables (as `build_model` builds them). A drafter run (a `drafter`
  section) trains the drafter alone: the frozen model costs one forward pass, without its LM head
  unless the drafter learns the model's own greedy tokens (drafter.labels='target')."""
  whole = cfg if "model" in cfg else None
  m = whole.model if whole else cfg
  model = 3 * sum(concept_forward_flops(m, seq_len).values()) if m.name == "concept" else \
      baseline_flops_per_token(m, seq_len)
  if whole and "drafter" in whole:
    head = 0 if whole.drafter.labels == "target" else 2 * m.d_model * m.vocab_size
    return model / 3 - head + drafter_flops_per_token(whole, seq_len)
  return model + (3 * sum(aux_forward_flops(whole, seq_len).values()) if whole else 0)
