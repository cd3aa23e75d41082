"""Mixture of experts in and out of Hugging Face (`python -m latent_jax.convert`, docs/interop.md) and through
generation, eval and export (issue 37, items 6 and 7).

Quick tier, without torch: a random MoE baseline (post-norm: FlexOlmo; pre-norm: OLMoE) goes to a Hugging Face
folder and back bit for bit (experts one tensor per expert, or fused as transformers 5 holds them); what Hugging
Face's MoE models cannot express is one `error:` line both ways; a random MoE generates greedily through the KV
cache the tokens full forwards give.
Slow tier: the same for ConceptLM with sparse modules (its concept cache); a tiny MoE trained 3 steps generates
through the cache as full forwards, evaluates (validation, a proxy task file) and exports, the export giving the
run's logits, scores and text. With transformers and torch (`pip install -e ".[hf]"`): tiny random
FlexOlmoForCausalLM and OlmoeForCausalLM built by transformers import with its float32 logits within 1e-5
relative and its greedy continuation; the trained MoE (both block orders) exports and AutoModelForCausalLM gives
our logits within 1e-5 and our greedy continuation; `eval --lm_eval_tasks` runs on the MoE, and lm-eval's own
`hf` model on its export gives the same loglikelihoods.
"""
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import ROOT, TINY, TINY_OVERRIDES
from latent_jax import load_config
from latent_jax.infer import generate, load_model
from latent_jax.interop import hf
from latent_jax.interop.safetensors_stream import Reader
import test_interop
from test_interop import relative, saved, torch_and_transformers
from test_cli_errors import check_one_error_line, run_main

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing from the hub: every model here is built in the test
TINY_MOE = os.path.join(ROOT, "configs", "tiny_moe.py")
# A MoE baseline FlexOlmo / OLMoE express: full attention, every layer sparse, top-2 of 4 experts.
MOE = TINY_OVERRIDES + ["model.moe.enabled=True", "model.moe.num_experts=4", "model.moe.top_k=2",
                        "model.moe.expert_dim=16", "model.window=0"]


def random_moe(out, tokenizer_file, order="post", extra=()):
  """An export folder of a MoE baseline with random params (test_interop.random_export's)."""
  return test_interop.random_export(out, tokenizer_file, MOE[len(TINY_OVERRIDES):] + [f"model.block_order={order}",
                                                                                      *extra])


@pytest.mark.parametrize("order,architecture", [("post", "FlexOlmoForCausalLM"), ("pre", "OlmoeForCausalLM")])
def test_moe_round_trip_without_torch(tmp_path, hf_tokenizer_file, order, architecture):
  """Ours -> FlexOlmo / OLMoE -> ours: the same params bit for bit and the same model section; the experts in
  the files' form (one tensor per expert, as save_pretrained writes them)."""
  cfg, params = random_moe(str(tmp_path / "ours"), hf_tokenizer_file, order, ["model.moe.norm_topk_prob=True"])
  hf.export_hf(str(tmp_path / "ours"), str(tmp_path / "hf"))
  spec = json.loads((tmp_path / "hf" / "config.json").read_text())
  assert spec["architectures"] == [architecture]
  assert (spec["num_experts"], spec["num_experts_per_tok"], spec["intermediate_size"], spec["norm_topk_prob"]) == (
      4, 2, 16, True)
  names = Reader(str(tmp_path / "hf")).tensors
  assert Reader(str(tmp_path / "hf")).shape("model.layers.1.mlp.experts.3.down_proj.weight") == (32, 16)
  assert ("model.layers.0.input_layernorm.weight" in names) == (order == "pre")
  assert ("model.layers.0.post_feedforward_layernorm.weight" in names) == (order == "post")
  back = str(tmp_path / "back")
  hf.import_hf(str(tmp_path / "hf"), back, load_config(TINY))  # a dense recipe: the experts come from config.json
  got = saved(back)
  assert got.keys() == params.keys()
  for path, value in params.items():
    np.testing.assert_array_equal(got[path], value, err_msg=path)
  imported = load_config(os.path.join(back, "config.json")).model
  for field in ("num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim", "block_order", "window",
                "norm_eps", "rope_base", "tie_embeddings", "rope_scaling", "yarn_factor", "yarn_original_context"):
    assert imported[field] == cfg.model[field], field
  for field in ("enabled", "num_experts", "top_k", "expert_dim", "router", "norm_topk_prob", "shared_experts",
                "every", "first_dense", "capacity_factor"):
    assert imported.moe[field] == cfg.model.moe[field], field


