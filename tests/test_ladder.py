"""The ladder command (latent_jax/ladder): plan's points spend their budgets under the rule (keyed on the
reference's N at each size) and the tune's factors, sizes widen until a minimum is bracketed, --shard splits
them, a recorded point is never retrained, plan and status need no token store, bad ladder configs are one
error line; and (slow tier) a tiny ladder end to end through the command line."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

LADDER = os.path.join(ROOT, "configs", "ladder_tiny.py")


@pytest.fixture(scope="session")
def tiny_store(corpus_dir, tmp_path_factory):
  """A token store of the synthetic corpus with a 320-piece vocabulary (configs/ladder_tiny.py's)."""
  from latent_jax import load_config
  from latent_jax.prepare import prepare
  out = str(tmp_path_factory.mktemp("ladder") / "store")
  prepare(load_config(os.path.join(ROOT, "configs", "tiny.py"), ["model.vocab_size=320", f"data.source={corpus_dir}"]),
          out, log=lambda *a: None)
  return out


def tiny_ladder(store, *overrides, tune=False):
  """configs/ladder_tiny.py on the store; without its tune unless asked (every ladder point planned at once)."""
  overrides = overrides if tune else ("tune.sizes=()", *overrides)
  from latent_jax.config import apply_overrides, read_config, validate
  ladder = read_config(LADDER)
  apply_overrides(ladder, [f"--config.data={store}", *[f"--config.{o}" for o in overrides]])
  return validate(ladder)


def test_points_spend_their_budget_to_within_one_step(tiny_store):
  from latent_jax.ladder.points import ladder_points
  from latent_jax.train import flops
  points, _ = ladder_points(tiny_ladder(tiny_store))
  assert {p.method for p in points} == {"baseline", "tst"} and {p.budget for p in points} == {2e8, 4e8}
  for p in points:
    cfg = p.config()
    rows, length = cfg.data.batch_size, cfg.data.seq_len
    step = rows * length * flops.flops_per_token(cfg, length)  # a plain step; TST's phase-1 step costs the same
    assert abs(p.tokens * p.flops_per_token - p.budget) <= step, p.name
    assert cfg.train.steps == p.steps and rows == p.batch_size
    if p.method == "baseline":  # an independent count: steps x rows x seq_len tokens at train/flops.py's rate
      assert p.tokens == p.steps * rows * length
      assert p.flops == pytest.approx(p.steps * step, rel=1e-12)


def test_without_the_lm_head_the_count_drops_by_its_matmul(tiny_store):
  from latent_jax.ladder.points import ladder_points
  with_head = {p.name: p for p in ladder_points(tiny_ladder(tiny_store, "budgets=(1e8,2e8)", "sizes=('16x1',)"))[0]}
  for p in ladder_points(tiny_ladder(tiny_store, "budgets=(1e8,2e8)", "sizes=('16x1',)", "count_lm_head=False"))[0]:
    d = int(p.size.split("x")[0])
    if p.method == "baseline":
      # fewer FLOPs per token buy more steps; per token the count drops by the LM head's 6 d V
      assert with_head[p.name].flops_per_token - p.flops_per_token == pytest.approx(6 * d * 320)
    # the head's share is kept in every point, so both conventions fit from the same points
    per_step = p.batch_size * p.config().data.seq_len * 6 * d * 320
    assert p.lm_head_flops == pytest.approx(p.steps * per_step)  # TST's bag positions: seq_len per row too
    assert with_head[p.name].lm_head_flops / with_head[p.name].steps == pytest.approx(per_step)


def test_the_rule_is_keyed_on_the_reference_and_the_tune_scales_lr(tiny_store):
  """Every method trains a size with the reference's batch, warmup (N tokens) and base lr; beta2 0.99 below
  0.5M-token batches; once its tune points are recorded, its lr is the rule's times its factor."""
  from latent_jax.ladder.points import ladder_points, rule
  ladder = tiny_ladder(tiny_store, f"methods.tst.recipe={ROOT}/configs/tiny_ncp.py", "family.head_dim=16",
                       "sizes=('32x1','48x1')", "budgets=(4e8,)", "tune.sizes=('32x1',)", tune=True)
  points, notes = ladder_points(ladder)
  assert {p.stage for p in points} == {"tune"} and "wait for their tune points" in notes[0]
  recorded = {p.name: {"name": p.name, "status": "done", "val_loss": 3.0 + (0.1 if p.lr_factor == 0.5 else 0.0)
                       + (0.2 if p.method == "tst" and p.lr_factor == 2.0 else 0.0)} for p in points}
  points, notes = ladder_points(ladder, recorded)
  ladder_pts = [p for p in points if p.stage == "ladder"]
  assert not notes and ladder_pts
  for p in ladder_pts:
    ref = next(q for q in ladder_pts if q.method == "baseline" and q.size == p.size and q.seed == p.seed)
    rows, lr = rule(ladder, ref.active_params)
    factor = {"baseline": 2.0, "tst": 0.5}[p.method]  # the swept factor with the lower loss (two: no parabola)
    assert (p.batch_size, p.reference_params) == (rows, ref.active_params)
    assert p.lr == pytest.approx(lr * factor, rel=1e-3) and p.lr_factor == factor
    assert p.warmup_steps == min(max(1, round(ref.active_params / (rows * ladder.seq_len))), p.steps - 1)  # N tokens
    assert "optim.b2=0.99" in p.overrides and "train.monitors=False" in p.overrides
  assert any(p.active_params != p.reference_params for p in ladder_pts if p.method == "tst")  # ConceptLM's own N differs


def test_sizes_widen_until_the_minimum_is_bracketed(tiny_store):
  from latent_jax.ladder.points import ladder_points
  ladder = tiny_ladder(tiny_store, "sizes=('16x1','24x1','32x1','40x1','48x1')", "sizes_per_budget=2",
                       "max_sizes_per_budget=4", "budgets=(4e8,)", "family.head_dim=8", "seeds=(0,)")
  def sizes(recorded):
    return [p.size for p in ladder_points(ladder, recorded)[0] if p.method == "baseline"]
  first = sizes({})
  assert len(first) == 2
  loss = {"16x1": 3.0, "24x1": 2.9, "32x1": 2.8, "40x1": 2.7, "48x1": 2.6}  # falling with size: the largest is best
  record = lambda names: {f"baseline_4e8_{s}_s0": {"name": "x", "status": "done", "val_loss": loss[s]} for s in names}
  grown = sizes(record(first))
  assert len(grown) == 3 and grown[:2] == first  # one size more on the side of the lowest loss
  grown = sizes(record(grown))
  assert len(grown) == 4
  points, notes = ladder_points(ladder, record(grown))
  assert [p.size for p in points if p.method == "baseline"] == grown  # max_sizes_per_budget: no more
  assert any("baseline at 4e+08" in n and "not bracketed" in n for n in notes)


def test_shards_cover_every_point_once(tiny_store):
  from latent_jax.config import ConfigError
  from latent_jax.ladder.points import ladder_points, shard
  points, _ = ladder_points(tiny_ladder(tiny_store))
  for n in (1, 2, 3, 5, 11):
    parts = [shard(points, f"{i}/{n}") for i in range(n)]
    names = [p.name for part in parts for p in part]
    assert sorted(names) == sorted(p.name for p in points) and len(set(names)) == len(points)
  for bad in ("2/2", "a/b", "1"):
    with pytest.raises(ConfigError, match="--shard"):
      shard(points, bad)


def test_a_recorded_or_finished_point_is_not_retrained(tiny_store, tmp_path, monkeypatch):
  from latent_jax.ladder import run
  from latent_jax.ladder.points import ladder_points
  ladder = tiny_ladder(tiny_store)
  points, _ = ladder_points(ladder)
  trained = []
  monkeypatch.setattr(run, "train_point", lambda p, w: trained.append(p.name) or (1, ""))  # stops at once
  workdir = str(tmp_path)
  run.record(ladder, workdir, points[0], {"val_loss": 3.0, "val_bpb": 1.0}, seconds=1.0)
  finished = os.path.join(workdir, points[1].name)
  os.makedirs(finished)
  with open(os.path.join(finished, "metrics.jsonl"), "w") as f:
    f.write(json.dumps({"step": points[1].steps, "loss": 3.1, "val_loss": 3.2, "val_bpb": 1.1}) + "\n")
  # A point that ends before its last step (a signal) stops the ladder there.
  assert run.run(ladder, workdir, log=lambda *a: None) == len(points) - 2
  assert trained == [points[2].name]
  assert run.read_result(ladder, workdir, points[1])["val_loss"] == 3.2  # recorded from its workdir


def test_plan_and_status_work_without_the_store(tiny_store, tmp_path, capsys):
  """From committed results alone: plan lists the points (no estimate), status counts them; run names the
  corpus recipe."""
  from latent_jax.ladder import run
  from latent_jax.ladder.points import ladder_points
  ladder = tiny_ladder(tiny_store)
  points, _ = ladder_points(ladder)
  workdir = str(tmp_path / "w")
  run.record(ladder, workdir, points[0], {"val_loss": 3.0}, seconds=1.0)
  missing = str(tmp_path / "no_store")
  flags = ["--config", LADDER, f"--config.data={missing}", "--config.tune.sizes=()", "--workdir", workdir]
  from latent_jax.ladder.__main__ import main
  main(["status", *flags])
  assert f"1 done, {len(points) - 1} missing of {len(points)} points" in capsys.readouterr().out
  main(["plan", *flags])
  out = capsys.readouterr().out
  assert "no token store" in out and f"{len(points)} points planned" in out
  code, out = ladder_cli(capsys, "run", *flags, "--config.data_recipe=python experiments/ladder_corpus.py ...")
  assert code == 2 and out.err.count("\n") == 1 and "python experiments/ladder_corpus.py" in out.err


def ladder_cli(capsys, *argv):
  from latent_jax.ladder.__main__ import main
  with pytest.raises(SystemExit) as e:
    main(list(argv))
  return e.value.code, capsys.readouterr()


@pytest.mark.parametrize("override, message", [
    ("reference=nope", "reference: 'nope' is not one of the methods"),
    ("methods.tst.recipe=configs/nope.py", "methods.tst: --config 'configs/nope.py': no such file"),
    ("budgets=(1e5,2e8)", "budgets: 1e+05 FLOPs is too small"),
    ("sizes=('16x1','20x1')", "sizes: '20x1' has d_model 20, not a multiple of family.head_dim=8"),
    ("budgets=(2e8,4e10)", "it would see tokens twice"),
    ("sizes=('4x',)", "sizes: must be WIDTHxDEPTH"),
    ("rule.beta2=1.5", "rule.beta2: must be in (0, 1)"),
    ("tune.sizes=('99x1',)", "tune.sizes: ('99x1',) must be sizes of the family"),
    ("max_sizes_per_budget=0", "max_sizes_per_budget: must be an integer >= sizes_per_budget"),
])
def test_a_bad_ladder_is_one_error_line(tiny_store, tmp_path, capsys, override, message):
  code, out = ladder_cli(capsys, "plan", "--config", LADDER, f"--config.data={tiny_store}", f"--config.{override}",
                         "--workdir", str(tmp_path / "w"), "--nomeasure")
  lines = out.err.strip().splitlines()
  assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], out.err
  assert not os.path.exists(tmp_path / "w")


