"""ConceptLM incremental decoding: every cached step gives the full forward's logits, prefill plus
greedy decoding equals greedy decoding by full forwards, and the generate CLI runs on an NCP run."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import ROOT, TINY_OVERRIDES
from latent_jax import build_model, load_config
from latent_jax.infer import generate

TINY_NCP = os.path.join(ROOT, "configs", "tiny_ncp.py")
# Small and fast; window 3 (every 2nd layer full) so that the caches must honour the window,
# in the concept module too. IRC and all three CRC routes are on by default.
SMALL = ["model.vocab_size=64", "model.d_model=16", "model.num_heads=2", "model.num_kv_heads=1",
         "model.head_dim=8", "model.mlp_dim=32", "model.window=3", "model.full_attention_every=2",
         "model.num_segments=4", "model.codebook_size=8", "model.residual_hidden=4", "data.seq_len=16",
         "kernels.impl=xla"]
# The paper's choices; the released code's (every switch flipped, k=3); and IRC off, one CRC route
# off, no document masking and YaRN on the full-attention layers, k=2. Between them every mixing,
# fusion and position mode.
CONFIGS = {
    "paper": [],
    "released": ["model.chunk_size=3", "model.mixing=raw_logits", "model.fusion=norm_add",
                 "model.concept_positions=token", "model.concept_norm=True", "model.irc_softmax=True"],
    "plain": ["model.chunk_size=2", "model.irc=False", "model.crc_concept_decoder=False",
              "model.document_mask=False", "model.concept_positions=token", "model.rope_scaling=yarn",
              "model.yarn_original_context=4"],
}


def random_model(*overrides, seed=1, std=0.3):
  """A ConceptLM with random values for every parameter (the zero-initialised IRC/CRC weights too,
  so every path is live), vectors around 1; drawn by NumPy to avoid a compile per shape."""
  cfg = load_config(TINY_NCP, SMALL + list(overrides)).model
  graphdef, state = nnx.split(nnx.eval_shape(lambda: build_model(cfg, nnx.Rngs(0))))
  leaves, tree = jax.tree.flatten(state)
  r = np.random.default_rng(seed)
  params = jax.tree.unflatten(tree, [jnp.asarray(r.normal(size=x.shape) * std + (1.0 if x.ndim == 1 else 0.0),
                                                 x.dtype) for x in leaves])
  return graphdef, params


@pytest.mark.parametrize("name", CONFIGS)
def test_every_decoding_step_matches_the_full_forward(name):
  """Token by token from an empty cache: logits at every position, T not a multiple of k."""
  graphdef, params = random_model(*CONFIGS[name])
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, size=(2, 15)))
  full = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t).logits)(params, tokens)
  cache = nnx.merge(graphdef, params).init_cache(2, 15)
  step = jax.jit(lambda p, t, c, i: nnx.merge(graphdef, p)(t, cache=c, cache_index=i))
  for i in range(15):
    out = step(params, tokens[:, i:i + 1], cache, i)
    cache = out.cache
    np.testing.assert_allclose(out.logits[:, 0], full[:, i], rtol=1e-5, atol=1e-5, err_msg=f"position {i}")


def test_prefill_and_greedy_generation_match_full_forwards():
  """generate(): prompt prefilled in one call (6 tokens, k=4: one chunk completes inside it),
  then one token per step, against greedy decoding by a full forward over each prefix."""
  graphdef, params = random_model()
  prompt = np.random.default_rng(3).integers(0, 64, size=(2, 6))
  new = 9
  got = generate(nnx.merge(graphdef, params), prompt, new, jax.random.key(0), temperature=0)
  assert got.shape == (2, 6 + new) and got.dtype == jnp.int32
  # The model is causal (tests/test_ncp.py), so one padded length serves every prefix: one compile.
  forward = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t).logits)
  want = np.zeros((2, 6 + new), np.int32)
  want[:, :6] = prompt
  for i in range(6, 6 + new):
    want[:, i] = np.argmax(forward(params, jnp.asarray(want))[:, i - 1], axis=-1)
  np.testing.assert_array_equal(got, want)


@pytest.mark.slow  # the slow tier by measured time (pyproject.toml)
def test_generate_cli_on_a_concept_run(tmp_path, corpus_dir, capsys):
  from latent_jax.generate import main
  from latent_jax.train.loop import train
  extra = ["model.num_segments=4", "model.codebook_size=16", "model.encoder_layers=1", "model.concept_layers=1",
           "model.decoder_layers=1", "train.steps=2", "optim.warmup_steps=1", "train.eval_every=0",
           "train.checkpoint_every=2", f"data.source={corpus_dir}"]
  train(load_config(TINY_NCP, TINY_OVERRIDES + extra), str(tmp_path))
  capsys.readouterr()
  main(["--workdir", str(tmp_path), "--prompt", "Kar lon", "--temperature=0", "--max_new_tokens=9",
        "--num_samples=2"])
  samples = capsys.readouterr().out.split("-" * 40 + "\n")
  assert len(samples) == 3 and samples[0] == samples[1] and samples[0].startswith("Kar lon")
