"""Hugging Face OLMo-3 folders (and the MoE ones, FlexOlmo and OLMoE) to latent_jax export folders and
back, one tensor at a time.

import_hf: config.json -> the model section (the rest from a recipe), safetensors -> params/ (a
params-only Orbax checkpoint, saved one stacked parameter at a time with Orbax's partial saving),
tokenizer files copied. export_hf: a run's checkpoint or an export, restored one parameter at a time,
-> safetensors files laid out in advance and filled layer by layer, config.json, tokenizer files.
Memory stays near the largest stacked parameter (an [L, d, mlp] matrix), not the model.
Every check (config, tensor names, shapes, tokenizer) runs before anything is written.
"""
import contextlib
import json
import os
import re
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from latent_jax.config import lora_enabled, validate
from latent_jax import cli, paths
from latent_jax.data.tokenizer import Tokenizer
from latent_jax.nn import abstract_model
from latent_jax.nn.lora import A, B, lora_merge
from latent_jax import checkpoint
from latent_jax.infer import load
from latent_jax.interop import olmo3
from latent_jax.interop.safetensors_stream import Reader, Writer

TOKENIZER_EXTRAS = ("tokenizer_config.json", "special_tokens_map.json")  # carried both ways when present


def param_shapes(model_cfg):
  """{our path: jax.ShapeDtypeStruct} of the model's params, allocating nothing."""
  return checkpoint.by_path(nnx.to_pure_dict(abstract_model(model_cfg)[1]))


def nested(path, value):
  """{"a": {"b": value}} of the path "a/b"."""
  for key in reversed(path.split("/")):
    value = {key: value}
  return value


def check_tensors(reader, plan, hf_dir, tied, family="OLMo-3"):
  """One line naming the first differences between the checkpoint's tensors and those config.json implies."""
  expected = {name: shape for name, _, _, _, shape in plan}
  missing = [n for n in expected if n not in reader.tensors]
  if missing:
    raise ValueError(f"{hf_dir}: no tensor {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1
                     else "") + "; the safetensors files do not hold the model its config.json describes.")
  wrong = [n for n in expected if reader.shape(n) != expected[n]]
  if wrong:
    n = wrong[0]
    raise ValueError(f"{hf_dir}: tensor {n!r} is {list(reader.shape(n))} but config.json makes it {list(expected[n])}"
                     + (f" ({len(wrong) - 1} more differ)" if len(wrong) > 1 else "") + "; the safetensors files and config.json "
                     "describe different models.")
  unexpected = sorted(set(reader.tensors) - set(expected) - ({olmo3.NAMES["lm_head"][0]} if tied else set()))
  if unexpected:
    raise ValueError(f"{hf_dir}: tensor {unexpected[0]!r}" + (f" and {len(unexpected) - 1} more" if len(unexpected) > 1
                     else "") + f" not in an {family} of its config.json; another architecture, or a damaged config.")


class FusedExperts:
  """A Reader that shows transformers 5's fused experts (save_pretrained(save_original_format=False)): a layer's
  `mlp.experts.gate_up_proj` [E, 2f, d] (each expert's gate rows, then its up rows) and `mlp.experts.down_proj`
  [E, d, f], as the files' one tensor per expert (`mlp.experts.{e}.gate_proj.weight` ...); every other tensor as
  it is. Reading an expert reads its layer's fused tensor once (kept until another is read)."""
  FUSED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")

  def __init__(self, reader):
    self.reader, self.tensors, self.parts, self.last = reader, {}, {}, (None, None)
    for name, entry in reader.tensors.items():
      match, shape = self.FUSED.match(name), entry[2]
      if not match or len(shape) != 3:
        self.tensors[name] = entry
        continue
      experts, rows, cols = shape
      halves = ("gate_proj", "up_proj") if match[2] == "gate_up_proj" else ("down_proj",)
      rows //= len(halves)
      for e in range(experts):
        for i, half in enumerate(halves):
          self.tensors[f"{match[1]}.{e}.{half}.weight"] = (entry[0], entry[1], (rows, cols))
          self.parts[f"{match[1]}.{e}.{half}.weight"] = (name, e, slice(i * rows, (i + 1) * rows))

  def shape(self, name):
    return self.tensors[name][2]

  def dtype(self, name):
    return self.tensors[name][1]

  def read(self, name):
    if name not in self.parts:
      return self.reader.read(name)
    fused, e, rows = self.parts[name]
    if self.last[0] != fused:
      self.last = (None, None)  # the previous one freed first
      self.last = (fused, self.reader.read(fused))
    return np.array(self.last[1][e, rows])


