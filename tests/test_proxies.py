"""Capability proxies (latent_jax/proxies.py): task files, their scores against an independent NumPy path,
Eq. 28's averaging order, bad files as one error line, training's proxy/... rows and eval --tasks; with
lm-eval (slow tier), the same per-example log-likelihoods as the harness model `latent_jax`."""
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import ROOT, TINY, TINY_OVERRIDES

from latent_jax import load_config, proxies, sharding
from latent_jax.data import Tokenizer, load_documents
from latent_jax.data.tokenizer import train_tokenizer
from latent_jax.nn import abstract_model, build_model
from test_cli_errors import check_one_error_line, run_main

TINY_NCP = os.path.join(ROOT, "configs", "tiny_ncp.py")
NCP_OVERRIDES = TINY_OVERRIDES + ["model.num_segments=4", "model.codebook_size=16", "model.encoder_layers=1",
                                  "model.concept_layers=1", "model.decoder_layers=1"]
MAX_LENGTH = 16  # shorter than the longest example below: its row keeps its end (and one length bucket)
# Hand-built: two capabilities, "c1" of two sources of unequal sizes (3 and 1 continuations), "c2" of one
# source with multiple choice (choices of unequal lengths) and a continuation; a prompt with trailing
# whitespace (it moves to the continuation), an empty prompt (EOS stands for it), a row longer than MAX_LENGTH.
EXAMPLES = [
    {"prompt": "Kar lon mith", "continuation": " sethal nur.", "source": "s1", "capability": "c1"},
    {"prompt": "Nur tad mis kap", "continuation": " lol sen.", "source": "s1", "capability": "c1"},
    {"prompt": "Lol sen tam ", "continuation": "mip tav.", "source": "s1", "capability": "c1"},
    {"prompt": "", "continuation": "Sed tap kar.", "source": "s2", "capability": "c1"},
    {"prompt": "Mip tav nuth", "choices": [" ses kal.", " kar lon mith sethal.", " nul."], "gold": 1,
     "source": "s3", "capability": "c2"},
    {"prompt": "Sed tap", "choices": [" lon.", " mis kap tad."], "gold": 0, "source": "s3", "capability": "c2"},
    {"prompt": " ".join(["Kar lon mith sethal nur tad mis kap"] * 4), "continuation": " lol sen tam.",
     "source": "s3", "capability": "c2"},
]


def write_jsonl(path, rows):
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
  return str(path)


@pytest.fixture(scope="module")
def tokenizer(corpus_dir, tmp_path_factory):
  path = tmp_path_factory.mktemp("tok") / "tokenizer.model"
  Tokenizer(str(path), train_tokenizer(load_documents(corpus_dir), 320)).save()
  return Tokenizer(str(path))


def random_model(config, overrides):
  """(model, graphdef, params, param shardings, mesh) of a freshly initialised inference model."""
  cfg = load_config(config, overrides)
  mesh = sharding.inference_mesh(cfg.mesh)
  graphdef, abstract = abstract_model(cfg.model)
  shardings = nnx.to_pure_dict(sharding.state_shardings(abstract, mesh))
  params = jax.jit(lambda: nnx.to_pure_dict(nnx.state(build_model(cfg.model, nnx.Rngs(1)))), out_shardings=shardings)()
  return nnx.merge(graphdef, params), graphdef, params, shardings, mesh


def reference_split(tok, prompt, text):
  """lm-eval's split, written out: trailing whitespace to the continuation, the prompt's tokens dropped."""
  if not prompt:
    return [tok.eos_id], tok.encode(text)
  stripped = prompt.rstrip()
  text = prompt[len(stripped):] + text
  return tok.encode(stripped), tok.encode(stripped + text)[len(tok.encode(stripped)):]


def reference_loglikelihoods(forward, tok, requests):
  """[(summed log-prob of the continuation's tokens, their count)] of (prompt, text) requests: one row each of
  the concatenated tokens (their last MAX_LENGTH + 1) then filler (token 7: the models are causal), all in
  one forward pass of the model's own logits, log-softmax in float64."""
  rows, spans = np.full((len(requests), MAX_LENGTH), 7, np.int32), []
  for r, (prompt, text) in enumerate(requests):
    context, continuation = reference_split(tok, prompt, text)
    whole = (context + continuation)[-(MAX_LENGTH + 1):]
    rows[r, :len(whole) - 1] = whole[:-1]
    spans.append((whole, min(len(continuation), len(whole) - 1)))
  logits = np.asarray(forward(jnp.asarray(rows)), np.float64)
  logp = logits - logits.max(-1, keepdims=True)
  logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
  picked = [logp[r, np.arange(len(w) - 1), w[1:]] for r, (w, _) in enumerate(spans)]
  return [(float(p[len(p) - m:].sum()), m) for p, (_, m) in zip(picked, spans)]


