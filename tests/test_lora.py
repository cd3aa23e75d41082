"""LoRA (docs/lora.md): factors beside the weights of a trained model, the scanned stacks' included,
which alone train; every reader (export, eval, convert, train.init_from) gets them merged."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from conftest import ROOT, TINY, TINY_OVERRIDES
from latent_jax import ConfigError, build_model, checkpoint, load_config
from latent_jax.data.tokenizer import Tokenizer
from latent_jax.nn import abstract_model
from latent_jax.nn.lora import A, B, adapt, apply_lora, lora_merge, without_factors
from latent_jax.infer import load
from latent_jax.train.loop import train
from test_cli_errors import check_one_error_line, listing, run_main

CONFIGS = os.path.join(ROOT, "configs")
NCP_CONFIG = os.path.join(CONFIGS, "tiny_ncp.py")
NITP_CONFIG = os.path.join(CONFIGS, "tiny_nitp.py")
NCP = TINY_OVERRIDES + ["model.num_segments=4", "model.codebook_size=8", "model.residual_hidden=4", "model.chunk_size=4"]
# test_interop's baseline, which a Hugging Face OLMo-3 expresses (window 8, every 2nd layer full, YaRN).
OURS = TINY_OVERRIDES + ["model.rope_scaling=yarn", "model.yarn_original_context=16", "model.yarn_factor=4.0"]
LORA_STEPS = 3


def run_overrides(base, corpus_dir, *extra):
  return base + [f"data.source={corpus_dir}", "train.steps=2", "train.eval_every=0", "optim.warmup_steps=1", *extra]


def lora_overrides(base, corpus_dir, source, *extra):
  """A LoRA run of LORA_STEPS steps from `source`, validated at its last step."""
  return run_overrides(base, corpus_dir, "lora.enabled=True", f"train.init_from={source}", f"train.steps={LORA_STEPS}",
                       f"train.eval_every={LORA_STEPS}", *extra)


def random_source(out, config, overrides, tokenizer_file):
  """An export folder (as python -m latent_jax.export writes one) of a freshly initialised model, with a Hugging
  Face tokenizer (so that a run adapting it converts): a source to adapt, trained or not."""
  cfg = load.inference_config(load_config(config, overrides))
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(os.path.join(out, "params"), nnx.to_pure_dict(nnx.state(build_model(cfg.model, nnx.Rngs(1)))))
  checkpointer.wait_until_finished()
  load.write_beside(out, cfg, Tokenizer(tokenizer_file))
  return out


@pytest.fixture(scope="module")
def baseline_source(tmp_path_factory, hf_tokenizer_file):
  return random_source(str(tmp_path_factory.mktemp("sources") / "baseline"), TINY, OURS, hf_tokenizer_file)


@pytest.fixture(scope="module")
def ncp_source(tmp_path_factory, hf_tokenizer_file):
  return random_source(str(tmp_path_factory.mktemp("sources") / "ncp"), NCP_CONFIG, NCP, hf_tokenizer_file)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, corpus_dir, baseline_source):
  """A LoRA run of the baseline source: (workdir, its overrides)."""
  overrides = lora_overrides(OURS, corpus_dir, baseline_source)
  workdir = str(tmp_path_factory.mktemp("lora") / "run")
  train(load_config(TINY, overrides), workdir)
  return workdir, overrides


def named(tree):
  return {k: np.asarray(v) for k, v in checkpoint.by_path(tree).items()}


def test_merge_is_w_plus_alpha_over_r_a_b():
  """lora_merge and apply_lora against NumPy in float64, on a stacked [layers, in, out] weight."""
  rng = np.random.default_rng(0)
  w, a, b = (rng.normal(size=s).astype(np.float32) for s in ((3, 5, 7), (3, 5, 2), (3, 2, 7)))
  want = w.astype(np.float64) + 16.0 / 2 * np.einsum("lir,lro->lio", a.astype(np.float64), b.astype(np.float64))
  np.testing.assert_allclose(np.asarray(lora_merge(w, a, b, 16.0 / 2)), want, rtol=1e-6, atol=1e-6)
  tree = {"blocks": {"q": w, "q" + A: a, "q" + B: b, "v": w}, "embed": w[0]}
  merged = apply_lora(tree, 16.0)
  np.testing.assert_allclose(np.asarray(merged["blocks"]["q"]), want, rtol=1e-6, atol=1e-6)
  assert merged["blocks"]["v"] is w and merged["embed"] is tree["embed"] and merged["blocks"]["q" + A] is a
  assert without_factors(merged).keys() == {"blocks", "embed"} and without_factors(merged)["blocks"].keys() == {"q", "v"}
  np.testing.assert_array_equal(np.asarray(lora_merge(w, a, np.zeros_like(b), 8.0)), w)  # B = 0: W itself


def test_bad_lora_settings_are_one_config_error_each():
  lora = ["lora.enabled=True", "train.init_from=runs/x"]
  for extra, match in [([], None), (["lora.rank=auto"], None),
                       (["lora.rank=0"], "lora.rank: must be a positive integer or 'auto', got 0"),
                       (["lora.rank=x"], "lora.rank: must be a positive integer or 'auto', got 'x'"),
                       (["lora.alpha=0"], "lora.alpha: must be a number > 0"),
                       (["lora.targets=attn/(q"], "lora.targets: 'attn/\\(q' is not a valid regex")]:
    if match is None:
      load_config(NCP_CONFIG, NCP + lora + extra)
    else:
      with pytest.raises(ConfigError, match=match):
        load_config(NCP_CONFIG, NCP + lora + extra)
  with pytest.raises(ConfigError, match="lora.enabled: LoRA adapts a trained model: set train.init_from="):
    load_config(TINY, TINY_OVERRIDES + ["lora.enabled=True"])
  with pytest.raises(ConfigError, match="lora.rank: 'auto' .* model.name='baseline' does not have"):
    load_config(TINY, TINY_OVERRIDES + lora + ["lora.rank=auto"])
  with pytest.raises(ConfigError, match="optim.trainable: 'lora' trains the LoRA factors"):
    load_config(TINY, TINY_OVERRIDES + ["optim.trainable=lora"])
  with pytest.raises(ConfigError, match=r"lora.targets: 'attention' matches no weight .* such as blocks/blocks/attn/k"):
    abstract_model(load_config(TINY, TINY_OVERRIDES + lora + ["lora.targets=attention"]))


@pytest.mark.parametrize("config", ["tiny_ncp.py", "tiny_ncp_sizes"])
def test_auto_rank_matches_vq_adaptations_count(config):
  """lora.rank='auto' = max(1, round(vq / per_rank)), where vq counts what optim.trainable=vq trains (the codebook
  [S, N, d/S], the heads [d, S*N] and their norm [d], counted here from the model config) and per_rank is
  the LoRA count per unit of rank (sum over targets of (in + out) x layers): so the LoRA count lies within half
  a rank's worth of vq, unless vq is below half of it (rank 1)."""
  overrides = [] if config == "tiny_ncp.py" else NCP + ["model.codebook_size=64", "lora.targets=.*attn/(q|v)"]
  cfg = load_config(NCP_CONFIG, overrides + ["lora.enabled=True", "lora.rank=auto", "train.init_from=runs/x"])
  m = cfg.model
  vq = m.codebook_size * m.d_model + m.d_model * m.num_segments * m.codebook_size + m.d_model
  shapes = {k: v.shape for k, v in checkpoint.by_path(nnx.to_pure_dict(abstract_model(cfg)[1])).items()}
  factors = {k: s for k, s in shapes.items() if k.endswith((A, B))}
  count = sum(int(np.prod(s)) for s in factors.values())
  rank = {s[-1] for k, s in factors.items() if k.endswith(A)}
  assert len(rank) == 1 and (rank := rank.pop()) >= 2
  per_rank = count // rank
  assert abs(count - vq) <= per_rank / 2, (count, vq, per_rank, rank)
  # Every scanned stack's matrices are adapted, with their leading layer axis.
  for stack, depth in (("encoder", m.encoder_layers), ("concept", m.concept_layers), ("decoder", m.decoder_layers)):
    assert shapes[f"{stack}/blocks/attn/q{A}"] == (depth, m.d_model, rank)


