"""The config schema every experiment shares, with every default.

An experiment file (`configs/*.py`) starts from `base_config()`, changes the values it cares about and returns
the locked result; the command line then overrides single keys with `--config.section.key=value`. Because the
config is locked, a misspelt key is an error, never a silently ignored setting.

Conventions:
    * `None` (an ml_collections placeholder with a type) means "unset": an optional path, or "use the
      algorithm's registered default" for the shared algorithm hyperparameters in `algo`. For the optional
      paths an empty string also means unset, so `--config.model.gguf=` clears a path on the command line.
    * `0` in a count that enables something (`eval_every`, `checkpoint.every_steps`, `top_k`,
      `train.micro_batch_size`) means "off" / "no limit" / "the whole mini-batch", as documented per key.
    * Batch sizes count sequences: completions for RL, pairs for DPO, examples for SFT.

To add a key: add it here with its default and a comment, add a check to `validation.py` when some values are
impossible, and read it directly (`config.section.key`) at the edge that unpacks the config.
"""

from __future__ import annotations

from ml_collections import ConfigDict
from ml_collections.config_dict import placeholder

SOURCE_KINDS = ("jsonl", "parquet", "tfds", "reasoning_gym", "champ")
"""Values of `data.sources.<name>.kind`."""


def base_config() -> ConfigDict:
    """Returns the locked schema with every section and its defaults.

    Returns:
        A locked `ConfigDict`. `data.sources` is empty; add sources with `add_data_source`.
    """
    config = ConfigDict()
    config.paradigm = "rl"  # "sft" | "dpo" | "rl" | "eval": what `feynrl-jax train` runs.
    config.name = "run"  # Run name, used in tracking.
    config.run_dir = "runs/run"  # Checkpoints, metrics.jsonl, plots and the resolved config go here.
    config.seed = 0  # Seeds parameter init, data order and sampling.

    config.model = ConfigDict()
    config.model.path = placeholder(str)  # A local Hugging Face folder (config.json + safetensors).
    config.model.gguf = placeholder(str)  # A GGUF file, or "smollm2" for the shipped SmolLM2-135M-Instruct.
    config.model.tokenizer = placeholder(str)  # Folder, GGUF file or "smollm2"; None: the model's own.
    config.model.param_dtype = "float32"  # "float32" | "bfloat16" (GPU/TPU: with master_dtype="float32").
    config.model.compute_dtype = "float32"  # "float32" | "bfloat16".
    # The train state's params and optimizer state (docs/DTYPES.md): "" (the same as param_dtype) | "float32" (float32
    # master weights: with param_dtype="bfloat16" the model runs on them rounded to bfloat16 and the update is
    # applied to the float32 masters, so steps smaller than a bfloat16 ulp are not lost). Checkpoints hold the
    # masters; rollout engines, reference and evaluation get param_dtype weights; HF export writes param_dtype.
    config.model.master_dtype = ""
    # Rematerialisation in the backward pass: "auto" (on a CPU "dots" in float32 without LoRA, which skips
    # recomputing the projections, else "full", as in bfloat16, where keeping residuals is slower; "none" on
    # accelerators; `ModelConfig.resolved_remat`) | "none" | "full" (recompute each layer) | "dots" (keep matmul
    # outputs).
    config.model.remat = "auto"
    # The model's matrix products on a CPU (feynrl_jax/kernels/onednn.py): "auto" (oneDNN where it was measured
    # faster than XLA on this machine in the compute dtype, bfloat16 or float32, on one device, with the kernel built
    # by `make setup`, and for bfloat16 bf16 instructions; else XLA) | "onednn" (refused where it cannot run) | "xla".
    # A bfloat16 model whose decode products run on oneDNN keeps a bfloat16 KV cache (else float32 on a CPU).
    config.model.cpu_matmul = "auto"
    # LoRA (Hu et al. 2021; docs/LORA.md): with rank > 0 only low-rank adapters on `targets` train; the base weights
    # stay frozen, the reference model is the base with the adapters off, and RL weight syncs carry the adapters.
    config.model.lora = ConfigDict()
    config.model.lora.rank = 0  # r; 0: full fine-tuning.
    config.model.lora.alpha = 16.0  # The adapters' output is scaled by alpha / rank.
    # QLoRA: "nf4" stores the frozen base's projection kernels in 4-bit NormalFloat blocks (docs/LORA.md); "": none.
    config.model.lora.quantize_base = ""
    config.model.lora.dropout = 0.0  # Dropout on the adapters' inputs in training passes (PEFT's lora_dropout).
    config.model.lora.targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    config.model.lora.init_from = placeholder(str)  # A PEFT adapter folder to start from (its r, alpha, targets).
    config.model.random_init = False  # Random weights with the shape below (tests, benchmarks).
    config.model.arch = ConfigDict()  # Shape of a random-init model; ignored when weights are loaded.
    config.model.arch.architecture = "llama"
    config.model.arch.vocab_size = 49152  # The SmolLM2 tokenizer's, so real tokenizers fit tiny models.
    config.model.arch.hidden_size = 64
    config.model.arch.intermediate_size = 128
    config.model.arch.num_layers = 2
    config.model.arch.num_heads = 4
    config.model.arch.num_kv_heads = 2
    config.model.arch.head_dim = 16
    config.model.arch.max_position_embeddings = 2048
    config.model.arch.tie_word_embeddings = True

    config.data = ConfigDict()
    config.data.sources = ConfigDict()  # name -> source (see `data_source`); mixed by `weight`.
    config.data.max_seq_len = 512  # Prompt + response tokens of one training row.
    config.data.max_prompt_len = 256  # Longer prompts are filtered (and counted), never truncated.
    config.data.packing = False  # Pack several SFT/DPO examples per row with `segment_ids`.
    config.data.on_bad_row = "error"  # "error": stop naming file and row | "skip": drop and count it.
    config.data.shuffle_seed = 0  # Order of the mixture; a resumed run continues the same order.
    config.data.chat_template = True  # Render prompts with the tokenizer's chat template.
    config.data.system_prompt = ""  # Prepended as a system turn when non-empty.
    config.data.response_template = "{answer}"  # reasoning-gym in SFT/DPO: the response stating an answer.

    config.optim = ConfigDict()  # AdamW (Loshchilov & Hutter, 2019) with gradient clipping.
    config.optim.lr = 1e-6  # Peak learning rate.
    config.optim.warmup_steps = 0  # Linear warm-up from 0 to `lr`.
    config.optim.schedule = "constant"  # "constant" | "cosine" (decays to 0 at `train.steps`).
    config.optim.weight_decay = 0.0
    config.optim.b1 = 0.9
    config.optim.b2 = 0.999
    config.optim.eps = 1e-8
    config.optim.max_grad_norm = 1.0  # Global-norm clipping; 0 disables it.
    config.optim.max_consecutive_nonfinite = 3  # Skip non-finite updates; stop after this many in a row.

    config.train = ConfigDict()
    config.train.steps = 100  # Optimizer phases (RL: rollout + `ppo_epochs` x `mini_batches` updates).
    config.train.global_batch_size = 16  # Sequences per phase across all devices (RL: prompts x n_samples).
    # Sequences per forward/backward pass. 0: SFT and DPO the whole mini-batch; RL by memory (`micro_batch_tokens`,
    # feynrl_jax/train/token_budget.py). RL refuses a value whose estimated step exceeds the free memory.
    config.train.micro_batch_size = 0
    # RL with micro_batch_size=0: token slots (rows x width) per forward/backward pass; 0: the most whose
    # estimated activations fit a share of the training device's free memory.
    config.train.micro_batch_tokens = 0
    # RL: pack each mini-batch's sequences into as few rows as they fit in and skip the micro-batches left empty
    # (train/packed_units.py): updates cost their real tokens. Applies when a mini-batch runs in several micro-batches.
    config.train.pack_sequences = True
    # RL: compile the update in a thread of its own from start-up, on a placeholder batch of the config's shapes,
    # while the first batch is generated (train/rl_trainer.py); False: at the first update.
    config.train.compile_ahead = True
    config.train.ppo_epochs = 1  # Passes over each RL batch.
    config.train.mini_batches = 1  # Optimizer updates per pass (the batch is split into this many).
    config.train.log_every = 1  # Steps between metric writes.
    config.train.eval_every = 0  # Steps between evaluations; 0: only at the start and the end.
    config.train.recompute_old_logprobs = True  # RL: recompute pi_old with the trainer (else the engine's).
    # RL: run each group as one row, its prompt once and the n completions behind it (same gradients, fewer
    # FLOPs): "auto" (when groups stay whole in micro-batches and it costs less) | "on" | "off".
    config.train.shared_prefix = "auto"
    # RL: how many policy versions a trained batch may lag behind. 0: sync (generate with the current params,
    # then train). k >= 1: async; the batch of step t is generated by version max(0, t - 1 - k) while the
    # trainer trains, a schedule fixed by version numbers (deterministic, resumes exactly).
    config.train.max_staleness = 0
    config.train.cpu_cores = ()  # RL: CPU cores the trainer actor is pinned to; (): not pinned.

    config.rollout = ConfigDict()
    # "native" (JAX, continuous batching) | "vllm" (pip install 'feynrl-jax[vllm]'; docs/VLLM.md). The engine of
    # the RL rollout workers, of RL evaluation with vLLM, and of `feynrl-jax eval`.
    config.rollout.engine = "native"
    config.rollout.n_samples = 8  # Completions per prompt (the group size of GRPO-style advantages).
    config.rollout.max_new_tokens = 128
    config.rollout.temperature = 1.0  # 0 means greedy.
    config.rollout.top_k = 0  # 0: no top-k filtering.
    config.rollout.top_p = 1.0  # 1: no nucleus filtering.
    config.rollout.num_workers = 1  # Rollout workers (Ray actors).
    config.rollout.max_slots = 32  # Sequences decoded concurrently per worker.
    config.rollout.decode_steps_per_dispatch = 8  # Decode steps per jitted call before refilling slots.
    # RL, native engine: each rollout worker compiles its engine's programs at start-up, on placeholder weights and
    # the first batch's prompt lengths, while the trainer starts (NativeEngine.warm_up); False: at the first batch.
    # vLLM warms itself up when it starts.
    config.rollout.warmup = True
    config.rollout.stop_strings = ()  # Generation stops after any of these strings (plus EOS).
    config.rollout.rewards = ConfigDict({"reasoning_gym": 1.0})  # RL: reward spec -> weight (rewards registry).
    config.rollout.reward_kwargs = ConfigDict()  # RL: reward spec -> its keyword arguments, e.g. {"gsm8k": {...}}.
    config.rollout.reward_workers = 1  # RL: reward-scoring processes (inside the reward actor).
    config.rollout.reward_timeout_s = 10.0  # RL: bound on one reward call; a timeout scores 0 and is counted.
    config.rollout.max_retries = 2  # RL: retries of a step's generation (or scoring) after its actor dies or hangs.
    # RL: stop the run when more than this fraction of a step's reward calls fail (raise or time out), naming the
    # reward and an example error; failed calls score 0 and are counted (`rollout/reward_failed_frac`). 1: never stop.
    config.rollout.max_reward_failure_frac = 0.5
    config.rollout.cpu_cores = ()  # RL: CPU cores every rollout worker actor is pinned to; (): not pinned.
    # RL, sync runs with the native engine: the rollout engine runs inside the trainer's process, on its first device
    # (no rollout worker actor). Each generation copies the trainer's params into the engine and frees that copy and
    # the KV cache at its end; the params no longer travel through Ray's object store. One process's memory and
    # runtime instead of two; generation and update take turns, as a sync run's do anyway. A failed generation ends
    # the run.
    config.rollout.colocate = False
    config.rollout.vllm = ConfigDict()  # rollout.engine="vllm" only.
    # Weights and activations inside vLLM: "float32" | "bfloat16" | "float16"; the trainer sends its weights in it.
    config.rollout.vllm.dtype = "float32"
    config.rollout.vllm.enforce_eager = True  # No torch.compile / CUDA graphs: starts faster, decodes slower.
    config.rollout.vllm.enable_prefix_caching = True  # A prompt's samples share its KV; dropped at each weight load.
    # KV cache memory per engine (vLLM's kv_cache_memory_bytes); 0: vLLM sizes it (gpu_memory_utilization).
    config.rollout.vllm.kv_cache_gib = 1.0
    # A LoRA policy (model.lora.rank > 0): "merge" (the worker merges each version's adapters into its copy of the
    # base and loads plain weights; full decode speed) or "adapter" (vLLM's LoRA support applies them unmerged).
    config.rollout.vllm.lora_mode = "merge"
    config.rollout.vllm.engine_kwargs = ConfigDict()  # Other `vllm.LLM` arguments, e.g. gpu_memory_utilization.

    config.algo = ConfigDict()
    # A registered algorithm (`feynrl_jax.losses.ALGORITHMS`) or your own loss: "package.module:function".
    config.algo.name = "grpo"
    config.algo.kl_coef = placeholder(float)  # None: the algorithm's default.
    config.algo.clip_low = placeholder(float)  # None: the algorithm's default.
    config.algo.clip_high = placeholder(float)  # None: the algorithm's default.
    config.algo.loss_agg = placeholder(str)  # "token_mean" | "seq_mean_token_mean" | "seq_mean_token_sum".
    config.algo.reference = "initial"  # "none" | "initial" (the starting policy) | a path to a model.
    config.algo.hparams = ConfigDict()  # Other hyperparameters of the algorithm, by name (see losses/README).
    config.algo.dynamic_sampling = False  # DAPO: drop groups whose rewards are all equal and refill.
    config.algo.max_refill_draws = 4  # DAPO dynamic sampling: extra prompt draws per step to refill the batch.
    # Off-policy correction of the policy-gradient losses (losses/off_policy.py): "none" | "tis" (truncated
    # importance weight min(pi_old / pi_behaviour, tis_cap), Yao et al. 2025) | "decoupled" (proximal policy =
    # the trainer's params at the start of the step, weight pi_prox / pi_behaviour truncated at tis_cap;
    # Hilton et al. 2022, AReaL). None: "decoupled" when train.max_staleness > 0; else "tis" with
    # rollout.engine="vllm" (its log-probabilities differ from the trainer's) and "none" with the native engine.
    config.algo.off_policy = placeholder(str)
    config.algo.tis_cap = 2.0  # Cap C of the importance weight; "decoupled" only: 0 leaves it untruncated.
    config.algo.critic_lr = 1e-5  # PPO: learning rate of the critic (its own AdamW, otherwise `optim`).
    config.algo.gae_gamma = 1.0  # PPO: GAE discount.
    config.algo.gae_lambda = 0.95  # PPO: GAE lambda.
    config.algo.reference_mode = "per_batch"  # DPO: "per_batch" (reference forward each step) | "precompute".

    config.mesh = ConfigDict()  # Device mesh ("data", "fsdp", "tensor"); one size may be -1 (the rest).
    config.mesh.data = -1
    config.mesh.fsdp = 1
    config.mesh.tensor = 1
    config.mesh.rules = "dp"  # Logical-axis rules table: "dp" | "fsdp" | "fsdp_tp".

    # Multi-process jobs (one process per host; `feynrl_jax.sharding.multihost` reads who is who from the launch
    # environment: SLURM, a TPU pod, or FEYNRL_COORDINATOR_ADDRESS / _NUM_PROCESSES / _PROCESS_ID).
    config.distributed = ConfigDict()
    config.distributed.initialization_timeout_s = 300  # How long every process waits for the others to join.
    # A process silent this long is dead: JAX's coordination service stops the others, which exit with one line.
    config.distributed.heartbeat_timeout_s = 100

    config.checkpoint = ConfigDict()
    config.checkpoint.every_steps = 50  # 0: only at the end.
    config.checkpoint.keep = 2  # Most recent checkpoints kept.
    config.checkpoint.async_save = True
    config.checkpoint.resume = True  # Continue from the latest checkpoint in `run_dir` if there is one.

    config.tracking = ConfigDict()
    config.tracking.jsonl = True  # `run_dir/metrics.jsonl`.
    config.tracking.wandb = False
    config.tracking.wandb_project = "feynrl-jax"
    config.tracking.progress_bar = True

    config.eval = ConfigDict()
    config.eval.n_samples = 4  # Completions per prompt.
    config.eval.k = (1, 4)  # pass@k reported for each k <= n_samples.
    config.eval.max_new_tokens = 256
    config.eval.temperature = 0.7
    config.eval.num_prompts = 100  # 0: the whole split.
    config.eval.split = "test"
    config.eval.during_training = True  # SFT/DPO loops: evaluate at the start, every train.eval_every, at the end.
    config.eval.reward = "reasoning_gym"  # Reward deciding correctness (rewards registry); "": no generation eval.
    config.eval.reward_kwargs = ConfigDict()  # Keyword arguments of `eval.reward`, e.g. {"fallback_last_number": True}.
    config.eval.success_threshold = 1.0  # A sample is correct when its reward >= this (empty: always wrong).
    # The native evaluation engine frees its copy of the params and its KV cache after each evaluation (its compiled
    # programs stay), so the trainer's updates between evaluations reuse that memory; False keeps them held. A vLLM
    # engine (rollout.engine="vllm") keeps what it reserved at start-up either way, as False asks. A colocated run
    # (rollout.colocate) evaluates on its rollout engine, which frees them after every generation: False is refused.
    config.eval.release_memory = True

    config.ray = ConfigDict()
    config.ray.address = placeholder(str)  # None: start Ray locally; else e.g. "ray://head:10001" or "auto".
    config.ray.num_cpus = placeholder(int)  # None: every CPU of the machine (local Ray only).
    config.ray.max_restarts = 3  # Restarts of a dead actor (rollout workers, reward scorer) before giving up.
    # An actor that does not answer a liveness ping for this long is hung (e.g. stopped): rollout workers and the
    # reward scorer are restarted and their call retried, a hung trainer or parameter store stops the run.
    config.ray.stall_timeout_s = 120.0
    # Local Ray (`ray.address` unset) listens on 127.0.0.1 only. A remote cluster is reached at `ray.address`
    # and keeps its own authentication (RAY_AUTH_MODE=token with RAY_AUTH_TOKEN in the environment).
    config.ray.log_to_driver = True  # Forward the actors' stdout/stderr to the driver.
    # GPUs per rollout worker: one placement group per worker keeps them on one node; vLLM's tensor-parallel size.
    config.ray.gpus_per_rollout_worker = 0
    config.ray.trainer_gpus = 0  # GPUs of the RL trainer actor (its JAX devices), of each when several.
    # Processes of the RL trainer: Ray actors joined by jax.distributed into one job (one per host on a cluster),
    # spread over the nodes; the mesh spans the devices of all of them.
    config.ray.trainer_processes = 1

    config.lock()
    return config


