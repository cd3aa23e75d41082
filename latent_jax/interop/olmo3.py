"""OLMo-3 as Hugging Face transformers holds it (`Olmo3ForCausalLM`) and the baseline: the parameter
name map and the config translation, both ways. Pure functions of dicts; no files, no torch.

The baseline is OLMo-3's architecture (post-norm blocks, RMSNorm over the whole q and k projections,
SwiGLU, GQA, sliding-window layers with a full-attention one every n-th, plain RoPE on the sliding
layers and optionally YaRN on the full ones), so the weights map one to one. Ours are stacked over
layers ([L, ...]) and our matrices are [d_in, d_out]; a torch Linear weight is [d_out, d_in].
"""
import math

ARCHITECTURE, MODEL_TYPE = "Olmo3ForCausalLM", "olmo3"
SLIDING, FULL = "sliding_attention", "full_attention"

# our parameter path -> (its Hugging Face name, "{}" standing for the layer of a stacked one; transposed)
NAMES = {
    "embed": ("model.embed_tokens.weight", False),
    "blocks/blocks/attn/q": ("model.layers.{}.self_attn.q_proj.weight", True),
    "blocks/blocks/attn/k": ("model.layers.{}.self_attn.k_proj.weight", True),
    "blocks/blocks/attn/v": ("model.layers.{}.self_attn.v_proj.weight", True),
    "blocks/blocks/attn/o": ("model.layers.{}.self_attn.o_proj.weight", True),
    "blocks/blocks/attn/q_norm/scale": ("model.layers.{}.self_attn.q_norm.weight", False),
    "blocks/blocks/attn/k_norm/scale": ("model.layers.{}.self_attn.k_norm.weight", False),
    "blocks/blocks/attn_norm/scale": ("model.layers.{}.post_attention_layernorm.weight", False),
    "blocks/blocks/mlp/gate": ("model.layers.{}.mlp.gate_proj.weight", True),
    "blocks/blocks/mlp/up": ("model.layers.{}.mlp.up_proj.weight", True),
    "blocks/blocks/mlp/down": ("model.layers.{}.mlp.down_proj.weight", True),
    "blocks/blocks/mlp_norm/scale": ("model.layers.{}.post_feedforward_layernorm.weight", False),
    "final_norm/scale": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
}

# Olmo3Config's defaults for the fields a config.json may leave out.
DEFAULTS = {"hidden_act": "silu", "attention_bias": False, "rms_norm_eps": 1e-5, "rope_theta": 500_000.0,
            "sliding_window": 4096, "tie_word_embeddings": False}
YARN_KEYS = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
             "beta_slow", "attention_factor", "truncate"}


def tensors(shapes):
  """[(Hugging Face name, our path, layer or None, transposed, Hugging Face shape)] in Hugging Face's
  order (embeddings, layer by layer, final norm, head), from {our path: shape} of the model's params."""
  out, layers = [], shapes["blocks/blocks/attn/q"][0]
  hf_shape = lambda shape, transposed: tuple(reversed(shape)) if transposed else tuple(shape)
  stacked = [p for p in NAMES if p.startswith("blocks/")]
  out.append((NAMES["embed"][0], "embed", None, False, tuple(shapes["embed"])))
  for layer in range(layers):
    for path in stacked:
      name, transposed = NAMES[path]
      out.append((name.format(layer), path, layer, transposed, hf_shape(shapes[path][1:], transposed)))
  for path in ("final_norm/scale", "lm_head"):
    if path in shapes:  # no lm_head when the embeddings are tied
      out.append((NAMES[path][0], path, None, NAMES[path][1], hf_shape(shapes[path], NAMES[path][1])))
  return out


def layer_pattern(layer_types, sliding_window, where):
  """(model.window, model.full_attention_every) of a config.json's `layer_types`: layer i (from 1) is
  full-attention iff i is a multiple of the period; an error naming the pattern when it is not."""
  unknown = sorted(set(layer_types) - {SLIDING, FULL})
  if unknown:
    raise ValueError(f"{where}: layer_types holds {unknown}; OLMo-3 layers are {SLIDING!r} or {FULL!r}.")
  full = [t == FULL for t in layer_types]
  if all(full):
    return 0, 1
  if not isinstance(sliding_window, int) or sliding_window < 1:
    raise ValueError(f"{where}: sliding_window={sliding_window!r} with {SLIDING!r} layers; it must be a positive "
                     "number of tokens.")
  for every in range(2, len(full) + 2):  # len + 1: no full layer at all
    if full == [(i + 1) % every == 0 for i in range(len(full))]:
      return sliding_window, every
  pattern = "".join("F" if f else "S" for f in full)
  raise ValueError(f"{where}: layer_types {pattern} (S sliding, F full) is not 'every n-th layer full', the only "
                   "pattern model.window + model.full_attention_every express; this checkpoint cannot convert.")


