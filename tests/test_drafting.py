"""Concept-injected block drafting (NCP Sec. 5.3): Eq. 26 and the acceptance rule against NumPy, the
concept signal's index map, the zero-gate start, no look-ahead, speculative decoding that returns
exactly the target's greedy tokens, and the train-and-measure command on a trained ConceptLM."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import ROOT, TINY_OVERRIDES
from latent_jax import ConfigError, load_config
from latent_jax.infer.speculative import speculative_generate
from latent_jax.nn.drafter import BlockDrafter, draft, target_features
from latent_jax.ops import drafting as D
from test_generate_concept import TINY_NCP, random_model

DRAFTER = os.path.join(ROOT, "configs", "tiny_drafter.py")


def drafter_cfg(concept="predicted", block_size=3, context=5):
  return load_config(DRAFTER, ["target=unused", f"drafter.concept={concept}", f"drafter.block_size={block_size}",
                               f"drafter.context={context}", "drafter.num_layers=2"])


def random_drafter(target_cfg, concept, seed=0, gate_std=0.0, **kw):
  drafter = BlockDrafter(target_cfg, drafter_cfg(concept, **kw).drafter, nnx.Rngs(seed))
  if concept != "none" and gate_std:
    drafter.gate[...] = jax.random.normal(jax.random.key(seed + 1), drafter.gate.shape) * gate_std
  return drafter


def proposals(target, drafter, tokens, anchors, concept):
  """The drafter's logits [B, A, K, V] at anchors [B, A] after one target pass over tokens [B, T], compiled."""
  (target_graph, target_params), (drafter_graph, drafter_params) = nnx.split(target), nnx.split(drafter)

  @jax.jit
  def run(target_params, drafter_params, tokens, anchors):
    target = nnx.merge(target_graph, target_params)
    _, hidden, concepts = target_features(target, tokens, concept=concept)
    return draft(nnx.merge(drafter_graph, drafter_params), target, hidden, concepts, tokens, jnp.zeros_like(tokens),
                 anchors)
  return run(target_params, drafter_params, jnp.asarray(tokens), jnp.asarray(anchors))


# ------------------------------------------------------------------------------------ pure functions


def test_accepted_length_and_mal_against_numpy():
  rng = np.random.default_rng(0)
  greedy = rng.integers(0, 3, size=(50, 6))
  draft = np.where(rng.random((50, 5)) < 0.7, greedy[:, :5], rng.integers(0, 3, size=(50, 5)))
  want = []
  for d, g in zip(draft, greedy):
    n = 0
    while n < 5 and d[n] == g[n]:
      n += 1
    want.append(n)
  got = np.asarray(D.accepted_length(jnp.asarray(draft), jnp.asarray(greedy)))
  np.testing.assert_array_equal(got, want)
  assert set(got.tolist()) == set(range(6))  # none, some and all of the draft accepted
  committed, rounds = np.array([7, 3]), np.array([2, 3])
  assert float(D.mean_accepted_length(jnp.asarray(committed), jnp.asarray(rounds))) == pytest.approx(10 / 5)


def test_concept_gate_is_eq26():
  rng = np.random.default_rng(1)
  s, c = rng.normal(size=(4, 3, 8)), rng.normal(size=(4, 8))
  c[1] = 0.0  # no complete chunk yet: nothing is added
  g, scale = rng.normal(size=8), rng.normal(size=8)
  want = s + (np.tanh(g) * c / np.sqrt(np.mean(c ** 2, -1, keepdims=True) + 1e-6) * scale)[:, None]
  got = D.concept_gate(jnp.asarray(s, jnp.float32), jnp.asarray(c, jnp.float32), jnp.asarray(g, jnp.float32),
                       jnp.asarray(scale, jnp.float32), 1e-6)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(got[1], s[1].astype(np.float32))