@pytest.mark.parametrize("extra,names", [
    (["model.moe.shared_experts=1"], ["model.moe.shared_experts=1", "set model.moe.shared_experts=0", "FlexOlmo"]),
    (["model.moe.router=sigmoid"], ["model.moe.router='sigmoid'", "softmax"]),
    (["model.moe.first_dense=1"], ["model.moe.first_dense=1", "every layer sparse"]),
    (["model.moe.every=2"], ["model.moe.every=2"]),
    (["model.moe.capacity_factor=1.0"], ["model.moe.capacity_factor=1.0", "dropless"]),
    (["model.window=8"], ["model.window=8", "full attention"]),
    (["model.qk_norm=head"], ["model.qk_norm='head'"]),
])
def test_moe_that_transformers_cannot_express_is_refused(tmp_path, hf_tokenizer_file, capsys, extra, names):
  random_moe(str(tmp_path / "ours"), hf_tokenizer_file, "post", extra)
  code, err = run_main("latent_jax.convert", ["--workdir", str(tmp_path / "ours"), "--out", str(tmp_path / "o")],
                       capsys)
  check_one_error_line(code, err, names)
  assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def flex_folder(tmp_path_factory, hf_tokenizer_file):
  """A FlexOlmo folder exported from a random MoE, to break in the test below."""
  root = tmp_path_factory.mktemp("flex")
  random_moe(str(root / "ours"), hf_tokenizer_file)
  hf.export_hf(str(root / "ours"), str(root / "hf"))
  return root / "hf"