def rope_fields(hf, where):
  """model.rope_base, .rope_scaling and .yarn_* of a config.json: the released files' `rope_theta` +
  `rope_scaling` (for the full-attention layers) or transformers 5's per-layer-type `rope_parameters`."""
  params = hf.get("rope_parameters")
  if isinstance(params, dict) and FULL in params:
    full, sliding = dict(params[FULL] or {}), dict(params.get(SLIDING) or {})
  elif isinstance(params, dict):  # one set for every layer type
    full, sliding = dict(params), dict(params)
  else:
    theta = hf.get("rope_theta", DEFAULTS["rope_theta"])
    full, sliding = {"rope_theta": theta, **(hf.get("rope_scaling") or {})}, {"rope_theta": theta}
  kind = lambda p: p.get("rope_type", p.get("type", "default"))
  theta = full.get("rope_theta", DEFAULTS["rope_theta"])
  if kind(sliding) != "default" or sliding.get("rope_theta", theta) != theta:
    raise ValueError(f"{where}: the sliding-window layers' RoPE is {sliding}; latent_jax gives them plain RoPE "
                     f"with the full-attention layers' base ({theta}).")
  if kind(full) == "default":
    return {"rope_base": float(theta), "rope_scaling": "none"}
  if kind(full) != "yarn":
    raise ValueError(f"{where}: rope_type {kind(full)!r} on the full-attention layers; latent_jax has 'default' "
                     "(plain RoPE) and 'yarn'.")
  extra = sorted(k for k in set(full) - YARN_KEYS if full[k] is not None)
  if extra or full.get("truncate", True) is not True:
    raise ValueError(f"{where}: YaRN with {extra or 'truncate=false'}; latent_jax's YaRN has factor, "
                     "original_max_position_embeddings, beta_fast, beta_slow and attention_factor only.")
  factor = float(full["factor"])
  return {"rope_base": float(theta), "rope_scaling": "yarn", "yarn_factor": factor,
          "yarn_original_context": int(full["original_max_position_embeddings"]),
          "yarn_beta_fast": float(full.get("beta_fast") or 32.0), "yarn_beta_slow": float(full.get("beta_slow") or 1.0),
          "yarn_attention_factor": float(full.get("attention_factor") or 0.0)}


def model_fields(hf, where):
  """The `model` fields of a latent_jax config from a Hugging Face config.json (a dict); a one-line
  error naming what differs when the checkpoint is not an OLMo-3 the baseline can express."""
  if hf.get("model_type") != MODEL_TYPE or ARCHITECTURE not in hf.get("architectures", [ARCHITECTURE]):
    raise ValueError(f"{where}: model_type {hf.get('model_type')!r} ({', '.join(hf.get('architectures') or [])}) "
                     f"is not OLMo-3 ({MODEL_TYPE!r}, {ARCHITECTURE}); only OLMo-3 checkpoints convert.")
  missing = [f for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
             if f not in hf]
  if missing:
    raise ValueError(f"{where}: no {', '.join(missing)}; the file is not a whole OLMo-3 config.json.")
  get = lambda f: hf.get(f, DEFAULTS.get(f))
  if get("hidden_act") != "silu" or get("attention_bias"):
    raise ValueError(f"{where}: hidden_act={get('hidden_act')!r}, attention_bias={get('attention_bias')}; the "
                     "baseline has SwiGLU ('silu') and no attention biases.")
  layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
  types = hf.get("layer_types") or [FULL if (i + 1) % 4 == 0 else SLIDING for i in range(layers)]
  if len(types) != layers:
    raise ValueError(f"{where}: {len(types)} layer_types for num_hidden_layers={layers}.")
  window, every = layer_pattern(types, get("sliding_window"), where)
  return {"name": "baseline", "vocab_size": hf["vocab_size"], "d_model": hf["hidden_size"], "num_layers": layers,
          "num_heads": heads, "num_kv_heads": hf.get("num_key_value_heads") or heads,
          "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads, "mlp_dim": hf["intermediate_size"],
          "norm_eps": float(get("rms_norm_eps")), "qk_norm": "layer", "block_order": "post", "window": window,
          "full_attention_every": every, "tie_embeddings": bool(get("tie_word_embeddings")),
          **rope_fields(hf, where)}


def check_expressible(m, where):
  """An error naming the field when the model section `m` is not an OLMo-3 (ours -> Hugging Face)."""
  wants = {"name": "baseline", "qk_norm": "layer", "block_order": "post"}
  for field, value in wants.items():
    if m[field] != value:
      raise ValueError(f"{where}: model.{field}={m[field]!r}; OLMo-3 is model.{field}={value!r}, so only such "
                       "baselines convert to Hugging Face.")


def hf_config(m, eos_id, bos_id, pad_id, dtype, seq_len):
  """config.json of Olmo3ForCausalLM for the model section `m`, in the released files' form (rope_theta
  and rope_scaling, which transformers applies to the full-attention layers only)."""
  window_of = lambda i: m.window > 0 and m.full_attention_every > 1 and (i + 1) % m.full_attention_every != 0
  layer_types = [SLIDING if window_of(i) else FULL for i in range(m.num_layers)]
  yarn = m.get("rope_scaling", "none") == "yarn"
  scaling = None
  if yarn:
    scaling = {"rope_type": "yarn", "factor": m.yarn_factor, "original_max_position_embeddings": m.yarn_original_context,
               "beta_fast": m.yarn_beta_fast, "beta_slow": m.yarn_beta_slow,
               "attention_factor": m.yarn_attention_factor or 0.1 * math.log(m.yarn_factor) + 1.0}
  return {
      "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "vocab_size": m.vocab_size,
      "hidden_size": m.d_model, "intermediate_size": m.mlp_dim, "num_hidden_layers": m.num_layers,
      "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads, "head_dim": m.head_dim,
      "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "rms_norm_eps": m.norm_eps,
      "rope_theta": m.rope_base, "rope_scaling": scaling, "layer_types": layer_types,
      "sliding_window": m.window if SLIDING in layer_types else None,
      # No absolute positions: the longest context the model is meant for (YaRN's stretch, or the training's).
      "max_position_embeddings": int(m.yarn_factor * m.yarn_original_context) if yarn else seq_len,
      "tie_word_embeddings": bool(m.tie_embeddings), "initializer_range": m.init_std, "use_cache": True,
      "eos_token_id": eos_id, "pad_token_id": pad_id, "bos_token_id": bos_id if bos_id >= 0 else None,
      "torch_dtype": dtype,
  }
