"""lm-evaluation-harness (the eval extra): the `latent_jax` harness model and python -m latent_jax.eval
--lm_eval_tasks, offline, on three tasks this file writes (local .jsonl files through `dataset_path: json`): multiple
choice (acc), loglikelihood_rolling (word_perplexity) and generate_until (exact_match).

Independent references: a trained baseline exported to Hugging Face (python -m latent_jax.convert)
and scored by lm-eval's own `hf` model gives the same per-example loglikelihoods and accuracy;
loglikelihood_rolling equals a NumPy sum of the model's own token log-probs from its logits, in
the harness's windows; ConceptLM's generate_until equals `infer.generate`'s greedy text.
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT, TINY_OVERRIDES
from test_interop import OURS, TINY, tokenizer_file  # noqa: F401  # the fixture: a Hugging Face tokenizer.json

# Before lm_eval (and its datasets) is imported: nothing from the hub, every task is local.
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
lm_eval = pytest.importorskip("lm_eval", reason="needs the eval extra: pip install -e '.[eval]'")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from latent_jax import load_config  # noqa: E402
from latent_jax.harness import LatentJaxLM, bucket, cut  # noqa: E402
from latent_jax.infer import generate  # noqa: E402

pytestmark = pytest.mark.slow
TINY_NCP = os.path.join(ROOT, "configs", "tiny_ncp.py")
MAX_LENGTH = 24  # shorter than the longest text below, so that rolling windows and prompt truncation happen
WORDS = ["Kar lon mith sethal", "Nur tad mis kap", "Lol sen tam", "Mip tav nuth ses kal", "Sed tap"]
MC = [{"question": f"{w}.", "choices": [" Kar lon.", " Tam mis sed.", " Nul."], "label": i % 3}
      for i, w in enumerate(WORDS)]
ROLLING = [{"text": " ".join(WORDS[:n]) + "."} for n in (1, 3, 5)] + [{"text": ". ".join(WORDS * 2) + "."}]
GEN = [{"prompt": w, "answer": " lon."} for w in WORDS]
TASKS = {
    "tiny_mc": ("mc.jsonl", MC, "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
                "doc_to_choice: '{{choices}}'\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n"),
    "tiny_rolling": ("rolling.jsonl", ROLLING, "output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
                     "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n"),
    "tiny_gen": ("gen.jsonl", GEN, "output_type: generate_until\ndoc_to_text: '{{prompt}}'\n"
                 "doc_to_target: '{{answer}}'\ngeneration_kwargs:\n  until: ['.']\n  max_gen_toks: 6\n"
                 "  do_sample: false\nmetric_list:\n  - metric: exact_match\n"),
}


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
  """A folder of task YAML files (for --include_path) over .jsonl files beside them."""
  root = tmp_path_factory.mktemp("tasks")
  for name, (file, rows, spec) in TASKS.items():
    (root / file).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / f"{name}.yaml").write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                       f"    test: {root / file}\ntest_split: test\n{spec}")
  return str(root)


def test_length_buckets_and_stop_strings():
  assert [bucket(n, 100) for n in (1, 16, 17, 64, 65, 100, 130)] == [16, 16, 32, 64, 100, 100, 130]
  assert cut("ab. cd\nef", [".", "\n"]) == "ab" and cut("abc", []) == "abc" and cut("abc", [""]) == "abc"


def train_tiny(config, overrides, workdir):
  from latent_jax.train.loop import train
  train(load_config(config, overrides + ["train.steps=10", "optim.warmup_steps=2", "train.eval_every=0",
                                         "train.checkpoint_every=10"]), workdir)
  return workdir


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, corpus_dir, tokenizer_file):  # noqa: F811
  """(workdir, Hugging Face folder): a baseline (OLMo-3 form, Hugging Face tokenizer) trained 10
  steps, exported by python -m latent_jax.convert."""
  from latent_jax.convert import main
  root = tmp_path_factory.mktemp("baseline")
  run = train_tiny(TINY, OURS + [f"data.source={corpus_dir}", f"data.tokenizer={tokenizer_file}"], str(root / "run"))
  main(["--workdir", run, "--out", str(root / "hf")])
  return run, str(root / "hf")


@pytest.fixture(scope="module")
def concept(tmp_path_factory, corpus_dir):
  """A ConceptLM (k=4) trained 10 steps with the corpus's SentencePiece tokenizer."""
  return train_tiny(TINY_NCP, TINY_OVERRIDES + [
      "model.num_segments=4", "model.codebook_size=16", "model.encoder_layers=1", "model.concept_layers=1",
      "model.decoder_layers=1", f"data.source={corpus_dir}"], str(tmp_path_factory.mktemp("concept")))


