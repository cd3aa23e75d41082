"""Token-Superposition Training: the bag math against NumPy, the config checks, and the two-phase
loop end to end (the switch through the phase-1 checkpoint, carry modes, resume across the
switch, per-phase tokens and FLOPs)."""
import os
import shutil
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import ROOT, TINY_OVERRIDES
from latent_jax import ConfigError, checkpoint, load_config, objectives, sharding
from latent_jax.config import validate_tst
from latent_jax.ops import superposition as sup
from latent_jax.data import build_data, make_val_batches
from latent_jax.nn import abstract_model, axes_tree
from latent_jax.train import phases
from latent_jax.train import step as steps
from latent_jax.train.loop import train
from latent_jax.train.metrics import read_metrics
from latent_jax.train.optim import build_optimizer, learning_rate_schedule

TINY_TST = os.path.join(ROOT, "configs", "tiny_tst.py")
# 4 steps: phase 1 is steps 1-2 (rows of 32*4 tokens -> 32 bags), phase 2 steps 3-4.
RUN = TINY_OVERRIDES + ["train.steps=4", "tst.r=0.5", "tst.s=4", "train.checkpoint_every=1",
                        "train.eval_every=2", "optim.warmup_steps=1"]
N1 = 2


# ----------------------------------------------------------------------------- NumPy references


def np_log_softmax(z):
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


def np_multihot_ce(hidden, weight, labels):
  """Per row: mean over the bag's non-ignored labels (each occurrence) of -log softmax(z)[y]."""
  logp = np_log_softmax(hidden.astype(np.float64) @ weight.astype(np.float64))
  out = np.zeros(labels.shape[:-1])
  for idx in np.ndindex(*labels.shape[:-1]):
    kept = [y for y in labels[idx] if y >= 0]
    out[idx] = -np.mean([logp[idx][y] for y in kept]) if kept else 0.0
  return out


