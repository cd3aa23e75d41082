"""Tiny OLMo-3-style baseline: trains on the embedded KJV corpus on 2 CPU cores in minutes."""
import ml_collections


def get_config():
  c = ml_collections.ConfigDict()

  c.model = ml_collections.ConfigDict()
  c.model.name = "baseline"            # baseline | concept (ConceptLM)
  c.model.vocab_size = 2048             # BPE pieces; at most the tokenizer's rounded up to 128 (or +10%)
  c.model.d_model = 128
  c.model.num_layers = 4
  c.model.num_heads = 4
  c.model.num_kv_heads = 2             # grouped-query attention: heads share KV groups
  c.model.head_dim = 32
  c.model.mlp_dim = 384                # SwiGLU hidden width
  c.model.rope_base = 500_000.0
  # RoPE scaling of the full-attention layers (the sliding-window ones keep plain RoPE, as OLMo-3 does):
  # none | yarn (YaRN, Peng et al. 2023: "NTK-by-parts" frequencies and a scale on cos and sin).
  c.model.rope_scaling = "none"
  c.model.yarn_factor = 8.0            # s: how many times the original context YaRN stretches to
  c.model.yarn_original_context = 8192 # L: the context plain RoPE was trained at
  c.model.yarn_beta_fast = 32.0        # pairs turning more than this many times over L keep their frequency
  c.model.yarn_beta_slow = 1.0         # pairs turning fewer times are interpolated (frequency / s); a ramp between
  c.model.yarn_attention_factor = 0.0  # scale on cos and sin (so 1/sqrt(t) on q and k); 0 = 0.1 ln(s) + 1
  c.model.norm_eps = 1e-6
  c.model.qk_norm = "layer"            # none | layer (OLMo-3: over the whole q/k projection) | head
  c.model.block_order = "post"         # post (OLMo-3: norm on each sublayer output) | pre
  c.model.window = 64                  # sliding-window size in tokens
  c.model.full_attention_every = 4     # every n-th layer attends to the full context; 1 = no window
  c.model.tie_embeddings = False
  c.model.init_std = 0.02
  # Mixed precision: param_dtype is the dtype parameters are stored in (the master copy, which
  # the optimiser updates and whose dtype its moments take); dtype is the compute dtype that
  # weights and activations are cast to for the forward and backward pass (norms and softmaxes
  # run in float32 inside). The large recipes store float32 and compute in bfloat16.
  c.model.param_dtype = "float32"      # stored (master) dtype: float32 | bfloat16 (needs allow_bf16_params)
  c.model.dtype = "float32"            # compute dtype: float32 | bfloat16
  c.model.allow_bf16_params = False    # True: param_dtype=bfloat16 is meant, no float32 master (small updates round away)
  c.model.remat = "none"               # none | full (recompute each block) | matmuls (keep matmul outputs)
  c.model.scan_unroll = 1              # layers per iteration of the layer scan (num_layers: unrolled, slower to compile)
  # Mixture of experts (docs/moe.md; configs/tiny_moe.py turns it on): the MLP of the sparse layers becomes
  # num_experts SwiGLU experts of width expert_dim, each token through top_k of them (+ shared experts).
  c.model.moe = ml_collections.ConfigDict()
  c.model.moe.enabled = False
  c.model.moe.num_experts = 8          # E routed experts
  c.model.moe.top_k = 2                # k experts per token
  c.model.moe.expert_dim = 192         # f: each expert's SwiGLU hidden width
  c.model.moe.shared_experts = 0       # always-on experts of width expert_dim (DeepSeek-V3: 1), one fused MLP
  c.model.moe.every = 1                # layer i is sparse when i >= first_dense and (i - first_dense) % every == 0
  c.model.moe.first_dense = 0          # the first layers keep a dense MLP (DeepSeek-V3: 3)
  c.model.moe.router = "softmax"       # softmax (OLMoE, FlexOlmo) | sigmoid (DeepSeek-V3, with aux-loss-free bias)
  c.model.moe.norm_topk_prob = False   # softmax: renormalise the k chosen probabilities to sum 1 (OLMoE: False)
  c.model.moe.capacity_factor = 0.0    # 0 = dropless; > 0: an expert takes ceil(cf * tokens * k / E) rows, drops the rest
  c.model.moe.lb_loss_weight = 0.01    # load-balance loss E * sum_e f_e P_e (OLMoE: 0.01), logged as moe_lb_loss
  c.model.moe.z_loss_weight = 0.001    # router z-loss mean(logsumexp^2) (OLMoE: 0.001), logged as router_z_loss
  c.model.moe.bias_update_rate = 0.001 # sigmoid router: aux-loss-free bias step per train step (DeepSeek-V3: 0.001)
  c.model.moe.impl = "auto"            # grouped matmul: auto (tiled on CPU, ragged_dot elsewhere) | ragged | tiled

  c.data = ml_collections.ConfigDict()
  c.data.source = "kjv"                # kjv | shakespeare | .txt/.jsonl(.gz)/.parquet files, folders, globs | a token store
  c.data.tokenizer = ""                # "" trains SentencePiece BPE on the train split (saved in the workdir)
  c.data.tokenizer_sources = ""        # sources (as data.source, comma-separated) the trained tokenizer also learns from, never trained on: e.g. "arithmetic" for an adaptation's domain
  c.data.seq_len = 128
  c.data.batch_size = 16               # global, across all hosts
  c.data.val_fraction = 0.05           # documents held out for validation
  c.data.doc_separator = ""            # split .txt files into documents on this string ("" = one file, one doc)
  c.data.max_text_gib = 1.0            # text files (GiB on disk) train tokenises in memory at each start; above: prepare a store

  c.train = ml_collections.ConfigDict()
  c.train.steps = 600
  c.train.seed = 0
  c.train.microbatches = 1             # split each batch's rows into this many, one gradient update
  c.train.z_loss = 0.0                 # weight of lse^2
  c.train.log_every = 25
  c.train.monitors = True              # log per-layer attention logit and q/k norm maxima, per-group grad/update norms (docs/performance.md)
  c.train.eval_every = 200
  c.train.eval_batches = 16            # 0 = the whole validation split
  c.train.eval_tasks = ()              # proxy task files (JSONL) or folders of them, scored at each eval as proxy/... (docs/data.md)
  c.train.checkpoint_every = 200
  c.train.keep_checkpoints = 2
  c.train.peak_flops = 0.0             # per device; 0 = known for the device kind, or measured on CPU
  c.train.init_from = ""               # a workdir or export whose params start a fresh run (fine-tuning, VQ adaptation)
  c.train.wandb_project = ""           # also log to this Weights & Biases project (pip install -e ".[wandb]"); "" = off
  c.train.profile_steps = (0, 0)       # (START, COUNT): a jax.profiler trace of COUNT steps after step START; COUNT 0 = off

  c.optim = ml_collections.ConfigDict()
  c.optim.name = "adamw"               # adamw | muon
  c.optim.lr = 3e-3
  c.optim.schedule = "cosine"          # cosine | wsd | constant
  c.optim.warmup_steps = 50 / 600      # below 1: a fraction of train.steps (50 of 600; --config.train.steps=40 alone: 3); >= 1: steps
  c.optim.min_lr_ratio = 0.1           # floor of the schedule, as a fraction of lr
  c.optim.decay_fraction = 0.1         # wsd: fraction of steps spent decaying
  c.optim.b1 = 0.9
  c.optim.b2 = 0.95
  c.optim.eps = 1e-8
  c.optim.weight_decay = 0.1
  c.optim.clip_norm = 1.0
  c.optim.skip_factor = 0.0            # spike guard: skip a step whose grad norm > this x the running median; 0 = off
  c.optim.skip_window = 100            # the running median's window, in applied steps
  c.optim.trainable = "all"            # all | vq (codebook + concept heads) | a regex over parameter paths

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1                     # -1: all devices left over
  c.mesh.fsdp = 1
  c.mesh.expert = 1                    # expert parallelism: splits model.moe's experts (and, like data, the batch)
  c.mesh.tensor = 1                    # data, fsdp, expert, tensor: within one slice
  c.mesh.slices = 1                    # TPU slices (or groups of hosts) the data axis spans, over DCN; fsdp, tensor stay inside one

  c.kernels = ml_collections.ConfigDict()
  c.kernels.impl = "auto"              # auto | pallas | xla | naive  (cross-entropy and codebook mixing; pallas: mesh.tensor=1)
  c.kernels.attention = "auto"         # auto | dense | xla_blocked | pallas_tpu | pallas_gpu  (self-attention, docs/kernels.md)

  # Auxiliary objectives, off here; configs/tiny_nitp.py turns NITP on (docs/aux.md).
  c.nitp = ml_collections.ConfigDict()
  c.nitp.enabled = False               # Next Implicit Token Prediction: + weight * L_NITP
  c.nitp.weight = 1.0                  # lambda (paper: 1.0; 0.8 at 3B/9B, 0.6 at 45B)
  c.nitp.layer = 0                     # target = state after the first k layers; 0 = max(1, round(0.2 * depth))
  c.nitp.source = "final_norm"         # prediction from h_t after the final norm | pre_norm (before it)
  c.nitp.loss = "cosine"               # cosine (1 - cos, the paper) | mse (ablation: unstable in the paper)
  c.nitp.alignment = "next"            # next (h_t -> z_{t+1}) | same (ablation: h_t -> z_t)
  c.nitp.stop_gradient = True          # sg on the target (ablation: False)
  c.nitp.projector = True              # SwiGLU d -> 4d -> d on h_t (ablation: False = identity)

  c.mtp = ml_collections.ConfigDict()
  c.mtp.enabled = False                # DeepSeek-V3 multi-token prediction, depth 1: + weight * CE(x_{t+2})
  c.mtp.weight = 0.3

  # LoRA (docs/lora.md): low-rank adapters beside the weights of a trained model (train.init_from),
  # which alone train; export merges them (W + alpha / rank * A @ B) into a plain model.
  c.lora = ml_collections.ConfigDict()
  c.lora.enabled = False
  # An int, or "auto": the rank whose trainable count is nearest VQ adaptation's (optim.trainable=vq;
  # ConceptLM only). A FieldReference of type object, so that --config.lora.rank takes either.
  c.lora.rank = ml_collections.FieldReference(8, field_type=object)
  c.lora.alpha = 16.0                  # the adapter's scale is alpha / rank
  c.lora.targets = r".*(attn/(q|k|v|o)|mlp/(gate|up|down))"  # a regex over whole parameter paths, as optim.trainable
  return c