def start_params(cfg):
  """The params a LoRA run starts from, as the train loop makes them: a fresh model, then train.init_from's."""
  fresh = nnx.to_pure_dict(nnx.state(build_model(cfg, nnx.Rngs(cfg.train.seed))))
  return checkpoint.initial_params(cfg.train.init_from, cfg, fresh)


@pytest.mark.parametrize("kind", ["baseline", "concept", "nitp_mtp"])
def test_step_zero_is_the_source_bitwise(kind, corpus_dir, request):
  """B starts at zero: the LoRA model's logits (the train step's params transform) are its source's, bit for bit;
  on the baseline, on ConceptLM (three scanned stacks) and on a baseline with the NITP and MTP heads."""
  config, base, source = {"baseline": (TINY, OURS, "baseline_source"), "concept": (NCP_CONFIG, NCP, "ncp_source"),
                          "nitp_mtp": (NITP_CONFIG, OURS, "baseline_source")}[kind]
  source = request.getfixturevalue(source)
  cfg = load_config(config, lora_overrides(base, corpus_dir, source, *(["mtp.enabled=True"] if kind == "nitp_mtp" else [])))
  params = start_params(cfg)
  flat = named(params)
  factors = [k for k in flat if k.endswith(B)]
  assert factors and all(not flat[k].any() for k in factors)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, cfg.data.seq_len)), jnp.int32)
  graphdef = abstract_model(cfg)[0]
  got = jax.jit(lambda p: nnx.merge(graphdef, adapt(p, cfg))(tokens).logits)(params)
  model, _, _ = load.load_model(source)
  src_graph, src_params = nnx.split(model)
  want = jax.jit(lambda p: nnx.merge(src_graph, p)(tokens).logits)(src_params)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.slow  # trains the LoRA run: > 20 s on 2 cores