def test_a_size_that_does_not_fit_a_recipe_names_it(tiny_store, tmp_path, capsys):
  # ConceptLM's 8 product-quantisation segments do not divide d_model 12.
  code, out = ladder_cli(capsys, "plan", "--config", LADDER, f"--config.data={tiny_store}",
                         f"--config.methods.tst.recipe={ROOT}/configs/tiny_ncp.py", "--config.family.head_dim=4",
                         "--config.sizes=('12x1','16x1')", "--workdir", str(tmp_path), "--nomeasure")
  assert code == 2 and "sizes: '12x1' does not fit method 'tst'" in out.err and "num_segments" in out.err


def test_plan_lists_every_point_with_its_launch_line(tiny_store, tmp_path, capsys):
  from latent_jax.ladder.__main__ import main
  from latent_jax.ladder.points import ladder_points
  main(["plan", "--config", LADDER, f"--config.data={tiny_store}", "--workdir", str(tmp_path), "--nomeasure"])
  out = capsys.readouterr().out
  points, notes = ladder_points(tiny_ladder(tiny_store, tune=True))
  for p in points:
    assert p.name in out and p.launch(str(tmp_path)) in out
  assert f"{len(points)} points planned so far" in out and notes[0] in out
  code, err = ladder_cli(capsys, "train", "--config", LADDER)
  assert code == 2 and "give a subcommand first" in err.err