def test_context_and_labels_stay_in_the_row_and_the_document():
  rng = np.random.default_rng(2)
  tokens = rng.integers(0, 50, size=(2, 12))
  segs = np.array([[1] * 5 + [2] * 7, [1] * 12])
  hidden = rng.normal(size=(2, 12, 3))
  anchors = np.array([[0, 4, 6, 11], [1, 5, 9, 11]])
  w, k = 4, 3
  context, valid = D.draft_context(jnp.asarray(hidden), jnp.asarray(segs), jnp.asarray(anchors), w)
  labels = D.draft_labels(jnp.asarray(tokens), jnp.asarray(segs), jnp.asarray(anchors), k)
  for b in range(2):
    for i, a in enumerate(anchors[b]):
      for j, p in enumerate(range(a - w, a)):
        ok = p >= 0 and segs[b, p] == segs[b, a]
        assert bool(valid[b, i, j]) == ok
        if ok:
          np.testing.assert_allclose(context[b, i, j], hidden[b, p])
      for j, p in enumerate(range(a + 1, a + 1 + k)):
        ok = p < 12 and segs[b, p] == segs[b, a]
        assert int(labels[b, i, j]) == (tokens[b, p] if ok else -1)


# ------------------------------------------------------------------------------------ the drafter


def test_concept_signal_follows_the_injection_index_map():
  """'predicted' at token t is the mixture ConceptLM injects there (p_{(t+1)//k-1}, the seed's table:
  tokens 1-3 get zero, 4-7 p_1, ...); 'pooled' is the same chunk's pooled concept."""
  graphdef, params = random_model()
  target = nnx.merge(graphdef, params)
  tokens = jnp.asarray(np.random.default_rng(4).integers(0, 64, size=(2, 14)))
  out = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, tokens)
  k = target.cfg.chunk_size
  for mode, source in [("predicted", out.aux["predicted"]), ("pooled", out.aux["concepts"])]:
    _, _, signal = jax.jit(lambda p, t: target_features(nnx.merge(graphdef, p), t, concept=mode))(params, tokens)
    for t in range(14):
      m = (t + 1) // k - 1
      want = np.zeros_like(signal[:, t]) if m < 0 else source[:, m]
      np.testing.assert_allclose(signal[:, t], want, rtol=1e-6, atol=1e-6, err_msg=f"{mode} t={t}")


def test_zero_gates_are_the_baseline_drafter_and_trained_gates_are_not():
  graphdef, params = random_model()
  target = nnx.merge(graphdef, params)
  tokens = np.random.default_rng(5).integers(0, 64, size=(2, 14))
  # k = 4: anchors 1-3 have no complete chunk among the positions the target has read (< a), so no
  # concept, gated or not; from anchor 4 on the signal is there.
  anchors = np.array([[1, 2, 3, 4, 9, 13], [3, 1, 2, 4, 8, 12]])
  base = proposals(target, random_drafter(target.cfg, "none"), tokens, anchors, "none")
  injected = proposals(target, random_drafter(target.cfg, "predicted"), tokens, anchors, "predicted")
  np.testing.assert_array_equal(base, injected)
  gated = proposals(target, random_drafter(target.cfg, "predicted", gate_std=1.0), tokens, anchors, "predicted")
  np.testing.assert_allclose(gated[:, :3], base[:, :3], rtol=1e-5, atol=1e-5)
  assert np.abs(np.asarray(gated[:, 3:] - base[:, 3:])).max(axis=(2, 3)).min() > 1e-3
  with pytest.raises(ValueError, match="concept signal"):
    proposals(target, random_drafter(target.cfg, "none"), tokens, anchors, "predicted")


def test_a_proposal_reads_only_what_the_target_has_verified():
  """At anchor a the target has read only x_0..x_{a-1} (x_a is its own unread token; in decoding its
  state at a belongs to a draft that may be rejected): the drafter's logits must not change when the
  target's states and concept signals at positions >= a are replaced by noise, and must change with x_a."""
  graphdef, params = random_model()
  target = nnx.merge(graphdef, params)
  drafter = random_drafter(target.cfg, "predicted", gate_std=1.0)
  rng = np.random.default_rng(6)
  tokens = jnp.asarray(rng.integers(0, 64, size=(1, 16)))
  d_graph, d_params = nnx.split(drafter)

  @jax.jit
  def logits(d_params, tokens, anchor, noise):
    _, hidden, concepts = target_features(target, tokens, concept="predicted")
    later = (jnp.arange(16) >= anchor)[None, :, None]
    hidden, concepts = jnp.where(later, noise, hidden), jnp.where(later, -noise, concepts)
    return draft(nnx.merge(d_graph, d_params), target, hidden, concepts, tokens, jnp.zeros_like(tokens),
                 jnp.full((1, 1), anchor))

  for a in (3, 4, 5, 8, 11):
    clean = logits(d_params, tokens, a, jnp.zeros((1, 16, target.cfg.d_model)))
    noisy = logits(d_params, tokens, a, jnp.asarray(rng.normal(size=(1, 16, target.cfg.d_model)) * 3, jnp.float32))
    np.testing.assert_allclose(clean, noisy, rtol=1e-5, atol=1e-5, err_msg=f"anchor {a}")
    other = tokens.at[0, a].set((tokens[0, a] + 1) % 64)
    assert np.abs(np.asarray(logits(d_params, other, a, jnp.zeros((1, 16, target.cfg.d_model))) - clean)).max() > 1e-3


