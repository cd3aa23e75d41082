"""The lm-evaluation-harness model `latent_jax`: a run's workdir or an export folder, BaselineLM or
ConceptLM, scored through loglikelihood, loglikelihood_rolling and generate_until.

Importing this module registers the model with lm-eval 0.4.13 (the eval extra: pip install -e '.[eval]').
`python -m latent_jax.eval --lm_eval_tasks` is the command; run as a module, this file is the harness's own CLI
with the model registered:

  python -m latent_jax.harness --model latent_jax --model_args workdir=runs/ncp --batch_size 16 --tasks arc_easy

model_args: workdir (required), step, max_length (the run's data.seq_len), max_gen_toks (256),
seed (0, for sampled generation); the harness's batch_size (8 when built directly) is the rows per batch.

Every batch has a fixed shape: batch_size rows (rounded up to a multiple of the batch shards of the
mesh `infer.load` places the params on, the training's layout, over which the rows are split) by a power-of-two length
bucket up to max_length, so one compile serves every batch of a bucket.
- loglikelihood: one forward per batch of right-padded rows; both models are causal, so the padding
  after a row's last token changes none of its scores. The batching and scoring are the proxies'
  (latent_jax/proxies.py: `loglikelihoods`, `score`), which the train loop and eval also score with.
- generate_until: every row advances one position per step through the model's KV cache (and
  ConceptLM's concept cache), fed its prompt's token while it has one and its own last token after.
  Rows of different prompt lengths share one scan; the price is prompts fed a token at a time.
"""
import json
import math

import jax
import jax.numpy as jnp
import lm_eval.models  # noqa: F401  # the harness's own models (hf, ...): its registry imports them only while empty
import numpy as np
from flax import nnx
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from latent_jax import sharding
from latent_jax.infer import load_model, sample_token
from latent_jax.infer.sample import params_mesh
from latent_jax.proxies import bucket, loglikelihoods, score

SAMPLING = ("do_sample", "temperature", "top_k", "top_p")  # the gen_kwargs sample_token takes, with until and max_gen_toks


def decode(graphdef, params, tokens, lengths, key, temperature, top_k, top_p):
  """tokens [B, L], row b's prompt in its first lengths[b] positions -> [B, L] with every later
  position sampled (greedy at temperature 0), one position per step through the model's cache."""
  batch, length = tokens.shape

  def step(carry, i):
    tokens, cache = carry
    out = nnx.merge(graphdef, params)(jax.lax.dynamic_slice_in_dim(tokens, i, 1, axis=1), cache=cache, cache_index=i)
    new = sample_token(out.logits[:, -1], jax.random.fold_in(key, i), temperature, top_k, top_p)
    following = jax.lax.dynamic_index_in_dim(tokens, i + 1, axis=1, keepdims=False)
    tokens = jax.lax.dynamic_update_index_in_dim(tokens, jnp.where(i + 1 < lengths, following, new), i + 1, axis=1)
    return (tokens, out.cache), None

  cache = nnx.merge(graphdef, params).init_cache(batch, length)
  (tokens, _), _ = jax.lax.scan(step, (tokens, cache), jnp.arange(length - 1))
  return tokens


def cut(text, until):
  """text up to the first of the `until` strings."""
  return text[:min([text.find(u) for u in until if u and u in text], default=len(text))]


