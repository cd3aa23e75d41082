"""Hugging Face OLMo-3 in and out (`python -m latent_jax.convert`, latent_jax/interop).

Without torch: a random baseline goes to a Hugging Face folder and back bit for bit (through one
safetensors file and through several), the import is read by train.init_from and plan's config
loader, and checkpoints that are not an OLMo-3 the baseline expresses are one-line errors.
Slow tier, with transformers and torch (`pip install -e ".[hf]"`): a tiny random Olmo3ForCausalLM
(sliding window 16, 3 sliding : 1 full layers, GQA, YaRN) imported gives transformers' logits within
1e-5 relative in float32 at a length beyond the window, and the same greedy continuation; a trained
baseline exported loads in transformers with our logits; the tokenizer's ids agree both ways.
"""
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from conftest import TINY, TINY_OVERRIDES
from latent_jax import build_model, checkpoint, load_config
from latent_jax.data.tokenizer import Tokenizer
from latent_jax.nn import abstract_model
from latent_jax.infer import generate, load, load_model
from latent_jax.interop import hf
from latent_jax.interop.safetensors_stream import INDEX, Reader, Writer
from test_cli_errors import check_one_error_line, run_main

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing from the hub: every model here is built in the test
TEXTS = ["Kar lon mith sethal.", "Karn lom  mith.\nSeth\ttav caf\u00e9 \u6c34 42! \U0001f642", ""]
# A baseline OLMo-3 expresses: window 8 with every 2nd layer full, YaRN (whose ramp covers the pairs
# of head dim 8 at L=16) on the full ones.
OURS = TINY_OVERRIDES + ["model.rope_scaling=yarn", "model.yarn_original_context=16", "model.yarn_factor=4.0"]


@pytest.fixture(scope="module")
def tokenizer_file(hf_tokenizer_file):
  return hf_tokenizer_file


def random_export(out, tokenizer_file, overrides=(), seed=0):
  """An export folder (as python -m latent_jax.export writes one) of a baseline with random params,
  norm scales around 1; drawn by NumPy."""
  cfg = load_config(TINY, OURS + list(overrides))
  shapes = hf.param_shapes(cfg.model)
  rng = np.random.default_rng(seed)
  params = {p: (rng.normal(size=s.shape) * 0.3 + (1.0 if p.endswith("scale") else 0.0)).astype(s.dtype)
            for p, s in shapes.items()}
  tree = {}
  for path, value in params.items():
    node = tree
    *parents, leaf = path.split("/")
    for key in parents:
      node = node.setdefault(key, {})
    node[leaf] = value
  os.makedirs(out)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(os.path.join(out, "params"), tree)
  checkpointer.wait_until_finished()
  load.write_beside(out, cfg, Tokenizer(tokenizer_file))
  return cfg, params


def saved(directory):
  """{path: array} of an export folder's params."""
  cfg, _ = checkpoint.load_config(directory)
  return checkpoint.by_path(jax.tree.map(np.asarray, checkpoint.saved_params(directory, cfg)))


@pytest.mark.parametrize("file_bytes", [2**40, 20_000])  # one model.safetensors; files and an index
def test_round_trip_without_torch(tmp_path, tokenizer_file, file_bytes):
  """Ours -> Hugging Face -> ours: the same params bit for bit, the same model config and tokenizer;
  the import is a source for train.init_from, and its config.json loads as a config (plan --config)."""
  cfg, params = random_export(str(tmp_path / "ours"), tokenizer_file)
  hf.export_hf(str(tmp_path / "ours"), str(tmp_path / "hf"), max_file_bytes=file_bytes)
  assert os.path.isfile(tmp_path / "hf" / INDEX) == (file_bytes < 2**40)
  back = str(tmp_path / "back")
  hf.import_hf(str(tmp_path / "hf"), back, load_config(TINY))
  got = saved(back)
  assert got.keys() == params.keys()
  for path, value in params.items():
    np.testing.assert_array_equal(got[path], value, err_msg=path)
  imported = load_config(os.path.join(back, "config.json"))
  for field in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim", "window",
                "full_attention_every", "rope_base", "norm_eps", "rope_scaling", "yarn_factor", "yarn_original_context",
                "yarn_beta_fast", "yarn_beta_slow", "tie_embeddings"):
    assert imported.model[field] == cfg.model[field], field
  assert imported.model.yarn_attention_factor == pytest.approx(0.1 * np.log(4.0) + 1)
  assert open(os.path.join(back, "tokenizer.json"), "rb").read() == open(tokenizer_file, "rb").read()
  assert open(os.path.join(back, "tokenizer_config.json")).read() == open(tmp_path / "hf" / "tokenizer_config.json").read()
  # Continued pretraining from the import: plain NTP, with NITP (whose projector the import lacks and
  # keeps its fresh init) and with TST (the same model, trained on bags first).
  tst = os.path.join(os.path.dirname(TINY), "tiny_tst.py")
  for config, extra in ((TINY, []), (TINY, ["nitp.enabled=True"]), (tst, [])):
    run = load_config(config, OURS + extra + [f"train.init_from={back}"])
    fresh = nnx.to_pure_dict(nnx.state(build_model(run, nnx.Rngs(0))))
    start, init = checkpoint.by_path(checkpoint.initial_params(back, run, fresh)), checkpoint.by_path(fresh)
    assert start.keys() == init.keys()
    for path, value in start.items():
      np.testing.assert_array_equal(np.asarray(value), params.get(path, np.asarray(init[path])), err_msg=path)
    assert any(path.startswith("nitp") for path in start) == bool(extra)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, tokenizer_file):
  """A Hugging Face folder exported from a random baseline, to break in each test below."""
  root = tmp_path_factory.mktemp("valid")
  random_export(str(root / "ours"), tokenizer_file)
  hf.export_hf(str(root / "ours"), str(root / "hf"))
  return root / "hf"


