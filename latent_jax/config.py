"""Config files (`get_config()` in a .py file, or a saved config.json), `a.b=v` overrides, and validation.

Validation runs before anything is traced or compiled, and every error names the field
and what to do about it.
"""
import importlib.util
import inspect
import json
import os
import re
import sys

import ml_collections
from absl import flags
from ml_collections import config_flags

KERNEL_IMPLS = ("auto", "pallas", "pallas_interpret", "xla", "naive")
ATTENTION_IMPLS = ("auto", "dense", "xla_blocked", "pallas_tpu", "pallas_gpu", "cudnn")  # ops/attention.py
DTYPES = ("float32", "bfloat16")
REMAT = ("none", "full", "matmuls")  # latent_jax.nn.layers.REMAT_POLICIES, and "none"


class ConfigError(ValueError):
  """A config value that cannot work; the message names the field and the fix."""


def load_config(path, overrides=()):
  """Load `get_config()` from the file at `path`, apply `a.b=v` overrides, validate.

  `path` may end in `:ARG` (as in configs/ncp_ladder.py:vanilla): the file's `get_config(ARG)`
  then picks a variant. A `.json` file is a saved config, such as an export folder's config.json.
  An override is what `--config.a.b=v` sets on a command line (apply_overrides).
  """
  cfg = read_config(path)
  apply_overrides(cfg, [f"--config.{item}" for item in overrides])
  validate(cfg)
  return cfg


def read_config(path):
  """The config of a config file (`file.py` or `file.py:ARG`) or of a saved config.json, as written there."""
  # Not config_flags.DEFINE_config_file: it loads .py files only, and without their folder on
  # sys.path (configs import their neighbours); config_flags applies the overrides (apply_overrides).
  if path.endswith(".json") and os.path.isfile(path):  # an export's config.json (python -m latent_jax.export)
    with open(path) as f:
      return config_from_json(json.load(f))
  arg = None
  if not os.path.isfile(path) and ":" in path:
    path, arg = path.rsplit(":", 1)
  if not os.path.isfile(path):
    raise ConfigError(f"--config {path!r}: no such file; pass a config file such as configs/tiny.py.")
  spec = importlib.util.spec_from_file_location(f"latent_jax_config_{abs(hash(path))}", path)
  module = importlib.util.module_from_spec(spec)
  # Configs derive from their neighbours (`import tiny` in configs/tiny_ncp.py).
  sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
  try:
    spec.loader.exec_module(module)
  finally:
    sys.path.pop(0)
  if not hasattr(module, "get_config"):
    raise ConfigError(f"--config {path!r} defines no get_config(); it must return an ml_collections.ConfigDict.")
  if arg is not None and not inspect.signature(module.get_config).parameters:
    raise ConfigError(f"--config {path}:{arg}: this config takes no argument; drop ':{arg}'.")
  return module.get_config() if arg is None else module.get_config(arg)


def config_from_json(obj):
  """The ConfigDict of a config saved as JSON (checkpoint metadata, an export's config.json)."""
  model = obj.get("model", {})
  if isinstance(model.get("remat"), bool):  # saved before model.remat named a policy
    obj = {**obj, "model": {**model, "remat": "full" if model["remat"] else "none"}}
  return ml_collections.ConfigDict(obj)


def apply_overrides(cfg, argv):
  """Set the fields that argv's `--config.a.b=v` (or `--config.a.b v`) name, by
  ml_collections.config_flags: each value parsed as its field's type; the config is locked after,
  so a field it lacks cannot be added. Returns argv's other arguments (flags and words), in order."""
  for arg in argv:
    if arg.startswith("--config."):
      check_field(cfg, arg.partition("=")[0].removeprefix("--config."))
  values = flags.FlagValues()  # a fresh one: config_flags reads the overrides from this argv when it is defined
  config_flags.DEFINE_config_dict("config", cfg, flag_values=values, sys_argv=["config", *argv])
  try:
    return values(["config", *argv], known_only=True)[1:]
  except flags.Error as e:
    raise ConfigError(f"{e}; give a value of the type the config file gives the field.") from None


def check_field(cfg, key):
  """Refuse an override of a field the config lacks, naming the section's fields (config_flags'
  own error names the last key alone)."""
  *parents, leaf = key.split(".")
  node = cfg
  for i, name in enumerate(parents):
    if name not in node or not isinstance(node[name], ml_collections.ConfigDict):
      raise ConfigError(f"--config.{key}: {'.'.join(parents[:i + 1])} is not a config section; "
                        f"sections are {sorted(k for k, v in node.items() if isinstance(v, ml_collections.ConfigDict))}.")
    node = node[name]
  if leaf not in node:
    raise ConfigError(f"--config.{key}: {key} is not a config field; fields here are {sorted(node.keys())}.")


def check(ok, field, message):
  if not ok:
    raise ConfigError(f"{field}: {message}")


def check_choice(value, field, choices):
  check(value in choices, field, f"{value!r} is not one of {list(choices)}.")


