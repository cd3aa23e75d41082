"""OLMo-3 as Hugging Face transformers holds it (`Olmo3ForCausalLM`) and the baseline: the parameter
name map and the config translation, both ways. Pure functions of dicts; no files, no torch.

Mixture of experts (model.moe, docs/moe.md): FlexOlmo (`FlexOlmoForCausalLM`: OLMo-3's post-norm blocks
and layer QK-norm, full attention, every MLP an OLMoE sparse MLP) and OLMoE (`OlmoeForCausalLM`: the same
with pre-norm blocks, model.block_order="pre") map onto the baseline's all-sparse stack: the router
`mlp.gate.weight` [E, d] and each expert's `mlp.experts.{e}.{gate,up,down}_proj.weight` (the files'
form, which save_pretrained writes and transformers 5 fuses into gate_up_proj [E, 2f, d] on loading).
Both route as ours: softmax over all experts, the top k, renormalised with norm_topk_prob.

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

# The sparse stack (every layer sparse) of FlexOlmo and OLMoE: "{}" the layer, then the expert for an expert's matrix.
SPARSE = "blocks/sparse_blocks/"
MOE_NAMES = {
    **{SPARSE + p[len("blocks/blocks/"):]: v for p, v in NAMES.items() if p.startswith("blocks/blocks/attn/")},
    SPARSE + "mlp/router": ("model.layers.{}.mlp.gate.weight", True),
    SPARSE + "mlp/gate": ("model.layers.{}.mlp.experts.{}.gate_proj.weight", True),
    SPARSE + "mlp/up": ("model.layers.{}.mlp.experts.{}.up_proj.weight", True),
    SPARSE + "mlp/down": ("model.layers.{}.mlp.experts.{}.down_proj.weight", True),
}
# block norms by model.block_order: post (OLMo-3, FlexOlmo) norms the sublayer's output, pre (OLMoE) its input
NORMS = {"post": ("model.layers.{}.post_attention_layernorm.weight", "model.layers.{}.post_feedforward_layernorm.weight"),
         "pre": ("model.layers.{}.input_layernorm.weight", "model.layers.{}.post_attention_layernorm.weight")}
# model_type -> (architecture, name, model.block_order, config.json defaults beyond DEFAULTS); olmo3 first
FAMILIES = {MODEL_TYPE: (ARCHITECTURE, "OLMo-3", "post", {}),
            "flex_olmo": ("FlexOlmoForCausalLM", "FlexOlmo", "post", {"rms_norm_eps": 1e-6}),
            "olmoe": ("OlmoeForCausalLM", "OLMoE", "pre", {"rope_theta": 10_000.0})}
SUPPORTED = ", ".join(f"{name} ({t!r}, {arch})" for t, (arch, name, _, _) in FAMILIES.items())
# config.json fields of other MoE variants (Qwen-MoE, DeepSeek, Mixtral ...) that a FlexOlmo or OLMoE has not
MOE_EXTRAS = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts", "decoder_sparse_step",
              "mlp_only_layers", "first_k_dense_replace", "moe_layer_freq", "scoring_func", "topk_method",
              "n_group", "routed_scaling_factor", "sliding_window", "layer_types", "clip_qkv")

# Olmo3Config's defaults for the fields a config.json may leave out.
DEFAULTS = {"hidden_act": "silu", "attention_bias": False, "rms_norm_eps": 1e-5, "rope_theta": 500_000.0,
            "sliding_window": 4096, "tie_word_embeddings": False}
YARN_KEYS = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
             "beta_slow", "attention_factor", "truncate"}


def names(m):
  """The name map of the model section `m`: NAMES for a dense baseline; with model.moe, the sparse stack's
  (FlexOlmo's or OLMoE's, their block norms by model.block_order)."""
  if not (m.get("moe") and m.moe.enabled):
    return NAMES
  attn, mlp = NORMS[m.block_order]
  return {"embed": NAMES["embed"], **MOE_NAMES, SPARSE + "attn_norm/scale": (attn, False),
          SPARSE + "mlp_norm/scale": (mlp, False), "final_norm/scale": NAMES["final_norm/scale"],
          "lm_head": NAMES["lm_head"]}


def tensors(shapes, names=NAMES):
  """[(Hugging Face name, our path, index or None, transposed, Hugging Face shape)] in Hugging Face's
  order (embeddings, layer by layer, final norm, head), from {our path: shape} of the model's params;
  the index is the layer of a stacked parameter, or (layer, expert) of an expert's matrix."""
  stacked = [p for p in names if p.startswith("blocks/")]
  out, layers = [], shapes[stacked[0]][0]
  hf_shape = lambda shape, transposed: tuple(reversed(shape)) if transposed else tuple(shape)
  out.append((names["embed"][0], "embed", None, False, tuple(shapes["embed"])))
  for layer in range(layers):
    for path in stacked:
      name, transposed = names[path]
      if name.count("{}") == 2:  # one tensor per expert
        for e in range(shapes[path][1]):
          out.append((name.format(layer, e), path, (layer, e), transposed, hf_shape(shapes[path][2:], transposed)))
      else:
        out.append((name.format(layer), path, layer, transposed, hf_shape(shapes[path][1:], transposed)))
  for path in ("final_norm/scale", "lm_head"):
    if path in shapes:  # no lm_head when the embeddings are tied
      out.append((names[path][0], path, None, names[path][1], hf_shape(shapes[path], names[path][1])))
  return out