@pytest.mark.slow
def test_a_tiny_ladder_end_to_end(tiny_store, tmp_path):
  """The tune, then run in two shards, status, a rerun that trains nothing, fit (one seed: no intervals)
  and plot: through the command line."""
  from latent_jax.ladder.points import ladder_points, read_results
  workdir = str(tmp_path / "ladder")
  base = [sys.executable, "-m", "latent_jax.ladder"]
  flags = ["--config", LADDER, f"--config.data={tiny_store}", "--workdir", workdir]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  out = subprocess.run(base + ["plan", *flags], capture_output=True, text=True, env=env, cwd=ROOT)
  assert out.returncode == 0 and "estimated" in out.stdout, out.stderr
  out = subprocess.run(base + ["tune", *flags], capture_output=True, text=True, env=env, cwd=ROOT)
  assert out.returncode == 0 and "best factor" in out.stdout, out.stderr[-3000:]
  log = str(tmp_path / "after.log")
  for i in range(2):
    out = subprocess.run(base + ["run", *flags, f"--shard={i}/2", f"--after_point=echo $LADDER_POINT >> {log}"],
                         capture_output=True, text=True, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
  ladder = tiny_ladder(tiny_store, tune=True)
  points, notes = ladder_points(ladder, read_results(os.path.join(workdir, "results")))
  assert {p.stage for p in points} == {"tune", "ladder"} and len(points) == 4 + 8
  assert sorted(open(log).read().split()) == sorted(p.name for p in points if p.stage == "ladder")
  for p in points:  # each point is an ordinary train workdir, and its result is recorded
    folder = "tune" if p.stage == "tune" else "points"
    with open(os.path.join(workdir, "results", folder, p.name + ".json")) as f:
      result = json.load(f)
    assert result["status"] == "done" and result["val_loss"] > 0 and result["steps"] == p.steps
    assert result["flops_logged"] == pytest.approx(p.flops, rel=1e-6)  # the train loop's own count agrees
  out = subprocess.run(base + ["status", *flags], capture_output=True, text=True, env=env, cwd=ROOT)
  assert f"{len(points)} done of {len(points)} points" in out.stdout
  out = subprocess.run(base + ["run", *flags], capture_output=True, text=True, env=env, cwd=ROOT)
  assert out.returncode == 0 and out.stdout.count("recorded") == len(points) and "training" not in out.stdout
  out = subprocess.run(base + ["fit", *flags, "--bootstrap=50"], capture_output=True, text=True, env=env, cwd=ROOT)
  assert out.returncode == 0, out.stderr[-3000:]
  with open(os.path.join(workdir, "fit.json")) as f:  # the workdir by default, not the results folder
    fitted = json.load(f)
  assert fitted["reference"] == "baseline" and fitted["n_boot"] == 0 and "no noise estimate" in fitted["noise_note"]
  assert set(fitted["conventions"]) == {"with_lm_head", "without_lm_head"}
  out = subprocess.run(base + ["plot", *flags, "--bootstrap=0"], capture_output=True, text=True, env=env, cwd=ROOT)
  assert out.returncode == 0 and os.path.getsize(os.path.join(workdir, "frontier.png")) > 0, out.stderr


def test_fit_and_plot_errors_a_newcomer_meets(tmp_path, capsys, monkeypatch):
  """A CSV without a 'baseline' names --reference; plot without matplotlib names the extra; both one line."""
  csv = tmp_path / "p.csv"
  csv.write_text("method,flops,params,tokens,loss\nncp,1e19,,,2.7\nncp,3e19,,,2.6\n")
  code, out = ladder_cli(capsys, "fit", "--points", str(csv))
  assert code == 2 and out.err.count("\n") == 1 and "--reference" in out.err and "'baseline'" in out.err
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
  code, out = ladder_cli(capsys, "plot", "--points", str(csv), "--reference", "ncp")
  assert code == 2 and out.err.strip() == 'error: plot needs matplotlib: pip install -e ".[experiments]"'
  assert not os.path.exists(tmp_path / "frontier.png")


def test_a_tune_whose_best_factor_is_at_an_edge_sweeps_further(tiny_store):
  from latent_jax.ladder.points import sweep
  ladder = tiny_ladder(tiny_store, "tune.lr_factors=(0.5,1.0,2.0)", "tune.max_factors=5", tune=True)
  name = lambda f: f"tune_baseline_2e8_16x1_lr{f:g}_s0"
  record = lambda losses: {name(f): {"name": name(f), "status": "done", "val_loss": x} for f, x in losses.items()}
  assert sweep(ladder, "baseline", "16x1", {}) == [0.5, 1.0, 2.0]
  falling = {0.5: 3.3, 1.0: 3.2, 2.0: 3.1}  # the largest factor is best: one more beyond it
  assert sweep(ladder, "baseline", "16x1", record(falling)) == [0.5, 1.0, 2.0, 4.0]
  assert sweep(ladder, "baseline", "16x1", record({**falling, 4.0: 3.15})) == [0.5, 1.0, 2.0, 4.0]  # bracketed
  rising = {0.5: 3.0, 1.0: 3.2, 2.0: 3.4, 0.25: 2.9, 0.125: 2.8}  # best at the small edge until max_factors
  assert sweep(ladder, "baseline", "16x1", record(rising)) == [0.125, 0.25, 0.5, 1.0, 2.0]


def test_a_mixture_of_experts_counts_active_parameters_and_keeps_the_active_width(tiny_store):
  """An MoE method: N is its active non-embedding count (a routed expert's weights at top_k / E), each expert
  mlp_ratio x width / top_k wide, so a token's MLP is as wide as the dense reference's."""
  from latent_jax.ladder.points import ladder_points
  ladder = tiny_ladder(tiny_store, f"methods.tst.recipe={ROOT}/configs/tiny_moe.py", "budgets=(4e8,)")
  for p in ladder_points(ladder)[0]:
    cfg = p.config()
    width = cfg.model.d_model
    if p.method == "baseline":
      assert p.active_params == p.total_params
      continue
    e, k, f = cfg.model.moe.num_experts, cfg.model.moe.top_k, cfg.model.moe.expert_dim
    assert f == round(3.0 * width / k) and k * f == cfg.model.mlp_dim  # mlp_ratio 3: the dense width
    experts = cfg.model.num_layers * e * 3 * width * f  # gate, up, down of every expert
    assert p.total_params - p.active_params == experts - experts * k // e
    dense = next(q for q in ladder_points(ladder)[0] if q.method == "baseline" and q.size == p.size)
    assert p.active_params == dense.active_params + cfg.model.num_layers * width * e  # + the router