def test_training_moves_only_the_adapters(lora_run, baseline_source):
  """After the LoRA run's steps every frozen parameter is its source's, bit for bit; the B factors have moved;
  the optimiser state holds AdamW's two moments of the factors alone."""
  workdir, overrides = lora_run
  cfg = load_config(TINY, overrides)
  _, abstract = abstract_model(cfg)
  manager, step = checkpoint.find_checkpoint(workdir)
  assert step == LORA_STEPS
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(abstract))
  got = named(manager.restore_params(step, target))
  src_cfg, src_step = checkpoint.load_config(baseline_source)
  src = named(checkpoint.saved_params(baseline_source, src_cfg, src_step))
  factors = {k for k in got if k.endswith((A, B))}
  assert got.keys() - factors == src.keys()
  for name in src:
    np.testing.assert_array_equal(got[name], src[name], err_msg=name)
  assert all(got[k].any() for k in factors if k.endswith(B))
  meta = manager.restore_meta(step)
  assert meta["config"]["lora"]["enabled"] is True
  opt = checkpoint.Checkpoints(workdir, read_only=True).read(step, opt_state=ocp.args.StandardRestore())["opt_state"]
  moments = sum(int(np.prod(np.shape(x))) for x in jax.tree.leaves(opt) if np.ndim(x) >= 1)
  assert moments == 2 * sum(got[k].size for k in factors)


@pytest.mark.slow  # trains the LoRA run: > 20 s on 2 cores
def test_merged_export_scores_like_the_run(lora_run, tmp_path):
  """export merges the adapters (W + alpha / r A B): a plain model with lora disabled, whose validation loss is
  the run's own at its last step (metrics.jsonl) within 1e-5; eval reads the workdir merged as well."""
  from latent_jax.eval import evaluate_dir
  from latent_jax.export import export
  workdir, _ = lora_run
  out = export(workdir, str(tmp_path / "export"))
  cfg = json.loads(open(os.path.join(out, "config.json")).read())
  assert cfg["lora"]["enabled"] is False
  params = named(checkpoint.saved_params(out, load_config(os.path.join(out, "config.json"))))
  assert params and not any("lora" in k for k in params)
  logged = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  want = [r for r in logged if "val_loss" in r][-1]
  assert want["step"] == LORA_STEPS
  assert evaluate_dir(out)["val_loss"] == pytest.approx(want["val_loss"], abs=1e-5)
  assert evaluate_dir(workdir)["val_loss"] == pytest.approx(want["val_loss"], abs=1e-5)