def test_eq28_averages_per_source_then_per_capability():
  """Unequal sources: c's NLL is the mean of its sources' means (1 and 3 -> 2), not of its examples (2.5)."""
  example = lambda source, capability, **kw: proxies.Example("p", source, capability, "f:1", **kw)
  examples = [example("a", "c", continuation="x")] + [example("b", "c", continuation="x")] * 3 + [
      example("m", "k", choices=("xx", "y"), gold=0), example("m", "k", choices=("x", "yyyy"), gold=1),
      example("n", "k", choices=("x", "y", "z"), gold=2)]
  lls = [[-2.0]] + [[-6.0]] * 3 + [[-2.0, -1.5], [-1.0, -2.0], [-3.0, -1.0, -2.0]]
  counts = [[2]] + [[2]] * 3 + [[1, 1]] * 2 + [[1, 1, 1]]
  nbytes = [[4]] + [[8]] * 3 + [[1, 1]] * 2 + [[1, 1, 1]]
  got = proxies.proxy_metrics(examples, lls, counts, nbytes)
  assert got["proxy/a/nll"] == 1.0 and got["proxy/b/nll"] == 3.0 and got["proxy/c/nll"] == 2.0
  assert got["proxy/c/bpb"] == pytest.approx((2 / 4 + 6 / 8) / 2 / math.log(2))
  # k: source m (acc 0 then 0: -1.0 > -2.0 picks choice 0; acc_norm 1 then 1: -2/2 > -1.5, -2/4 > -1), n (acc 0).
  assert got["proxy/k/acc"] == pytest.approx((0 + 0) / 2 / 2 + 0 / 2)
  assert got["proxy/k/acc_norm"] == pytest.approx(((1 + 1) / 2 + 0) / 2)
  margins_m = [-1.0 - (-1.5), -0.5 - (-1.0)]
  assert got["proxy/k/margin"] == pytest.approx((np.mean(margins_m) + (-2.0 - (-1.0))) / 2)
  assert "proxy/m/nll" not in got and "proxy/k/nll" not in got  # multiple choice gives no NLL


@pytest.mark.parametrize("config,overrides", [
    (TINY, TINY_OVERRIDES), pytest.param(TINY_NCP, NCP_OVERRIDES, marks=pytest.mark.slow)],  # concept: 25 s
    ids=["baseline", "concept"])