def np_next_bags(targets, s):
  """labels[b, j, k] = token (j+1)*s + k of the row's window = targets[j*s + s-1 + k], else -1."""
  b, t = targets.shape
  out = -np.ones((b, t // s, s), np.int64)
  for bi in range(b):
    for j in range(t // s):
      for k in range(s):
        if j * s + s - 1 + k < t:
          out[bi, j, k] = targets[bi, j * s + s - 1 + k]
  return out


def np_bag_positions(segments, positions, s, mode):
  """Walk each row: a bag's segment is its last token's; positions restart per segment."""
  b, t = segments.shape
  out = np.zeros((b, t // s), np.int64)
  for bi in range(b):
    count, prev = 0, None
    for j in range(t // s):
      seg = segments[bi, j * s + s - 1]
      count = 0 if seg != prev else count + 1
      prev = seg
      first_in_seg = next(i for i in range(j * s, j * s + s) if segments[bi, i] == seg)
      out[bi, j] = count if mode == "bag" else (positions[bi, j * s] if first_in_seg == j * s else 0)
  return out


def random_bags(rng, n, s, vocab):
  labels = rng.integers(0, vocab, size=(n, s))
  labels[rng.random((n, s)) < 0.25] = -1
  labels[1] = -1                     # a bag with every label ignored
  if s > 1:
    labels[2, :] = labels[2, 0] if labels[2, 0] >= 0 else 5  # all duplicates
    labels[3, :2] = 9                                        # one duplicate
  return labels


# ----------------------------------------------------------------------------- pure functions


@pytest.mark.parametrize("s", [1, 2, 4, 8])
def test_multihot_cross_entropy_matches_numpy(s):
  rng = np.random.default_rng(s)
  b, length, d, vocab = 2, 5, 16, 50
  hidden = rng.normal(size=(b, length, d)).astype(np.float32)
  weight = (rng.normal(size=(d, vocab)) * 0.5).astype(np.float32)
  labels = random_bags(rng, b * length, s, vocab).reshape(b, length, s)
  got = sup.multihot_cross_entropy(jnp.asarray(hidden), jnp.asarray(weight), jnp.asarray(labels), "xla")
  np.testing.assert_allclose(np.asarray(got), np_multihot_ce(hidden, weight, labels), rtol=1e-5, atol=1e-6)
  assert float(got.reshape(-1)[1]) == 0.0
  if s == 1:  # the reference is then plain CE; the NTP objective's CE agrees with it
    ce, _ = objectives.token_cross_entropy(jnp.asarray(hidden), jnp.asarray(weight), jnp.asarray(labels[..., 0]), "xla")
    logp = np_log_softmax(hidden.astype(np.float64) @ weight.astype(np.float64))
    y = labels[..., 0]
    plain = np.where(y >= 0, -np.take_along_axis(logp, np.maximum(y, 0)[..., None], -1)[..., 0], 0.0)
    np.testing.assert_allclose(np_multihot_ce(hidden, weight, labels), plain, rtol=1e-12)
    np.testing.assert_allclose(np.asarray(ce), plain, rtol=1e-5, atol=1e-6)


def test_superpose_embeddings_and_next_bag_targets_match_numpy():
  rng = np.random.default_rng(0)
  for s in (1, 3, 4):
    emb = rng.normal(size=(2, 6 * s, 5)).astype(np.float32)
    got = np.asarray(sup.superpose_embeddings(jnp.asarray(emb), s))
    want = np.stack([emb[:, j * s:(j + 1) * s].mean(1) for j in range(6)], axis=1)
    np.testing.assert_allclose(got, want, rtol=1e-6)

    targets = rng.integers(0, 30, size=(2, 6 * s))
    targets[0, 4] = -1  # padding stays ignored
    np.testing.assert_array_equal(np.asarray(sup.next_bag_targets(jnp.asarray(targets), s)), np_next_bags(targets, s))
  with pytest.raises(ValueError, match="not a multiple of the bag size tst.s=4"):
    sup.superpose_embeddings(jnp.zeros((1, 10, 3)), 4)


def test_bag_positions_and_segments_follow_documents():
  s = 4
  segments = np.array([[1] * 6 + [2] * 7 + [3] * 3 + [4] * 8, [1] * 24])  # docs cut mid-bag and on a bag edge
  positions = np.concatenate([np.arange(6), np.arange(7), np.arange(3), np.arange(8)])[None].repeat(2, 0)
  positions[1] = np.arange(24)
  for mode in ("bag", "token"):
    got = sup.bag_positions(jnp.asarray(segments), jnp.asarray(positions), s, mode)
    np.testing.assert_array_equal(np.asarray(got), np_bag_positions(segments, positions, s, mode))
  np.testing.assert_array_equal(np.asarray(sup.bag_segments(jnp.asarray(segments), s))[0], [1, 2, 2, 3, 4, 4])
  np.testing.assert_array_equal(np.asarray(sup.bag_positions(jnp.asarray(segments), jnp.asarray(positions), s))[0],
                                [0, 0, 1, 0, 0, 1])


def test_phase1_rows_of_l_times_s_tokens_give_l_positions():
  cfg = load_config(TINY_TST, RUN)
  first, second = phases.plan(cfg)
  assert (first.seq_len, first.positions, second.seq_len, second.positions) == (128, 32, 32, 32)
  assert (first.end, second.start, second.end) == (N1, N1, 4)

  calls = []

  class Spy:  # the model as the objective sees it, recording what the blocks are fed
    def __init__(self, model):
      self.model = model

    def __getattr__(self, name):
      return getattr(self.model, name)

    def __call__(self, tokens, segment_ids, positions, **kw):
      calls.append((kw["embeddings"].shape, segment_ids.shape, positions.shape))
      return self.model(tokens, segment_ids, positions, **kw)

  graphdef, params = abstract_model(cfg.model)
  batch = {k: jax.ShapeDtypeStruct((2, 128), jnp.int32) for k in ("inputs", "targets", "segment_ids", "positions")}
  objective = lambda p, b: objectives.tst_objective(Spy(nnx.merge(graphdef, p)), b, cfg)
  loss, metrics = jax.eval_shape(objective, nnx.to_pure_dict(params), batch)  # traces, runs nothing
  assert calls == [((2, 32, cfg.model.d_model), (2, 32), (2, 32))]
  assert loss.shape == () and set(metrics) == {"loss", "total_loss", "counts"}


def np_next_tokens(targets, s):
  """labels[b, t, k] = targets[b, t + k], -1 past the end of the row."""
  b, t = targets.shape
  return np.array([[[targets[bi, ti + k] if ti + k < t else -1 for k in range(s)] for ti in range(t)]
                   for bi in range(b)])


@pytest.mark.parametrize("superpose,positions", [("input", "bag"), ("output", "bag"), ("both", "token")])
def test_tst_objective_modes_feed_and_score_what_they_say(superpose, positions, monkeypatch):
  """The phase-1 objective, run on a real tiny model: what the blocks get (bags or tokens, their
  segments and positions) and which labels are scored, against the NumPy references; the loss
  is the NumPy multi-hot CE of those labels, averaged over the positions that have one."""
  s = 4
  cfg = load_config(TINY_TST, RUN + [f"tst.superpose={superpose}", f"tst.positions={positions}"])
  row = 32 if superpose == "output" else 32 * s
  rng = np.random.default_rng(1)
  lengths = [6, 7, 3, 40, row - 56] if row > 32 else [6, 7, 3, 16]  # documents cut mid-bag
  segments = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)])[None].repeat(2, 0)
  pos = np.concatenate([np.arange(n) for n in lengths])[None].repeat(2, 0)
  inputs = rng.integers(0, cfg.model.vocab_size, size=(2, row))
  targets = rng.integers(0, cfg.model.vocab_size, size=(2, row))
  targets[0, -3:] = -1  # padding
  batch = {k: jnp.asarray(v, jnp.int32) for k, v in
           dict(inputs=inputs, targets=targets, segment_ids=segments, positions=pos).items()}

  fed, scored, real_ce = [], [], sup.multihot_cross_entropy

  class Spy:
    def __init__(self, model):
      self.model = model

    def __getattr__(self, name):
      return getattr(self.model, name)

    def __call__(self, tokens, segment_ids, positions, **kw):
      fed.append((tokens, kw.get("embeddings"), segment_ids, positions))
      return self.model(tokens, segment_ids, positions, **kw)

  def multihot(hidden, weight, labels, *args, **kw):
    scored.append((hidden, weight, labels))
    return real_ce(hidden, weight, labels, *args, **kw)

  monkeypatch.setattr(sup, "multihot_cross_entropy", multihot)
  graphdef, abstract = abstract_model(cfg.model)
  params = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * 0.2, x.dtype), nnx.to_pure_dict(abstract))

  @jax.jit  # one compilation, rather than op by op
  def objective(params):
    model = nnx.merge(graphdef, params)
    loss, metrics = objectives.tst_objective(Spy(model), batch, cfg)
    return loss, metrics, fed[0], scored[0], model.embed_tokens(jnp.arange(cfg.model.vocab_size))

  loss, metrics, fed, scored, table = jax.device_get(objective(params))
  fed, scored = [fed], [scored]
  [(tokens, embeddings, got_segments, got_positions)] = fed
  if superpose == "output":  # plain tokens in, the next s tokens out at every position
    np.testing.assert_array_equal(np.asarray(tokens), inputs)
    assert embeddings is None
    np.testing.assert_array_equal(got_segments, segments)
    np.testing.assert_array_equal(got_positions, pos)
    want_labels = np_next_tokens(targets, s)
  else:  # bags in: the mean of each bag's token embeddings, the bag's segment and position
    assert tokens is None
    np.testing.assert_allclose(np.asarray(embeddings), table[inputs].reshape(2, 32, s, -1).mean(2), rtol=1e-6)
    np.testing.assert_array_equal(got_segments, segments[:, s - 1::s])
    np.testing.assert_array_equal(got_positions, np_bag_positions(segments, pos, s, positions))
    want_labels = np_next_bags(targets, s)
    if superpose == "input":
      want_labels = want_labels[..., :1]  # the next token only: plain CE
  [(hidden, weight, labels)] = scored
  np.testing.assert_array_equal(labels, want_labels)
  per_position = np_multihot_ce(hidden, weight, want_labels)
  has_label = (want_labels >= 0).any(-1)
  assert float(metrics["loss"]) == pytest.approx(per_position[has_label].mean(), rel=1e-5)
  assert float(loss) == float(metrics["total_loss"]) == float(metrics["loss"])  # no z-loss or aux terms here


def test_config_errors_are_clear(corpus_dir, tmp_path):
  with pytest.raises(ConfigError, match=r"data.seq_len: 30 is not divisible by tst.s=4"):
    load_config(TINY_TST, RUN + ["tst.budget=tokens", "data.seq_len=30"])
  load_config(TINY_TST, RUN + ["data.seq_len=30"])  # budget "flops": rows of 120 tokens, 30 bags
  with pytest.raises(ConfigError, match=r"tst.r: round\(tst.r \* train.steps\) = 0"):
    load_config(TINY_TST, RUN + ["tst.r=0.1"])
  with pytest.raises(ConfigError, match="tst.carry"):
    load_config(TINY_TST, RUN + ["tst.carry=optimizer"])
  with pytest.raises(ConfigError, match="optim.warmup_steps: 2 must be below both phases"):
    load_config(TINY_TST, RUN + ["tst.carry=params", "optim.warmup_steps=2"])
  cfg = load_config(TINY_TST, RUN)
  cfg.model.name = "concept"
  with pytest.raises(ConfigError, match="tst.enabled: TST is defined for model.name='baseline' only"):
    validate_tst(cfg)
  # Rows of seq_len * s tokens must fit the corpus: refused before anything is traced.
  with pytest.raises(ConfigError, match="tst.budget: phase 1 reads rows of data.seq_len \\* tst.s = 5120 tokens"):
    train(load_config(TINY_TST, RUN + [f"data.source={corpus_dir}", "tst.s=160"]), str(tmp_path))


# ----------------------------------------------------------------------------- the two-phase loop


class Killed(Exception):
  """Stands in for SIGKILL between two steps: nothing more is saved. (Checkpoint saves already
  under way finish, as the loop's `finally` waits for them; a save lost to a real kill leaves
  the previous checkpoint as the latest, which is another of the cases tested here.)"""


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
  """Share compiled steps between the runs of this module (they trace identical programs)."""
  from jax.experimental.compilation_cache import compilation_cache
  old = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs,
         jax.config.jax_persistent_cache_min_entry_size_bytes)
  jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("jax_cache")))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  compilation_cache.reset_cache()
  yield
  jax.config.update("jax_compilation_cache_dir", old[0])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", old[1])
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", old[2])
  compilation_cache.reset_cache()


