"""What every command line shares: declared flags, `--help`, and bad input as one line.

  FLAGS = [cli.CONFIG, cli.Flag("workdir", str, cli.REQUIRED, "the run's folder")]

  def main(argv=None):
    with cli.errors():
      args = cli.parse(__doc__, FLAGS, argv)   # args.config (a validated ConfigDict), args.workdir
      ...

absl parses the flags, each command's in a fresh FlagValues (commands run in-process, repeatedly,
in tests): `--name=value` or `--name value`; a bool flag is `--name`, `--noname` or `--name=true`.
With a config flag (type ConfigDict, CONFIG), `--config FILE[:ARG]` loads a config file and
`--config.a.b=v` (or `--config.a.b v`) overrides a field through ml_collections.config_flags
(config.apply_overrides). An unknown flag, a value of the wrong type or out of range, and any bad
setting, path or file met later end the command with `error: ...` on stderr, one line, exit code 2.
Anything else is a bug and keeps its traceback.

Flags that several commands take are constants here (CONFIG, STEP); a command's FLAGS is a plain
list, so a shared group of them is added with `+`.
"""
import contextlib
import os
import re
import signal
import sys
import threading
import types
from typing import Callable, NamedTuple

import ml_collections
from absl import flags

from latent_jax import distributed, paths
from latent_jax.config import apply_overrides, read_config, validate

REQUIRED = object()  # a Flag default: the flag must be given


class Flag(NamedTuple):
  name: str
  type: type                    # str, int, float, bool (a switch), or ConfigDict (a config file, loaded)
  default: object               # REQUIRED, or the value when the flag is not given (None: unset)
  help: str
  ok: Callable = None           # a check of the parsed value ...
  rule: str = ""                # ... and what it asks, for the error: ">= 1" says "must be >= 1"


CONFIG = Flag("config", ml_collections.ConfigDict, REQUIRED,
              "config file, e.g. configs/tiny.py (FILE:ARG picks a variant); --config.a.b=v then overrides a field")
STEP = Flag("step", int, None, "the checkpoint to load, by step; the latest when not given", lambda s: s >= 0, ">= 0")
# How this process joins a multi-process job (distributed.initialize reads them).
DISTRIBUTED = [
    Flag("coordinator_address", str, None, "HOST:PORT of process 0's coordinator (or $JAX_COORDINATOR_ADDRESS)"),
    Flag("num_processes", int, None, "processes in the job (or $JAX_NUM_PROCESSES)", lambda n: n >= 1, ">= 1"),
    Flag("process_id", int, None, "this process's index, 0..num_processes-1 (or $JAX_PROCESS_ID)",
         lambda i: i >= 0, ">= 0"),
    Flag("agreement_timeout", float, distributed.TIMEOUT_S, "seconds a process waits for the others at a point where "
         "all must meet (a checkpoint restore, a write by process 0) before every process stops with an error",
         lambda t: t > 0, "> 0"),
]

# Bad input: a setting, a path or a file. ConfigError and UnicodeDecodeError are ValueErrors.
EXPECTED = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError)
DEFINES = {str: flags.DEFINE_string, int: flags.DEFINE_integer, float: flags.DEFINE_float, bool: flags.DEFINE_bool,
           ml_collections.ConfigDict: flags.DEFINE_string}  # the config's path; parse loads it


@contextlib.contextmanager
def errors(*more):
  """Turn bad input (EXPECTED, and `more`) into `error: MESSAGE` on stderr and exit code 2."""
  try:
    yield
  except EXPECTED + more as e:
    if not str(e).strip():  # no message: a bug, not bad input; its traceback says where
      raise
    line = " ".join(str(e).splitlines())
    print("error: " + line, file=sys.stderr)
    distributed.stop_others(line)  # with several processes: they stop too, rather than wait for this one
    raise SystemExit(2) from None