def validate(cfg):
  """Reject impossible settings before anything is traced."""
  if "target" in cfg:  # the draft command's (configs/tiny_drafter.py): its run's config is validated once built
    return validate_draft(cfg)
  if is_ladder(cfg):  # the ladder command's (configs/ladder_cpu.py): its points' configs are validated as built
    return validate_ladder(cfg)
  for section in ("model", "data", "train", "optim", "mesh", "kernels"):
    check(section in cfg, section, "missing section; start from configs/tiny.py.")
  m, d, t, o = cfg.model, cfg.data, cfg.train, cfg.optim
  check_choice(m.name, "model.name", ("baseline", "concept"))
  check(o.get("skip_factor", 0) == 0 or o.skip_factor > 1, "optim.skip_factor",
        f"must be 0 (off) or > 1 (a step is skipped when its gradient norm exceeds this many times the running "
        f"median), got {o.get('skip_factor')!r}.")
  check(o.get("skip_factor", 0) == 0 or (isinstance(o.skip_window, int) and o.skip_window >= 1), "optim.skip_window",
        f"must be a positive integer, got {o.get('skip_window')!r}.")
  check(isinstance(t.get("monitors", False), bool), "train.monitors", f"must be True or False, got {t.get('monitors')!r}.")
  profile = t.get("profile_steps", (0, 0))
  check(isinstance(profile, (tuple, list)) and len(profile) == 2 and all(isinstance(x, int) and x >= 0 for x in profile),
        "train.profile_steps", f"must be (START, COUNT), two integers >= 0 (COUNT 0 = off), got {profile!r}.")
  check(not t.get("wandb_project") or importlib.util.find_spec("wandb") is not None, "train.wandb_project",
        f"{t.wandb_project!r} needs the wandb package: pip install -e '.[wandb]', or set train.wandb_project=''.")
  for f in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim"):
    check(isinstance(m[f], int) and m[f] > 0, f"model.{f}", f"must be a positive integer, got {m[f]!r}.")
  check(m.num_heads % m.num_kv_heads == 0, "model.num_kv_heads",
        f"{m.num_kv_heads} does not divide model.num_heads={m.num_heads}; pick a divisor of it.")
  check(m.head_dim % 2 == 0, "model.head_dim", f"{m.head_dim} is odd; RoPE rotates pairs, use an even size.")
  check_choice(m.qk_norm, "model.qk_norm", ("none", "layer", "head"))
  check_choice(m.block_order, "model.block_order", ("post", "pre"))
  check_choice(m.param_dtype, "model.param_dtype", DTYPES)
  check_choice(m.dtype, "model.dtype", DTYPES)
  # bf16 storage rounds away an update under half a bf16 step (2^-9 to 2^-8 of the weight): at
  # lr 6e-5 a norm scale of 1 never moves, and most matrix entries do not either.
  check(m.param_dtype == "float32" or m.get("allow_bf16_params", False), "model.param_dtype",
        "'bfloat16' stores the parameters and optimiser state in bfloat16 with no float32 master copy, so "
        "updates below bf16's resolution are lost; use model.param_dtype=float32 with model.dtype=bfloat16 "
        "(float32 master, bf16 compute), or set model.allow_bf16_params=True to store bf16 anyway.")
  check_choice(m.remat, "model.remat", REMAT)
  check(isinstance(m.get("scan_unroll", 1), int) and m.get("scan_unroll", 1) >= 1, "model.scan_unroll",
        f"must be a positive integer (layers per loop iteration), got {m.get('scan_unroll')!r}.")
  check(m.window >= 0, "model.window", "must be >= 0 (0 = no sliding window).")
  check(m.full_attention_every >= 1, "model.full_attention_every", "must be >= 1 (1 = every layer full).")
  check(m.rope_base > 0 and m.norm_eps > 0 and m.init_std > 0, "model.rope_base/norm_eps/init_std", "must be > 0.")
  validate_rope_scaling(m)
  validate_moe(cfg)

  check(d.seq_len >= 2, "data.seq_len", f"must be >= 2, got {d.seq_len}.")
  check(d.batch_size >= 1, "data.batch_size", f"must be >= 1, got {d.batch_size}.")
  k = t.microbatches
  check(isinstance(k, int) and k >= 1, "train.microbatches", f"must be a positive integer, got {k!r}.")
  check(d.batch_size % k == 0, "train.microbatches",
        f"{k} does not divide data.batch_size={d.batch_size}; pick a divisor of it.")
  check(0 < d.val_fraction < 1, "data.val_fraction", f"must lie in (0, 1), got {d.val_fraction}.")
  check(isinstance(d.source, str) and d.source.strip() != "", "data.source",
        "is empty; use 'kjv' or a path to .txt/.jsonl files.")
  check(d.get("max_text_gib", 1) > 0, "data.max_text_gib", f"must be > 0 (GiB), got {d.get('max_text_gib')}.")
  extra = d.get("tokenizer_sources", "")
  check(isinstance(extra, str), "data.tokenizer_sources", f"must be a string (sources, comma-separated), got {extra!r}.")
  check(not (extra.strip() and d.get("tokenizer", "")), "data.tokenizer_sources",
        f"{extra!r} adds text to the tokenizer trained here, but data.tokenizer={d.get('tokenizer')!r} gives one; "
        "drop one of the two.")

  check(t.steps > 0, "train.steps", f"must be > 0, got {t.steps}.")
  start, count = profile
  check(count == 0 or start + count <= t.steps, "train.profile_steps",
        f"({start}, {count}) traces steps {start + 1}..{start + count}, past the run's end at train.steps={t.steps}; "
        f"set START + COUNT <= {t.steps} (e.g. --config.train.profile_steps=\"({max(0, min(start, t.steps - count))}, "
        f"{min(count, t.steps)})\"), or COUNT 0 for no profile.")
  for f in ("log_every", "checkpoint_every", "keep_checkpoints"):
    check(t[f] >= 1, f"train.{f}", f"must be >= 1, got {t[f]}.")
  check(t.eval_every >= 0 and t.eval_batches >= 0, "train.eval_every/eval_batches", "must be >= 0 (0 = off / all).")
  tasks = t.get("eval_tasks", ())
  check(isinstance(tasks, (tuple, list)) and all(isinstance(f, str) for f in tasks), "train.eval_tasks",
        f"must be a tuple of task files or folders of them (repeat the flag: --config.train.eval_tasks=a.jsonl "
        f"--config.train.eval_tasks=b.jsonl); got {tasks!r}.")
  check(t.z_loss >= 0, "train.z_loss", "must be >= 0.")
  check(t.peak_flops >= 0, "train.peak_flops", "must be >= 0 (0 = known or measured).")

  check_choice(o.name, "optim.name", ("adamw", "muon"))
  check_choice(o.schedule, "optim.schedule", ("cosine", "wsd", "constant"))
  check(o.lr > 0, "optim.lr", f"must be > 0, got {o.lr}.")
  w = o.warmup_steps
  number = isinstance(w, (int, float)) and not isinstance(w, bool)
  check(number and (0 <= w < 1 or (w == int(w) and w < t.steps)), "optim.warmup_steps",
        f"{f'{w:g}' if number else repr(w)} must lie in [0, train.steps={t.steps}): a whole number of steps, or "
        "below 1 a fraction of train.steps (e.g. 0.1).")
  check(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", f"must lie in [0, 1], got {o.min_lr_ratio}.")
  check(0 < o.decay_fraction <= 1, "optim.decay_fraction", f"must lie in (0, 1], got {o.decay_fraction}.")
  check(o.clip_norm >= 0 and o.weight_decay >= 0, "optim.clip_norm/weight_decay", "must be >= 0 (0 = off).")
  trainable = o.get("trainable", "all")
  check(isinstance(trainable, str) and trainable.strip() != "", "optim.trainable",
        "is empty; use 'all', 'vq' or a regex over parameter paths such as 'codebook|heads'.")
  if trainable == "lora":
    check(lora_enabled(cfg), "optim.trainable", "'lora' trains the LoRA factors, which this run has not; set "
          "lora.enabled=True (docs/lora.md) or use 'all'.")
  elif trainable == "vq":
    check(m.name == "concept", "optim.trainable",
          f"'vq' trains the codebook and concept heads, which model.name={m.name!r} does not have; use 'all'.")
  elif trainable != "all":
    try:
      re.compile(trainable)
    except re.error as e:
      raise ConfigError(f"optim.trainable: {trainable!r} is not a valid regex ({e}).") from None
  check(isinstance(t.get("init_from", ""), str), "train.init_from", "must be a path ('' = a fresh model).")

  for axis in ("data", "fsdp", "expert", "tensor"):
    size = cfg.mesh.get(axis, 1)  # mesh.expert: 1 in configs saved before it
    check(isinstance(size, int) and (size == -1 or size >= 1), f"mesh.{axis}",
          f"{size!r} must be >= 1, or -1 to take the devices left over.")
  check([cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.get("expert", 1), cfg.mesh.tensor].count(-1) <= 1,
        "mesh.data/fsdp/expert/tensor", "at most one may be -1 (fill).")
  expert = cfg.mesh.get("expert", 1)
  if moe_enabled(m) and isinstance(expert, int) and expert > 1:  # -1: sharding.check_experts, once the devices are known
    check(m.moe.num_experts % expert == 0, "mesh.expert",
          f"{expert} does not divide model.moe.num_experts={m.moe.num_experts} (the expert axis splits the experts); "
          f"use a mesh.expert that divides {m.moe.num_experts}, or a multiple of {expert} experts.")
  slices = cfg.mesh.get("slices", 1)
  check(isinstance(slices, int) and slices >= 1, "mesh.slices", f"{slices!r} must be a positive integer (1: one slice).")
  check_choice(cfg.kernels.impl, "kernels.impl", KERNEL_IMPLS)
  # The cross-entropy and mixing kernels take the LM head / codebook whole per batch shard, and XLA
  # cannot split a Mosaic call over the vocabulary the tensor axis shards (-1 may fill it).
  check(not (cfg.kernels.impl.startswith("pallas") and cfg.mesh.tensor != 1), "kernels.impl",
        f"{cfg.kernels.impl!r} (the Pallas cross-entropy and codebook-mixing kernels) does not run with "
        f"mesh.tensor={cfg.mesh.tensor}, which shards the vocabulary; set kernels.impl='auto' (XLA paths) or "
        "'xla', or mesh.tensor=1.")
  check_choice(cfg.kernels.get("attention", "auto"), "kernels.attention", ATTENTION_IMPLS)
  if cfg.kernels.get("attention", "auto") == "cudnn":
    check(m.dtype != "float32", "kernels.attention",
          "'cudnn' (cuDNN flash attention) computes in bfloat16 or float16 only, and model.dtype is float32; "
          "set model.dtype=bfloat16 or choose another kernels.attention ('auto' picks one).")
    check(m.head_dim % 8 == 0 and m.head_dim <= 256, "kernels.attention",
          f"'cudnn' needs model.head_dim a multiple of 8 and at most 256, got {m.head_dim}; choose another "
          "kernels.attention ('auto' picks one).")
  if m.name == "concept":
    validate_ncp(cfg)
  validate_tst(cfg)
  validate_aux(cfg)
  validate_lora(cfg)
  if "drafter" in cfg:
    validate_drafter(cfg)
  return cfg


def tst_enabled(cfg):
  """Whether the config asks for Token-Superposition Training (an optional `tst` section)."""
  return "tst" in cfg and bool(cfg.tst.enabled)


def tst_phase1_steps(cfg):
  """Steps of TST phase 1: round(tst.r * train.steps)."""
  return round(cfg.tst.r * cfg.train.steps)


def validate_tst(cfg):
  """The `tst` section (docs/tst.md); checked only when tst.enabled."""
  if not tst_enabled(cfg):
    return
  t, steps = cfg.tst, cfg.train.steps
  check(cfg.model.name == "baseline", "tst.enabled",
        f"TST is defined for model.name='baseline' only, not {cfg.model.name!r}; set tst.enabled=False "
        "or model.name='baseline'.")
  check(isinstance(t.s, int) and t.s >= 1, "tst.s", f"the bag size must be a positive integer, got {t.s!r}.")
  check(0 < t.r < 1, "tst.r", f"the phase-1 fraction of train.steps must lie in (0, 1), got {t.r}.")
  n1 = tst_phase1_steps(cfg)
  check(1 <= n1 < steps, "tst.r", f"round(tst.r * train.steps) = {n1} phase-1 steps leaves phase 1 or "
        f"phase 2 empty (train.steps={steps}); raise train.steps or move tst.r away from 0 and 1.")
  check_choice(t.budget, "tst.budget", ("flops", "tokens"))
  check_choice(t.carry, "tst.carry", ("all", "params"))
  check_choice(t.superpose, "tst.superpose", ("both", "input", "output"))
  check_choice(t.positions, "tst.positions", ("bag", "token"))
  check(isinstance(t.reinit_embeddings_at_switch, bool), "tst.reinit_embeddings_at_switch", "must be True or False.")
  if t.budget == "tokens" and t.superpose != "output":
    check(cfg.data.seq_len % t.s == 0, "data.seq_len",
          f"{cfg.data.seq_len} is not divisible by tst.s={t.s}: with tst.budget='tokens' phase-1 rows of "
          f"data.seq_len tokens are cut into bags of tst.s; pick a multiple of {t.s}, or tst.budget='flops'.")
  if t.carry == "params":
    warmup = warmup_steps(cfg.optim, steps)
    check(warmup < min(n1, steps - n1), "optim.warmup_steps",
          f"{cfg.optim.warmup_steps:g}" + (f" ({warmup} steps)" if cfg.optim.warmup_steps < 1 else "") +
          f" must be below both phases' lengths ({n1} and {steps - n1}): with tst.carry='params' each phase "
          "restarts the schedule, warmup included.")


def warmup_steps(optim, steps):
  """The warmup's length in steps: optim.warmup_steps as a number of steps, or, below 1, as a fraction of
  `steps` (train.steps), rounded (at most steps - 1), so that a shorter run keeps its warmup's share."""
  w = optim.warmup_steps
  return min(round(w * steps), steps - 1) if 0 < w < 1 else int(w)


def nitp_enabled(cfg):
  """Whether the (whole) config turns on Next Implicit Token Prediction (an optional `nitp` section)."""
  return "nitp" in cfg and bool(cfg.nitp.enabled)


def mtp_enabled(cfg):
  """Whether the (whole) config turns on multi-token prediction (an optional `mtp` section)."""
  return "mtp" in cfg and bool(cfg.mtp.enabled)


def nitp_depth(model_cfg):
  """Layers the NITP target may come from, and the depth its default is a fraction of.

  Baseline: all layers of a depth-L model. ConceptLM: the encoder's E layers (the target must
  be a shallow token-rate state), against the token path's depth E + D (docs/aux.md).
  """
  if model_cfg.name == "concept":
    return model_cfg.encoder_layers, model_cfg.encoder_layers + model_cfg.decoder_layers
  return model_cfg.num_layers, model_cfg.num_layers


def nitp_layer(cfg):
  """k: the NITP target is the state after the first k layers; nitp.layer = 0 picks ~20% of depth."""
  limit, depth = nitp_depth(cfg.model)
  return cfg.nitp.layer or min(limit, max(1, round(0.2 * depth)))


NITP_FIELDS = ("enabled", "weight", "layer", "source", "loss", "alignment", "stop_gradient", "projector")


def validate_aux(cfg):
  """The `nitp` and `mtp` sections (docs/aux.md); checked only when enabled."""
  if nitp_enabled(cfg):
    n = cfg.nitp
    for f in NITP_FIELDS:
      check(f in n, f"nitp.{f}", "missing; start from configs/tiny_nitp.py.")
    check(n.weight >= 0, "nitp.weight", f"the loss weight lambda must be >= 0, got {n.weight}.")
    limit, _ = nitp_depth(cfg.model)
    where = "model.encoder_layers" if cfg.model.name == "concept" else "model.num_layers"
    check(isinstance(n.layer, int) and 0 <= n.layer <= limit, "nitp.layer",
          f"{n.layer!r} is not a layer of the model: use 1..{where}={limit}, or 0 for ~20% of the depth.")
    check_choice(n.source, "nitp.source", ("final_norm", "pre_norm"))
    check_choice(n.loss, "nitp.loss", ("cosine", "mse"))
    check_choice(n.alignment, "nitp.alignment", ("next", "same"))
    for f in ("stop_gradient", "projector"):
      check(isinstance(n[f], bool), f"nitp.{f}", f"must be True or False, got {n[f]!r}.")
  if mtp_enabled(cfg):
    check("weight" in cfg.mtp, "mtp.weight", "missing; start from configs/tiny.py.")
    check(cfg.mtp.weight >= 0, "mtp.weight", f"the loss weight must be >= 0, got {cfg.mtp.weight}.")
    check(cfg.data.seq_len >= 3, "data.seq_len", f"{cfg.data.seq_len} is too short for MTP, which predicts "
          "token t+2; use at least 3.")


def moe_enabled(model_cfg):
  """Whether the model section turns on mixture of experts (`model.moe`; configs saved before it: off)."""
  return "moe" in model_cfg and bool(model_cfg.moe.enabled)


MOE_FIELDS = ("num_experts", "top_k", "expert_dim", "shared_experts", "every", "first_dense", "router",
              "norm_topk_prob", "capacity_factor", "lb_loss_weight", "z_loss_weight", "bias_update_rate", "impl")


def validate_moe(cfg):
  """`model.moe` (configs/tiny.py, docs/moe.md); checked only when enabled."""
  m = cfg.model
  if not moe_enabled(m):
    return
  e = m.moe
  for f in MOE_FIELDS:
    check(f in e, f"model.moe.{f}", "missing; start from configs/tiny_moe.py.")
  for f in ("num_experts", "top_k", "expert_dim", "every"):
    check(isinstance(e[f], int) and e[f] > 0, f"model.moe.{f}", f"must be a positive integer, got {e[f]!r}.")
  check(e.top_k <= e.num_experts, "model.moe.top_k",
        f"{e.top_k} is above model.moe.num_experts={e.num_experts}; choose at most {e.num_experts}.")
  check(isinstance(e.shared_experts, int) and e.shared_experts >= 0, "model.moe.shared_experts",
        f"must be an integer >= 0 (0 = none), got {e.shared_experts!r}.")
  depth = m.num_layers if m.name != "concept" else min(m.encoder_layers, m.concept_layers, m.decoder_layers)
  check(isinstance(e.first_dense, int) and 0 <= e.first_dense < depth, "model.moe.first_dense",
        f"{e.first_dense!r} must lie in [0, {depth}) so that at least one layer is sparse; lower it.")
  check(e.every <= depth - e.first_dense, "model.moe.every",
        f"{e.every} is above the {depth - e.first_dense} layers after model.moe.first_dense; use 1..{depth - e.first_dense}.")
  if m.name == "concept":
    check(e.every == 1 and e.first_dense == 0, "model.moe.every/first_dense",
          "ConceptLM makes every layer of each module sparse; set model.moe.every=1 and model.moe.first_dense=0.")
    check(not (m.irc and m.remat != "none"), "model.moe",
          f"ConceptLM with IRC recomputes its layers in a custom backward pass (model.remat={m.remat!r}) that does "
          "not carry the router losses yet; set model.remat=none or model.irc=False.")
  check_choice(e.router, "model.moe.router", ("softmax", "sigmoid"))
  check(isinstance(e.norm_topk_prob, bool), "model.moe.norm_topk_prob", f"must be True or False, got {e.norm_topk_prob!r}.")
  check(e.capacity_factor >= 0, "model.moe.capacity_factor",
        f"must be 0 (dropless) or > 0 (rows per expert = cf * tokens * top_k / num_experts), got {e.capacity_factor}.")
  for f in ("lb_loss_weight", "z_loss_weight", "bias_update_rate"):
    check(e[f] >= 0, f"model.moe.{f}", f"must be >= 0 (0 = off), got {e[f]}.")
  check_choice(e.impl, "model.moe.impl", ("auto", "ragged", "tiled"))


def validate_rope_scaling(m):
  """model.rope_scaling and, for YaRN, its fields (configs/tiny.py); configs saved before them mean "none"."""
  check_choice(m.get("rope_scaling", "none"), "model.rope_scaling", ("none", "yarn"))
  if m.get("rope_scaling", "none") != "yarn":
    return
  for f in ("yarn_factor", "yarn_original_context", "yarn_beta_fast", "yarn_beta_slow", "yarn_attention_factor"):
    check(f in m, f"model.{f}", "missing; model.rope_scaling='yarn' needs it, start from configs/tiny.py.")
  check(m.yarn_factor >= 1, "model.yarn_factor", f"must be >= 1 (the context stretch), got {m.yarn_factor}.")
  check(isinstance(m.yarn_original_context, int) and m.yarn_original_context > 0, "model.yarn_original_context",
        f"must be a positive integer (tokens), got {m.yarn_original_context!r}.")
  check(m.yarn_beta_fast > m.yarn_beta_slow > 0, "model.yarn_beta_fast/yarn_beta_slow",
        f"need beta_fast > beta_slow > 0 (turns over the original context), got {m.yarn_beta_fast} and "
        f"{m.yarn_beta_slow}; YaRN's are 32 and 1.")
  check(m.yarn_attention_factor >= 0, "model.yarn_attention_factor",
        f"must be >= 0 (0 = 0.1 ln(yarn_factor) + 1), got {m.yarn_attention_factor}.")


def lora_enabled(cfg):
  """Whether the (whole) config adapts its model with LoRA (an optional `lora` section, docs/lora.md)."""
  return "lora" in cfg and bool(cfg.lora.enabled)


def trainable_setting(cfg):
  """optim.trainable as it applies: with lora.enabled, "all" means the LoRA factors alone ("lora")."""
  trainable = cfg.optim.get("trainable", "all")
  return "lora" if trainable == "all" and lora_enabled(cfg) else trainable


def validate_lora(cfg):
  """The `lora` section (docs/lora.md); checked only when enabled. lora.targets is matched against the
  model's parameter paths when it is built (nn/lora.py), before anything compiles."""
  if not lora_enabled(cfg):
    return
  lo = cfg.lora
  for f in ("rank", "alpha", "targets"):
    check(f in lo, f"lora.{f}", "missing; start from configs/tiny.py.")
  check(bool(cfg.train.get("init_from")), "lora.enabled", "LoRA adapts a trained model: set train.init_from=... "
        "(a trained run's workdir or an export folder).")
  rank, alpha = lo.rank, lo.alpha
  check(rank == "auto" or (isinstance(rank, int) and not isinstance(rank, bool) and rank >= 1), "lora.rank",
        f"must be a positive integer or 'auto', got {rank!r}.")
  check(rank != "auto" or cfg.model.name == "concept", "lora.rank",
        "'auto' is the rank whose trainable count matches VQ adaptation's (optim.trainable=vq), which "
        f"model.name={cfg.model.name!r} does not have (no codebook); give an integer rank, e.g. lora.rank=8.")
  check(isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and 0 < alpha < float("inf"), "lora.alpha",
        f"must be a number > 0 (the adapters' scale is alpha / rank), got {alpha!r}.")
  check(isinstance(lo.targets, str) and lo.targets.strip() != "", "lora.targets",
        "is empty; give a regex over parameter paths, e.g. '.*attn/(q|v)'.")
  try:
    re.compile(lo.targets)
  except re.error as e:
    raise ConfigError(f"lora.targets: {lo.targets!r} is not a valid regex ({e}).") from None


NCP_FIELDS = ("encoder_layers", "concept_layers", "decoder_layers", "chunk_size", "num_segments", "codebook_size",
              "mixing", "fusion", "fusion_scale_init", "concept_norm", "concept_positions", "document_mask", "irc",
              "irc_softmax", "crc_encoder_concept", "crc_encoder_decoder", "crc_concept_decoder",
              "residual_hidden", "crc_scale_init")


def validate_ncp(cfg):
  """The ConceptLM fields of `model` and the loss section `ncp` (docs/ncp.md)."""
  m = cfg.model
  for f in NCP_FIELDS:
    check(f in m, f"model.{f}", "missing; model.name='concept' needs the NCP fields, start from configs/tiny_ncp.py.")
  check("ncp" in cfg, "ncp", "missing section (alpha, beta, reduction); start from configs/tiny_ncp.py.")
  for f in ("encoder_layers", "concept_layers", "decoder_layers", "chunk_size", "num_segments", "codebook_size",
            "residual_hidden"):
    check(isinstance(m[f], int) and m[f] > 0, f"model.{f}", f"must be a positive integer, got {m[f]!r}.")
  check(m.d_model % m.num_segments == 0, "model.num_segments",
        f"{m.num_segments} does not divide model.d_model={m.d_model}; each segment has d_model/num_segments dims.")
  k = m.chunk_size
  check(cfg.data.seq_len >= 2 * k, "data.seq_len",
        f"{cfg.data.seq_len} is shorter than 2*model.chunk_size={2 * k}: NCP needs two complete chunks "
        "(one to predict from, one to predict); raise data.seq_len or lower model.chunk_size.")
  check_choice(m.mixing, "model.mixing", ("softmax", "raw_logits"))
  check_choice(m.fusion, "model.fusion", ("add", "norm_add"))
  check_choice(m.concept_positions, "model.concept_positions", ("index", "token"))
  for f in ("concept_norm", "document_mask", "irc", "irc_softmax", "crc_encoder_concept", "crc_encoder_decoder",
            "crc_concept_decoder"):
    check(isinstance(m[f], bool), f"model.{f}", f"must be True or False, got {m[f]!r}.")
  check(m.crc_scale_init >= 0, "model.crc_scale_init", f"must be >= 0, got {m.crc_scale_init}.")
  n = cfg.ncp
  check(n.alpha >= 0 and n.beta >= 0, "ncp.alpha/beta", f"loss weights must be >= 0, got {n.alpha}, {n.beta}.")
  check_choice(n.reduction, "ncp.reduction", ("paper", "algorithm1", "released"))


DRAFTER_FIELDS = ("block_size", "num_layers", "context", "anchors")


def validate_drafter(cfg):
  """The `drafter` section: a drafter config's (configs/tiny_drafter.py), or a drafter run's, whose model is the target's."""
  d = cfg.drafter
  check_choice(d.concept, "drafter.concept", ("none", "predicted", "pooled"))
  check_choice(d.labels, "drafter.labels", ("data", "target"))
  for f in DRAFTER_FIELDS:
    check(isinstance(d[f], int) and d[f] >= 1, f"drafter.{f}", f"must be a positive integer, got {d[f]!r}.")
  if "model" in cfg:
    check(d.concept == "none" or cfg.model.name == "concept", "drafter.concept",
          f"{d.concept!r} needs a ConceptLM target, but the target is model.name={cfg.model.name!r}; "
          "use --config.drafter.concept=none.")
    check(not (tst_enabled(cfg) or nitp_enabled(cfg) or mtp_enabled(cfg)), "drafter",
          "a drafter run trains the drafter alone; turn tst, nitp and mtp off.")


def validate_draft(cfg):
  """The draft command's config (`python -m latent_jax.draft`, docs/ncp.md): the target, the drafter and
  the measurement; the training sections are checked with the target's config they are laid over."""
  for section in ("drafter", "eval"):
    check(section in cfg, section, "missing section; start from configs/tiny_drafter.py.")
  check(isinstance(cfg.target, str) and cfg.target.strip() != "", "target",
        "is empty; give the workdir or export folder of a trained model (--config.target=runs/ncp).")
  validate_drafter(cfg)
  for f in ("prompts", "prompt_len", "max_new_tokens"):
    check(isinstance(cfg.eval[f], int) and cfg.eval[f] >= 1, f"eval.{f}",
          f"must be a positive integer, got {cfg.eval[f]!r}.")
  return cfg


def is_ladder(cfg):
  """A ladder config (python -m latent_jax.ladder, configs/ladder_cpu.py), not a training run's."""
  return "methods" in cfg and "budgets" in cfg


def validate_ladder(cfg):
  """The ladder's own fields (docs/ladder.md); each point's training config is checked as the ladder builds it."""
  for section in ("methods", "family", "rule", "tune", "train"):
    check(section in cfg, section, "missing section; start from configs/ladder_cpu.py.")
  check(isinstance(cfg.data, str) and cfg.data.strip() != "", "data",
        "is empty; name a token store (python -m latent_jax.prepare ... --out DIR).")
  check(len(cfg.methods) >= 1, "methods", "is empty; add one, e.g. methods.baseline = method('tiny.py').")
  for name, m in cfg.methods.items():
    check(isinstance(m.get("recipe"), str) and m.recipe.strip() != "", f"methods.{name}.recipe",
          "is empty; name a config file, e.g. 'tiny.py' (relative to the ladder config's folder).")
    for o in m.get("overrides", ()):
      check(isinstance(o, str) and "=" in o, f"methods.{name}.overrides", f"{o!r} is not 'a.b=value'.")
  check(cfg.reference in cfg.methods, "reference", f"{cfg.reference!r} is not one of the methods {list(cfg.methods)}.")
  check(len(cfg.budgets) >= 1 and all(isinstance(b, (int, float)) and b > 0 for b in cfg.budgets), "budgets",
        f"must be positive FLOPs, e.g. (2e12, 5e12), got {cfg.budgets!r}.")
  check(len(set(cfg.budgets)) == len(cfg.budgets), "budgets", f"{cfg.budgets!r} repeats a budget.")
  check(len(cfg.sizes) >= 1 and all(re.match(r"^\d+x\d+$", str(s)) for s in cfg.sizes), "sizes",
        f"must be WIDTHxDEPTH strings, e.g. ('64x2', '96x3'), got {cfg.sizes!r}.")
  check(isinstance(cfg.sizes_per_budget, int) and cfg.sizes_per_budget >= 0, "sizes_per_budget",
        f"must be an integer >= 0 (0: every size), got {cfg.sizes_per_budget!r}.")
  check(isinstance(cfg.max_sizes_per_budget, int) and cfg.max_sizes_per_budget >= max(cfg.sizes_per_budget, 1),
        "max_sizes_per_budget", f"must be an integer >= sizes_per_budget ({cfg.sizes_per_budget}), "
        f"got {cfg.max_sizes_per_budget!r}.")
  check(cfg.tokens_per_param > 0, "tokens_per_param", f"must be > 0, got {cfg.tokens_per_param!r}.")
  check(len(cfg.seeds) >= 1 and all(isinstance(s, int) for s in cfg.seeds), "seeds",
        f"must be integers, e.g. (0, 1), got {cfg.seeds!r}.")
  check(isinstance(cfg.seq_len, int) and cfg.seq_len >= 2, "seq_len", f"must be an integer >= 2, got {cfg.seq_len!r}.")
  f, r, t = cfg.family, cfg.rule, cfg.train
  check(isinstance(f.head_dim, int) and f.head_dim >= 1, "family.head_dim", f"must be a positive integer, got {f.head_dim!r}.")
  check(isinstance(f.kv_group, int) and f.kv_group >= 1, "family.kv_group", f"must be a positive integer, got {f.kv_group!r}.")
  check(f.mlp_ratio > 0, "family.mlp_ratio", f"must be > 0, got {f.mlp_ratio!r}.")
  check(len(f.concept_split) == 3 and all(x > 0 for x in f.concept_split), "family.concept_split",
        f"must be three positive fractions of depth (encoder, concept, decoder), got {f.concept_split!r}.")
  for name in ("params", "batch_tokens", "lr"):
    check(r[name] > 0, f"rule.{name}", f"must be > 0, got {r[name]!r}.")
  check(r.warmup_tokens_per_param >= 0, "rule.warmup_tokens_per_param", f"must be >= 0, got {r.warmup_tokens_per_param!r}.")
  check(0 < r.beta2 < 1, "rule.beta2", f"must be in (0, 1), got {r.beta2!r}.")
  check(r.beta2_below_batch_tokens >= 0, "rule.beta2_below_batch_tokens",
        f"must be >= 0 (0: never), got {r.beta2_below_batch_tokens!r}.")
  tune = cfg.tune
  check(all(s in cfg.sizes for s in tune.sizes), "tune.sizes",
        f"{tuple(tune.sizes)!r} must be sizes of the family {tuple(cfg.sizes)!r} (or () for no tune).")
  check(not tune.sizes or (len(tune.lr_factors) >= 2 and all(f > 0 for f in tune.lr_factors)
                           and len(set(tune.lr_factors)) == len(tune.lr_factors)), "tune.lr_factors",
        f"must be two or more distinct factors > 0, e.g. (0.5, 1.0, 2.0), got {tuple(tune.lr_factors)!r}.")
  check(isinstance(tune.max_factors, int) and tune.max_factors >= len(tune.lr_factors), "tune.max_factors",
        f"must be an integer >= the {len(tune.lr_factors)} lr_factors, got {tune.max_factors!r}.")
  check(tune.budget > 0, "tune.budget", f"must be FLOPs > 0, got {tune.budget!r}.")
  check(isinstance(tune.seed, int), "tune.seed", f"must be an integer, got {tune.seed!r}.")
  check(0 < t.checkpoint_fraction <= 1, "train.checkpoint_fraction", f"must be in (0, 1], got {t.checkpoint_fraction!r}.")
  check(isinstance(t.eval_batches, int) and t.eval_batches >= 0, "train.eval_batches",
        f"must be an integer >= 0 (0: the whole validation split), got {t.eval_batches!r}.")
  check(isinstance(t.log_every, int) and t.log_every >= 1, "train.log_every", f"must be >= 1, got {t.log_every!r}.")
  return cfg