def import_hf(hf_dir, out, recipe, dtype=None):
  """A Hugging Face OLMo-3 (FlexOlmo, OLMoE) folder -> a latent_jax export folder at `out`; `recipe` (a
  config) gives every section but the model. `dtype`: the params' (default: the checkpoint's bf16 or float32)."""
  where = os.path.join(hf_dir, "config.json")
  if not os.path.isfile(where):
    raise FileNotFoundError(f"--hf {hf_dir}: no config.json; give a Hugging Face checkpoint folder.")
  check_out(out)
  try:
    hf = json.load(open(where))
  except json.JSONDecodeError as e:
    raise ValueError(f"{where} is not JSON ({e}).") from None
  fields = olmo3.model_fields(hf, where)
  moe = fields.pop("moe", {"enabled": False})
  reader = FusedExperts(Reader(hf_dir))
  tokenizer_path = os.path.join(hf_dir, "tokenizer.json")
  if not os.path.isfile(tokenizer_path):
    raise FileNotFoundError(f"--hf {hf_dir}: no tokenizer.json; the export needs the checkpoint's tokenizer.")
  tokenizer = Tokenizer(tokenizer_path)
  embed = olmo3.NAMES["embed"][0]
  stored = reader.dtype(embed).name if embed in reader.tensors else "float32"
  dtype = dtype or ("bfloat16" if stored == "bfloat16" else "float32")
  cfg = load.inference_config(recipe)
  cfg.model.update(fields)
  cfg.model.update(param_dtype=dtype, allow_bf16_params=dtype == "bfloat16")
  if "moe" in cfg.model:
    cfg.model.moe.update(moe)
  elif moe["enabled"]:
    raise ValueError(f"--config: the recipe has no model.moe section for {olmo3.family(hf)}'s experts; give "
                     "configs/tiny_moe.py or a recipe derived from configs/tiny.py.")
  cfg.data.tokenizer = ""  # the export carries its own
  validate(cfg)
  if tokenizer.vocab_size > cfg.model.vocab_size:
    raise ValueError(f"{tokenizer_path} has {tokenizer.vocab_size} tokens but config.json's vocab_size is "
                     f"{cfg.model.vocab_size}; they belong to different models.")
  shapes = param_shapes(cfg.model)
  plan = olmo3.tensors({p: s.shape for p, s in shapes.items()}, olmo3.names(cfg.model))
  check_tensors(reader, plan, hf_dir, cfg.model.tie_embeddings, olmo3.family(hf))
  with removed_on_error(out):
    staging = os.path.join(out, "params.partial")
    for path, shape in shapes.items():
      stacked = np.empty(shape.shape, shape.dtype)
      for name, _, layer, transposed, _ in (t for t in plan if t[1] == path):
        x = reader.read(name)
        (stacked if layer is None else stacked[layer])[...] = x.T if transposed else x
      with checkpoint.quiet_orbax():
        ocp.v1.partial.save(staging, nested(path, stacked))
      del stacked
    with checkpoint.quiet_orbax():
      ocp.v1.partial.finalize(staging)
    # Partial saving keeps the tree in the checkpoint's "state" item: that folder is a params-only
    # checkpoint as export.py writes one.
    os.rename(os.path.join(staging, "state"), os.path.join(out, "params"))
    shutil.rmtree(staging)
    load.write_beside(out, cfg, tokenizer, {"hf": os.path.abspath(hf_dir)})
    copy_extras(hf_dir, out)
  return cfg