def exit_on_interrupt():
  """Ctrl-C (SIGINT) ends a command that writes nothing (plan) at once, with one line and exit code 130.

  A Python handler alone would wait for a compile in XLA to return (minutes for a large model), and a
  KeyboardInterrupt can be lost in a callback; so SIGINT is blocked in this thread, and with it in
  every thread XLA starts later, and a watcher thread takes it. The handler covers a thread started
  before this call."""
  def stop(*_):
    print("error: interrupted (Ctrl-C); nothing was written.", file=sys.stderr, flush=True)
    os._exit(130)
  signal.signal(signal.SIGINT, stop)
  signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
  threading.Thread(target=lambda: stop(signal.sigwait({signal.SIGINT})), daemon=True).start()


def parse(doc, declared, argv=None):
  """argv (default sys.argv[1:]) -> a namespace of the flags' values; the config flag's (named
  "config") is its file's config with the `--config.a.b=v` overrides applied, validated (None when
  not given). `--help` or `-h` prints usage and exits 0."""
  argv = sys.argv[1:] if argv is None else list(argv)
  values = flags.FlagValues()
  for f in declared:
    notes = ([f"must be {f.rule}"] if f.rule else []) + (["required"] if f.default is REQUIRED else [])
    DEFINES[f.type](f.name, None if f.default is REQUIRED else f.default,
                    f.help + (f" ({'; '.join(notes)})" if notes else ""), flag_values=values, module_name="flags")
    if f.ok:
      flags.register_validator(f.name, lambda v, ok=f.ok: v is None or ok(v), f"must be {f.rule}", values)
  if "--help" in argv or "-h" in argv:
    print(doc.strip() + "\n" + values.get_help(include_special_flags=False))
    raise SystemExit(0)
  try:
    rest = values(["", *argv], known_only=True)[1:]  # what is not a declared flag: overrides, or mistakes
  except flags.Error as e:  # absl's "flag --NAME=VALUE: why": add what the flag takes ("an integer")
    name = re.match(r"flag --(\w+)=", str(e))
    takes = name and values[name[1]].parser.syntactic_help
    raise ValueError(f"{e}" + (f"; --{name[1]} takes {takes}" if takes else "") + " (see --help).") from None
  has_config = any(f.type is ml_collections.ConfigDict for f in declared)
  cfg = None
  if has_config and values["config"].value is not None:
    cfg = read_config(values["config"].value)
    rest = apply_overrides(cfg, rest)
  for arg in rest:
    if arg.startswith("-"):
      raise ValueError(f"unknown flag {arg.partition('=')[0]}; the flags are "
                       + ", ".join(f"--{f.name}" for f in declared)
                       + (", --config.a.b=v" if has_config else "") + " (see --help).")
    raise ValueError(f"unexpected argument {arg!r}; flags look like --name=value, a switch like --name or --noname "
                     "(see --help).")
  # Not flags.mark_flag_as_required: its check runs inside the parse, before a stray word above is told apart.
  missing = [f"--{f.name}" for f in declared if f.default is REQUIRED and values[f.name].value is None]
  if missing:
    raise ValueError(f"missing {' and '.join(missing)} (see --help).")
  args = types.SimpleNamespace(**{f.name: values[f.name].value for f in declared})
  if cfg is not None:
    validate(cfg)
    args.config = cfg
  return args


def writable_dir(path, flag):
  """Check, creating nothing, that `path` is a folder this process may write in, or one it may
  create: its nearest existing parent is a writable folder. (A bucket's permissions show at the
  first write.)"""
  if paths.is_url(path):
    paths.expand(path)  # the scheme's package is there
    return
  existing = os.path.abspath(path)
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  what = f"{flag} {path}" if existing == os.path.abspath(path) else f"{flag} {path}: {existing}"
  if not os.path.isdir(existing):
    raise NotADirectoryError(f"{what} is a file, not a folder; choose another {flag}.")
  if not os.access(existing, os.W_OK | os.X_OK):
    raise PermissionError(f"{what} is not writable; choose another {flag}, or fix its permissions.")
