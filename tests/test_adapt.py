"""Starting from another run (train.init_from) and training part of the model (optim.trainable),
as the NCP paper's VQ adaptation does: only the codebook and the concept heads move."""
import filecmp
import os

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import ROOT, TINY_OVERRIDES
from latent_jax import ConfigError, checkpoint, load_config, objectives, sharding
from latent_jax.nn import abstract_model, axes_tree
from latent_jax.train import step as steps
from latent_jax.train.loop import train
from latent_jax.infer import load
from latent_jax.train.optim import build_optimizer, trainable_mask

CONFIGS = os.path.join(ROOT, "configs")
NCP = TINY_OVERRIDES + ["model.d_model=32", "model.num_segments=4", "model.codebook_size=8",
                        "model.residual_hidden=4", "model.chunk_size=4"]
VQ = {"codebook", "heads", "head_norm/scale"}


def named(tree):
  return {"/".join(str(k.key) for k in p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_vq_preset_is_the_papers_17m_at_8b():
  """Sec. 5.1: ~17M trainable parameters, the codebook (N*d) and the heads (d x S*N)."""
  cfg = load_config(os.path.join(CONFIGS, "ncp_archpreview_8b.py"), ["optim.trainable=vq"])
  _, abstract = abstract_model(cfg)
  axes = axes_tree(abstract)
  mask = named(trainable_mask(axes, "vq"))
  assert {name for name, train in mask.items() if train} == VQ
  m = cfg.model
  shapes = named(nnx.to_pure_dict(abstract))
  count = sum(int(np.prod(shapes[name].shape)) for name in VQ)
  assert count == m.codebook_size * m.d_model + m.d_model * m.num_segments * m.codebook_size + m.d_model
  assert 17.0e6 < count < 17.5e6


def small_state(trainable, name="adamw"):
  cfg = load_config(os.path.join(CONFIGS, "tiny_ncp.py"), NCP + [f"optim.trainable={trainable}", f"optim.name={name}", "optim.warmup_steps=0"])
  mesh = sharding.make_mesh(cfg.mesh)
  graphdef, abstract = abstract_model(cfg)
  tx, _ = build_optimizer(cfg.optim, cfg.train.steps, axes_tree(abstract))
  shardings = steps.state_shardings(abstract, tx, mesh)
  state = steps.init_state(cfg, 0, tx, shardings)
  tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (cfg.data.batch_size, cfg.data.seq_len + 1))
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
           "segment_ids": np.ones((cfg.data.batch_size, cfg.data.seq_len), np.int32),
           "positions": np.tile(np.arange(cfg.data.seq_len), (cfg.data.batch_size, 1))}
  return cfg, graphdef, tx, shardings, mesh, state, sharding.global_batch(batch, mesh)


@pytest.mark.slow  # the slow tier by measured time (pyproject.toml)
def test_vq_adaptation_moves_only_the_codebook_and_heads():
  """With Muon (the paper's optimiser): three groups, Muon for heads, AdamW for the codebook and
  head norm, nothing for the rest."""
  cfg, graphdef, tx, shardings, mesh, state, batch = small_state("vq", "muon")
  before = named(jax.device_get(state["params"]))
  state_before = jax.device_get(state["params"])
  # No optimiser state for frozen params: as much state as the same optimiser over the
  # trainable params alone.
  axes = axes_tree(abstract_model(cfg)[1])
  alone = {k: axes[k] for k in ("codebook", "heads", "head_norm")}
  o = cfg.optim.copy_and_resolve_references()
  o.trainable = "all"
  alone_state = build_optimizer(o, cfg.train.steps, alone)[0].init({k: state["params"][k] for k in alone})
  size = lambda tree: sum(x.size for x in jax.tree.leaves(tree))
  assert size(state["opt_state"]) == size(alone_state)

  # The gradients of the trainable params are those of the unrestricted loss (a second path:
  # plain jax.grad of the objective, no stop_gradient anywhere).
  def loss(params):
    return objectives.objective_for(cfg)(nnx.merge(graphdef, params), batch, cfg)[0]
  full = named(jax.jit(jax.grad(loss))(state["params"]))

  step = steps.make_train_step(graphdef, tx, cfg, shardings, mesh, objectives.objective_for(cfg))
  new_state, metrics = step(state, batch)
  after = named(jax.device_get(new_state["params"]))
  for name in before:
    if name in VQ:
      assert not np.array_equal(after[name], before[name]), name
    else:
      np.testing.assert_array_equal(after[name], before[name], err_msg=name)
  expected_norm = optax.tree.norm({n: full[n] for n in VQ})
  np.testing.assert_allclose(metrics["grad_norm"], expected_norm, rtol=1e-5)
  # Leaf by leaf: the same optimiser over the trained params alone, fed the unrestricted
  # gradients of those params, gives the step's new values.
  grads = {"codebook": full["codebook"], "heads": full["heads"], "head_norm": {"scale": full["head_norm/scale"]}}
  tx_alone = build_optimizer(o, cfg.train.steps, alone)[0]
  updates, _ = tx_alone.update(grads, alone_state, {k: state_before[k] for k in alone})
  want = named(optax.apply_updates({k: state_before[k] for k in alone}, updates))
  for name in VQ:
    np.testing.assert_allclose(after[name], want[name], rtol=1e-5, atol=1e-7, err_msg=name)