def test_scores_equal_a_numpy_rederivation(config, overrides, tokenizer, tmp_path):
  """Per-example log-likelihoods (batched, right-padded, length-bucketed) equal an unpadded forward pass over
  each request's tokens; NLL, bits/byte, acc, acc_norm and margin equal the NumPy formulas of those, averaged
  per source then per capability."""
  model, graphdef, params, shardings, mesh = random_model(config, overrides)
  examples = proxies.read_tasks([write_jsonl(tmp_path / "t.jsonl", EXAMPLES)], "--tasks")
  scorer = proxies.Proxies(examples, "--tasks", tokenizer, graphdef, shardings, mesh, rows=2, max_length=MAX_LENGTH)
  got = scorer.loglikelihoods(params)
  want = reference_loglikelihoods(jax.jit(lambda tokens: model(tokens).logits), tokenizer,
                                 [(e.prompt, t) for e in examples for t in e.texts])
  np.testing.assert_allclose(got, [ll for ll, _ in want], rtol=1e-5, atol=1e-5)
  assert len(tokenizer.encode(EXAMPLES[-1]["prompt"])) > MAX_LENGTH  # the long row was cut

  flat, lls, counts = iter(want), [], []
  for e in examples:
    pairs = [next(flat) for _ in e.texts]
    lls.append([ll for ll, _ in pairs])
    counts.append([m for _, m in pairs])
  # Bytes: the scored tokens' (the continuation's own where nothing is cut or moved).
  table, nbytes = np.asarray(tokenizer.token_bytes), []
  for e, ms in zip(examples, counts):
    wholes = [sum(reference_split(tokenizer, e.prompt, t), [])[-(MAX_LENGTH + 1):] for t in e.texts]
    nbytes.append([int(table[w[len(w) - m:]].sum()) for w, m in zip(wholes, ms)])
  assert nbytes[:2] == [[len(EXAMPLES[0]["continuation"].encode())], [len(EXAMPLES[1]["continuation"].encode())]]
  metrics = scorer(params)
  cont = [(e, ll[0], n[0], b[0]) for e, ll, n, b in zip(examples, lls, counts, nbytes) if e.continuation is not None]
  source_mean = lambda s, f: np.mean([f(ll, n, b) for e, ll, n, b in cont if e.source == s])
  nll, bpb = (lambda ll, n, b: -ll / n), (lambda ll, n, b: -ll / math.log(2) / b)
  for s in ("s1", "s2", "s3"):
    assert metrics[f"proxy/{s}/nll"] == pytest.approx(source_mean(s, nll), rel=1e-5)
  assert metrics["proxy/c1/nll"] == pytest.approx((source_mean("s1", nll) + source_mean("s2", nll)) / 2, rel=1e-5)
  assert metrics["proxy/c1/bpb"] == pytest.approx((source_mean("s1", bpb) + source_mean("s2", bpb)) / 2, rel=1e-5)
  assert metrics["proxy/c2/nll"] == metrics["proxy/s3/nll"]
  assert metrics["proxy/c2/bpb"] == pytest.approx(source_mean("s3", bpb), rel=1e-5)
  mc = [(np.asarray(ll), np.asarray(ll) / [len(c) for c in e.choices], e.gold)
        for e, ll in zip(examples, lls) if e.choices]
  assert metrics["proxy/c2/acc"] == np.mean([np.argmax(ll) == g for ll, _, g in mc])
  assert metrics["proxy/c2/acc_norm"] == np.mean([np.argmax(p) == g for _, p, g in mc])
  assert metrics["proxy/c2/margin"] == pytest.approx(np.mean([p[g] - np.delete(p, g).max() for _, p, g in mc]),
                                                     rel=1e-5)
  assert set(metrics) == {"proxy/s1/nll", "proxy/s2/nll", "proxy/s3/nll", "proxy/c1/nll", "proxy/c2/nll",
                          "proxy/c1/bpb", "proxy/c2/bpb", "proxy/c2/acc", "proxy/c2/acc_norm", "proxy/c2/margin"}


