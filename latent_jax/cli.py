"""What every command line shares: declared flags, `--help`, and bad input as one line.

  FLAGS = [cli.CONFIG, cli.Flag("workdir", str, cli.REQUIRED, "the run's folder")]

  def main(argv=None):
    with cli.errors():
      args = cli.parse(__doc__, FLAGS, argv)   # args.config, args.overrides, args.workdir
      ...

Flags are written `--name=value` or `--name value`; with CONFIG declared, `--config.a.b=v` (or
`--config.a.b v`) overrides a config field. An unknown flag, a value of the wrong type or out of
range, and any bad setting, path or file met later end the command with `error: ...` on stderr,
one line, exit code 2. Anything else is a bug and keeps its traceback.

Flags that several commands take are constants here (CONFIG, STEP); a command's FLAGS is a plain
list, so a shared group of them is added with `+`.
"""
import contextlib
import os
import sys
import types
from typing import Callable, NamedTuple

from latent_jax import paths

REQUIRED = object()  # a Flag default: the flag must be given


class Flag(NamedTuple):
  name: str
  type: type                    # str, int, float, or bool (a switch: `--name` alone means true)
  default: object               # REQUIRED, or the value when the flag is not given (None: unset)
  help: str
  ok: Callable = None           # a check of the parsed value ...
  rule: str = ""                # ... and what it asks, for the error: ">= 1" says "must be >= 1"


CONFIG = Flag("config", str, REQUIRED, "config file, e.g. configs/tiny.py; --config.a.b=v then overrides a field")
STEP = Flag("step", int, None, "the checkpoint to load, by step; the latest when not given", lambda s: s >= 0, ">= 0")

# Bad input: a setting, a path or a file. ConfigError and UnicodeDecodeError are ValueErrors.
EXPECTED = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError)
TYPE_NAMES = {str: "TEXT", int: "INT", float: "FLOAT", bool: ""}


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
    from latent_jax import distributed  # pylint: disable=import-outside-toplevel  # which imports this module
    distributed.stop_others(line)  # with several processes: they stop too, rather than wait for this one
    raise SystemExit(2) from None


def parse(doc, flags, argv=None):
  """argv (default sys.argv[1:]) -> a namespace of the flags' values, plus `overrides`
  (["a.b=v", ...]) when CONFIG is among them. `--help` or `-h` prints usage and exits 0."""
  argv = sys.argv[1:] if argv is None else list(argv)
  if "--help" in argv or "-h" in argv:
    print(usage(doc, flags))
    raise SystemExit(0)
  known = {f.name: f for f in flags}
  values, overrides = {}, []
  while argv:
    arg = argv.pop(0)
    if not arg.startswith("--"):
      raise ValueError(f"unexpected argument {arg!r}; flags look like --name=value (see --help).")
    name, eq, raw = arg[2:].partition("=")
    name = name.replace("-", "_")
    if not eq and name in known and known[name].type is bool:
      raw = "true"
    elif not eq:
      if not argv or argv[0].startswith("--"):
        raise ValueError(f"--{name} needs a value: --{name}=VALUE.")
      raw = argv.pop(0)
    if name.startswith("config.") and "config" in known:
      overrides.append(f"{name.removeprefix('config.')}={raw}")
    elif name in known:
      values[name] = convert(known[name], raw)
    else:
      raise ValueError(f"unknown flag --{name}; the flags are "
                       + ", ".join(f"--{f.name}" for f in flags)
                       + (", --config.a.b=v" if "config" in known else "") + " (see --help).")
  missing = [f"--{f.name}" for f in flags if f.default is REQUIRED and f.name not in values]
  if missing:
    raise ValueError(f"missing {' and '.join(missing)} (see --help).")
  return types.SimpleNamespace(**{f.name: values.get(f.name, f.default) for f in flags}, overrides=overrides)


def convert(flag, raw):
  if flag.type is bool:
    if raw.lower() not in ("true", "false", "1", "0"):
      raise ValueError(f"--{flag.name}={raw}: expected true or false.")
    return raw.lower() in ("true", "1")
  try:
    value = flag.type(raw)
  except ValueError:
    raise ValueError(f"--{flag.name}={raw}: expected {'an integer' if flag.type is int else 'a number'}.") from None
  if flag.ok and not flag.ok(value):
    raise ValueError(f"--{flag.name}={raw}: must be {flag.rule}.")
  return value


def usage(doc, flags):
  lines = [doc.strip(), "", "flags:"]
  names = {f.name: f"  --{f.name} {TYPE_NAMES[f.type]}" for f in flags}
  width = max(28, *(len(n) + 2 for n in names.values()))
  for f in flags:
    notes = [f"must be {f.rule}"] if f.rule else []
    if f.default is REQUIRED:
      notes.append("required")
    elif f.default is not None:
      notes.append(f"default {f.default!r}")
    lines.append(f"{names[f.name]:<{width}}{f.help}" + (f" ({'; '.join(notes)})" if notes else ""))
  if any(f.name == "config" for f in flags):
    lines.append(f"{'  --config.a.b=VALUE':<{width}}override a field of the config (configs/tiny.py lists them)")
  return "\n".join(lines)


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