@pytest.fixture(scope="module")
def task_manager(tasks_dir):
  return TaskManager(include_path=tasks_dir)  # indexing the harness's own tasks takes seconds: once


def samples(model, task, task_manager):
  out = lm_eval.simple_evaluate(model=model, tasks=[task], task_manager=task_manager, log_samples=True)
  return out["results"][task], sorted(out["samples"][task], key=lambda s: s["doc_id"])


def test_baseline_matches_the_hf_model(baseline, task_manager):
  """lm-eval's own `hf` model on the Hugging Face export: the same per-example loglikelihoods
  (within 1e-4), greedy flags and accuracy; and the same rolling loglikelihoods."""
  from lm_eval.api.registry import get_model
  pytest.importorskip("transformers", reason="the hf model needs the hf extra: pip install -e '.[hf]'")
  run, hf_dir = baseline
  ours = LatentJaxLM(workdir=run, batch_size=4, max_length=MAX_LENGTH)
  hf = get_model("hf")(pretrained=hf_dir, dtype="float32", device="cpu", batch_size=4, max_length=MAX_LENGTH)
  (want, want_samples), (got, got_samples) = samples(hf, "tiny_mc", task_manager), samples(ours, "tiny_mc", task_manager)
  pairs = [(g, w) for gs, ws in zip(got_samples, want_samples) for g, w in zip(gs["resps"], ws["resps"])]
  assert len(pairs) == 3 * len(MC)
  diff = max(abs(g[0][0] - w[0][0]) for g, w in pairs)
  # Requests the task does not make: an empty context (EOS stands for it) and a truncated one.
  extra = [Instance("loglikelihood", {}, ("", " Kar lon mith."), 0),
           Instance("loglikelihood", {}, (" ".join(WORDS) + ".", " Kar lon."), 0)]
  extra_diff = max(abs(g[0] - w[0]) for g, w in zip(ours.loglikelihood(extra), hf.loglikelihood(extra)))
  rolling = [Instance("loglikelihood_rolling", {}, (r["text"],), 0) for r in ROLLING]
  got_rolling, want_rolling = ours.loglikelihood_rolling(rolling), hf.loglikelihood_rolling(rolling)
  rolling_diff = max(abs(g - w) for g, w in zip(got_rolling, want_rolling))
  print(f"\nmax |loglikelihood ours - hf|: {diff:.2e} over {len(pairs)} choices; {extra_diff:.2e} on an empty and "
        f"a truncated context; rolling {rolling_diff:.2e}")
  assert diff < 1e-4 and extra_diff < 1e-4 and rolling_diff < 1e-4
  assert [g[0][1] for g, _ in pairs] == [w[0][1] for _, w in pairs]
  assert got["acc,none"] == want["acc,none"]


def rolling_reference(forward, tokens, eos, length):
  """The harness's rolling windows by hand: spans of `length` tokens (the last one shorter), each
  scored after the `length` tokens before its end (EOS before the first token); log-probs from the
  logits, summed."""
  total, padded = 0.0, [eos] + tokens
  for start in range(0, len(tokens), length):
    end = min(start + length, len(tokens))
    first = max(0, end - length)
    logp = jax.nn.log_softmax(np.asarray(forward(jnp.asarray([padded[first:end]])), np.float64)[0])
    picked = np.take_along_axis(logp, np.asarray(tokens[first:end])[:, None], axis=1)[:, 0]
    total += float(picked[start - first:].sum())
  return total


def test_concept_rolling_and_generation_match_the_model(concept):
  """ConceptLM: loglikelihood_rolling equals the model's own log-probs summed (one window and
  several); generate_until, rows of two prompt lengths in one batch, equals infer.generate."""
  lm = LatentJaxLM(workdir=concept, batch_size=4, max_length=MAX_LENGTH)
  texts = [r["text"] for r in ROLLING]
  forward = jax.jit(lambda t: lm.model(t).logits)
  want = [rolling_reference(forward, lm.tok_encode(t), lm.eot_token_id, MAX_LENGTH) for t in texts]
  assert len(lm.tok_encode(texts[-1])) > 2 * MAX_LENGTH  # three windows
  np.testing.assert_allclose(lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), 0) for t in texts]),
                             want, rtol=1e-5, atol=1e-4)

  kwargs = {"until": [" s"], "max_gen_toks": 7, "do_sample": False}
  prompts = WORDS[:2]
  got = lm.generate_until([Instance("generate_until", {}, (p, kwargs), 0) for p in prompts])
  for prompt, text in zip(prompts, got):
    ids = lm.tok_encode(prompt)
    new = np.asarray(generate(lm.model, jnp.asarray([ids]), 7, jax.random.key(0), temperature=0))[0, len(ids):].tolist()
    if lm.eot_token_id in new:
      new = new[:new.index(lm.eot_token_id)]
    assert text == lm.tok_decode(new).split(" s")[0], prompt


