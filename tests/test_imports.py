"""Imports flow one way: a module imports its own layer and those below it, never one above (docs/code.md,
"Layers"). The sources are parsed, not imported: no jax, a fraction of a second."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
ORDER = ["kernels", "config", "runtime", "data", "ops", "nn", "objectives", "checkpoint", "train", "infer", "interop",
         "commands"]
# Module prefix -> layer; the longest prefix of a module decides.
LAYERS = {
    "pallas_kernels": "kernels",  # jax alone: ops and objectives call them
    "latent_jax.config": "config",
    "latent_jax.paths": "runtime", "latent_jax.cli": "runtime", "latent_jax.distributed": "runtime",
    "latent_jax.sharding": "runtime",
    "latent_jax.data": "data",
    "latent_jax.ops": "ops",
    "latent_jax.nn": "nn",
    "latent_jax": "nn",  # the package itself: its __init__ exports build_model
    "latent_jax.objectives": "objectives",
    "latent_jax.proxies": "objectives",  # the capability proxies' scoring: the train loop and eval call it
    "latent_jax.checkpoint": "checkpoint",
    "latent_jax.train": "train",
    "latent_jax.infer": "infer",
    "latent_jax.interop": "interop",
    "latent_jax.train.__main__": "commands", "latent_jax.eval": "commands", "latent_jax.generate": "commands",
    "latent_jax.export": "commands", "latent_jax.plan": "commands", "latent_jax.prepare": "commands",
    "latent_jax.draft": "commands", "latent_jax.convert": "commands", "latent_jax.tasks": "commands",
    "latent_jax.harness": "commands",  # lm-eval's model, loaded by eval --lm_eval_tasks only
    "latent_jax.ladder": "commands",
}


def prefix(module):
  """The longest prefix of `module` in LAYERS; None for a module outside them (jax, numpy, ...)."""
  parts = module.split(".")
  return next((".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in LAYERS), None)


def layer(module):
  return LAYERS.get(prefix(module))


def imports(tree, package):
  """(line, module) of every import in `tree`, at any depth. `from a import b` gives a.b: b may be a
  module (a.b's layer), or a name (a.b falls back to a's)."""
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      yield from ((node.lineno, alias.name) for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:  # relative to the importing module's package
        parts = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([node.module] if node.module else []))
      yield from ((node.lineno, f"{base}.{alias.name}") for alias in node.names)


def upward_imports(source, path):
  """'path:line: module (layer) imports other (layer)' for each import of a higher layer in `source`,
  the text of the file at `path` (relative to the repository root)."""
  parts = pathlib.PurePath(path).with_suffix("").parts
  package = ".".join(parts[:-1])
  module = package if parts[-1] == "__init__" else ".".join(parts)
  own = layer(module)
  found = []
  for line, name in sorted(imports(ast.parse(source, path), package)):
    other = layer(name)
    if other and ORDER.index(other) > ORDER.index(own):
      found.append(f"{path}:{line}: {module} ({own}) imports {name} ({other}), a higher layer")
  return found


def sources():
  """Every module's path, relative to the repository root."""
  return sorted(p.relative_to(ROOT) for package in ("latent_jax", "pallas_kernels")
                for p in (ROOT / package).rglob("*.py"))


def test_imports_flow_down():
  found = [e for path in sources() for e in upward_imports((ROOT / path).read_text(), str(path))]
  assert not found, "imports of a higher layer:\n" + "\n".join(found)


def test_every_module_has_a_layer():
  """A new top-level module or package is placed in LAYERS, not left to the package's own layer."""
  modules = [".".join(p.with_suffix("").parts) for p in sources() if p != pathlib.Path("latent_jax/__init__.py")]
  unplaced = [m for m in modules if prefix(m) in (None, "latent_jax")]
  assert not unplaced, f"add to LAYERS: {unplaced}"


def test_upward_imports_are_found():
  source = ("import os\n"
            "from latent_jax.config import validate\n"
            "from latent_jax import sharding\n"
            "from latent_jax.nn import build_model\n"
            "def f():\n"
            "  from latent_jax.train import step as steps\n"
            "from .. import checkpoint\n")
  assert upward_imports(source, "latent_jax/nn/fake.py") == [
      "latent_jax/nn/fake.py:6: latent_jax.nn.fake (nn) imports latent_jax.train.step (train), a higher layer",
      "latent_jax/nn/fake.py:7: latent_jax.nn.fake (nn) imports latent_jax.checkpoint (checkpoint), a higher layer"]
  assert upward_imports("from latent_jax import ConfigError\n", "latent_jax/config.py") == [
      "latent_jax/config.py:1: latent_jax.config (config) imports latent_jax.ConfigError (nn), a higher layer"]
  assert upward_imports("import latent_jax.ops\n", "pallas_kernels/fake.py") == [
      "pallas_kernels/fake.py:1: pallas_kernels.fake (kernels) imports latent_jax.ops (ops), a higher layer"]
  assert not upward_imports("from latent_jax.train import loop\n", "latent_jax/eval.py")


def module_graph(files):
  """{module: {modules it imports}} over `files` ({path: source}), a `from a import b` resolved to a.b when
  that is one of the modules, else to a."""
  names = {}
  for path in files:
    parts = pathlib.PurePath(path).with_suffix("").parts
    names[path] = ".".join(parts[:-1]) if parts[-1] == "__init__" else ".".join(parts)
  modules = set(names.values())
  graph = {}
  for path, source in files.items():
    module, parts = names[path], pathlib.PurePath(path).with_suffix("").parts
    found = {name if name in modules else name.rpartition(".")[0] for _, name in imports(ast.parse(source), ".".join(parts[:-1]))}
    graph[module] = {m for m in found if m in modules and m != module}
  return graph


def cycles(graph):
  """Each import cycle of `graph`, as the modules around it (one rotation each)."""
  found, done = set(), set()

  def visit(module, trail):
    if module in trail:
      loop = trail[trail.index(module):]
      start = loop.index(min(loop))
      found.add(tuple(loop[start:] + loop[:start]))
      return
    if module in done:
      return
    for other in sorted(graph[module]):
      visit(other, trail + [module])
    done.add(module)
  for module in sorted(graph):
    visit(module, [])
  return sorted(found)


def test_no_module_imports_itself_back():
  """Within a layer too, imports form no cycle (a function-level import counts: it still ties the two)."""
  graph = module_graph({str(p): (ROOT / p).read_text() for p in sources()})
  assert not cycles(graph), "import cycles:\n" + "\n".join(" -> ".join(c + (c[0],)) for c in cycles(graph))
  fake = module_graph({"latent_jax/a.py": "from latent_jax import b\n",
                       "latent_jax/b.py": "def f():\n  from latent_jax.a import g\n",
                       "latent_jax/c.py": "import latent_jax.a\n"})
  assert cycles(fake) == [("latent_jax.a", "latent_jax.b")]