def family(hf):
  """The name (OLMo-3, FlexOlmo, OLMoE) of a config.json's model_type."""
  return FAMILIES.get(hf.get("model_type"), (None, "OLMo-3"))[1]


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


def rope_fields(hf, where, theta_default=DEFAULTS["rope_theta"], sliding_layers=True):
  """model.rope_base, .rope_scaling and .yarn_* of a config.json: the released files' `rope_theta` +
  `rope_scaling` (for the full-attention layers) or transformers 5's per-layer-type `rope_parameters`.
  Without sliding layers (FlexOlmo, OLMoE) one set serves every layer."""
  params = hf.get("rope_parameters")
  if isinstance(params, dict) and FULL in params:
    full, sliding = dict(params[FULL] or {}), dict(params.get(SLIDING) or {})
  elif isinstance(params, dict):  # one set for every layer type
    full, sliding = dict(params), dict(params)
  else:
    theta = hf.get("rope_theta", theta_default)
    full, sliding = {"rope_theta": theta, **(hf.get("rope_scaling") or {})}, {"rope_theta": theta}
  kind = lambda p: p.get("rope_type", p.get("type", "default"))
  theta = full.get("rope_theta", theta_default)
  if sliding_layers and (kind(sliding) != "default" or sliding.get("rope_theta", theta) != theta):
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
  """The `model` fields of a latent_jax config from a Hugging Face config.json (a dict), `moe` a dict of
  model.moe fields; a one-line error naming what differs when the checkpoint is not an OLMo-3, FlexOlmo or
  OLMoE the baseline can express."""
  kind = hf.get("model_type")
  architecture, name, order, defaults = FAMILIES.get(kind, (None, None, None, None))
  if "num_local_experts" in hf and "num_experts" not in hf:  # FlexOlmoConfig's other name for it
    hf = {**hf, "num_experts": hf["num_local_experts"]}
  if architecture is None or architecture not in hf.get("architectures", [architecture]):
    raise ValueError(f"{where}: model_type {kind!r} ({', '.join(hf.get('architectures') or [])}) is not OLMo-3 "
                     f"and not a mixture of experts latent_jax reads; {SUPPORTED} checkpoints convert.")
  moe = kind != MODEL_TYPE
  required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
  missing = [f for f in required + (("num_experts", "num_experts_per_tok") if moe else ()) if f not in hf]
  if missing:
    raise ValueError(f"{where}: no {', '.join(missing)}; the file is not a whole {name} config.json.")
  get = lambda f: hf.get(f, defaults.get(f, DEFAULTS.get(f)))
  if get("hidden_act") != "silu" or get("attention_bias"):
    raise ValueError(f"{where}: hidden_act={get('hidden_act')!r}, attention_bias={get('attention_bias')}; the "
                     "baseline has SwiGLU ('silu') and no attention biases.")
  if moe:
    return moe_fields(hf, where, name, order, get)
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


def moe_fields(hf, where, name, order, get):
  """model fields (and `moe`) of a FlexOlmo or OLMoE config.json: every layer sparse, full attention."""
  extra = [f for f in MOE_EXTRAS if hf.get(f) not in (None, False, 0, [])]
  if extra:
    raise ValueError(f"{where}: {name} with {extra[0]}={hf[extra[0]]!r}; latent_jax reads {name} with a softmax "
                     "router over routed experts in every layer, no shared experts, full attention and no QKV "
                     f"clipping ({SUPPORTED}).")
  heads, d = hf["num_attention_heads"], hf["hidden_size"]
  head_dim = hf.get("head_dim") or d // heads
  if name == "OLMoE" and head_dim * heads != d:
    raise ValueError(f"{where}: head_dim={head_dim} with {heads} heads is not hidden_size={d}; OLMoE's q_norm is "
                     "over hidden_size, so its heads must fill it.")
  experts, k = hf["num_experts"], hf["num_experts_per_tok"]
  if not (isinstance(experts, int) and isinstance(k, int) and 0 < k <= experts):
    raise ValueError(f"{where}: num_experts_per_tok={k!r} of num_experts={experts!r}; it must be 1..num_experts.")
  return {"name": "baseline", "vocab_size": hf["vocab_size"], "d_model": d, "num_layers": hf["num_hidden_layers"],
          "num_heads": heads, "num_kv_heads": hf.get("num_key_value_heads") or heads, "head_dim": head_dim,
          "mlp_dim": hf["intermediate_size"], "norm_eps": float(get("rms_norm_eps")), "qk_norm": "layer",
          "block_order": order, "window": 0, "full_attention_every": 1, "tie_embeddings": bool(get("tie_word_embeddings")),
          **rope_fields(hf, where, get("rope_theta"), sliding_layers=False),
          "moe": {"enabled": True, "num_experts": experts, "top_k": k, "expert_dim": hf["intermediate_size"],
                  "shared_experts": 0, "every": 1, "first_dense": 0, "router": "softmax",
                  "norm_topk_prob": bool(hf.get("norm_topk_prob", False)), "capacity_factor": 0.0,
                  "lb_loss_weight": float(hf.get("router_aux_loss_coef", 0.01))}}