def export_hf(workdir, out, step=None, dtype=None, max_file_bytes=5 * 2**30):
  """A baseline run's checkpoint (or an export folder) -> a Hugging Face OLMo-3 folder at `out` (with
  model.moe: FlexOlmo for post-norm blocks, OLMoE for pre-norm), in
  safetensors files of at most `max_file_bytes`. `dtype`: the tensors' (default: the model's
  compute dtype, as export.py)."""
  check_out(out)
  cfg, step = checkpoint.load_config(workdir, step)
  saved = param_shapes(cfg) if lora_enabled(cfg) else {}  # a LoRA run's factors, merged as they are read
  alpha = cfg.lora.alpha if saved else None
  cfg = load.inference_config(cfg)
  olmo3.check_expressible(cfg.model, f"--workdir {workdir}")
  tokenizer = checkpoint.load_tokenizer(workdir, cfg)
  if tokenizer.kind != "huggingface":
    raise ValueError(f"--workdir {workdir}: its tokenizer is SentencePiece ({tokenizer.path}); transformers needs a "
                     "tokenizer.json: train with data.tokenizer set to a Hugging Face tokenizer.json.")
  dtype = np.dtype(jax.numpy.dtype(dtype or cfg.model.dtype))
  params = (os.path.join(workdir, "params") if checkpoint.is_export(workdir)
            else os.path.join(checkpoint.find_checkpoint(workdir, step)[0].path(step), "params"))
  shapes = param_shapes(cfg.model)
  plan = olmo3.tensors({p: s.shape for p, s in shapes.items()}, olmo3.names(cfg.model))
  with removed_on_error(out):
    writer = Writer(out, [(name, shape, dtype) for name, _, _, _, shape in plan], max_file_bytes)
    for path, shape in shapes.items():
      value = restore_one(params, path, shape)
      if path + A in saved:  # W + alpha / r * A @ B, as checkpoint.merge_lora gives every other reader
        a, b = (restore_one(params, path + s, saved[path + s]) for s in (A, B))
        value = np.asarray(lora_merge(value, a, b, alpha / a.shape[-1]))
      for name, _, layer, transposed, _ in (t for t in plan if t[1] == path):
        x = value if layer is None else value[layer]
        writer.write(name, np.ascontiguousarray(x.T if transposed else x).astype(dtype))
      del value
    writer.close()
    m, specials = cfg.model, tokenizer.hf.get_added_tokens_decoder()
    config = olmo3.hf_config(m, tokenizer.eos_id, tokenizer.bos_id, tokenizer.pad_id, dtype.name, cfg.data.seq_len)
    write_json(os.path.join(out, "config.json"), config)
    paths.path(os.path.join(out, "tokenizer.json")).write_bytes(tokenizer.proto)
    if not copy_extras(workdir, out):
      token = lambda i: specials[i].content if i in specials else None
      write_json(os.path.join(out, "tokenizer_config.json"), {
          "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": token(tokenizer.eos_id),
          "pad_token": token(tokenizer.pad_id), "bos_token": token(tokenizer.bos_id),
          "model_max_length": config["max_position_embeddings"], "clean_up_tokenization_spaces": False})
  return out


def restore_one(params, path, shape):
  """One parameter of a params-only Orbax checkpoint, as a NumPy array (the others stay on disk)."""
  with checkpoint.quiet_orbax():
    tree = ocp.PyTreeCheckpointer().restore(paths.absolute(params), args=ocp.args.PyTreeRestore(
        item=nested(path, shape), restore_args=nested(path, ocp.RestoreArgs(restore_type=np.ndarray)),
        partial_restore=True))
  for key in path.split("/"):
    tree = tree[key]
  return tree


def copy_extras(source, out):
  """Copy the Hugging Face tokenizer files beside tokenizer.json; whether there was a tokenizer_config.json."""
  for name in TOKENIZER_EXTRAS:
    if os.path.isfile(os.path.join(source, name)):
      shutil.copyfile(os.path.join(source, name), os.path.join(out, name))
  return os.path.isfile(os.path.join(source, TOKENIZER_EXTRAS[0]))


def write_json(path, obj):
  with open(path, "w") as f:
    json.dump(obj, f, indent=2)


def check_out(out):
  if os.path.exists(out):
    raise FileExistsError(f"--out {out!r} exists; choose a new folder (convert never overwrites).")
  cli.writable_dir(out, "--out")


@contextlib.contextmanager
def removed_on_error(out):
  """Creates the folder `out`, and removes it again if what runs inside fails: a failed conversion leaves nothing."""
  os.makedirs(out)
  try:
    yield
  except BaseException:
    shutil.rmtree(out, ignore_errors=True)
    raise