# ------------------------------------------------------------------------------------ speculative decoding


def greedy_by_full_forwards(target, prompt, new):
  forward = jax.jit(lambda t: target(t).logits)
  out = np.zeros((prompt.shape[0], prompt.shape[1] + new), np.int32)
  out[:, :prompt.shape[1]] = prompt
  for i in range(prompt.shape[1], out.shape[1]):
    out[:, i] = np.argmax(forward(jnp.asarray(out))[:, i - 1], axis=-1)
  return out


@pytest.mark.parametrize("target_name,concept", [("concept", "predicted"), ("concept", "pooled"),
                                                 ("baseline", "none")])
def test_speculative_decoding_returns_the_targets_greedy_tokens(target_name, concept, tiny_cfg):
  if target_name == "concept":
    graphdef, params = random_model()
    target = nnx.merge(graphdef, params)
  else:
    from latent_jax import build_model
    target = build_model(tiny_cfg.model, nnx.Rngs(0))
  prompt = np.random.default_rng(7).integers(0, 64, size=(3, 6))
  want = greedy_by_full_forwards(target, prompt, 13)
  drafter = random_drafter(target.cfg, concept, gate_std=1.0)
  got, committed, rounds = speculative_generate(target, drafter, prompt, 13)
  np.testing.assert_array_equal(got, want)
  # Every round commits 1..K+1 tokens, and together they cover the 12 tokens after the prefill's.
  assert np.all(np.asarray(committed) >= 12) and np.all(np.asarray(committed) <= 12 + drafter.block_size)
  assert np.all(np.asarray(rounds) >= 1) and np.all(np.asarray(committed) <= np.asarray(rounds) * (drafter.block_size + 1))


