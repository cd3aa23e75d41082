"""python -m latent_jax.generate --workdir DIR --prompt "..." [--max_new_tokens=200]
   [--temperature=0.8] [--top_k=0] [--top_p=0.95] [--seed=0] [--num_samples=1] [--step=N]
   [--drafter DRAFTER_DIR --temperature=0]

--drafter: greedy speculative decoding with a block drafter trained by `python -m latent_jax.draft`
(the same text as plain greedy decoding; prints the mean accepted length)."""
import sys

import jax
import jax.numpy as jnp

from latent_jax.config import parse_cli
from latent_jax.draft import load_drafter
from latent_jax.infer import generate, load_model
from latent_jax.infer.speculative import speculative_generate
from latent_jax.ops.drafting import mean_accepted_length


def main(argv):
  _, _, flags = parse_cli(argv)
  if "workdir" not in flags:
    raise SystemExit(__doc__)
  model, cfg, tokenizer = load_model(flags["workdir"], int(flags["step"]) if "step" in flags else None)
  prompt = tokenizer.encode(flags.get("prompt", ""))
  if not prompt:
    prompt = [tokenizer.eos_id]  # an empty prompt starts a fresh document
  n, new, temperature = int(flags.get("num_samples", 1)), int(flags.get("max_new_tokens", 200)), float(
      flags.get("temperature", 0.8))
  if "drafter" in flags:
    if temperature != 0:
      raise ValueError(f"--drafter decodes greedily (exact-match verification); add --temperature=0, not {temperature}.")
    drafter, _ = load_drafter(flags["drafter"], cfg.model)
    out, committed, rounds = speculative_generate(model, drafter, jnp.asarray([prompt] * n), new)
    print(f"mean accepted length {float(mean_accepted_length(committed, rounds)):.3f} over {int(rounds.sum())} rounds")
  else:
    out = generate(model, jnp.asarray([prompt] * n), new, jax.random.key(int(flags.get("seed", 0))), temperature,
                   int(flags.get("top_k", 0)), float(flags.get("top_p", 0.95)))
  for row in out.tolist():
    row = row[len(prompt):]
    if tokenizer.eos_id in row:  # a document ends at EOS
      row = row[:row.index(tokenizer.eos_id)]
    print(flags.get("prompt", "") + tokenizer.decode(row))
    print("-" * 40)


if __name__ == "__main__":
  try:
    main(sys.argv[1:])
  except (FileNotFoundError, FileExistsError, ValueError) as e:  # bad paths and settings: no traceback
    raise SystemExit(f"error: {e}") from None
