"""python -m latent_jax.convert --hf HF_DIR --config RECIPE --out DIR [--dtype=bfloat16] [--config.a.b=v ...]
   python -m latent_jax.convert --workdir DIR --out HF_DIR [--step=N] [--dtype=float32]

Hugging Face OLMo-3 checkpoints in and out, and the mixture-of-experts FlexOlmo (post-norm) and OLMoE
(pre-norm) ones (docs/interop.md).
--hf: a transformers OLMo-3, FlexOlmo or OLMoE folder (config.json, safetensors files, tokenizer.json) -> a latent_jax
export folder (params/, config.json, tokenizer.json) that generate, eval, train.init_from and plan
(--config DIR/config.json) read. Its model section comes from config.json, every other section
from the recipe --config (e.g. configs/olmo3_7b.py). The params keep the checkpoint's dtype unless
--dtype says otherwise.
--workdir: a baseline run's checkpoint or an export folder (a MoE: FlexOlmo if post-norm, OLMoE if
pre-norm) -> a folder (config.json, safetensors files, tokenizer files) that transformers'
AutoModelForCausalLM and AutoTokenizer load, in the
model's compute dtype unless --dtype says otherwise.
Tensors are converted one at a time: memory stays near the largest stacked parameter, not the model.
"""
import jax

from latent_jax.config import DTYPES
from latent_jax import cli, distributed
from latent_jax.interop import hf

FLAGS = [cli.Flag("hf", str, None, "a Hugging Face OLMo-3, FlexOlmo or OLMoE folder to import"),
         cli.Flag("workdir", str, None, "a baseline run's workdir or an export folder, to export to Hugging Face"),
         cli.Flag("out", str, cli.REQUIRED, "the folder to write, which must not exist yet"),
         cli.CONFIG._replace(default=None, help="with --hf: the recipe whose sections but the model the export "
                             "carries; --config.a.b=v then overrides a field"), cli.STEP,
         cli.Flag("dtype", str, None, "the parameters' dtype", lambda d: d in DTYPES, f"one of {', '.join(DTYPES)}"),
         ] + cli.DISTRIBUTED


def convert(args):
  if bool(args.hf) == bool(args.workdir):
    raise ValueError("give --hf HF_DIR (import) or --workdir DIR (export to Hugging Face), one of them.")
  if jax.process_count() > 1:
    raise ValueError("convert runs as one process; start it without --num_processes on one host.")
  if args.hf:
    if args.step is not None:
      raise ValueError("--step picks a checkpoint of --workdir; --hf has none.")
    if not args.config:
      raise ValueError("--hf needs --config: the recipe whose data, train and optim sections the export carries "
                       "(e.g. configs/olmo3_7b.py); its model section comes from config.json.")
    hf.import_hf(args.hf, args.out, args.config, args.dtype)
  else:
    if args.config:
      raise ValueError("--config goes with --hf; an export to Hugging Face takes the run's own config.")
    hf.export_hf(args.workdir, args.out, args.step, args.dtype)
  return args.out


def main(argv=None):
  with cli.errors():
    args = cli.parse(__doc__, FLAGS, argv)
    distributed.initialize(args)
    print(f"converted to {convert(args)}")


if __name__ == "__main__":
  main()
