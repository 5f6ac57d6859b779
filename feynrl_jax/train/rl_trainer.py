"""The RL trainer: from scored rollouts to `ppo_epochs x mini_batches` optimizer updates, on the training mesh.

`RLTrainer` is plain Python (no Ray): `feynrl_jax.orchestration.actors.TrainerActor` runs it in its own process.
The config is unpacked once, into `RLSettings`; below that nothing reads it. One `train` call is the trainer's
half of an RL step (sync or async alike), in named steps:

1. `layout`: the batch's rows, and where the forward passes run (one row per sample, or the shared-prefix
   layout of `feynrl_jax.train.shared_prefix` when it is cheaper: one row per group, the prompt once and its
   `n` completions behind it, with the same log-probabilities and gradients);
2. `build_rl_batch`: the ratio's denominator `old_logprobs` (with `train.recompute_old_logprobs`, the
   policy's log-probabilities at the start of the step, i.e. the proximal policy of the decoupled objective;
   with one update per step the update's own forward pass gives them, with several a no-grad pass runs
   first; else the engine's behaviour log-probabilities), the reference model's log-probabilities when the
   loss has a KL term, and advantages with the algorithm's estimator (PPO: GAE from the critic's values);
3. `update`: `ppo_epochs` passes over the batch, each in `mini_batches` shuffled mini-batches (one optimizer
   update each); PPO updates its critic on the same mini-batches; metrics are combined by their own type.

Every step measures the behaviour policy against the proximal one on completion tokens:
`rollout/logprob_mismatch_kl` (k1 estimate of KL(behaviour || proximal)), `_k3`, `_max_abs` and
`rollout/behavior_ess` (effective sample size of the weights pi_prox / pi_behaviour). In a sync run they measure
the engine's numerical mismatch; in an async run (`train.max_staleness >= 1`) the staleness too.

Off-policy correction (`algo.off_policy`, `losses/off_policy.py`): "tis" and "decoupled" multiply each token's
policy loss by `min(pi_prox / pi_behaviour, algo.tis_cap)` around a trust region on `pi / pi_prox`; "decoupled"
with `algo.tis_cap = 0` leaves the weight untruncated.

`save` checkpoints the policy (and critic) state with the driver's PRNG key and data state (in-flight batches
included, see `feynrl_jax.orchestration.pipeline`).

Departure from some references: PPO advantages are not whitened (GAE on a 0/1 reward is already bounded), and
the critic is a separate model with its own AdamW (the actor's loss runs with `vf_coef = 0`; the critic's loss is
scaled by the algorithm's `vf_coef`, which matters through gradient clipping and AdamW's eps only).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import ConfigDict

from feynrl_jax.checkpoints.train_state import RunProgress, TrainCheckpointer
from feynrl_jax.config.derived import (
    BatchPlan,
    algorithm_hyperparameters,
    batch_plan,
    checkpoint_every,
    effective_off_policy,
    off_policy_problem,
)
from feynrl_jax.config.errors import ConfigError
from feynrl_jax.host_memory import peak_rss_gib, system_cpu_seconds
from feynrl_jax.losses import Algorithm, TrainBatch, compute_metrics, get_algorithm
from feynrl_jax.losses.advantages import gae
from feynrl_jax.losses.metrics import combine_updates
from feynrl_jax.models import ModelConfig, SegmentBounds, as_param_dtype, lora, quant
from feynrl_jax.rollout.types import FINISH_STOP, Rollouts
from feynrl_jax.sharding import batch_size_multiple, host_tree, mesh_shape
from feynrl_jax.train import run_setup, token_budget
from feynrl_jax.train.critic import critic_params_spec, critic_values, init_critic_params, make_critic_train_step
from feynrl_jax.train.frozen_logprobs import make_logprob_fn
from feynrl_jax.train.loss_parts import logprob_diagnostic_metrics, old_logprobs_from_current, with_logprob_diagnostics
from feynrl_jax.train.nonfinite import NonFiniteGuard, check_restored_state
from feynrl_jax.train.packed_units import PackStats, pack_units
from feynrl_jax.train.rl_batch import rollouts_to_batch, scatter_completion, sequence_reward_at_last_token
from feynrl_jax.train.shared_prefix import SharedPrefixRows, cheaper_than_rows, shared_bounds, shared_prefix_rows
from feynrl_jax.train.state import TrainState
from feynrl_jax.train.step import ParamsSpec, make_train_step, mesh_chunk_tokens, model_logprob_fn

log = logging.getLogger(__name__)


# With packing and micro-batches sized by memory, a mini-batch is split at least this finely: the update skips
# whole micro-batches, so with M of them up to 1/M of the slots is rounding. benchmarks/bench_rl_update.py (SmolLM2-135M
# on a CPU, 4 groups of 8 at 64 new tokens) packs the 4 group rows into 3: in 4 micro-batches of one group, 3 run
# (0.79x the unpacked update's time, measured); in 2 micro-batches of two groups, both would.
PACKED_MIN_MICRO_BATCHES = 4


def algorithm_values(config: ConfigDict) -> dict[str, Any]:
    """Every hyperparameter of the algorithm's loss from `config.algo` (registry defaults, then overrides).

    Dr. GRPO's `seq_mean_token_sum` normaliser `max_tokens` becomes `rollout.max_new_tokens` unless set; the
    off-policy keywords `tis_cap` and `decoupled` come from `algo.off_policy` and `algo.tis_cap`.
    """
    values = algorithm_hyperparameters(config, get_algorithm(config.algo.name).hyperparameters)
    if values.get("loss_agg") == "seq_mean_token_sum" and "max_tokens" not in config.algo.hparams:
        values["max_tokens"] = float(config.rollout.max_new_tokens)
    mode, cap = effective_off_policy(config), float(config.algo.tis_cap)
    problem = off_policy_problem(config, values)
    if problem is not None:
        raise ConfigError([problem])
    if not {"decoupled", "tis_cap"} <= values.keys():
        return values  # A loss of your own without off-policy keywords: on-policy samples only (checked above).
    values["decoupled"] = mode == "decoupled"
    values["tis_cap"] = cap if mode != "none" and cap > 0 else None
    return values


def loss_hyperparameters(config: ConfigDict) -> dict[str, Any]:
    """The actor loss's keyword arguments: `algorithm_values`, with `vf_coef = 0` for a critic-based loss (the
    critic is trained by its own step, `RLSettings.value_clip` and `vf_coef`)."""
    values = algorithm_values(config)
    if get_algorithm(config.algo.name).needs_critic:
        values["vf_coef"] = 0.0
    return values


def uses_reference(config: ConfigDict) -> bool:
    """Whether the trainer runs the reference model.

    It does when the loss has an active KL-to-reference term (the effective `kl_coef > 0`, which needs
    `batch.ref_logprobs`), or when the algorithm is registered with a reference and `algo.reference` names one
    (then `train/kl_ref` is reported even without a penalty).
    """
    kl_coef = float(loss_hyperparameters(config).get("kl_coef", 0.0) or 0.0)
    registered = get_algorithm(config.algo.name).needs_reference and config.algo.reference != "none"
    return kl_coef > 0.0 or registered


@dataclasses.dataclass(frozen=True)
class RLSettings:
    """What the RL trainer reads from a validated config, unpacked once (`rl_settings`).

    Attributes:
        algorithm: the registry record.
        loss_hyperparameters: the actor loss's keyword arguments (`loss_hyperparameters`).
        off_policy: the effective `algo.off_policy`.
        plan: the batch arithmetic.
        steps: `train.steps`.
        ppo_epochs, mini_batches: passes over a step's batch, and updates per pass.
        recompute_old: `train.recompute_old_logprobs`.
        separate_old_pass: pi_old needs a no-grad pass of its own (several updates per step); with one
            update, the update's own pass runs on the pre-update params and gives it.
        temperature: the rollouts' sampling temperature (1 for greedy).
        seq_len: `data.max_seq_len`, the row width of the row layout.
        prompt_width: `data.max_prompt_len`.
        group_size: `rollout.n_samples`.
        max_new_tokens: `rollout.max_new_tokens`, the longest completion.
        completion_width: a group's completions at most (`n_samples * max_new_tokens`).
        shared_prefix: `train.shared_prefix` ("auto", "on", "off").
        micro_batch_size, micro_batch_tokens: `train.micro_batch_size` and `train.micro_batch_tokens` (the trainer
            sizes its micro-batches from them, `token_budget.rl_micro_batch`).
        pack_sequences: `train.pack_sequences` (`packed_units`).
        compile_ahead: `train.compile_ahead` (`RLTrainer._compile_update`).
        reference: `algo.reference` ("none", "initial" or a model folder).
        uses_reference: whether the reference model runs (`uses_reference`).
        gae_gamma, gae_lambda: PPO's GAE.
        critic_lr: the critic's learning rate.
        value_clip, vf_coef: the critic's value-loss clip and scale (the algorithm's, with overrides).
        seed: `seed` (random init).
    """

    algorithm: Algorithm
    loss_hyperparameters: dict[str, Any]
    off_policy: str
    plan: BatchPlan
    steps: int
    ppo_epochs: int
    mini_batches: int
    recompute_old: bool
    separate_old_pass: bool
    temperature: float
    seq_len: int
    prompt_width: int
    group_size: int
    max_new_tokens: int
    completion_width: int
    shared_prefix: str
    micro_batch_size: int
    micro_batch_tokens: int
    pack_sequences: bool
    compile_ahead: bool
    reference: str
    uses_reference: bool
    gae_gamma: float
    gae_lambda: float
    critic_lr: float
    value_clip: float | None
    vf_coef: float
    seed: int


def rl_settings(config: ConfigDict) -> RLSettings:
    """Unpacks a validated RL config into `RLSettings` (the one place the trainer reads `config.train`,
    `config.algo` and `config.rollout`)."""
    train, rollout, algo = config.train, config.rollout, config.algo
    algorithm = get_algorithm(algo.name)
    everything = algorithm_values(config)
    recompute = train.recompute_old_logprobs
    return RLSettings(
        algorithm=algorithm,
        loss_hyperparameters=loss_hyperparameters(config),
        off_policy=effective_off_policy(config),
        plan=batch_plan(config),
        steps=train.steps,
        ppo_epochs=train.ppo_epochs,
        mini_batches=train.mini_batches,
        recompute_old=recompute,
        separate_old_pass=recompute and train.ppo_epochs * train.mini_batches > 1,
        temperature=rollout.temperature if rollout.temperature > 0 else 1.0,
        seq_len=config.data.max_seq_len,
        prompt_width=config.data.max_prompt_len,
        group_size=rollout.n_samples,
        max_new_tokens=rollout.max_new_tokens,
        completion_width=rollout.n_samples * rollout.max_new_tokens,
        shared_prefix=train.shared_prefix,
        micro_batch_size=train.micro_batch_size,
        micro_batch_tokens=train.micro_batch_tokens,
        pack_sequences=bool(train.pack_sequences),
        compile_ahead=bool(train.compile_ahead),
        reference=algo.reference,
        uses_reference=uses_reference(config),
        gae_gamma=algo.gae_gamma,
        gae_lambda=algo.gae_lambda,
        critic_lr=algo.critic_lr,
        value_clip=everything.get("value_clip"),
        vf_coef=float(everything.get("vf_coef", 1.0)),
        seed=config.seed,
    )


def _host(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(np.asarray(v)) for k, v in jax.device_get(metrics).items()}


def _rename(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    """`train/x` -> `train/<prefix>x`, `loss/x` -> `loss/<prefix>x` (the critic's metrics beside the actor's)."""
    return {f"{k.split('/', 1)[0]}/{prefix}{k.split('/', 1)[1]}": v for k, v in metrics.items()}


def _rows(batch: TrainBatch, rows: np.ndarray) -> TrainBatch:
    return jax.tree.map(lambda x: x[rows], batch)


@dataclasses.dataclass(frozen=True)
class Layout:
    """One step's rows, and the layout its forward and backward passes run on.

    Attributes:
        rows: the row-layout batch (one row per sample, `[N, seq_len]`): tokens, mask, behaviour
            log-probabilities; the other fields are filled by `build_rl_batch`.
        shared: the shared-prefix rows (one row per group), or None to train on `rows`.
        inputs: `(tokens, positions, segment_ids)` of the training layout, placed on the mesh.
    """

    rows: TrainBatch
    shared: SharedPrefixRows | None
    inputs: tuple[jax.Array, jax.Array, jax.Array]

    def to_rows(self, per_token: jax.Array) -> np.ndarray:
        """A forward pass's `[rows, width]` output of the training layout, as `[N, seq_len]` float32."""
        out = np.asarray(host_tree(per_token), np.float32)
        return out if self.shared is None else self.shared.unpack(out, self.rows.tokens.shape[1])

    def training(self, batch: TrainBatch) -> TrainBatch:
        """A row-layout batch moved to the training layout (every per-token field packed when shared)."""
        if self.shared is None:
            return batch
        shared = self.shared
        pack = lambda x: None if x is None else shared.pack(x)  # noqa: E731
        return TrainBatch(
            tokens=shared.tokens,
            positions=shared.positions,
            segment_ids=shared.segment_ids,
            loss_mask=pack(batch.loss_mask),
            advantages=pack(batch.advantages),
            old_logprobs=pack(batch.old_logprobs),
            ref_logprobs=pack(batch.ref_logprobs),
            behavior_logprobs=pack(batch.behavior_logprobs),
            values=pack(batch.values),
            returns=pack(batch.returns),
        )