def check_expressible(m, where):
  """An error naming the field when the model section `m` is not an OLMo-3, or with model.moe a FlexOlmo
  (post-norm) or OLMoE (pre-norm) (ours -> Hugging Face)."""
  moe = bool(m.get("moe") and m.moe.enabled)
  if not moe:
    wants = {"name": "baseline", "qk_norm": "layer", "block_order": "post"}
    for field, value in wants.items():
      if m[field] != value:
        raise ValueError(f"{where}: model.{field}={m[field]!r}; OLMo-3 is model.{field}={value!r}, so only such "
                         "baselines convert to Hugging Face.")
    return
  supported = ("a mixture of experts converts as FlexOlmo (model.block_order=post) or OLMoE (pre): a baseline "
               "with model.qk_norm=layer, full attention, every layer sparse, a softmax router, no shared "
               "experts, dropless")
  e, head_dim = m.moe, m.head_dim
  wants = [("model.name", m.name, "baseline"), ("model.qk_norm", m.qk_norm, "layer"),
           ("model.moe.router", e.router, "softmax"), ("model.moe.shared_experts", e.shared_experts, 0),
           ("model.moe.every", e.every, 1), ("model.moe.first_dense", e.first_dense, 0),
           ("model.moe.capacity_factor", e.capacity_factor, 0.0)]
  if m.window > 0 and m.full_attention_every != 1:
    wants.append(("model.window", m.window, 0))
  if m.block_order == "pre" and head_dim * m.num_heads != m.d_model:
    wants.append(("model.head_dim", head_dim, m.d_model // m.num_heads))
  for field, value, want in wants:
    if value != want:
      raise ValueError(f"{where}: {field}={value!r}, which Hugging Face's MoE models cannot express (set {field}="
                       f"{want!r}); {supported}.")


def hf_config(m, eos_id, bos_id, pad_id, dtype, seq_len):
  """config.json of Olmo3ForCausalLM for the model section `m`, in the released files' form (rope_theta
  and rope_scaling, which transformers applies to the full-attention layers only); with model.moe,
  FlexOlmoForCausalLM's (post-norm) or OlmoeForCausalLM's (pre-norm)."""
  if m.get("moe") and m.moe.enabled:
    return moe_config(m, eos_id, bos_id, pad_id, dtype, seq_len)
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


def moe_config(m, eos_id, bos_id, pad_id, dtype, seq_len):
  """config.json of FlexOlmoForCausalLM (model.block_order=post) or OlmoeForCausalLM (pre), transformers 5's
  form (rope_parameters, one set for every layer: all attend fully)."""
  kind = "flex_olmo" if m.block_order == "post" else "olmoe"
  yarn = m.get("rope_scaling", "none") == "yarn"
  rope = {"rope_type": "default", "rope_theta": m.rope_base}
  if yarn:
    rope.update(rope_type="yarn", factor=m.yarn_factor, original_max_position_embeddings=m.yarn_original_context,
                beta_fast=m.yarn_beta_fast, beta_slow=m.yarn_beta_slow,
                attention_factor=m.yarn_attention_factor or 0.1 * math.log(m.yarn_factor) + 1.0)
  config = {
      "architectures": [FAMILIES[kind][0]], "model_type": kind, "vocab_size": m.vocab_size,
      "hidden_size": m.d_model, "intermediate_size": m.moe.expert_dim, "num_hidden_layers": m.num_layers,
      "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads, "hidden_act": "silu",
      "attention_bias": False, "attention_dropout": 0.0, "rms_norm_eps": m.norm_eps, "rope_parameters": rope,
      "num_experts": m.moe.num_experts, "num_experts_per_tok": m.moe.top_k, "norm_topk_prob": bool(m.moe.norm_topk_prob),
      "router_aux_loss_coef": m.moe.lb_loss_weight, "output_router_logits": False,
      "max_position_embeddings": int(m.yarn_factor * m.yarn_original_context) if yarn else seq_len,
      "tie_word_embeddings": bool(m.tie_embeddings), "initializer_range": m.init_std, "use_cache": True,
      "eos_token_id": eos_id, "pad_token_id": pad_id, "bos_token_id": bos_id if bos_id >= 0 else None,
      "torch_dtype": dtype,
  }
  if kind == "flex_olmo":
    config["head_dim"] = m.head_dim  # OLMoE's is hidden_size / heads (checked)
  else:
    config["clip_qkv"] = None
  return config
