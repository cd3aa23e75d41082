"""python -m latent_jax.generate --workdir DIR --prompt "..." [--max_new_tokens=200]
   [--temperature=0.8] [--top_k=0] [--top_p=0.95] [--seed=0] [--num_samples=1] [--step=N]"""
import sys

import jax
import jax.numpy as jnp

from latent_jax.config import parse_cli
from latent_jax.infer import generate, load_model


def main(argv):
  _, _, flags = parse_cli(argv)
  if "workdir" not in flags:
    raise SystemExit(__doc__)
  model, _, tokenizer = load_model(flags["workdir"], int(flags["step"]) if "step" in flags else None)
  prompt = tokenizer.encode(flags.get("prompt", ""))
  if not prompt:
    prompt = [tokenizer.eos_id]  # an empty prompt starts a fresh document
  n = int(flags.get("num_samples", 1))
  out = generate(model, jnp.asarray([prompt] * n), int(flags.get("max_new_tokens", 200)),
                 jax.random.key(int(flags.get("seed", 0))), float(flags.get("temperature", 0.8)),
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