def run(workdir, corpus, *overrides, kill=None, cost=False):
  """Train a tiny TST run; returns what the steps saw, as host copies:

  .first {phase: state at its first step}, .after {phase: [state after each of its steps]},
  and with cost=True .xla_flops {phase: FLOPs of its compiled train step, by XLA's cost analysis}.
  kill=(phase, n) raises Killed instead of that phase's n-th step of this call.
  """
  cfg = load_config(TINY_TST, RUN + [f"data.source={corpus}", *overrides])
  seen, counts, real = types.SimpleNamespace(first={}, after={}, xla_flops={}), {}, steps.make_train_step

  def make_train_step(graphdef, tx, cfg, shardings, mesh, objective, monitors=False):
    jitted = real(graphdef, tx, cfg, shardings, mesh, objective, monitors)
    phase = 1 if objective is objectives.tst_objective else 2

    def compile_recorded(lowered):  # the loop compiles its step ahead of time: lower(...).compile()
      step_fn = lowered.compile()
      if cost and phase not in seen.xla_flops:
        analysis = step_fn.cost_analysis()
        seen.xla_flops[phase] = (analysis[0] if isinstance(analysis, list) else analysis)["flops"]

      def recorded(state, batch):
        counts[phase] = counts.get(phase, 0) + 1
        if kill == (phase, counts[phase]):
          raise Killed
        seen.first.setdefault(phase, jax.device_get(state))  # before the step donates it
        state, metrics = step_fn(state, batch)
        seen.after.setdefault(phase, []).append(jax.device_get(state))
        return state, metrics
      return recorded
    return types.SimpleNamespace(lower=lambda *args: types.SimpleNamespace(compile=lambda: compile_recorded(
        jitted.lower(*args))))

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(steps, "make_train_step", make_train_step)
    train(cfg, str(workdir))
  return seen