def fused(folder, out):
  """A copy of a FlexOlmo folder with each layer's experts fused as transformers 5 holds them
  (save_pretrained(save_original_format=False)): gate_up_proj [E, 2f, d], down_proj [E, d, f]."""
  from latent_jax.interop.safetensors_stream import Writer
  shutil.copytree(folder, out)
  os.remove(out / "model.safetensors")
  reader = Reader(str(folder))
  plain = {n: reader.read(n) for n in reader.tensors if ".experts." not in n}
  spec = json.loads((folder / "config.json").read_text())
  for layer in range(spec["num_hidden_layers"]):
    expert = lambda e, kind: reader.read(f"model.layers.{layer}.mlp.experts.{e}.{kind}.weight")
    experts = range(spec["num_experts"])
    plain[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = np.stack(
        [np.concatenate([expert(e, "gate_proj"), expert(e, "up_proj")]) for e in experts])
    plain[f"model.layers.{layer}.mlp.experts.down_proj"] = np.stack([expert(e, "down_proj") for e in experts])
  writer = Writer(str(out), [(n, v.shape, v.dtype) for n, v in plain.items()])
  for n, v in plain.items():
    writer.write(n, v)
  writer.close()
  return out


def test_fused_experts_import_as_the_files_form(flex_folder, tmp_path):
  """A checkpoint with transformers 5's fused experts imports to the same params as the per-expert files."""
  hf.import_hf(str(flex_folder), str(tmp_path / "a"), load_config(TINY))
  hf.import_hf(str(fused(flex_folder, tmp_path / "fused")), str(tmp_path / "b"), load_config(TINY))
  a, b = saved(str(tmp_path / "a")), saved(str(tmp_path / "b"))
  assert a.keys() == b.keys()
  for path in a:
    np.testing.assert_array_equal(a[path], b[path], err_msg=path)


def test_recipes_moe_section_follows_the_checkpoint(flex_folder, tmp_path, hf_tokenizer_file):
  """The model section is the checkpoint's: a dense OLMo-3 imported with the MoE recipe is dense, a FlexOlmo whose
  config.json names its experts num_local_experts (FlexOlmoConfig's alias) imports with them."""
  test_interop.random_export(str(tmp_path / "dense"), hf_tokenizer_file)
  hf.export_hf(str(tmp_path / "dense"), str(tmp_path / "dense_hf"))
  assert not hf.import_hf(str(tmp_path / "dense_hf"), str(tmp_path / "a"), load_config(TINY_MOE)).model.moe.enabled
  spec = json.loads((flex_folder / "config.json").read_text())
  spec["num_local_experts"] = spec.pop("num_experts")
  source = test_interop.broken(flex_folder, tmp_path)
  (source / "config.json").write_text(json.dumps(spec))
  assert hf.import_hf(str(source), str(tmp_path / "b"), load_config(TINY)).model.moe.num_experts == 4


QWEN = {"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], "shared_expert_intermediate_size": 64}


@pytest.mark.parametrize("config,names", [
    (QWEN, ["'qwen2_moe'", "FlexOlmo ('flex_olmo', FlexOlmoForCausalLM)", "OLMoE ('olmoe', OlmoeForCausalLM)"]),
    ({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}, ["'mixtral'", "OLMo-3 ('olmo3'"]),
    ({"shared_expert_intermediate_size": 64}, ["FlexOlmo with shared_expert_intermediate_size=64", "no shared experts"]),
    ({"sliding_window": 16}, ["FlexOlmo with sliding_window=16", "full attention"]),
    ({"model_type": "olmoe", "architectures": ["OlmoeForCausalLM"], "clip_qkv": 8.0}, ["OLMoE with clip_qkv=8.0"]),
    ({"num_experts_per_tok": 5}, ["num_experts_per_tok=5 of num_experts=4"]),
    ({"num_experts": 3}, ["'model.layers.0.mlp.gate.weight' is [4, 32]", "[3, 32]"]),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, ["rope_type 'linear'"]),
])
def test_unsupported_hf_moe_checkpoints_are_one_line_errors(flex_folder, tmp_path, capsys, config, names):
  source = test_interop.broken(flex_folder, tmp_path, config=config)
  code, err = run_main("latent_jax.convert", ["--hf", str(source), "--config", TINY, "--out", str(tmp_path / "o")],
                       capsys)
  check_one_error_line(code, err, names)
  assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------ item 7: a trained MoE generates, evaluates, exports

def train_moe(workdir, corpus_dir, tokenizer_file, order="post", extra=()):
  from latent_jax.train.loop import train
  cfg = load_config(TINY_MOE, MOE + [*extra, f"model.block_order={order}", f"data.source={corpus_dir}",
                                     f"data.tokenizer={tokenizer_file}", "train.steps=3", "optim.warmup_steps=1",
                                     "train.eval_every=0", "train.checkpoint_every=3"])
  train(cfg, workdir)
  return cfg


@pytest.fixture(scope="module")
def trained_moe(tmp_path_factory, corpus_dir, hf_tokenizer_file):
  """A tiny MoE (top-2 of 4, every layer sparse, post-norm) trained 3 steps with a Hugging Face tokenizer."""
  run = str(tmp_path_factory.mktemp("moe") / "run")
  train_moe(run, corpus_dir, hf_tokenizer_file)
  return run


def greedy_by_full_forwards(model, prompt, new):
  """Greedy decoding without a cache: a full forward over each prefix (the model is causal, so one padded
  length serves every prefix)."""
  graphdef, params = nnx.split(model)
  forward = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t).logits)
  tokens = np.zeros((prompt.shape[0], prompt.shape[1] + new), np.int32)
  tokens[:, :prompt.shape[1]] = prompt
  for i in range(prompt.shape[1], tokens.shape[1]):
    tokens[:, i] = np.argmax(forward(params, jnp.asarray(tokens))[:, i - 1], axis=-1)
  return tokens


