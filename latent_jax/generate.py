"""python -m latent_jax.generate --workdir DIR --prompt "..." [--max_new_tokens=200]
   [--temperature=0.8] [--top_k=0] [--top_p=0.95] [--seed=0] [--num_samples=1] [--step=N]
   [--drafter DRAFTER_DIR --temperature=0]

--drafter: greedy speculative decoding with a block drafter trained by `python -m latent_jax.draft`
(the same text as plain greedy decoding; prints the mean accepted length)."""
import jax
import jax.numpy as jnp

from latent_jax import cli, distributed
from latent_jax.draft import load_drafter
from latent_jax.infer import generate, load_model
from latent_jax.infer.speculative import speculative_generate
from latent_jax.ops.drafting import mean_accepted_length


FLAGS = [
    cli.Flag("workdir", str, cli.REQUIRED, "a run's workdir or an export folder"), cli.STEP,
    cli.Flag("prompt", str, "", "the text to continue; '' starts a new document"),
    cli.Flag("max_new_tokens", int, 200, "tokens to generate", lambda n: n >= 1, ">= 1"),
    cli.Flag("temperature", float, 0.8, "softmax temperature; 0 decodes greedily", lambda t: t >= 0, ">= 0"),
    cli.Flag("top_k", int, 0, "sample from the k likeliest tokens; 0 = all", lambda k: k >= 0, ">= 0"),
    cli.Flag("top_p", float, 0.95, "sample from the likeliest tokens holding this much probability; 1 = all",
             lambda p: 0 < p <= 1, "in (0, 1]"),
    cli.Flag("seed", int, 0, "the sampling seed"),
    cli.Flag("num_samples", int, 1, "samples to draw", lambda n: n >= 1, ">= 1"),
    cli.Flag("drafter", str, None, "a drafter's workdir (python -m latent_jax.draft): speculative decoding"),
] + cli.DISTRIBUTED


def main(argv=None):
  with cli.errors():
    args = cli.parse(__doc__, FLAGS, argv)
    distributed.initialize(args)
    if args.drafter and args.temperature != 0:
      raise ValueError(f"--drafter decodes greedily (exact-match verification); add --temperature=0, "
                       f"not {args.temperature}.")
    sample(args)


def sample(args):
  model, cfg, tokenizer = load_model(args.workdir, args.step)
  if args.top_k > cfg.model.vocab_size:
    raise ValueError(f"--top_k={args.top_k}: the model has only {cfg.model.vocab_size} tokens; lower it (0 = all).")
  prompt = tokenizer.encode(args.prompt)
  if not prompt:
    prompt = [tokenizer.eos_id]  # an empty prompt starts a fresh document
  prompts = jnp.asarray([prompt] * args.num_samples)
  if args.drafter:
    drafter, _ = load_drafter(args.drafter, cfg.model)
    out, committed, rounds = speculative_generate(model, drafter, prompts, args.max_new_tokens)
    print(f"mean accepted length {float(mean_accepted_length(committed, rounds)):.3f} over {int(rounds.sum())} rounds")
  else:
    out = generate(model, prompts, args.max_new_tokens, jax.random.key(args.seed), args.temperature, args.top_k,
                   args.top_p)
  for row in out.tolist():
    row = row[len(prompt):]
    if tokenizer.eos_id in row:  # a document ends at EOS
      row = row[:row.index(tokenizer.eos_id)]
    print(args.prompt + tokenizer.decode(row))
    print("-" * 40)


if __name__ == "__main__":
  main()