def saved_state(workdir, subdir, step):
  """(train state, meta) of checkpoint `step` in WORKDIR/SUBDIR, on the host."""
  cfg = load_config(TINY_TST, RUN)
  _, abstract_params = abstract_model(cfg.model)
  tx, _ = build_optimizer(cfg.optim, cfg.train.steps, axes_tree(abstract_params))
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                          jax.eval_shape(lambda: steps.init_state(cfg.model, 0, tx, None)))
  ckpts = checkpoint.Checkpoints(str(workdir), subdir=subdir, read_only=True)
  try:
    state, meta = ckpts.restore(step, abstract)
  finally:
    ckpts.close()
  return jax.device_get(state), meta


def assert_trees_equal(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def straight(tmp_path_factory, corpus_dir, compile_cache):
  """An uninterrupted run: carry "all", a checkpoint every step, evaluation at steps 2 and 4."""
  workdir = tmp_path_factory.mktemp("straight")
  seen = run(workdir, corpus_dir, cost=True)
  return workdir, seen, saved_state(workdir, "checkpoints", 4)[0]["params"]


def adam_counts(opt_state):
  """The step counts in an AdamW state: Adam's (bias correction) and the LR schedule's."""
  return [int(x) for path, x in jax.tree_util.tree_leaves_with_path(opt_state)
          if jax.tree_util.keystr(path).endswith(".count")]


def test_phase2_starts_from_the_saved_phase1_result_with_its_optimiser(straight, corpus_dir):
  workdir, seen, _ = straight
  saved, meta = saved_state(workdir, "phase1", N1)
  assert meta["phase"] == 1 and meta["phase1_final"] is True and meta["step"] == N1
  # phase1/ holds the state that phase 1's last step left in memory (params, moments, counts)...
  last = seen.after[1][-1]
  assert len(seen.after[1]) == N1 and int(last["step"]) == N1
  assert_trees_equal(last["params"], saved["params"])
  assert_trees_equal(last["opt_state"], saved["opt_state"])
  # ...and phase 2's first step starts from exactly that (restored from phase1/; carry "all").
  assert_trees_equal(seen.first[2]["params"], saved["params"])
  assert_trees_equal(seen.first[2]["opt_state"], saved["opt_state"])
  assert adam_counts(seen.first[2]["opt_state"]) == [N1, N1]
  assert sorted(os.listdir(workdir / "checkpoints")) == ["3", "4"]  # phase 1's checkpoints rotated out...
  assert os.listdir(workdir / "phase1") == [str(N1)]                  # ...its result stays

  rows = read_metrics(str(workdir))
  assert [(r["step"], r["phase"]) for r in rows] == [(1, 1), (2, 1), (3, 2), (4, 2)]
  cfg = load_config(TINY_TST, RUN)
  assert rows[2]["lr"] == pytest.approx(float(learning_rate_schedule(cfg.optim, 4)(N1)))  # one schedule across both phases
  tokens = np.diff([0] + [r["tokens"] for r in rows])
  assert list(tokens) == [8 * 128, 8 * 128, 8 * 32, 8 * 32]  # phase 1 reads 4x the tokens per step
  # Validation is plain per-token NTP on the same split in both phases: the phase-1 value is
  # what the plain evaluator gives for the phase-1 result.
  assert "val_loss" in rows[1] and "val_loss" in rows[3]
  cfg = load_config(TINY_TST, RUN + [f"data.source={corpus_dir}"])
  data = build_data(cfg, str(workdir))
  val = make_val_batches(data, cfg.data.seq_len, cfg.data.batch_size, cfg.train.eval_batches)
  mesh = sharding.make_mesh(cfg.mesh)
  graphdef, _ = abstract_model(cfg.model)
  eval_step = steps.make_eval_step(graphdef, cfg, None, mesh, data.tokenizer.token_bytes)
  got = steps.evaluate(eval_step, saved["params"], val, mesh, cfg.data.batch_size)
  assert got["val_loss"] == pytest.approx(rows[1]["val_loss"], rel=1e-6)


def test_equal_flops_budget_matches_xla_cost_analysis(straight):
  """Budget "flops": the two phases' compiled train steps do the same work (XLA's own count of
  the programs that ran), and the logged FLOPs (train/flops.py's analytic count) say so too."""
  workdir, seen, _ = straight
  xla1, xla2 = seen.xla_flops[1], seen.xla_flops[2]
  assert abs(xla1 / xla2 - 1) < 0.01
  rows = read_metrics(str(workdir))
  flops = np.diff([0] + [r["flops"] for r in rows])
  assert flops[0] == flops[1] and flops[2] == flops[3]
  assert abs((flops[0] / flops[2]) / (xla1 / xla2) - 1) < 0.01
  # The analytic count leaves out what XLA also counts (optimiser, norms, softmax, ...), but it
  # is the same order: this catches a forgotten backward pass (x1/3) or tokens counted as bags (x4).
  assert 0.7 < flops[0] / xla1 < 1.1 and 0.7 < flops[2] / xla2 < 1.1


def test_killed_in_phase1_resumes_bitwise(straight, tmp_path, corpus_dir, compile_cache):
  _, _, want = straight
  with pytest.raises(Killed):
    run(tmp_path, corpus_dir, kill=(1, 2))
  assert os.listdir(tmp_path / "checkpoints") == ["1"] and not os.listdir(tmp_path / "phase1")
  seen = run(tmp_path, corpus_dir)  # phase 1 resumes at step 2, with its data iterator's state
  assert int(seen.first[1]["step"]) == 1 and len(seen.after[1]) == 1
  assert_trees_equal(saved_state(tmp_path, "checkpoints", 4)[0]["params"], want)
  assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2, 3, 4]