@register_model("latent_jax")
class LatentJaxLM(TemplateLM):
  """lm-eval's model for a latent_jax workdir or export folder (see the module's docstring)."""

  def __init__(self, workdir, step=None, batch_size=8, max_length=None, max_gen_toks=256, seed=0, **harness):
    super().__init__()
    del harness  # max_batch_size and device from the harness: jax picks its own devices
    if jax.process_count() > 1:
      raise ValueError("the latent_jax harness model runs as one process (on its local devices); start it on one host.")
    try:
      batch_size, max_gen_toks, seed = int(batch_size), int(max_gen_toks), int(seed)
    except ValueError:
      raise ValueError(f"batch_size={batch_size!r}, max_gen_toks={max_gen_toks!r}, seed={seed!r}: give integers "
                       "(batch_size=auto is not supported).") from None
    if batch_size < 1 or max_gen_toks < 1:
      raise ValueError(f"batch_size={batch_size}, max_gen_toks={max_gen_toks}: both must be >= 1.")
    self.model, self.cfg, self.tokenizer = load_model(workdir, None if step is None else int(step))
    self.max_length = int(max_length or self.cfg.data.seq_len)
    if self.max_length < 2:
      raise ValueError(f"max_length={self.max_length}: must be >= 2 (a context token and a scored one).")
    self.max_gen_toks, self.key = max_gen_toks, jax.random.key(seed)
    graphdef, self.params = nnx.split(self.model)
    # Rows split over the batch axes of the mesh infer.load placed the params on (the training's layout).
    self.rows = sharding.batch_sharding(params_mesh(self.params))
    shards = math.prod(self.rows.mesh.shape[a] for a in self.rows.spec[0])
    self.batch_size = -(-batch_size // shards) * shards
    self._score = jax.jit(lambda params, *a: score(nnx.merge(graphdef, params), *a))
    self._decode = jax.jit(lambda *a, **k: decode(graphdef, *a, **k), static_argnames=("temperature", "top_k", "top_p"))

  @property
  def eot_token_id(self):
    return self.tokenizer.eos_id  # documents are joined by EOS in training: it is also what precedes a new one

  def tok_encode(self, string, add_special_tokens=None, **kwargs):
    del add_special_tokens, kwargs  # our tokenizers add no BOS or EOS
    return self.tokenizer.encode(string)

  def tok_decode(self, tokens):
    return self.tokenizer.decode(tokens)

  def place(self, *arrays):
    return [jax.device_put(np.asarray(a), self.rows) for a in arrays]

  def batches(self, items, disable_tqdm, desc):
    """Indices of `items` (token lists) in batches of self.batch_size, longest first."""
    order = sorted(range(len(items)), key=lambda i: -len(items[i]))
    starts = range(0, len(order), self.batch_size)
    return (order[s:s + self.batch_size] for s in tqdm(starts, desc=desc, disable=disable_tqdm))

  # ---------------------------------------------------------------- the harness's requests
  def _loglikelihood_tokens(self, requests, disable_tqdm=False):
    """requests: ((context, continuation) or None, context ids, continuation ids) -> (logprob, is_greedy)."""
    results = loglikelihoods([(context, continuation) for _, context, continuation in requests],
                             lambda *rows: jax.device_get(self._score(self.params, *self.place(*rows))),
                             self.batch_size, self.max_length, self.tokenizer.pad_id,
                             lambda starts: tqdm(starts, desc="loglikelihood", disable=disable_tqdm))
    for (key, _, _), result in zip(requests, results):
      if key is not None:
        self.cache_hook.add_partial("loglikelihood", key, result)
    return results

  def loglikelihood_rolling(self, requests, disable_tqdm=False):
    """Each string's total log-probability, in windows of max_length tokens after EOS (each window
    conditioned on the one token before it, as the harness's own models do)."""
    windows, owners = [], []
    for i, (string,) in enumerate(req.args for req in requests):
      for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
          self.tok_encode(string), self.prefix_token_id, self.max_length, context_len=1)):
        windows.append((None, context, continuation))
        owners.append(i)
    totals = np.zeros(len(requests))
    np.add.at(totals, owners, [logp for logp, _ in self._loglikelihood_tokens(windows, disable_tqdm)])
    for req, total in zip(requests, totals):
      self.cache_hook.add_partial("loglikelihood_rolling", req.args, float(total))
    return [float(t) for t in totals]

  def generate_until(self, requests, disable_tqdm=False):
    """Each (context, gen_kwargs) -> the continuation up to the first `until` string or EOS, of at
    most max_gen_toks tokens. Requests are batched by equal gen_kwargs."""
    groups = {}
    for i, req in enumerate(requests):
      groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
    results = [None] * len(requests)
    for members in groups.values():
      kwargs = dict(requests[members[0]].args[1])
      until = kwargs.pop("until", None) or []
      until = [until] if isinstance(until, str) else list(until)
      new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
      unknown = sorted(set(kwargs) - set(SAMPLING))
      if unknown:
        raise ValueError(f"generate_until: gen_kwargs {', '.join(unknown)} are not supported; the latent_jax model "
                         f"takes until, max_gen_toks, {', '.join(SAMPLING)}.")
      sampling = dict(temperature=float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0,
                      top_k=int(kwargs.get("top_k") or 0), top_p=float(kwargs.get("top_p") or 1.0))
      # Keep the end of a long prompt, leaving room for the new tokens (the harness's convention).
      prompts = [self.tok_encode(requests[i].args[0])[-max(1, self.max_length - new):] or [self.prefix_token_id]
                 for i in members]
      for rows in self.batches(prompts, disable_tqdm, "generate_until"):
        length = bucket(len(prompts[rows[0]]) + new, self.max_length)
        tokens = np.full((self.batch_size, length), self.tokenizer.pad_id, np.int32)
        lengths = np.ones(self.batch_size, np.int32)
        for r, j in enumerate(rows):
          tokens[r, :len(prompts[j])], lengths[r] = prompts[j], len(prompts[j])
        self.key, key = jax.random.split(self.key)
        out = jax.device_get(self._decode(self.params, *self.place(tokens, lengths), key, **sampling))
        for r, j in enumerate(rows):
          ids = out[r, lengths[r]:lengths[r] + new].tolist()
          if self.tokenizer.eos_id in ids:  # a document ends at EOS
            ids = ids[:ids.index(self.tokenizer.eos_id)]
          i = members[j]
          results[i] = cut(self.tok_decode(ids), until)
          self.cache_hook.add_partial("generate_until", requests[i].args, results[i])
    return results


if __name__ == "__main__":
  from lm_eval.__main__ import cli_evaluate
  cli_evaluate()