@dataclasses.dataclass(frozen=True)
class ForwardPasses:
    """The no-grad passes that fill an RL batch; each takes the placed `(tokens, positions, segment_ids)` of
    the training layout, and is None when the step does not run it.

    Attributes:
        proximal: `-> (logprobs, entropy)` of the params at the start of the step (pi_old when it needs a pass
            of its own).
        reference: `-> logprobs` of the reference model.
        values: `-> values` of the critic.
    """

    proximal: Callable[..., tuple[jax.Array, jax.Array]] | None
    reference: Callable[..., jax.Array] | None
    values: Callable[..., jax.Array] | None


@functools.cache
def _as_one_program(fn: Callable[..., Any], static: tuple[str, ...] = ()) -> Callable[..., Any]:
    """`fn` jitted: the batch's host-side JAX functions (an advantage estimator, GAE, the log-prob diagnostics) run
    as one program each. Run op by op, their few dozen small operations each compiled on first use, in every
    trainer process: about 2 s of a run's first step on a 2-core CPU. Estimators are pure JAX functions (the
    contract of `feynrl_jax.losses.advantages`)."""
    return jax.jit(fn, static_argnames=static)


def _diagnostics(proximal: jax.Array, entropy: jax.Array, batch: TrainBatch) -> dict[str, jax.Array]:
    return compute_metrics(logprob_diagnostic_metrics(proximal, entropy, batch))