@pytest.mark.slow  # the slow tier by measured time (pyproject.toml)
def test_budget_tokens_with_carry_params(tmp_path, corpus_dir, compile_cache):
  """Patch-Level Training's setup end to end: phase 1 reads plain rows (8 bags of 4 tokens)
  at about 1/4 of phase 2's FLOPs; phase 2 starts from phase 1's params with a fresh optimiser
  and its own schedule, whose warmup starts again at lr 0."""
  seen = run(tmp_path, corpus_dir, "tst.budget=tokens", "tst.carry=params")
  saved, _ = saved_state(tmp_path, "phase1", N1)
  last, start = seen.after[1][-1], seen.first[2]
  assert_trees_equal(last["params"], saved["params"])  # phase1/ holds phase 1's result...
  assert_trees_equal(start["params"], saved["params"])  # ...and phase 2 starts from it
  assert adam_counts(last["opt_state"]) == [N1, N1]
  assert all(not np.any(x) for x in jax.tree.leaves(start["opt_state"]))  # fresh: zero moments and counts
  # One phase-2 step: the optimiser counts from 0 again, and the restarted schedule's lr at 0
  # (the warmup's start, 0.0) leaves the params exactly as they were.
  after = seen.after[2][0]
  assert adam_counts(after["opt_state"]) == [1, 1]
  assert_trees_equal(after["params"], start["params"])
  rows = read_metrics(str(tmp_path))
  assert [(r["step"], r["phase"]) for r in rows] == [(1, 1), (2, 1), (3, 2), (4, 2)]
  o = load_config(TINY_TST, RUN).optim
  assert rows[0]["lr"] == float(learning_rate_schedule(o, N1)(0))
  assert rows[1]["lr"] == pytest.approx(float(learning_rate_schedule(o, N1)(1)))
  assert rows[2]["lr"] == float(learning_rate_schedule(o, 4 - N1)(0)) == 0.0
  tokens = np.diff([0] + [r["tokens"] for r in rows])
  flops = np.diff([0] + [r["flops"] for r in rows])
  assert list(tokens) == [8 * 32] * 4
  assert 0.2 < flops[0] / flops[2] < 0.3  # 8 bags instead of 32 tokens per row (attention is not linear)