def test_trainable_regex_and_bad_values():
  axes = axes_tree(abstract_model(load_config(os.path.join(CONFIGS, "tiny_ncp.py"), NCP))[1])
  mask = named(trainable_mask(axes, r"decoder/.*|lm_head"))
  assert {n for n, t in mask.items() if t} == {n for n in mask if n.startswith("decoder/") or n == "lm_head"}
  assert all(named(trainable_mask(axes, "all")).values())
  with pytest.raises(ConfigError, match="optim.trainable.*matches no parameter"):
    trainable_mask(axes, "encoder")  # whole paths only: no parameter is called just "encoder"
  with pytest.raises(ConfigError, match="optim.trainable.*not a valid regex"):
    load_config(os.path.join(CONFIGS, "tiny_ncp.py"), ["optim.trainable=heads("])
  with pytest.raises(ConfigError, match="optim.trainable.*'vq'.*baseline"):
    load_config(os.path.join(CONFIGS, "tiny.py"), ["optim.trainable=vq"])


@pytest.fixture(scope="module")
def ncp_source(tmp_path_factory, corpus_dir):
  """A 2-step tiny ConceptLM run on the test corpus."""
  source = tmp_path_factory.mktemp("source")
  train(load_config(os.path.join(CONFIGS, "tiny_ncp.py"), run_overrides(corpus_dir)), str(source))
  return source


def run_overrides(corpus_dir, *extra):
  return NCP + [f"data.source={corpus_dir}", "train.steps=2", "train.eval_every=0", "optim.warmup_steps=1", *extra]


@pytest.mark.slow  # the slow tier by measured time (pyproject.toml)
def test_init_from_starts_from_the_source_and_keeps_its_tokenizer(tmp_path, corpus_dir, ncp_source):
  """A VQ adaptation of the source run on the same corpus: every frozen parameter ends equal to
  the source's final one, the trained ones differ, and the token ids are the source's."""
  adapted = tmp_path / "adapted"
  cfg = load_config(os.path.join(CONFIGS, "tiny_ncp_adapt.py"), run_overrides(corpus_dir, f"train.init_from={ncp_source}"))
  train(cfg, str(adapted))

  assert filecmp.cmp(ncp_source / "tokenizer.model", adapted / "tokenizer.model", shallow=False)
  src_cfg, src_step = checkpoint.load_config(str(ncp_source))
  ada_cfg, ada_step = checkpoint.load_config(str(adapted))
  src = named(load.load_params(str(ncp_source), src_cfg, src_step)[1])
  ada = named(load.load_params(str(adapted), ada_cfg, ada_step)[1])
  for name in src:
    if name in VQ:
      assert not np.array_equal(src[name], ada[name]), name
    else:
      np.testing.assert_array_equal(src[name], ada[name], err_msg=name)


@pytest.mark.slow  # the slow tier by measured time (pyproject.toml)
def test_init_from_errors_before_anything_compiles(tmp_path, corpus_dir, ncp_source):
  def start(config, *extra):
    workdir = tmp_path / str(len(os.listdir(tmp_path)))
    overrides = run_overrides(corpus_dir, *extra)
    if config == "tiny.py":  # the baseline has no NCP fields
      overrides = [o for o in overrides if o not in NCP or o in TINY_OVERRIDES]
    train(load_config(os.path.join(CONFIGS, config), overrides), str(workdir))

  with pytest.raises(FileNotFoundError, match="train.init_from.*neither a training workdir"):
    start("tiny_ncp_adapt.py", f"train.init_from={tmp_path}/none")
  with pytest.raises(ValueError, match="train.init_from.*has no parameter 'blocks/"):
    start("tiny.py", f"train.init_from={ncp_source}")  # a baseline from a ConceptLM
  with pytest.raises(ValueError, match=r"train.init_from: parameter '\w+' is \(4, 8, 8\) in .* but \(4, 8, 12\) here"):
    start("tiny_ncp_adapt.py", "model.d_model=48", f"train.init_from={ncp_source}")
  assert not any((tmp_path / d / "checkpoints").exists() for d in os.listdir(tmp_path))  # refused up front


@pytest.mark.slow  # the slow tier by measured time (pyproject.toml)
def test_resume_ignores_a_missing_source_and_refuses_another_trainable(tmp_path, corpus_dir, ncp_source):
  """A resumed adaptation reads its own checkpoints, even when the source is gone; resuming with
  another optim.trainable (another optimiser state) is refused, naming both values."""
  import shutil
  source = tmp_path / "source_copy"
  shutil.copytree(ncp_source, source)
  adapted = tmp_path / "adapted"
  config = os.path.join(CONFIGS, "tiny_ncp_adapt.py")
  train(load_config(config, run_overrides(corpus_dir, f"train.init_from={source}")), str(adapted))
  shutil.rmtree(source)
  with pytest.raises(ConfigError, match=r"was saved with another model, tokenizer or optimiser \(optim.trainable: saved 'vq', now 'all'\)"):
    train(load_config(config, run_overrides(corpus_dir, f"train.init_from={source}", "optim.trainable=all")),
          str(adapted))
  # A fresh start would need the (deleted) source; the resume reaches step 3 from checkpoint 2.
  train(load_config(config, run_overrides(corpus_dir, f"train.init_from={source}", "train.steps=3")), str(adapted))
  assert os.path.isdir(adapted / "checkpoints" / "3")


def test_tst_reinit_refuses_frozen_embeddings():
  from latent_jax.train.loop import check_trains_embeddings
  axes = axes_tree(abstract_model(load_config(os.path.join(CONFIGS, "tiny.py"), TINY_OVERRIDES))[1])
  check_trains_embeddings(trainable_mask(axes, "all"), "all")
  with pytest.raises(ConfigError, match=r"optim.trainable='blocks/.\*' freezes \['embed', 'lm_head'\]"):
    check_trains_embeddings(trainable_mask(axes, "blocks/.*"), "blocks/.*")