@pytest.mark.slow  # trains the LoRA run: > 20 s on 2 cores
def test_convert_to_hugging_face_merges_the_adapters(lora_run, tmp_path):
  """convert --workdir of a LoRA run writes the merged weights: imported back, they are the export's."""
  from latent_jax import convert
  from latent_jax.export import export
  from latent_jax.interop import hf
  workdir, _ = lora_run
  convert.main(["--workdir", workdir, "--out", str(tmp_path / "hf")])
  hf.import_hf(str(tmp_path / "hf"), str(tmp_path / "back"), load_config(TINY))
  exported = export(workdir, str(tmp_path / "export"))
  back = named(checkpoint.saved_params(str(tmp_path / "back"), checkpoint.load_config(str(tmp_path / "back"))[0]))
  want = named(checkpoint.saved_params(exported, checkpoint.load_config(exported)[0]))
  assert back.keys() == want.keys()
  for name, value in want.items():
    np.testing.assert_array_equal(back[name], value, err_msg=name)


@pytest.mark.slow  # trains the LoRA run: > 20 s on 2 cores
def test_init_from_a_lora_run_starts_from_its_merged_weights(lora_run, corpus_dir, tmp_path):
  """A run (a LoRA one of another rank here) from a LoRA run starts from its weights with the adapters merged,
  as the export holds them, and from fresh factors of its own."""
  from latent_jax.export import export
  workdir, _ = lora_run
  cfg = load_config(TINY, lora_overrides(OURS, corpus_dir, workdir, "lora.rank=2"))
  start = named(start_params(cfg))
  exported = export(workdir, str(tmp_path / "export"))
  want = named(checkpoint.saved_params(exported, checkpoint.load_config(exported)[0]))
  assert start.keys() - want.keys() == {k for k in start if k.endswith((A, B))}
  for name, value in want.items():
    np.testing.assert_array_equal(start[name], value, err_msg=name)
  assert all(start[k].shape[-2] == 2 and not start[k].any() for k in start if k.endswith(B))


@pytest.mark.slow  # trains the LoRA run: > 20 s on 2 cores
@pytest.mark.parametrize("change,field", [("lora.rank=2", "lora.rank"), ("lora.targets=.*attn/(q|v)", "lora.targets")])
def test_resume_with_another_rank_or_targets_is_one_error_line(lora_run, change, field, capsys):
  workdir, overrides = lora_run
  before = listing(workdir)
  argv = ["--config", TINY, "--workdir", workdir] + [f"--config.{o}" for o in overrides + [change]]
  code, err = run_main("latent_jax.train.__main__", argv, capsys)
  check_one_error_line(code, err, [field, "was saved with another model"])
  assert listing(workdir) == before


@pytest.mark.parametrize("extra,names", [
    (["lora.enabled=True"], ["LoRA adapts a trained model: set train.init_from="]),
    (["lora.enabled=True", "train.init_from={source}", "lora.targets=nothing"],
     ["lora.targets: 'nothing' matches no weight", "blocks/blocks/attn/k"])])
def test_bad_lora_input_is_one_error_line_and_writes_nothing(extra, names, tmp_path, corpus_dir, baseline_source, capsys):
  """Refused before the source is read or anything compiles: the train command writes nothing."""
  workdir = str(tmp_path / "run")
  extra = [e.format(source=baseline_source) for e in extra]
  argv = ["--config", TINY, "--workdir", workdir] + [f"--config.{o}" for o in run_overrides(OURS, corpus_dir, *extra)]
  code, err = run_main("latent_jax.train.__main__", argv, capsys)
  check_one_error_line(code, err, names)
  assert not os.path.exists(workdir)