def data_source(
    kind: str,
    *,
    path: str | None = None,
    task: str | None = None,
    split: str = "train",
    weight: float = 1.0,
    size: int = 1000,
    seed: int = 0,
    fields: dict[str, str] | None = None,
    options: dict[str, object] | None = None,
) -> ConfigDict:
    """One named data source, with every field present so the command line can override any of them.

    Args:
        kind: one of `SOURCE_KINDS`.
        path: file or folder for "jsonl", "parquet" and "tfds".
        task: the reasoning-gym task ("basic_arithmetic", "chain_sum", ...), tfds builder or champ subset.
        split: "train" or "test"; reasoning-gym draws the test split from a disjoint seed.
        weight: relative sampling weight in the mixture (normalised over sources).
        size: examples generated for procedural sources (reasoning-gym).
        seed: generator seed for procedural sources.
        fields: column names in the file: prompt, response, chosen, rejected, answer.
        options: the task's own generator settings, for reasoning-gym sources only (e.g.
            `{"min_terms": 2, "max_terms": 2, "max_digits": 1}` for basic_arithmetic); each becomes a key that
            the command line can override: `--config.data.sources.<name>.options.max_digits=2`.

    Returns:
        A `ConfigDict` for `config.data.sources.<name>`.
    """
    columns = {
        "prompt": "prompt",
        "response": "response",
        "chosen": "chosen",
        "rejected": "rejected",
        "answer": "answer",
    }
    columns.update(fields or {})
    source = ConfigDict()
    source.kind = kind
    source.path = placeholder(str) if path is None else path
    source.task = placeholder(str) if task is None else task
    source.split = split
    source.weight = float(weight)
    source.size = size
    source.seed = seed
    source.fields = ConfigDict(columns)
    source.options = ConfigDict(dict(options or {}))
    return source


def add_data_source(config: ConfigDict, name: str, source: ConfigDict) -> None:
    """Adds `source` as `config.data.sources.<name>` to a locked config (the config stays locked).

    Args:
        config: a config from `base_config()`.
        name: the source's name, used on the command line: `--config.data.sources.<name>.weight=0.5`.
        source: from `data_source(...)`.
    """
    with config.data.sources.unlocked():
        config.data.sources[name] = source
    config.data.sources.lock()


def set_algorithm_hparams(config: ConfigDict, **values: object) -> None:
    """Declares algorithm-specific hyperparameters in `config.algo.hparams` (the config stays locked).

    Declared keys can then be overridden on the command line (`--config.algo.hparams.dual_clip=3.0`); the loop
    checks them against the algorithm's registered hyperparameters (`derived.algorithm_hyperparameters`).
    """
    with config.algo.hparams.unlocked():
        for key, value in values.items():
            config.algo.hparams[key] = value
    config.algo.hparams.lock()