def test_carry_params_restarts_optimiser_and_schedule(straight, tmp_path, corpus_dir, compile_cache):
  # Start at the switch from the straight run's phase-1 result (a workdir holding only
  # phase1/ resumes there), so that only phase 2 runs here.
  shutil.copytree(straight[0] / "phase1", tmp_path / "phase1")
  shutil.copy(straight[0] / "tokenizer.model", tmp_path / "tokenizer.model")
  seen = run(tmp_path, corpus_dir, "tst.carry=params", "tst.reinit_embeddings_at_switch=True")
  saved, _ = saved_state(tmp_path, "phase1", N1)
  assert sorted(seen.first) == [2]
  assert all(not np.any(x) for x in jax.tree.leaves(seen.first[2]["opt_state"]))  # fresh: zero moments and count
  p2, p1 = seen.first[2]["params"], saved["params"]
  reinit = ("embed", "lm_head")
  assert_trees_equal({k: v for k, v in p2.items() if k not in reinit}, {k: v for k, v in p1.items() if k not in reinit})
  assert not np.allclose(p2["embed"], p1["embed"]) and not np.allclose(p2["lm_head"], p1["lm_head"])
  rows = read_metrics(str(tmp_path))
  assert [(r["step"], r["phase"]) for r in rows] == [(3, 2), (4, 2)]
  assert rows[0]["lr"] == 0.0  # the warmup starts again
  assert rows[0]["tokens"] == 2 * 8 * 128 + 8 * 32  # phase 1's tokens are counted