@pytest.mark.slow  # the slow tier by measured time (pyproject.toml)
def test_rounds_and_commits_against_a_replay():
  """The bookkeeping of Eq. 27: a drafter that always proposes token 0 (its final norm zeroed), replayed
  by hand against the target's greedy tokens; and a target that always says 0 accepts every block."""
  graphdef, params = random_model()
  target = nnx.merge(graphdef, params)
  k, new = 3, 20
  drafter = random_drafter(target.cfg, "none", block_size=k)
  drafter.final_norm.scale[...] = jnp.zeros_like(drafter.final_norm.scale[...])
  prompt = np.random.default_rng(8).integers(0, 64, size=(2, 6))
  # Swap the target's most frequent greedy token with token 0, so that blocks are partly accepted.
  c = np.bincount(greedy_by_full_forwards(target, prompt, new)[:, 6:].ravel()).argmax()
  swap = np.arange(64)
  swap[[0, c]] = [c, 0]
  target.lm_head[...], target.embed[...] = target.lm_head[...][:, swap], target.embed[...][swap]
  prompt = swap[prompt]
  want = greedy_by_full_forwards(target, prompt, new + k + 1)  # the last round may verify past `new`
  tokens, committed, rounds = speculative_generate(target, drafter, prompt, new)
  np.testing.assert_array_equal(tokens, want[:, :6 + new])
  for b in range(2):
    a, total, n = 6, 0, 0  # x_6 comes from the prefill; a round at anchor a proposes a+1..a+k
    while a - 6 + 1 < new:
      m = 0
      while m < k and want[b, a + 1 + m] == 0:
        m += 1
      total, n, a = total + m + 1, n + 1, a + m + 1
    assert (int(committed[b]), int(rounds[b])) == (total, n)
  assert 0 < np.mean(want[:, 7:6 + new] == 0) < 1  # the replay saw accepted and rejected drafts
  target.final_norm.scale[...] = jnp.zeros_like(target.final_norm.scale[...])  # greedy: always 0
  tokens, committed, rounds = speculative_generate(target, drafter, prompt, new)
  assert np.all(np.asarray(tokens[:, 6:]) == 0)
  np.testing.assert_array_equal(rounds, [-(-(new - 1) // (k + 1))] * 2)
  np.testing.assert_array_equal(committed, rounds * (k + 1))


# ------------------------------------------------------------------------------------ config and command


def test_bad_drafter_settings_are_named_before_anything_runs(tmp_path, tiny_cfg):
  with pytest.raises(ConfigError, match="drafter.concept"):
    load_config(DRAFTER, ["target=x", "drafter.concept=mixture"])
  with pytest.raises(ConfigError, match="target"):
    load_config(DRAFTER, [])
  with pytest.raises(ConfigError, match="drafter.block_size"):
    load_config(DRAFTER, ["target=x", "drafter.block_size=0"])
  from latent_jax.draft import run
  with pytest.raises(FileNotFoundError, match="train first"):
    run(load_config(DRAFTER, [f"target={tmp_path / 'nothing'}"]), str(tmp_path / "out"))




def with_drafter(graphdef, params, drafter):
  """The target of (graphdef, params) with `drafter` attached, as a drafter run's model holds it."""
  model = nnx.merge(graphdef, params)
  model.drafter = drafter
  return model


def test_the_loss_scores_only_real_next_tokens_of_the_document():
  """drafter_scores: labels past the row, across a document boundary or on padding (target -1) are not
  scored; with labels='target' they are the target's greedy tokens from the true prefix."""
  from latent_jax.objectives import drafter_scores
  graphdef, params = random_model()
  target = nnx.merge(graphdef, params)
  drafter = random_drafter(target.cfg, "predicted", block_size=3)
  rng = np.random.default_rng(9)
  inputs = rng.integers(0, 64, size=(1, 14))
  segs = np.array([[1] * 6 + [2] * 8])
  targets = np.concatenate([inputs[:, 1:], [[-1]]], 1)
  targets[:, 10:] = -1  # inputs 11.. are padding
  batch = {"inputs": inputs, "targets": targets, "segment_ids": segs,
           "positions": np.array([list(range(6)) + list(range(8))])}
  batch = {k: jnp.asarray(v, jnp.int32) for k, v in batch.items()}
  anchors = jnp.asarray([[2, 4, 7, 9, 12]])
  for source in ("data", "target"):
    ce, labels, _ = jax.jit(lambda p, b: drafter_scores(with_drafter(graphdef, p, drafter), b, anchors, source))(
        params, batch)
    want = [[1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 0, 0], [0, 0, 0]]  # x_{a+1..a+3} in the document, not padding
    np.testing.assert_array_equal(labels[0] >= 0, want)
    assert np.all(np.isfinite(ce))
    if source == "data":
      np.testing.assert_array_equal(np.asarray(labels[0])[np.asarray(want, bool)],
                                    [inputs[0, a + j] for a, n in [(2, 3), (4, 1), (7, 3), (9, 1)] for j in range(1, n + 1)])

  @jax.jit
  def labelled(params, b):  # the target's greedy tokens, the proposals, and what the loss scored
    model = nnx.merge(graphdef, params)
    greedy = jnp.argmax(model(b["inputs"], b["segment_ids"], b["positions"]).logits, -1)
    _, hidden, concepts = target_features(model, b["inputs"], b["segment_ids"], b["positions"], "predicted")
    proposals = jnp.argmax(draft(drafter, model, hidden, concepts, b["inputs"], b["segment_ids"], anchors), -1)
    _, labels, scored_proposals = drafter_scores(with_drafter(graphdef, params, drafter), b, anchors, "target")
    return greedy, proposals, labels, scored_proposals

  greedy, proposals, labels, scored_proposals = labelled(params, batch)
  np.testing.assert_array_equal(proposals, scored_proposals)
  for i, a in enumerate([2, 4, 7, 9, 12]):
    for j in range(3):
      if labels[0, i, j] >= 0:
        assert labels[0, i, j] == greedy[0, a + j]


def test_anchors_follow_the_row_not_its_batch():
  """D.row_anchors: in [1, T), spread over the row, and a row's anchors do not depend on the rows beside it
  (so microbatches and hosts draw the batch's anchors); another row or seed draws others."""
  from latent_jax.ops.drafting import row_anchors, strided_anchors
  rows = jnp.asarray(np.random.default_rng(0).integers(0, 50, size=(8, 33)), jnp.int32)
  anchors = np.asarray(row_anchors(rows, 400, seed=3))
  assert anchors.shape == (8, 400) and anchors.min() == 1 and anchors.max() == 32
  np.testing.assert_array_equal(np.asarray(row_anchors(rows[1::2], 400, seed=3)), anchors[1::2])
  np.testing.assert_array_equal(np.asarray(row_anchors(rows[::-1], 400, seed=3)), anchors[::-1])
  assert not np.array_equal(np.asarray(row_anchors(rows, 400, seed=4)), anchors)
  assert len({tuple(a) for a in anchors}) == 8
  counts = np.bincount(anchors.ravel(), minlength=33)[1:]  # uniform over 32 positions: 100 each
  assert counts.min() > 50 and counts.max() < 150
  np.testing.assert_array_equal(strided_anchors(2, 33, 4), [[1, 9, 17, 25]] * 2)


def test_a_baseline_target_has_no_concept_signal(tiny_cfg):
  from latent_jax import build_model
  target = build_model(tiny_cfg.model, nnx.Rngs(0))
  with pytest.raises(ValueError, match="drafter.concept='none'"):
    target_features(target, jnp.zeros((1, 8), jnp.int32), concept="predicted")
  drafter = random_drafter(target.cfg, "none")
  for prompt, new in [(np.zeros((1, 0), np.int32), 4), (np.zeros((1, 3), np.int32), 0)]:
    with pytest.raises(ValueError, match="at least one token"):
      speculative_generate(target, drafter, prompt, new)


@pytest.mark.slow  # the slow tier by measured time (pyproject.toml)
def test_draft_command_trains_measures_saves_and_loads(tmp_path, corpus_dir, capsys):
  """python -m latent_jax.draft on a trained ConceptLM, through the train loop: the target stays as it was,
  the drafter trains, the result file, a saved drafter that loads and decodes like the one measured,
  and a second run that refuses to overwrite it."""
  from latent_jax.draft import load_drafter, load_run, main
  from latent_jax.infer import load_model
  from latent_jax.train.loop import train
  from latent_jax.train.metrics import read_metrics
  extra = ["model.num_segments=4", "model.codebook_size=16", "model.encoder_layers=1", "model.concept_layers=1",
           "model.decoder_layers=1", "train.steps=2", "optim.warmup_steps=1", "train.eval_every=0",
           "train.checkpoint_every=2", f"data.source={corpus_dir}", "nitp.enabled=True"]
  train(load_config(TINY_NCP, TINY_OVERRIDES + extra), str(tmp_path / "target"))
  args = ["--config", DRAFTER, "--workdir", str(tmp_path / "drafter"), f"--config.target={tmp_path / 'target'}",
          "--config.train.steps=3", "--config.optim.warmup_steps=1", "--config.data.batch_size=4",
          "--config.drafter.anchors=4", "--config.drafter.block_size=3", "--config.drafter.context=4",
          "--config.drafter.labels=target", "--config.train.eval_batches=1", "--config.train.log_every=1",
          "--config.train.eval_every=3", "--config.eval.prompts=3", "--config.eval.prompt_len=6",
          "--config.eval.max_new_tokens=7"]
  main(args)
  printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  with open(tmp_path / "drafter" / "drafter.json") as f:
    saved = json.load(f)
  assert saved["config"]["drafter"]["labels"] == "target" and [r["step"] for r in saved["history"]] == [1, 2, 3]
  assert printed["mal"] == saved["mal"] and 1 <= saved["mal"] <= 4 and len(saved["slot_accuracy"]) == 3
  assert saved["committed"] >= 3 * 6 and saved["rounds"] >= 3 * 6 / 4  # 3 prompts, 6 tokens after the prefill each
  # The loop evaluated the drafter at its last step on the same batch the measurement scored.
  assert read_metrics(str(tmp_path / "drafter"))[-1]["val_loss"] == pytest.approx(saved["val_loss"], rel=1e-5)
  model, run_cfg, step = load_run(str(tmp_path / "drafter"))
  assert step == 3 and run_cfg.optim.trainable == "drafter/.*" and not run_cfg.nitp.enabled
  from latent_jax import build_model
  from latent_jax.checkpoint import by_path
  trained = by_path(nnx.to_pure_dict(nnx.state(model)))
  original, _, _ = load_model(str(tmp_path / "target"))
  for name, value in by_path(nnx.to_pure_dict(nnx.state(original))).items():
    np.testing.assert_array_equal(trained[name], value, err_msg=f"target parameter {name} moved")  # bit for bit
  initial = by_path(nnx.to_pure_dict(nnx.state(build_model(run_cfg, nnx.Rngs(run_cfg.train.seed)).drafter)))
  still = [name for name, value in initial.items() if np.array_equal(trained["drafter/" + name], value)]
  assert still == []  # every drafter parameter trained (Eq. 26's norm scale from the second step: tanh(g) is 0 at init)
  from latent_jax.eval import evaluate_dir  # eval (and export) read a drafter run as its frozen target
  ours, theirs = (evaluate_dir(str(tmp_path / run), max_batches=0) for run in ("drafter", "target"))  # whole split
  assert ours["tokens"] == theirs["tokens"] and ours["val_loss"] == pytest.approx(theirs["val_loss"], rel=1e-5)
  target, target_cfg, _ = load_model(str(tmp_path / "target"))
  drafter, cfg = load_drafter(str(tmp_path / "drafter"), target_cfg.model)
  other = target_cfg.model.copy_and_resolve_references()
  other.chunk_size = 2
  with pytest.raises(ValueError, match=r"model.chunk_size \(4 there, 2 here\)"):
    load_drafter(str(tmp_path / "drafter"), other)
  from latent_jax.draft import validation_prompts  # the measured prompts: the same MAL again
  from latent_jax.data import build_data
  data_cfg = target_cfg.copy_and_resolve_references()
  data_cfg.data.tokenizer = str(tmp_path / "target" / "tokenizer.model")
  prompts = validation_prompts(build_data(data_cfg, str(tmp_path / "scratch")), 3, 6)
  _, committed, rounds = speculative_generate(target, drafter, prompts, 7)
  assert (int(committed.sum()), int(rounds.sum())) == (saved["committed"], saved["rounds"])
  capsys.readouterr()
  with pytest.raises(SystemExit, match="2"):
    main(args)
  assert "never overwritten" in capsys.readouterr().err
  from latent_jax.generate import main as generate_main  # --drafter: the same text as greedy decoding
  texts = []
  for extra in ([], ["--drafter", str(tmp_path / "drafter")]):
    capsys.readouterr()
    generate_main(["--workdir", str(tmp_path / "target"), "--prompt", "Kar lon", "--temperature=0",
                   "--max_new_tokens=12", *extra])
    texts.append(capsys.readouterr().out)
  assert texts[1].startswith("mean accepted length") and texts[1].split("\n", 1)[1] == texts[0]
  with pytest.raises(SystemExit, match="2"):
    generate_main(["--workdir", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter")])
  assert "--temperature=0" in capsys.readouterr().err


def test_drafter_flops_against_xla(tiny_cfg):
  """flops.drafter_flops_per_token's forward count against XLA's cost analysis of the drafter's forward
  (one layer: XLA counts a scanned body once), and the drafter run's total: the target's forward, once."""
  import ml_collections
  from latent_jax.train import flops
  cfg = load_config(os.path.join(ROOT, "configs", "tiny.py"), TINY_OVERRIDES + ["model.d_model=256", "model.num_heads=4",
                    "model.head_dim=64", "model.mlp_dim=1024", "model.vocab_size=2048"])
  run = ml_collections.ConfigDict(cfg.to_dict())
  run.drafter = ml_collections.ConfigDict(drafter_cfg("none").drafter.to_dict())
  run.drafter.num_layers = 1
  graphdef, state = nnx.split(BlockDrafter(cfg.model, run.drafter, nnx.Rngs(0)))
  n, w, d = 64, run.drafter.context, 256
  forward = jax.jit(lambda s, context: nnx.merge(graphdef, s)(context, jnp.ones((n, w), bool), jnp.ones((n, d)), None,
                                                              jnp.ones((d, 2048))))
  cost = forward.lower(state, jnp.ones((n, w, d))).compile().cost_analysis()
  xla = (cost[0] if isinstance(cost, list) else cost)["flops"]
  seq = cfg.data.seq_len
  counted = flops.drafter_flops_per_token(run, seq) / 3 * seq / run.drafter.anchors * n  # n anchors' forward
  assert xla == pytest.approx(counted, rel=0.03)
  for labels, head in [("data", 0), ("target", 2 * d * 2048)]:
    run.drafter.labels = labels
    assert flops.flops_per_token(run, seq) == pytest.approx(
        flops.flops_per_token(cfg.model, seq) / 3 - 2 * d * 2048 + head + flops.drafter_flops_per_token(run, seq))