GOOD = EXAMPLES[0]
BAD_FILES = {
    "unknown_field": ([GOOD, {**GOOD, "answer": "x"}], ["t.jsonl:2", "field 'answer'", "prompt, continuation"]),
    "missing_field": ([{k: v for k, v in GOOD.items() if k != "source"}], ["t.jsonl:1", "field 'source'", "missing"]),
    "missing_gold": ([{k: v for k, v in EXAMPLES[4].items() if k != "gold"}], ["t.jsonl:1", "field 'gold'", "missing"]),
    "gold_out_of_range": ([{**EXAMPLES[4], "gold": 3}], ["t.jsonl:1", "field 'gold'", "[0, 2]"]),
    "one_choice": ([{**EXAMPLES[4], "choices": [" a"], "gold": 0}], ["t.jsonl:1", "field 'choices'"]),
    "not_a_string": ([GOOD, GOOD, {**GOOD, "prompt": 3}], ["t.jsonl:3", "field 'prompt'", "string"]),
    "not_json": ([GOOD, "{not json"], ["t.jsonl:2", "not valid JSON"]),
    "slash_in_a_name": ([{**GOOD, "capability": "a/b"}], ["t.jsonl:1", "field 'capability'", "'/'"]),
    "source_names_a_capability": ([GOOD, {**GOOD, "source": "c1", "capability": "c9"}],
                                  ["t.jsonl:2", "field 'source'", "'c1'", "proxy/c1/nll"]),
    "empty_file": ([], ["t.jsonl", "holds no examples"]),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_task_file_is_one_error_line(case, tmp_path, capsys):
  rows, names = BAD_FILES[case]
  path = write_jsonl(tmp_path / "t.jsonl", rows) if rows else str(tmp_path / "t.jsonl")
  if not rows:
    (tmp_path / "t.jsonl").write_text("\n")
  code, err = run_main("latent_jax.eval", ["--workdir", str(tmp_path / "nope"), "--tasks", path], capsys)
  check_one_error_line(code, err, ["--tasks", path] + names)


def test_training_refuses_a_bad_task_file_before_writing(tmp_path, corpus_dir, capsys):
  path = write_jsonl(tmp_path / "t.jsonl", BAD_FILES["unknown_field"][0])
  code, err = run_main("latent_jax.train.__main__", ["--config", TINY, "--workdir", str(tmp_path / "run")] + [
      f"--config.{o}" for o in TINY_OVERRIDES + [f"data.source={corpus_dir}", f"train.eval_tasks={path}"]], capsys)
  check_one_error_line(code, err, ["train.eval_tasks", "t.jsonl:2", "field 'answer'"])
  assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- trained runs


def train_run(config, overrides, workdir, tasks):
  from latent_jax.train.loop import train
  train(load_config(config, overrides + [f"train.eval_tasks={tuple(tasks)!r}"]), workdir)
  return workdir


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
  """The hand-built file and the shipped arithmetic set."""
  from latent_jax.data.task_sets import write_task_sets
  root = tmp_path_factory.mktemp("tasks")
  write_jsonl(root / "hand.jsonl", EXAMPLES)
  write_task_sets(str(root), ["arithmetic"], max_examples=40)
  return str(root)


@pytest.fixture(scope="module")
def baseline_run(tmp_path_factory, corpus_dir, task_dir):
  """A tiny baseline trained 6 steps on the corpus with train.eval_tasks (a folder and a file), evaluated at 3 and 6."""
  return train_run(TINY, TINY_OVERRIDES + [f"data.source={corpus_dir}"], str(tmp_path_factory.mktemp("run")),
                   [task_dir, os.path.join(task_dir, "hand.jsonl")])


@pytest.fixture(scope="module")
def concept_run(tmp_path_factory, corpus_dir, task_dir):
  return train_run(TINY_NCP, NCP_OVERRIDES + [f"data.source={corpus_dir}", "train.eval_every=6"],
                   str(tmp_path_factory.mktemp("concept")), [task_dir])


NAMES = {"proxy/math/nll", "proxy/math/bpb", "proxy/math/acc", "proxy/math/acc_norm", "proxy/math/margin",
         "proxy/arithmetic/nll", "proxy/c1/nll", "proxy/c2/margin", "proxy/s1/nll"}


@pytest.mark.slow
def test_training_logs_proxies_and_eval_prints_them(baseline_run, task_dir, capsys):
  """Rows of eval steps (3, 6) carry the proxy names, in metrics.jsonl and TensorBoard; others none; eval
  --tasks on the run prints the same values as its last evaluation."""
  from latent_jax.eval import main
  rows = [json.loads(line) for line in open(os.path.join(baseline_run, "metrics.jsonl"))]
  assert [r["step"] for r in rows if NAMES <= set(r)] == [3, 6]
  assert not any(k.startswith("proxy/") for r in rows if r["step"] not in (3, 6) for k in r)
  events = b"".join(open(os.path.join(root, f), "rb").read() for root, _, files in
                    os.walk(os.path.join(baseline_run, "tensorboard")) for f in files)
  assert b"proxy/math/margin" in events and b"proxy/c1/nll" in events
  capsys.readouterr()
  main(["--workdir", baseline_run, "--tasks", f"{task_dir}/arithmetic.jsonl,{task_dir}/hand.jsonl"])
  result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert NAMES <= set(result)
  last = rows[-1]
  # The hand file twice in training (the folder holds it too): the same averages.
  for name in sorted(k for k in result if k.startswith("proxy/")):
    assert result[name] == pytest.approx(last[name], rel=1e-5, abs=1e-6), name


@pytest.mark.slow
def test_concept_run_logs_proxies_and_eval_prints_them(concept_run, task_dir, capsys):
  from latent_jax.eval import main
  last = [json.loads(line) for line in open(os.path.join(concept_run, "metrics.jsonl"))][-1]
  capsys.readouterr()
  main(["--workdir", concept_run, "--tasks", task_dir])
  result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert NAMES <= set(result)
  check_concept_terms(concept_run, result)
  for name in sorted(k for k in result if k.startswith("proxy/")):
    assert result[name] == pytest.approx(last[name], rel=1e-5, abs=1e-6), name


@pytest.mark.slow
@pytest.mark.parametrize("which", ["baseline", "concept"])
def test_loglikelihoods_equal_the_harness_models(which, request, task_dir):
  """The same requests through lm-eval (its own request encoding, the harness model `latent_jax`) and through
  the proxies: per-example log-likelihoods within 1e-5."""
  os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
  pytest.importorskip("lm_eval", reason="needs the eval extra: pip install -e '.[eval]'")
  from lm_eval.api.instance import Instance
  from latent_jax.harness import LatentJaxLM
  from latent_jax.infer import load_model
  from latent_jax.infer.load import inference_config
  run = request.getfixturevalue(f"{which}_run")
  files = proxies.task_files(task_dir, "--tasks")
  examples = proxies.read_tasks(files, "--tasks")
  model, cfg, tok = load_model(run)
  cfg = inference_config(cfg)
  mesh = sharding.inference_mesh(cfg.mesh)
  graphdef, params = nnx.split(model)
  shardings = nnx.to_pure_dict(sharding.state_shardings(abstract_model(cfg.model)[1], mesh))
  # The harness's batches of 4 rows: XLA may round a batch of another shape differently (float32, ~1 ulp).
  ours = proxies.Proxies(examples, "--tasks", tok, graphdef, shardings, mesh, rows=4, max_length=MAX_LENGTH)
  got = ours.loglikelihoods(nnx.to_pure_dict(params))
  lm = LatentJaxLM(workdir=run, batch_size=4, max_length=MAX_LENGTH)
  want = lm.loglikelihood([Instance("loglikelihood", {}, (e.prompt, t), 0) for e in examples for t in e.texts],
                          disable_tqdm=True)
  assert len(got) == len(want) > 100
  np.testing.assert_allclose(got, [ll for ll, _ in want], rtol=0, atol=1e-5)


def check_concept_terms(workdir, result):
  """eval's ncp_loss, vq_loss and code usage equal the objective's own, run batch by batch without jit:
  each term's sums over its counts, the codes histogram summed over the batches."""
  import numpy as np
  from latent_jax import checkpoint, objectives
  from latent_jax.data import build_data, make_val_batches
  from latent_jax.infer import load
  saved, step = checkpoint.load_config(workdir)
  cfg = load.inference_config(saved)
  graphdef, params = load.load_params(workdir, saved, step)
  data = build_data(cfg, workdir)
  from flax import nnx
  sums, counts, histogram = {"ncp_loss": 0.0, "vq_loss": 0.0}, {"ncp_loss": 0.0, "vq_loss": 0.0}, 0
  for b in make_val_batches(data, cfg.data.seq_len, cfg.data.batch_size, cfg.train.eval_batches):
    _, m = objectives.ncp_objective(nnx.merge(graphdef, params), b, cfg)
    for k in sums:
      sums[k] += float(m[k]) * float(m["counts"][k])
      counts[k] += float(m["counts"][k])
    histogram = histogram + np.asarray(m["code_histogram"])
  for k in sums:
    assert result[k] == pytest.approx(sums[k] / counts[k], rel=1e-4), k
  assert result["dead_codes"] == pytest.approx(float(np.mean(np.sum(histogram == 0, -1))))
  assert result["code_usage"] == pytest.approx(float(np.mean(np.mean(histogram > 0, -1))))


def test_byte_pieces_warn_and_tokenizer_sources_cover_the_domain(corpus_dir, tmp_path, capsys):
  """A tokenizer trained on text without digits spells arithmetic's in byte-fallback pieces: building the
  proxies says so in one stderr line naming the set. data.tokenizer_sources=arithmetic trains the tokenizer on
  that domain's training split too (not the model: the run's documents stay its own), and the line goes."""
  from latent_jax.data import build_data
  from latent_jax.data.task_sets import write_task_sets
  write_task_sets(str(tmp_path), ["arithmetic"], max_examples=20)
  hand = write_jsonl(tmp_path / "hand.jsonl", EXAMPLES)  # the corpus's own words: no warning for its sources
  examples = proxies.read_tasks([str(tmp_path / "arithmetic.jsonl"), hand], "--tasks")
  overrides = TINY_OVERRIDES + [f"data.source={corpus_dir}", "model.vocab_size=384"]
  _, graphdef, _, shardings, mesh = random_model(TINY, overrides)
  shares, docs, warned = {}, {}, {}
  for extra in ([], ["data.tokenizer_sources=arithmetic"]):
    data = build_data(load_config(TINY, overrides + extra), str(tmp_path / "run"))
    scored = [i for e in examples if e.source == "arithmetic" for t in e.texts
              for i in proxies.encode_pair(data.tokenizer, e.prompt, t)[1]]
    shares[bool(extra)], docs[bool(extra)] = data.tokenizer.byte_pieces[scored].mean(), data.num_docs
    capsys.readouterr()
    proxies.Proxies(examples, "--tasks", data.tokenizer, graphdef, shardings, mesh, max_length=64)
    warned[bool(extra)] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
  assert shares[False] > proxies.BYTE_PIECES_WARNING and shares[True] < 0.01, shares
  assert len(warned[False]) == 1 and not warned[True], warned
  assert warned[False][0].startswith("warning: --tasks: ") and "arithmetic" in warned[False][0]
  assert not any(f" {s} " in warned[False][0] for s in ("s1", "s2", "s3")) and "data.tokenizer_sources" in warned[False][0]
  assert docs[True] == docs[False]  # the tokenizer saw the domain; the run's data is its own
