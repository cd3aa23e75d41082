"""What the library reads from outside the public APIs of jax and Orbax, all of it in
latent_jax/distributed.py: JAX's coordination-service client (jax has no public accessor) and the
status codes its errors carry. An upgrade that moves any of it fails here, saying what moved."""
import subprocess
import sys

from conftest import ROOT
from test_multihost import free_port

# Every call and status code that latent_jax/distributed.py relies on, on a one-process runtime.
CHECKS = """
import sys
import jax
from latent_jax import distributed

def moved(what):
  sys.exit(f"MOVED: {what}; update latent_jax/distributed.py (coordination_client and the agreements) to match")

jax.distributed.initialize("127.0.0.1:%d", 1, 0)
client = distributed.coordination_client()
if client is None:
  moved("jax._src.distributed.global_state.client is None after jax.distributed.initialize()")
for method in ("key_value_set", "blocking_key_value_get", "key_value_try_get", "key_value_dir_get"):
  if not callable(getattr(client, method, None)):
    moved(f"the coordination client ({type(client).__module__}.{type(client).__name__}) has no {method}()")

def status(call, code):
  try:
    call()
  except jax.errors.JaxRuntimeError as e:
    if code not in str(e):
      moved(f"the coordination client's error says {str(e)[:200]!r}, without the status {code}")
    return
  moved(f"the coordination client raised no error where it should say {code}")

client.key_value_set("t/a/0", "x")
status(lambda: client.key_value_set("t/a/0", "y"), "ALREADY_EXISTS")
client.key_value_set("t/a/0", "y", allow_overwrite=True)
if client.blocking_key_value_get("t/a/0", 1000) != "y" or client.key_value_try_get("t/a/0") != "y":
  moved("key_value_set(..., allow_overwrite=True) no longer overwrites, or the getters read another value")
status(lambda: client.key_value_try_get("t/none"), "NOT_FOUND")
status(lambda: client.blocking_key_value_get("t/none", 10), "DEADLINE_EXCEEDED")
if sorted(client.key_value_dir_get("t/a/")) != [("t/a/0", "y")]:
  moved("key_value_dir_get(prefix) no longer lists (full key, value) pairs")
print("ok")
"""


def test_coordination_client_and_its_status_codes_are_where_distributed_py_reads_them():
  from jax._src import distributed as jax_distributed
  assert hasattr(jax_distributed, "global_state") and hasattr(jax_distributed.global_state, "client"), (
      "MOVED: jax._src.distributed.global_state.client, which latent_jax/distributed.py reads for the "
      "coordination service's key-value store")
  out = subprocess.run([sys.executable, "-c", CHECKS % free_port()], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