def broken(hf_folder, tmp_path, config=None, drop=None, reshape=None):
  """A copy of hf_folder with config.json fields changed, a tensor dropped, or one reshaped."""
  out = tmp_path / "broken"
  shutil.copytree(hf_folder, out)
  spec = json.loads((out / "config.json").read_text())
  (out / "config.json").write_text(json.dumps({**spec, **(config or {})}))
  if drop or reshape:
    reader = Reader(str(hf_folder))
    os.remove(out / "model.safetensors")
    names = [n for n in reader.tensors if n != drop]
    shape = lambda n: (reader.shape(n)[0] + 1, *reader.shape(n)[1:]) if n == reshape else reader.shape(n)
    writer = Writer(str(out), [(n, shape(n), reader.dtype(n)) for n in names])
    for n in names:
      writer.write(n, np.resize(reader.read(n), shape(n)))
    writer.close()
  return out


@pytest.mark.parametrize("change,names", [
    (dict(config={"model_type": "llama", "architectures": ["LlamaForCausalLM"]}), ["'llama'", "not OLMo-3"]),
    (dict(drop="model.layers.1.mlp.up_proj.weight"), ["no tensor 'model.layers.1.mlp.up_proj.weight'"]),
    (dict(reshape="model.layers.0.self_attn.k_proj.weight"),
     ["'model.layers.0.self_attn.k_proj.weight' is [17, 32]", "config.json makes it [16, 32]"]),
    (dict(config={"intermediate_size": 48}), ["'model.layers.0.mlp.gate_proj.weight' is [64, 32]", "[48, 32]"]),
    (dict(config={"num_hidden_layers": 1, "layer_types": ["full_attention"]}),
     ["tensor 'model.layers.1.", "not in an OLMo-3 of its config.json"]),
    (dict(config={"layer_types": ["full_attention", "sliding_attention"]}), ["layer_types FS", "every n-th"]),
    (dict(config={"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}), ["rope_type 'dynamic'"]),
    (dict(config={"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16,
                                   "mscale": 0.7}}), ["YaRN with ['mscale']"]),
    (dict(config={"attention_bias": True}), ["attention_bias=True"]),
])
def test_mismatched_checkpoints_are_one_line_errors(hf_folder, tmp_path, capsys, change, names):
  source = broken(hf_folder, tmp_path, **change)
  out = tmp_path / "out"
  code, err = run_main("latent_jax.convert", ["--hf", str(source), "--config", TINY, "--out", str(out)], capsys)
  check_one_error_line(code, err, names)
  assert not out.exists()


def test_convert_refuses_what_it_cannot_export(tmp_path, tokenizer_file, capsys):
  """Ours -> Hugging Face: a model that is not OLMo-3-shaped, or a SentencePiece tokenizer, is refused."""
  random_export(str(tmp_path / "head"), tokenizer_file, ["model.qk_norm=head"])
  code, err = run_main("latent_jax.convert", ["--workdir", str(tmp_path / "head"), "--out", str(tmp_path / "o")], capsys)
  check_one_error_line(code, err, ["model.qk_norm='head'", "OLMo-3 is model.qk_norm='layer'"])
  assert not (tmp_path / "o").exists()


# Slow tier: transformers and torch.

def torch_and_transformers():
  torch = pytest.importorskip("torch", reason="the transformers comparisons need the hf extra: pip install -e '.[hf]'")
  transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
  torch.manual_seed(0)
  return torch, transformers


def relative(got, want):
  return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


@pytest.fixture(scope="module")
def olmo3(tmp_path_factory, tokenizer_file):
  """A tiny random Olmo3ForCausalLM saved by transformers (sliding window 16, 3 sliding : 1 full
  layers, GQA 4:2, the released YaRN), every weight drawn (norm scales around 1), and its tokenizer."""
  torch, transformers = torch_and_transformers()
  config = transformers.Olmo3Config(
      vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
      num_key_value_heads=2, rms_norm_eps=1e-6, sliding_window=16, max_position_embeddings=65536,
      rope_theta=500_000.0, rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192,
                                          "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 0.1 * np.log(8) + 1},
      eos_token_id=0, pad_token_id=1, bos_token_id=None)
  model = transformers.Olmo3ForCausalLM(config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      norm = "norm" in name
      p.copy_(torch.randn_like(p) * (0.1 if norm else 0.15) + (1.0 if norm else 0.0))
  folder = tmp_path_factory.mktemp("olmo3") / "hf"
  model.save_pretrained(folder)
  shutil.copyfile(tokenizer_file, folder / "tokenizer.json")
  out = str(folder.parent / "ours")
  hf.import_hf(str(folder), out, load_config(TINY))
  return model, folder, out


@pytest.mark.slow
def test_olmo3_imports_with_transformers_logits(olmo3):
  """Float32 logits of the imported model within 1e-5 relative of transformers', at 48 tokens (3x
  the window) over two rows; without YaRN on its full layer they would be off by far more."""
  torch, _ = torch_and_transformers()
  model, _, out = olmo3
  tokens = np.random.default_rng(0).integers(0, 300, size=(2, 48))
  with torch.no_grad():
    want = model(torch.tensor(tokens)).logits.double().numpy()
  ours, cfg, _ = load_model(out)
  assert cfg.model.rope_scaling == "yarn" and (cfg.model.window, cfg.model.full_attention_every) == (16, 4)
  assert relative(ours(jnp.asarray(tokens)).logits, want) < 1e-5
  cfg.model.rope_scaling = "none"
  plain = nnx.merge(abstract_model(cfg.model)[0], nnx.state(ours))
  assert relative(plain(jnp.asarray(tokens)).logits, want) > 1e-3


@pytest.mark.slow
def test_olmo3_greedy_continuation_and_tokenizer(olmo3):
  """The same greedy continuation as transformers' generate (past the window, through the KV cache),
  and the same token ids from AutoTokenizer as from our tokenizer of the export."""
  torch, transformers = torch_and_transformers()
  model, folder, out = olmo3
  ours, _, tokenizer = load_model(out)
  prompt = np.random.default_rng(1).integers(2, 300, size=(1, 10))
  with torch.no_grad():
    want = model.generate(torch.tensor(prompt), do_sample=False, max_new_tokens=30).numpy()
  got = np.asarray(generate(ours, prompt, 30, jax.random.key(0), temperature=0.0))
  assert want.shape[1] == 40 or want[0, -1] == 0  # all 30 tokens, or stopped at EOS
  np.testing.assert_array_equal(got[:, :want.shape[1]], want)
  auto = transformers.AutoTokenizer.from_pretrained(folder)
  for text in TEXTS:
    assert auto(text)["input_ids"] == tokenizer.encode(text)
    assert auto.decode(tokenizer.encode(text)) == text == tokenizer.decode(auto(text)["input_ids"])


@pytest.mark.slow
def test_trained_baseline_exports_to_transformers(tmp_path, corpus_dir, tokenizer_file):
  """A baseline trained 2 steps (YaRN, window 8, every 2nd layer full; Hugging Face tokenizer) ->
  Hugging Face: AutoModelForCausalLM gives our logits within 1e-5 relative at 40 tokens, the same
  greedy continuation, and AutoTokenizer our ids."""
  torch, transformers = torch_and_transformers()
  from latent_jax.train.loop import train
  run = str(tmp_path / "run")
  train(load_config(TINY, OURS + [f"data.source={corpus_dir}", f"data.tokenizer={tokenizer_file}", "train.steps=2",
                                  "optim.warmup_steps=1", "train.eval_every=0"]), run)
  hf.export_hf(run, str(tmp_path / "hf"))
  model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
  ours, _, tokenizer = load_model(run)
  tokens = np.random.default_rng(2).integers(0, 300, size=(2, 40))
  with torch.no_grad():
    want = model(torch.tensor(tokens)).logits.double().numpy()
    continuation = model.generate(torch.tensor(tokens[:1, :6]), do_sample=False, max_new_tokens=20).numpy()
  assert relative(ours(jnp.asarray(tokens)).logits, want) < 1e-5
  got = np.asarray(generate(ours, tokens[:1, :6], 20, jax.random.key(0), temperature=0.0))
  np.testing.assert_array_equal(got[:, :continuation.shape[1]], continuation)
  auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
  for text in TEXTS:
    assert auto(text)["input_ids"] == tokenizer.encode(text)