def test_moe_greedy_generation_through_the_cache(tmp_path, hf_tokenizer_file):
  """infer.generate (prompt prefilled into the KV cache, then a token a step) on a random pre-norm MoE gives the
  tokens of greedy full forwards without a cache (the trained post-norm one: the slow tier below)."""
  random_moe(str(tmp_path / "ours"), hf_tokenizer_file, "pre")
  model = load_model(str(tmp_path / "ours"))[0]
  prompt = np.random.default_rng(0).integers(2, 300, size=(2, 5))
  got = np.asarray(generate(model, prompt, 10, jax.random.key(0), temperature=0.0))
  np.testing.assert_array_equal(got, greedy_by_full_forwards(model, prompt, 10))


@pytest.mark.slow  # ConceptLM's decode compiles: ~1 min on the shared 2 cores
def test_concept_moe_greedy_generation_through_the_caches():
  """ConceptLM with every module's MLP sparse: generate (KV cache and concept cache: the concept module runs as a
  chunk completes, inside the prompt too) gives the tokens of greedy full forwards."""
  from latent_jax import build_model
  cfg = load_config(os.path.join(ROOT, "configs", "tiny_ncp.py"), TINY_OVERRIDES + MOE[len(TINY_OVERRIDES):] + [
      "model.num_segments=4", "model.codebook_size=16", "model.encoder_layers=2", "model.concept_layers=1",
      "model.decoder_layers=1"])
  model = build_model(cfg.model, nnx.Rngs(0))
  prompt = np.random.default_rng(3).integers(0, 300, size=(2, 6))
  got = np.asarray(generate(model, prompt, 9, jax.random.key(0), temperature=0.0))
  np.testing.assert_array_equal(got, greedy_by_full_forwards(model, prompt, 9))


@pytest.mark.slow  # a training, eval, export and the generate command: compiles
def test_trained_moe_generates_evaluates_and_exports(trained_moe, tmp_path, capsys):
  """Greedy generation through the KV cache equals full forwards; eval gives validation and proxy scores; the
  export gives the same logits, scores and generated text (python -m latent_jax.generate on both)."""
  model, cfg, _ = load_model(trained_moe)
  assert cfg.model.moe.enabled
  prompt = np.random.default_rng(0).integers(2, 300, size=(2, 5))
  got = np.asarray(generate(model, prompt, 12, jax.random.key(0), temperature=0.0))
  np.testing.assert_array_equal(got, greedy_by_full_forwards(model, prompt, 12))

  tasks = tmp_path / "tasks.jsonl"
  tasks.write_text("".join(json.dumps(r) + "\n" for r in [
      {"prompt": "Kar lon", "continuation": " mith.", "source": "toy", "capability": "text"},
      {"prompt": "Seth", "choices": [" tav.", " lon mith.", " kar."], "gold": 1, "source": "toy", "capability": "text"}]))
  results = []
  for directory in (trained_moe, str(tmp_path / "export")):
    if directory != trained_moe:
      from latent_jax.export import main as export_main
      export_main(["--workdir", trained_moe, "--out", directory])
    capsys.readouterr()
    from latent_jax.eval import main as eval_main
    eval_main(["--workdir", directory, "--tasks", str(tasks), "--val"])
    results.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
  for result in results:
    assert result["step"] == 3 and 0 < result["val_loss"] < 10
    assert np.isfinite(result["proxy/text/nll"]) and 0 <= result["proxy/text/acc"] <= 1
  for key in ("val_loss", "proxy/text/nll", "proxy/text/margin"):
    assert results[1][key] == pytest.approx(results[0][key], rel=1e-6), key

  exported = load_model(str(tmp_path / "export"))[0]
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 300, size=(2, 24)))
  np.testing.assert_array_equal(exported(tokens).logits, model(tokens).logits)
  texts = []
  from latent_jax.generate import main as generate_main
  for directory in (trained_moe, str(tmp_path / "export")):
    capsys.readouterr()
    generate_main(["--workdir", directory, "--prompt", "Kar lon", "--temperature=0", "--max_new_tokens=8"])
    texts.append(capsys.readouterr().out)
  assert texts[0] == texts[1] and texts[0].startswith("Kar lon")