def test_eval_command_on_three_tasks(concept, tasks_dir, tmp_path, capsys):
  """python -m latent_jax.eval --lm_eval_tasks on a ConceptLM run: the three tasks' metrics in its one JSON line
  (beside the validation loss and a proxy task file's scores), the harness's table on stderr, its results
  written."""
  from latent_jax.eval import main
  proxy = tmp_path / "proxy.jsonl"
  proxy.write_text("".join(json.dumps({"prompt": r["question"], "choices": r["choices"], "gold": r["label"],
                                       "source": "tiny", "capability": "words"}) + "\n" for r in MC))
  capsys.readouterr()
  main(["--workdir", concept, "--lm_eval_tasks", "tiny_mc,tiny_rolling,tiny_gen", "--include_path", tasks_dir,
        "--limit", "4", "--batch_size", "2", "--output", str(tmp_path / "out" / "results.json"), "--tasks", str(proxy)])
  out, err = capsys.readouterr()
  line = json.loads(out.strip().splitlines()[-1])
  results = json.loads((tmp_path / "out" / "results.json").read_text())["results"]
  assert 0 <= results["tiny_mc"]["acc,none"] <= 1 and results["tiny_rolling"]["word_perplexity,none"] > 1
  assert results["tiny_gen"]["exact_match,none"] in (0, 0.25, 0.5, 0.75, 1)
  assert line["lm_eval/tiny_mc/acc"] == results["tiny_mc"]["acc,none"]
  assert line["lm_eval/tiny_rolling/word_perplexity"] == results["tiny_rolling"]["word_perplexity,none"]
  assert line["val_loss"] > 0 and 0 <= line["proxy/words/acc"] <= 1 and "proxy/words/margin" in line
  assert "tiny_rolling" in err


@pytest.mark.parametrize("argv,names", [
    (["--lm_eval_tasks", "no_such_task"], ["--lm_eval_tasks", "no_such_task", "--include_path"]),
    (["--lm_eval_tasks", "tiny_mc", "--include_path", "{tmp}/nope"], ["--include_path", "nope", "not a folder"]),
    (["--lm_eval_tasks", ","], ["--lm_eval_tasks", "names no task"]),
])
def test_eval_refuses_bad_lm_eval_input(argv, names, concept, tasks_dir, tmp_path, capsys):
  from test_cli_errors import check_one_error_line, run_main
  code, err = run_main("latent_jax.eval", ["--workdir", concept] + [a.format(tmp=tmp_path) for a in argv], capsys)
  check_one_error_line(code, err, [n.format(tmp=tmp_path) for n in names])


def test_eval_refuses_a_workdir_without_checkpoints(tasks_dir, tmp_path, capsys):
  from test_cli_errors import check_one_error_line, run_main
  code, err = run_main("latent_jax.eval", ["--workdir", str(tmp_path), "--lm_eval_tasks", "tiny_mc", "--include_path",
                                           tasks_dir], capsys)
  check_one_error_line(code, err, ["--workdir", "no checkpoints"])


def test_lm_eval_tasks_need_no_data(concept, tasks_dir, tmp_path, capsys):
  """An export whose recipe's data is absent (as an OLMo-3 imported with configs/olmo3_7b.py's data/dolma3_store)
  is judged on lm-eval tasks alone: validation left out with one stderr line, the scores and its step printed."""
  import json as json_lib
  from latent_jax.eval import main
  from latent_jax.export import export
  out = export(concept, str(tmp_path / "export"))
  config = json_lib.loads((tmp_path / "export" / "config.json").read_text())
  config["data"]["source"] = str(tmp_path / "dolma3_store")
  (tmp_path / "export" / "config.json").write_text(json_lib.dumps(config))
  capsys.readouterr()
  main(["--workdir", out, "--lm_eval_tasks", "tiny_mc", "--include_path", tasks_dir, "--limit", "2"])
  result, err = capsys.readouterr()
  line = json_lib.loads(result.strip().splitlines()[-1])
  assert 0 <= line["lm_eval/tiny_mc/acc"] <= 1 and line["val_loss"] is None and line["step"] == 10
  left_out = [e for e in err.splitlines() if e.startswith("eval: validation loss left out")]
  assert len(left_out) == 1 and "dolma3_store" in left_out[0] and "matches no file" in left_out[0], err