@pytest.mark.parametrize("kill", [(2, 1), (2, 2)], ids=["before-first-phase2-step", "after-first-phase2-step"])
def test_resume_across_the_switch_is_bitwise(straight, tmp_path, corpus_dir, kill, compile_cache):
  _, _, want = straight
  with pytest.raises(Killed):
    run(tmp_path, corpus_dir, kill=kill)
  latest = sorted(int(x) for x in os.listdir(tmp_path / "checkpoints"))[-1]
  assert latest == (1 if kill == (2, 1) else 3)  # resume from the phase-1 result, or from step 3
  seen = run(tmp_path, corpus_dir)
  assert 1 not in seen.first  # phase 1 is not run again
  assert_trees_equal(saved_state(tmp_path, "checkpoints", 4)[0]["params"], want)
  assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2, 3, 4]


def test_resume_when_killed_while_saving_the_phase1_result(straight, tmp_path, corpus_dir, compile_cache, monkeypatch):
  _, _, want = straight
  real_save = checkpoint.Checkpoints.save

  def save(self, step, *args):
    if self.directory.endswith("phase1"):
      raise Killed
    return real_save(self, step, *args)

  monkeypatch.setattr(checkpoint.Checkpoints, "save", save)
  with pytest.raises(Killed):
    run(tmp_path, corpus_dir)
  monkeypatch.undo()
  assert not os.listdir(tmp_path / "phase1")
  seen = run(tmp_path, corpus_dir)  # redoes phase-1 step 2 from checkpoint 1 and its iterator state
  assert sorted(seen.first) == [1, 2]
  assert_trees_equal(saved_state(tmp_path, "checkpoints", 4)[0]["params"], want)