def sequence_advantages(algorithm: Algorithm, rollouts: Rollouts, rewards: np.ndarray) -> np.ndarray:
    """`[N, C]` completion-aligned advantages of a sequence-level estimator (GRPO-style groups, RLOO, ...)."""
    out = _as_one_program(algorithm.advantage_fn)(
        jnp.asarray(rewards, jnp.float32), jnp.asarray(rollouts.group_id), jnp.asarray(rollouts.completion_mask)
    )
    return np.asarray(out, np.float32)


def placeholder_rollouts(rows: int, group_size: int, max_new_tokens: int, *, pad_id: int) -> Rollouts:
    """Rollouts of the shapes and dtypes a rollout engine returns: what `RLTrainer` compiles its update on before
    real ones exist.

    Args:
        rows: sampled rows (`train.global_batch_size`).
        group_size: consecutive rows per prompt (`rollout.n_samples`).
        max_new_tokens: the completions' width (`rollout.max_new_tokens`).
        pad_id: the token every prompt and completion holds.

    Returns:
        `Rollouts` of one-token prompts and one-token completions, all of `pad_id`, behaviour log-probabilities 0.
    """
    completion_mask = np.zeros((rows, max_new_tokens), np.float32)
    completion_mask[:, 0] = 1.0
    return Rollouts(
        prompt_ids=np.full((rows, 1), pad_id, np.int32),
        prompt_lengths=np.ones(rows, np.int32),
        completion_ids=np.full((rows, max_new_tokens), pad_id, np.int32),
        completion_mask=completion_mask,
        behavior_logprobs=np.zeros((rows, max_new_tokens), np.float32),
        finish_reason=np.full(rows, FINISH_STOP, np.int32),
        group_id=np.arange(rows, dtype=np.int32) // group_size,
        policy_version=np.zeros(rows, np.int32),
    )