# ------------------------------------------------------------------------------------- slow tier: transformers

def random_hf(kind, folder, tokenizer_file, files_form=True, **extra):
  """A tiny random FlexOlmoForCausalLM or OlmoeForCausalLM saved by transformers (one tensor per expert, or
  with `files_form` False its fused experts), every weight drawn (norm scales around 1), with the test tokenizer."""
  torch, transformers = torch_and_transformers()
  config = getattr(transformers, f"{kind}Config")(
      vocab_size=320, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
      num_key_value_heads=2, num_experts=6, num_experts_per_tok=2, eos_token_id=0, pad_token_id=1,
      bos_token_id=None, **extra)
  model = getattr(transformers, f"{kind}ForCausalLM")(config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      norm = "norm" in name
      p.copy_(torch.randn_like(p) * (0.1 if norm else 0.15) + (1.0 if norm else 0.0))
  model.save_pretrained(folder, save_original_format=files_form)
  shutil.copyfile(tokenizer_file, folder / "tokenizer.json")
  return model


@pytest.mark.slow
@pytest.mark.parametrize("kind,extra,order", [
    ("FlexOlmo", {}, "post"), ("FlexOlmo", {"norm_topk_prob": True, "files_form": False}, "post"), ("Olmoe", {}, "pre")])
def test_hf_moe_imports_with_transformers_logits(tmp_path, hf_tokenizer_file, kind, extra, order):
  """Float32 logits of the imported model within 1e-5 relative of transformers' (two rows of 40 tokens), and
  the same 20-token greedy continuation through the KV cache; saved with one tensor per expert or fused."""
  torch, _ = torch_and_transformers()
  model = random_hf(kind, tmp_path / "hf", hf_tokenizer_file, **extra)
  from safetensors import safe_open
  with safe_open(tmp_path / "hf" / "model.safetensors", "np") as f:
    assert ("model.layers.0.mlp.experts.gate_up_proj" in f.keys()) == (extra.get("files_form") is False)
  out = str(tmp_path / "ours")
  assert run_main_ok(["--hf", str(tmp_path / "hf"), "--config", TINY_MOE, "--out", out])
  tokens = np.random.default_rng(0).integers(0, 320, size=(2, 40))
  with torch.no_grad():
    want = model(torch.tensor(tokens)).logits.double().numpy()
    continuation = model.generate(torch.tensor(tokens[:1, :6]), do_sample=False, max_new_tokens=20).numpy()
  ours, cfg, _ = load_model(out)
  assert (cfg.model.block_order, cfg.model.moe.num_experts, cfg.model.moe.norm_topk_prob) == (
      order, 6, bool(extra.get("norm_topk_prob")))
  error = relative(ours(jnp.asarray(tokens)).logits, want)
  print(f"\nrelative logit difference: {error:.1e}")
  assert error < 1e-5
  got = np.asarray(generate(ours, tokens[:1, :6], 20, jax.random.key(0), temperature=0.0))
  np.testing.assert_array_equal(got[:, :continuation.shape[1]], continuation)


def run_main_ok(argv):
  from latent_jax.convert import main
  main(argv)
  return True


@pytest.mark.slow
@pytest.mark.parametrize("order", ["post", "pre"])
def test_trained_moe_exports_to_transformers(tmp_path, corpus_dir, hf_tokenizer_file, trained_moe, order):
  """A MoE trained 3 steps -> Hugging Face (FlexOlmo; OLMoE with YaRN): AutoModelForCausalLM gives our logits
  within 1e-5 relative and our greedy continuation."""
  torch, transformers = torch_and_transformers()
  run = trained_moe if order == "post" else str(tmp_path / "run")
  if order == "pre":
    train_moe(run, corpus_dir, hf_tokenizer_file, "pre", ["model.rope_scaling=yarn", "model.yarn_original_context=16",
                                                          "model.yarn_factor=4.0"])
  assert run_main_ok(["--workdir", run, "--out", str(tmp_path / "hf")])
  model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
  assert type(model).__name__ == {"post": "FlexOlmoForCausalLM", "pre": "OlmoeForCausalLM"}[order]
  ours = load_model(run)[0]
  tokens = np.random.default_rng(2).integers(0, 300, size=(2, 32))
  with torch.no_grad():
    want = model(torch.tensor(tokens)).logits.double().numpy()
    continuation = model.generate(torch.tensor(tokens[:1, :6]), do_sample=False, max_new_tokens=20).numpy()
  error = relative(ours(jnp.asarray(tokens)).logits, want)
  print(f"\nrelative logit difference: {error:.1e}")
  assert error < 1e-5
  got = np.asarray(generate(ours, tokens[:1, :6], 20, jax.random.key(0), temperature=0.0))
  np.testing.assert_array_equal(got[:, :continuation.shape[1]], continuation)


MC = [{"question": f"{w}.", "choices": [" Kar lon.", " Tam mis sed.", " Nul."], "label": i % 3}
      for i, w in enumerate(["Kar lon mith sethal", "Nur tad mis kap", "Lol sen tam", "Mip tav nuth ses kal"])]


@pytest.mark.slow
def test_lm_eval_on_a_moe_matches_the_hf_model(trained_moe, tmp_path, capsys):
  """eval --lm_eval_tasks on the trained MoE (a multiple-choice task written here, offline) prints its accuracy;
  lm-eval's own `hf` model on the MoE's FlexOlmo export gives the same per-example loglikelihoods (within 1e-4)."""
  os.environ["HF_DATASETS_OFFLINE"] = "1"
  lm_eval = pytest.importorskip("lm_eval", reason="needs the eval extra: pip install -e '.[eval]'")
  pytest.importorskip("transformers", reason="the hf model needs the hf extra: pip install -e '.[hf]'")
  from lm_eval.api.registry import get_model
  from lm_eval.tasks import TaskManager
  from latent_jax.eval import main as eval_main
  from latent_jax.harness import LatentJaxLM
  (tmp_path / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in MC))
  (tmp_path / "moe_mc.yaml").write_text(
      f"task: moe_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / 'mc.jsonl'}\n"
      "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
      "doc_to_target: label\nmetric_list:\n  - metric: acc\n")
  capsys.readouterr()
  eval_main(["--workdir", trained_moe, "--lm_eval_tasks", "moe_mc", "--include_path", str(tmp_path), "--batch_size",
             "4", "--noval"])
  line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert 0 <= line["lm_eval/moe_mc/acc"] <= 1
  run_main_ok(["--workdir", trained_moe, "--out", str(tmp_path / "hf")])
  manager = TaskManager(include_path=str(tmp_path))
  scores = []
  for model in (LatentJaxLM(workdir=trained_moe, batch_size=4, max_length=24),
                get_model("hf")(pretrained=str(tmp_path / "hf"), dtype="float32", device="cpu", batch_size=4,
                                max_length=24)):
    out = lm_eval.simple_evaluate(model=model, tasks=["moe_mc"], task_manager=manager, log_samples=True)
    scores.append([r[0][0] for s in sorted(out["samples"]["moe_mc"], key=lambda s: s["doc_id"]) for r in s["resps"]])
  assert len(scores[0]) == 3 * len(MC)
  diff = max(abs(g - w) for g, w in zip(*scores))
  print(f"\nmax |loglikelihood ours - hf|: {diff:.1e} over {len(scores[0])} choices")
  assert diff < 1e-4
