"""Mixed precision: the embedding's gradient sums a frequent token's rows in float32."""
import jax
import jax.numpy as jnp
import numpy as np

from latent_jax.nn.layers import embed_lookup


def test_embedding_gradient_sums_in_float32():
  """bf16 compute: a token seen 4096 times gets 4096 times its row's gradient, not bf16's 256."""
  tokens = jnp.full((2, 2048), 7, jnp.int32)
  lookup = lambda table: jnp.sum(embed_lookup(table, tokens, jnp.bfloat16).astype(jnp.float32))
  row = np.asarray(jax.grad(lookup)(jnp.zeros((16, 8), jnp.float32)))[7]
  np.testing.assert_array_equal(row, np.full(8, 4096.0, np.float32))
