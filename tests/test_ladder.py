"""The ladder command (latent_jax/ladder): plan's points spend their budgets, --shard splits them, a
recorded point is never retrained, bad ladder configs are one error line; and (slow tier) a tiny
ladder end to end through the command line."""
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


def tiny_ladder(store, *overrides):
  from latent_jax.config import apply_overrides, read_config, validate
  ladder = read_config(LADDER)
  apply_overrides(ladder, [f"--config.data={store}", *[f"--config.{o}" for o in overrides]])
  return validate(ladder)


def test_points_spend_their_budget_to_within_one_step(tiny_store):
  from latent_jax.ladder.points import ladder_points
  from latent_jax.train import flops
  points = ladder_points(tiny_ladder(tiny_store))
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
  with_head = {p.name: p for p in ladder_points(tiny_ladder(tiny_store, "budgets=(1e8,2e8)", "sizes=('16x1',)"))}
  for p in ladder_points(tiny_ladder(tiny_store, "budgets=(1e8,2e8)", "sizes=('16x1',)", "count_lm_head=False")):
    if p.method == "baseline":
      d = int(p.size.split("x")[0])
      # fewer FLOPs per token buy more steps; per token the count drops by the LM head's 6 d V
      assert with_head[p.name].flops_per_token - p.flops_per_token == pytest.approx(6 * d * 320)


def test_shards_cover_every_point_once(tiny_store):
  from latent_jax.config import ConfigError
  from latent_jax.ladder.points import ladder_points, shard
  points = ladder_points(tiny_ladder(tiny_store))
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
  points = ladder_points(ladder)
  trained = []
  monkeypatch.setattr(run, "train_point", lambda p, w: trained.append(p.name) or (0, ""))
  workdir = str(tmp_path)
  run.record(ladder, workdir, points[0], {"val_loss": 3.0, "val_bpb": 1.0}, seconds=1.0)
  finished = os.path.join(workdir, points[1].name)
  os.makedirs(finished)
  with open(os.path.join(finished, "metrics.jsonl"), "w") as f:
    f.write(json.dumps({"step": points[1].steps, "loss": 3.1, "val_loss": 3.2, "val_bpb": 1.1}) + "\n")
  left = run.run(ladder, workdir, points[:2], log=lambda *a: None)
  assert left == 0 and trained == []
  assert run.read_result(ladder, workdir, points[1])["val_loss"] == 3.2  # recorded from its workdir
  # A point that ends before its last step (a signal) stops the ladder there.
  assert run.run(ladder, workdir, points, log=lambda *a: None) == len(points) - 2
  assert trained == [points[2].name]


def ladder_cli(capsys, *argv):
  from latent_jax.ladder.__main__ import main
  with pytest.raises(SystemExit) as e:
    main(list(argv))
  return e.value.code, capsys.readouterr()


@pytest.mark.parametrize("override, message", [
    ("reference=nope", "reference: 'nope' is not one of the methods"),
    ("methods.tst.recipe=configs/nope.py", "methods.tst: --config 'configs/nope.py': no such file"),
    ("budgets=(1e5,2e8)", "budgets: 1e+05 FLOPs is too small"),
    ("sizes=('20x1',)", "sizes: '20x1' has d_model 20, not a multiple of family.head_dim=8"),
    ("budgets=(2e8,4e10)", "it would see tokens twice"),
    ("sizes=('4x',)", "sizes: must be WIDTHxDEPTH"),
    ("rule.warmup_fraction=1.5", "rule.warmup_fraction: must be in [0, 1)"),
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
  points = ladder_points(tiny_ladder(tiny_store))
  for p in points:
    assert p.name in out and p.launch(str(tmp_path)) in out
  assert f"{len(points)} points" in out
  code, err = ladder_cli(capsys, "train", "--config", LADDER)
  assert code == 2 and "give a subcommand first" in err.err


@pytest.mark.slow
def test_a_tiny_ladder_end_to_end(tiny_store, tmp_path):
  """run in two shards, status, a rerun that trains nothing, fit and plot: through the command line."""
  from latent_jax.ladder.points import ladder_points
  workdir = str(tmp_path / "ladder")
  base = [sys.executable, "-m", "latent_jax.ladder"]
  flags = ["--config", LADDER, f"--config.data={tiny_store}", "--workdir", workdir]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  out = subprocess.run(base + ["plan", *flags], capture_output=True, text=True, env=env, cwd=ROOT)
  assert out.returncode == 0 and "estimated" in out.stdout, out.stderr
  for i in range(2):
    out = subprocess.run(base + ["run", *flags, f"--shard={i}/2"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
  points = ladder_points(tiny_ladder(tiny_store))
  for p in points:  # each point is an ordinary train workdir, and its result is recorded
    with open(os.path.join(workdir, "results", "points", p.name + ".json")) as f:
      result = json.load(f)
    assert result["status"] == "done" and result["val_loss"] > 0 and result["steps"] == p.steps
    assert result["flops_logged"] == pytest.approx(p.flops, rel=1e-6)  # the train loop's own count agrees
  out = subprocess.run(base + ["status", *flags], capture_output=True, text=True, env=env, cwd=ROOT)
  assert f"{len(points)} done of {len(points)} points" in out.stdout
  out = subprocess.run(base + ["run", *flags], capture_output=True, text=True, env=env, cwd=ROOT)
  assert out.returncode == 0 and out.stdout.count("recorded") == len(points) and "training" not in out.stdout
  out = subprocess.run(base + ["fit", *flags, "--bootstrap=20"], capture_output=True, text=True, env=env, cwd=ROOT)
  assert out.returncode == 0, out.stderr[-3000:]
  with open(os.path.join(workdir, "results", "fit.json")) as f:
    fitted = json.load(f)
  assert fitted["reference"] == "baseline"
  out = subprocess.run(base + ["plot", *flags, "--bootstrap=0"], capture_output=True, text=True, env=env, cwd=ROOT)
  assert out.returncode == 0 and os.path.getsize(os.path.join(workdir, "results", "frontier.png")) > 0, out.stderr