def build_rl_batch(
    rollouts: Rollouts,
    rewards: np.ndarray,
    layout: Layout,
    passes: ForwardPasses,
    settings: RLSettings,
) -> tuple[TrainBatch, dict[str, float]]:
    """The `TrainBatch` of one RL step, in the training layout, and its `rollout/` and `train/` metrics.

    Runs the passes `passes` holds (proximal policy, reference, critic), computes advantages with the
    algorithm's estimator (GAE on the critic's values for PPO, from the sequence reward on the last token) and
    sets `old_logprobs` (the proximal pass's, or the behaviour log-probabilities; with one update per step and
    `recompute_old`, the train step replaces them by its own pass's).

    Args:
        rollouts: `[N]` sampled rows.
        rewards: `[N]` total rewards.
        layout: the step's `Layout`.
        passes: the forward passes to run.
        settings: the trainer's settings.

    Returns:
        `(batch, metrics)`.
    """
    batch, mask = layout.rows, layout.rows.loss_mask
    metrics = {
        "rollout/old_logprobs_recomputed": float(settings.recompute_old),
        "train/shared_prefix": float(layout.shared is not None),
    }
    proximal = entropy = None
    if passes.proximal is not None:
        proximal, entropy = (layout.to_rows(x) for x in passes.proximal(*layout.inputs))
    old = proximal * mask if proximal is not None else batch.behavior_logprobs
    ref = None if passes.reference is None else layout.to_rows(passes.reference(*layout.inputs)) * mask
    if proximal is not None:
        # The same metrics the train step reports when its own pass gives pi_old.
        diagnostics = _as_one_program(_diagnostics)(proximal, entropy, dataclasses.replace(batch, ref_logprobs=ref))
        metrics.update(_host(diagnostics))
    values = returns = None
    if passes.values is not None:
        values = layout.to_rows(passes.values(*layout.inputs)) * mask
        token_rewards = sequence_reward_at_last_token(rewards, rollouts, settings.seq_len)
        adv, ret = _as_one_program(gae, ("gamma", "lam"))(
            jnp.asarray(token_rewards),
            jnp.asarray(values),
            jnp.asarray(mask),
            jnp.asarray(rollouts.finish_reason == FINISH_STOP),
            gamma=settings.gae_gamma,
            lam=settings.gae_lambda,
        )
        advantages, returns = np.asarray(adv, np.float32), np.asarray(ret, np.float32)
        metrics["train/value_mean"] = float(values[mask > 0].mean()) if mask.any() else 0.0
    else:
        per_completion = sequence_advantages(settings.algorithm, rollouts, rewards)
        advantages = scatter_completion(per_completion, rollouts, settings.seq_len)
    batch = dataclasses.replace(
        batch, advantages=advantages, old_logprobs=old, ref_logprobs=ref, values=values, returns=returns
    )
    valid = advantages[mask > 0]
    metrics["train/advantage_mean"] = float(valid.mean()) if valid.size else 0.0
    metrics["train/advantage_abs_mean"] = float(np.abs(valid).mean()) if valid.size else 0.0
    return layout.training(batch), metrics


@dataclasses.dataclass(frozen=True)
class Restored:
    """Where a (re)started run begins: `step` updates done, and the driver's state at that step.

    Attributes:
        step: RL steps completed.
        policy_version: version of the params now held (and published).
        rng: the driver's PRNG key data (`uint32` array) saved with `step`, or None for a fresh run.
        data_state: the driver's data state saved with `step` (prompt iterator, in-flight batches), or None.
    """

    step: int
    policy_version: int
    rng: np.ndarray | None
    data_state: Any


