"""Tiny NCP-ArchPreview ConceptLM (docs/ncp.md): configs/tiny.py with a 2/2/2-layer hierarchy, k=4.

`add_ncp(c)` adds every NCP field with its default (the paper's choices, except the loss
reduction); larger NCP recipes (configs/ncp_archpreview_8b.py) call it too. ConceptLM ignores
model.num_layers.
"""
import ml_collections

import tiny  # configs load with their own folder on sys.path


def add_ncp(c):
  """Turn a baseline config into a ConceptLM config with the default NCP fields."""
  c.model.name = "concept"
  c.model.encoder_layers = 2           # E: token encoder, token rate
  c.model.concept_layers = 2           # C: concept module, one position per chunk
  c.model.decoder_layers = 2           # D: token decoder, token rate
  c.model.chunk_size = 4               # k tokens per concept; M = floor(seq_len / k)
  c.model.num_segments = 8             # S product-quantisation segments of d/S (must divide d_model)
  c.model.codebook_size = 64           # N codewords per segment
  c.model.mixing = "softmax"           # softmax (paper: convex mixture) | raw_logits (released code)
  c.model.fusion = "add"               # add (paper: h + b) | norm_add (released: LN(h) + a*LN(b))
  c.model.fusion_scale_init = 0.1      # a at init, for fusion=norm_add
  c.model.concept_norm = False         # released code: RMSNorm on the pooled concept before every use
  c.model.concept_positions = "index"  # RoPE position of concept m: index (m) | token (m*k)
  c.model.document_mask = True         # concepts pool, attend, inject and are scored within a document
  c.model.irc = True                   # intra-module residuals (Eq. 14-18) in every module
  c.model.irc_softmax = False          # softmax over IRC weights (released decoder) instead of free weights
  c.model.crc_encoder_concept = True   # cross-module residual routes (Eq. 19-20)
  c.model.crc_encoder_decoder = True
  c.model.crc_concept_decoder = True   # shift-aligned exactly like the injection (Eq. 11)
  c.model.residual_hidden = 16         # hidden width of the IRC and CRC weight MLPs
  c.model.crc_scale_init = 0.02        # D at init (0 = CRC starts as the plain model)

  c.ncp = ml_collections.ConfigDict()
  # paper (Eq. 21-22, the default) | algorithm1 (NCP / S) | released (elementwise means).
  c.ncp.reduction = "paper"
  return per_dimension_weights(c)


def per_dimension_weights(c):
  """alpha = 1/d, beta = S/d. The paper gives no alpha, beta; Eq. 22 sums squared errors over d
  dims and Eq. 21 over d/S, so these give both terms per-dimension scale, as the released
  code's elementwise means have (docs/ncp.md). Both are references: they follow later changes
  of model.d_model and model.num_segments (recipes, command-line overrides) until set themselves."""
  d = c.model.get_ref("d_model").to_float()
  c.ncp.alpha = 1.0 / d  # weight of L_NCP (Eq. 24)
  c.ncp.beta = c.model.get_ref("num_segments").to_float() / d  # weight of L_VQ
  return c


def get_config():
  return add_ncp(tiny.get_config())