class RLTrainer:
    """The trainer of an RL run: policy (and critic) state, reference model, checkpoints, evaluation.

    Args:
        config: a validated RL config (unpacked here into `RLSettings`; the run-set-up helpers read its model,
            mesh, optimizer, checkpoint and eval sections).
        model_config: the policy's `ModelConfig` where the caller has it already, `run_setup.model_config` of
            this config's model and tokenizer (the RL driver's; `TrainerActor`): the tokenizer is then loaded
            only where the trainer needs it (evaluation, a reference model), which keeps transformers' import out
            of the trainer's start. None: computed here.
        compile_after: a callable the update's compile-ahead runs first, in its thread, and which holds it until
            it returns: True, then compile; False, compile nothing (the first update compiles). A colocated
            `TrainerActor` passes its engine's warm-up (`TrainerActor._after_warm_up`). None: compile at once.
    """

    def __init__(
        self,
        config: ConfigDict,
        model_config: ModelConfig | None = None,
        *,
        compile_after: Callable[[], bool] | None = None,
    ):
        self.config = config
        self.settings = settings = rl_settings(config)
        self.algorithm = settings.algorithm
        self.source = run_setup.resolve_model_source(config.model, config.run_dir)
        self._tokenizer = None
        if model_config is None:
            model_config = run_setup.model_config(config.model, self.source, self.tokenizer)
        self.model_config: ModelConfig = model_config
        self.mesh, self.rules = run_setup.build_mesh(config.mesh)
        run_setup.log_compute(self.model_config)
        self.pad_id = self.model_config.pad_token_id if self.model_config.pad_token_id is not None else 0
        self.total_updates = settings.steps * settings.ppo_epochs * settings.mini_batches
        self.micro_choice = token_budget.rl_micro_batch(
            settings.plan,
            self.model_config,
            micro_batch_size=settings.micro_batch_size,
            micro_batch_tokens=settings.micro_batch_tokens,
            seq_len=settings.seq_len,
            group_size=settings.group_size,
            shared_width=settings.prompt_width + settings.completion_width,
            shards=batch_size_multiple(self.mesh),
            min_micro_batches=PACKED_MIN_MICRO_BATCHES if settings.pack_sequences else 1,
            whole_groups=settings.shared_prefix != "off",
        )
        self.plan = self.micro_choice.plan
        self.shared_prefix = self._choose_shared_prefix()
        # What a training row's segments can span: attention runs in blocks where that is cheaper than the dense
        # mask (`models.block_attention`): the shared-prefix layout's long rows of short segments.
        if self.shared_prefix:
            self.segment_bounds = shared_bounds(settings.prompt_width, settings.max_new_tokens)
        else:
            self.segment_bounds = SegmentBounds(segment=settings.seq_len, prefix=0)
        # Packing moves completions off the columns they have in the unpacked layout, so the update's output
        # projection runs from column 1 (the no-grad passes, unpacked, still skip the prompts).
        self.pack = settings.pack_sequences and self.plan.grad_accum_steps > 1
        first_column = settings.prompt_width if self.shared_prefix else 1
        # Rows per forward pass: a micro-batch's samples, or its groups in the shared-prefix layout.
        chunk_rows = self.plan.micro_batch_size // (settings.group_size if self.shared_prefix else 1)
        self.optimizer, schedule = run_setup.build_optimizer(config.optim, self.total_updates)
        loss = self.algorithm.make_loss(**settings.loss_hyperparameters)
        if settings.recompute_old and not settings.separate_old_pass:
            loss = old_logprobs_from_current(loss)
        if not settings.separate_old_pass:
            loss = with_logprob_diagnostics(loss, pass_entropy=self.algorithm.uses_entropy)
        predict = model_logprob_fn(
            self.model_config,
            chunk_tokens=mesh_chunk_tokens(self.mesh),
            temperature=settings.temperature,
            first_column=1 if self.pack else first_column,
            with_entropy=self.algorithm.uses_entropy or not settings.separate_old_pass,
            segment_bounds=self.segment_bounds,
        )
        self.train_step = make_train_step(
            loss,
            self.optimizer,
            self.mesh,
            self.rules,
            predict=predict,
            params_spec=ParamsSpec.of_model(self.model_config).with_master_dtype(config.model.master_dtype or None),
            grad_accum=self.plan.grad_accum_steps,
            learning_rate_fn=schedule,
            rng_seed=run_setup.dropout_seed(config, self.model_config),
            check_updated=False,  # build_optimizer's AdamW: finite in, finite out (make_optimizer)
        )
        logprob_settings = dict(
            chunk_rows=chunk_rows,
            temperature=settings.temperature,
            with_entropy=True,
            first_column=first_column,
            segment_bounds=self.segment_bounds,
        )
        self.logprobs = make_logprob_fn(self.model_config, self.mesh, self.rules, **logprob_settings)
        # A LoRA run's reference has no adapters (its base, or another model folder): the base model's program
        # (`_reference_from_base` switches to the policy's for a run started from a PEFT adapter).
        self.reference_logprobs = self.logprobs
        if self.model_config.lora_rank:
            self.reference_logprobs = make_logprob_fn(
                self.model_config.frozen_base(), self.mesh, self.rules, **logprob_settings
            )
        self.critic_step = None
        if self.algorithm.needs_critic:
            critic_optim = config.optim.copy_and_resolve_references()
            with critic_optim.unlocked():
                critic_optim.lr = settings.critic_lr
            self.critic_optimizer, _ = run_setup.build_optimizer(critic_optim, self.total_updates)
            # The critic is a full model of the base architecture (LoRA adapters belong to the policy alone).
            critic_config = self.model_config.without_lora()
            self.critic_step = make_critic_train_step(
                critic_config,
                self.critic_optimizer,
                self.mesh,
                self.rules,
                value_clip=settings.value_clip,
                vf_coef=settings.vf_coef,
                grad_accum=self.plan.grad_accum_steps,
                params_spec=critic_params_spec(critic_config).with_master_dtype(config.model.master_dtype or None),
                segment_bounds=self.segment_bounds,
                check_updated=False,  # build_optimizer's AdamW: finite in, finite out (make_optimizer)
            )
            self._values = jax.jit(
                functools.partial(critic_values, config=critic_config, segment_bounds=self.segment_bounds)
            )
        self.guard = NonFiniteGuard(config.optim.max_consecutive_nonfinite)
        self.critic_guard = NonFiniteGuard(config.optim.max_consecutive_nonfinite, model="critic")
        self.checkpointer = TrainCheckpointer(
            config.run_dir,
            save_every=checkpoint_every(config),
            keep=config.checkpoint.keep,
            async_save=config.checkpoint.async_save,
        )
        self.state: TrainState | None = None
        self.critic_state: TrainState | None = None
        # The update's programs compile in a thread of their own from `start` on (`_compile_update`), once
        # `compile_after()` returns where it is given: a colocated engine's warm-up (`actors.TrainerActor`).
        self._compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compile-update")
        self._compiled: Future | None = None
        self.compile_after = compile_after
        self._compiled_at: float | None = None  # `time.time()` when the compile-ahead ended, where it compiled
        self._compile_figures: dict[str, float] = {}  # for the next `train`'s metrics (`_wait_for_compile`)
        self.reference: Any = None
        self.policy_version = 0
        self.evaluator = None

    def _choose_shared_prefix(self) -> bool:
        """Whether forward and backward passes run on the shared-prefix layout (`train.shared_prefix`).

        "off" never; "on" always (an error when the batch plan cannot keep groups whole); "auto" when groups
        stay whole and the layout costs fewer FLOPs (`cheaper_than_rows`).

        Raises:
            ValueError: naming `train.shared_prefix` when it is "on" but the layout cannot be used.
        """
        settings = self.settings
        mode = settings.shared_prefix
        if mode == "off":
            return False
        n, micro, shards = settings.group_size, self.plan.micro_batch_size, batch_size_multiple(self.mesh)
        why = None
        if n < 2:
            why = "rollout.n_samples is 1, so no two samples share a prompt"
        elif micro % n or (micro // n) % shards:
            why = (
                f"a micro-batch of {micro} sequences (train.micro_batch_size, or the mini-batch) is not a whole "
                f"number of groups of rollout.n_samples={n} spread over the {shards} batch shard(s) of the mesh"
            )
        elif mode == "auto" and not cheaper_than_rows(
            self.model_config,
            group_size=n,
            seq_len=settings.seq_len,
            prompt_width=settings.prompt_width,
            completion_width=settings.completion_width,
        ):
            why = "one row per sample costs fewer FLOPs at these lengths"
        if why is None:
            return True
        if mode == "on":
            raise ValueError(f"train.shared_prefix='on' cannot be used: {why}")
        log.info("training on one row per sample (train.shared_prefix=auto): %s", why)
        return False

    # Start-up ------------------------------------------------------------------------------------------------

    def _initial_params(self) -> Any:
        return run_setup.load_params(
            self.model_config,
            self.source,
            seed=self.settings.seed,
            shardings=self.train_step.state_shardings.params,
            lora_init_from=self.config.model.lora.init_from or None,
        )

    @property
    def tokenizer(self) -> Any:
        """The run's tokenizer (`run_setup.load_run_tokenizer`), loaded at first use."""
        if self._tokenizer is None:
            self._tokenizer = run_setup.load_run_tokenizer(self.source)
        return self._tokenizer

    def _reference_params(self) -> Any:
        reference = self.settings.reference
        ref_source = run_setup.ModelSource(weights_dir=reference, tokenizer_dir=self.source.tokenizer_dir)
        ref_config = run_setup.model_config(self.config.model, ref_source, self.tokenizer).without_lora()
        if ref_config != self.model_config.without_lora():
            raise ValueError(f"config.algo.reference={reference!r} has another architecture than the policy")
        shardings = self.train_step.state_shardings.params
        return run_setup.load_params(
            ref_config,
            ref_source,
            seed=self.settings.seed,
            shardings=lora.base_params(shardings) if self.model_config.lora_rank else shardings,
        )

    def _abstract_state(self) -> dict[str, Any]:
        tree = {"policy": self.train_step.abstract_state}
        if self.critic_step is not None:
            tree["critic"] = self.critic_step.abstract_state
        return tree

    def start(self) -> Restored:
        """Builds the state (fresh, or restored from the run folder's latest checkpoint), then starts compiling the
        update's programs in the background (`_compile_update`, unless `train.compile_ahead` is False).

        Raises:
            FileExistsError: the run folder holds checkpoints but `checkpoint.resume` is False.
            InputError: the restored checkpoint holds non-finite params or optimizer state (names the step folder).
        """
        latest = self.checkpointer.latest_step()
        if latest is not None and not self.config.checkpoint.resume:
            raise FileExistsError(
                f"run folder {self.config.run_dir} already holds checkpoints (latest step {latest}) and "
                "checkpoint.resume is False; pass --resume to continue it or choose another config.run_dir"
            )
        lora_run = bool(self.model_config.lora_rank)
        # With LoRA the initial reference is the state's own frozen base (set below, once the state exists).
        initial = self.settings.reference == "initial" and not lora_run
        params = self._initial_params() if latest is None or initial else None
        if self.settings.uses_reference and not (lora_run and self.settings.reference == "initial"):
            # A copy: the train step donates the state's buffers, which must not be the reference's.
            self.reference = jax.tree.map(jnp.copy, params) if initial else self._reference_params()
        if latest is None:
            if self.critic_step is not None:
                critic_backbone = lora.base_params(params) if self.model_config.lora_rank else params
                # A QLoRA base is dequantized: the critic is a full model of the plain base architecture.
                critic_backbone = quant.dequantize_base(critic_backbone, jnp.dtype(self.model_config.param_dtype))
                self.critic_state = self.critic_step.init_state(
                    init_critic_params(critic_backbone, self.model_config.without_lora())
                )
            self.state = self.train_step.init_state(params)
            self._reference_from_base()
            self.policy_version = 0
            self._compile_ahead()
            return Restored(step=0, policy_version=0, rng=None, data_state=None)
        tree, progress = self.checkpointer.restore(self._abstract_state())
        where = os.path.join(self.checkpointer.directory, str(progress.step))
        for state in tree.values():
            check_restored_state(state, where)
        self.state = tree["policy"]
        self._reference_from_base()
        self.critic_state = tree.get("critic")
        self.policy_version = progress.policy_version
        log.info(
            "resumed %s from step %d (policy version %d)", self.config.run_dir, progress.step, progress.policy_version
        )
        rng = np.asarray(jax.random.key_data(progress.rng), np.uint32)
        self._compile_ahead()
        return Restored(progress.step, progress.policy_version, rng, progress.data_state)

    def _compile_ahead(self) -> None:
        if self.settings.compile_ahead:
            self._compiled = self._compiler.submit(self._compile_or_warn)

    def _compile_update(self) -> None:
        """Compiles the update's programs (the policy's train step, the critic's) for this run's mini-batches.

        An RL update's shapes follow from the config alone (packing keeps them, `packed_units`), so the programs
        can compile before the first batch exists: on a placeholder batch laid out, filled and cut into a
        mini-batch as `train` does with a real one. `start` runs this in a thread of its own while the rollout
        worker generates the first batch and the trainer evaluates: compiling takes one core for seconds (7 s of
        the demo's first step on the 2-core machine), and the first generation leaves one idle while it compiles
        its own programs. `update` waits for it (`_compile_or_warn`: an error is logged, and the first update
        compiles as it would have).
        """
        t0 = time.perf_counter()
        settings = self.settings
        rollouts = placeholder_rollouts(
            self.plan.global_batch_size, settings.group_size, settings.max_new_tokens, pad_id=self.pad_id
        )
        layout = self.layout(rollouts)

        def zeros(*inputs: jax.Array) -> np.ndarray:  # a no-grad pass's output: `[rows, width]` of the layout
            return np.zeros(inputs[0].shape, np.float32)

        passes = ForwardPasses(
            proximal=(lambda *inputs: (zeros(*inputs), zeros(*inputs))) if settings.separate_old_pass else None,
            reference=None if self.reference is None else zeros,
            values=None if self.critic_step is None else zeros,
        )
        rewards = np.zeros(rollouts.prompt_ids.shape[0], np.float32)
        batch, _ = build_rl_batch(rollouts, rewards, layout, passes, settings)
        mini, _ = self._mini_batch(batch, np.arange(batch.tokens.shape[0] // settings.mini_batches))
        self.train_step.compile(self.state, mini)
        if self.critic_step is not None:
            self.critic_step.compile(self.critic_state, mini)
        log.info("trainer: the update compiled in %.1f s, in the background", time.perf_counter() - t0)

    def _compile_or_warn(self) -> None:
        """`_compile_update` once `compile_after()` returns True (where set; False: nothing); an error is logged,
        not raised: the first update then compiles as it would have."""
        try:
            if self.compile_after is None or self.compile_after():
                self._compile_update()
                self._compiled_at = time.time()
        except Exception:
            log.warning("trainer: compiling the update ahead failed; the first update compiles it", exc_info=True)

    def _wait_for_compile(self) -> None:
        """Waits for the compile-ahead, if one is pending. Where it compiled the update, the next `train` reports
        when it ended (`perf/update_compiled_at`, `time.time()`; the RL driver turns it into
        `perf/update_compile_past_start_seconds`, from its trainer's start-up's end) and how long this call waited
        for it (`perf/update_compile_wait_seconds`): what a first update waits for where nothing else runs before
        it (`benchmarks/learning_vs_trl.py` charges the part that an evaluation before training hid)."""
        if self._compiled is None:
            return
        compiled, self._compiled = self._compiled, None
        t0 = time.perf_counter()
        compiled.result()
        if self._compiled_at is not None:
            self._compile_figures = {
                "perf/update_compiled_at": self._compiled_at,
                "perf/update_compile_wait_seconds": time.perf_counter() - t0,
            }

    def _reference_from_base(self) -> None:
        """With LoRA and `algo.reference="initial"`, the reference is the starting policy over the train state's own
        frozen base arrays (never donated, never changed), not a copy (`run_setup.lora_reference`)."""
        if self.settings.uses_reference and self.model_config.lora_rank and self.settings.reference == "initial":
            init_from = self.config.model.lora.init_from or None
            self.reference = run_setup.lora_reference(
                self.state.params,
                self.model_config,
                lora_init_from=init_from,
                shardings=self.train_step.state_shardings.params,
            )
            if init_from:  # the base plus the starting adapters: the policy's program
                self.reference_logprobs = self.logprobs

    def host_base(self) -> dict[str, Any]:
        """The frozen base params of a LoRA policy in `model.param_dtype` on host (published once per run); with
        several trainer processes a collective that gathers them on every process."""
        return host_tree(as_param_dtype(lora.base_params(self.state.params), self.model_config))

    def host_adapters(self) -> dict[str, Any]:
        """The LoRA adapters alone in `model.param_dtype` on host (what a weight sync of a LoRA run carries)."""
        return host_tree(as_param_dtype(lora.adapters_of(self.state.params), self.model_config))

    def host_params(self) -> dict[str, Any]:
        """The policy params in `model.param_dtype` (float32 masters rounded on the device first) fetched to host
        NumPy (what the parameter store publishes); with several trainer processes a collective that gathers them
        on every process."""
        return host_tree(as_param_dtype(self.state.params, self.model_config))

    def describe(self) -> dict[str, Any]:
        """Where the trainer runs: its processes, devices and mesh (the driver logs it)."""
        return {
            "processes": jax.process_count(),
            "devices": jax.device_count(),
            "local_devices": jax.local_device_count(),
            "mesh": mesh_shape(self.mesh),
        }

    # One RL step -----------------------------------------------------------------------------------------------

    def layout(self, rollouts: Rollouts) -> Layout:
        """The step's row batch and its training layout (`Layout`), inputs placed on the mesh."""
        settings = self.settings
        zeros = np.zeros(rollouts.completion_mask.shape, np.float32)
        rows = rollouts_to_batch(rollouts, zeros, seq_len=settings.seq_len, pad_id=self.pad_id)
        shared = None
        if self.shared_prefix:
            shared = shared_prefix_rows(
                rollouts,
                prompt_width=settings.prompt_width,
                completion_width=settings.completion_width,
                pad_id=self.pad_id,
            )
        source = shared if shared is not None else rows
        self.segment_bounds.check(source.positions, source.segment_ids)
        inputs = tuple(self.train_step.place_batch(x) for x in (source.tokens, source.positions, source.segment_ids))
        return Layout(rows=rows, shared=shared, inputs=inputs)

    def passes(self) -> ForwardPasses:
        """The no-grad passes this run's steps need, bound to the current params."""
        return ForwardPasses(
            proximal=functools.partial(self.logprobs, self.state.params) if self.settings.separate_old_pass else None,
            reference=None if self.reference is None else self._reference_pass,
            values=None if self.critic_step is None else functools.partial(self._values, self.critic_state.params),
        )

    def _reference_pass(self, *inputs: jax.Array) -> jax.Array:
        return self.reference_logprobs(self.reference, *inputs)[0]

    def update(self, batch: TrainBatch, *, shuffle_seed: int, step: int) -> dict[str, float]:
        """`ppo_epochs` passes of `mini_batches` shuffled updates over `batch` (and the critic's, for PPO).

        Returns:
            The updates' metrics combined by type (`combine_updates`), the critic's as `*/critic_*`.

        Raises:
            NonFiniteError: too many consecutive non-finite updates of the policy or the critic
                (`optim.max_consecutive_nonfinite`), or an update that wrote a non-finite state.
        """
        self._wait_for_compile()
        order = np.random.default_rng(shuffle_seed)
        units = batch.tokens.shape[0]  # samples, or groups in the shared-prefix layout
        size = units // self.settings.mini_batches
        records, critic_records, packing = [], [], []
        for _ in range(self.settings.ppo_epochs):
            perm = order.permutation(units)
            for m in range(self.settings.mini_batches):
                mini, stats = self._mini_batch(batch, perm[m * size : (m + 1) * size])
                if stats is not None:
                    packing.append(stats)
                self.state, update_metrics = self.train_step(self.state, mini)
                update_metrics = jax.device_get(update_metrics)
                self.guard.check(update_metrics, step)
                records.append(update_metrics)
                if self.critic_step is not None:
                    self.critic_state, critic_metrics = self.critic_step(self.critic_state, mini)
                    critic_metrics = jax.device_get(critic_metrics)
                    self.critic_guard.check(critic_metrics, step)
                    critic_records.append(critic_metrics)
        metrics = combine_updates(records)
        if critic_records:
            metrics.update(_rename(combine_updates(critic_records), "critic_"))
        metrics["train/updates"] = float(len(records))
        metrics["train/micro_batch_size"] = float(self.plan.micro_batch_size)
        metrics["train/micro_batches"] = float(self.plan.grad_accum_steps)
        # Micro-batches that ran per update, and the share of their token slots that held tokens.
        run = [s.micro_batches for s in packing] or [self.plan.grad_accum_steps] * len(records)
        metrics["train/micro_batches_run"] = float(np.mean(run))
        if packing:
            metrics["train/pack_fill"] = sum(s.tokens for s in packing) / max(sum(s.slots for s in packing), 1)
        return metrics

    def _mini_batch(self, batch: TrainBatch, rows: np.ndarray) -> tuple[TrainBatch, PackStats | None]:
        """The mini-batch of `batch`'s units `rows`, packed when the run packs (with what packing did), placed."""
        mini, stats = _rows(batch, rows), None
        if self.pack:
            mini, stats = pack_units(mini, num_micro=self.plan.grad_accum_steps, pad_id=self.pad_id)
            self.segment_bounds.check(mini.positions, mini.segment_ids)
        return self.train_step.place_batch(mini), stats

    def train(self, rollouts: Rollouts, rewards: np.ndarray, *, step: int, shuffle_seed: int) -> dict[str, float]:
        """RL step `step` on `rollouts`: layout, batch, updates; bumps the policy version.

        Args:
            rollouts: `N = train.global_batch_size` sampled rows (groups consecutive).
            rewards: `[N]` total rewards.
            step: the RL step (1-based).
            shuffle_seed: seeds the mini-batch shuffling of this step.

        Returns:
            `train/`, `loss/`, `rollout/` (mismatch, KL, ESS) and `perf/` metrics of the step.

        Raises:
            ValueError: the batch does not hold `train.global_batch_size` rows.
            NonFiniteError: too many consecutive skipped (non-finite) updates, or an update that wrote a
                non-finite state; at the run's last step (`train.steps`), every update of the run skipped (`finish`).
        """
        t0 = time.perf_counter()
        n = rollouts.prompt_ids.shape[0]
        if n != self.plan.global_batch_size:
            raise ValueError(
                f"step {step}: got {n} rollout rows, train.global_batch_size is {self.plan.global_batch_size}"
            )
        layout = self.layout(rollouts)
        batch, metrics = build_rl_batch(rollouts, np.asarray(rewards, np.float32), layout, self.passes(), self.settings)
        sample_tokens = float((layout.rows.segment_ids > 0).sum())
        prep_seconds = time.perf_counter() - t0
        t1, kernel_seconds = time.perf_counter(), system_cpu_seconds()
        metrics.update(self.update(batch, shuffle_seed=shuffle_seed, step=step))
        train_seconds = time.perf_counter() - t1
        kernel_seconds = system_cpu_seconds() - kernel_seconds
        if step == self.settings.steps:
            self.finish()
        self.policy_version += 1
        tokens = sample_tokens * self.settings.ppo_epochs
        metrics.update(
            {
                "train/policy_version": float(self.policy_version),
                "perf/train_prep_seconds": prep_seconds,
                "perf/train_update_seconds": train_seconds,
                # The process's CPU time in the kernel during the update (all its threads): mostly faulting in
                # memory it had not touched before. Then its peak resident memory so far.
                "perf/train_update_system_seconds": kernel_seconds,
                "perf/train_peak_rss_gib": peak_rss_gib(),
                "perf/train_tokens_per_second": tokens / max(train_seconds, 1e-9),
            }
        )
        metrics.update(self._compile_figures)  # the first update after a compile-ahead (`_wait_for_compile`)
        self._compile_figures = {}
        return metrics

    def finish(self) -> None:
        """Raises `NonFiniteError` when every update of the run was skipped, the policy's or the critic's.

        `train` calls it after the run's last step (`train.steps`); calling it again is harmless.
        """
        self.guard.finish()
        self.critic_guard.finish()

    def save(self, step: int, rng: np.ndarray, data_state: Any, *, force: bool) -> bool:
        """Checkpoints the policy (and critic) state after `step` with the driver's `rng` and `data_state`.

        Saves when `step` is a multiple of `checkpoint.every_steps` (or `force`); returns whether it did.
        """
        tree = {"policy": self.state}
        if self.critic_state is not None:
            tree["critic"] = self.critic_state
        progress = RunProgress(
            step=step,
            rng=jax.random.wrap_key_data(jnp.asarray(rng, jnp.uint32)),
            data_state=data_state,
            policy_version=self.policy_version,
            config=run_setup.config_dict(self.config),
        )
        return self.checkpointer.save(tree, progress, force=force)

    # Evaluation and shutdown -----------------------------------------------------------------------------------

    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out `eval/` metrics of the current policy (`config.eval`) with the native engine, samples in
        `eval_results_step<step>.json`: on the mesh, or, with several trainer processes, on process 0's devices
        with the params gathered from all (the other processes return no metrics)."""
        if self.evaluator is None:
            from feynrl_jax.train.sft_loop import generation_evaluation

            self.evaluator = generation_evaluation(
                self.config, self.model_config, self.tokenizer, param_shardings=self.train_step.state_shardings.params
            )
        return self.evaluator(self.state.params, step)

    def final_params(self) -> dict[str, Any]:
        """The policy params on host (tests compare them bitwise)."""
        return self.host_params()

    def close(self) -> None:
        """Waits for the last checkpoint, releases the evaluator's reward workers, and leaves a background compile
        still running to finish on its own (a run that failed before its first update)."""
        self.checkpointer.wait_until_finished()
        self.checkpointer.close()
        if self.evaluator is not None:
            self.evaluator.close()
        self._compiler.shutdown(wait=False, cancel_futures=True)
