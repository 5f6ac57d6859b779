"""The RL trainer: from scored rollouts to `ppo_epochs x mini_batches` optimizer updates, on the training mesh.

`RLTrainer` is plain Python (no Ray): `actors.TrainerActor` runs it in its own process. One `train` call is the
trainer's half of a sync RL step:

1. the ratio's denominator `old_logprobs`: with `train.recompute_old_logprobs`, the current policy's
   log-probabilities of the sampled tokens, else the engine's behaviour log-probabilities. With one update per
   step (`ppo_epochs = mini_batches = 1`) the update's own forward pass gives them (the params are still the
   pre-update ones), so no separate pass runs; with several updates a no-grad forward pass computes them first.
   Either way their mismatch with the engine's is measured (`rollout/logprob_mismatch_kl`, a k1 estimate of
   KL(behaviour || trainer) over completion tokens, `_k3` and `rollout/logprob_mismatch_max_abs`), with the
   policy's entropy;
2. the reference model's log-probabilities when the loss has a KL term (`kl_coef > 0`);
3. advantages with the algorithm's estimator: sequence estimators from the rewards and groups; PPO's GAE from
   per-token rewards (the sequence reward on the last token) and the critic's values;
4. `ppo_epochs` passes over the batch, each in `mini_batches` shuffled mini-batches (one optimizer update
   each); PPO updates its critic on the same mini-batches;
5. a checkpoint when due (train state, critic, data-iterator state, RNG, policy version).

Forward and backward passes run on the shared-prefix layout when it is cheaper (`train.shared_prefix`,
`feynrl_jax.train.shared_prefix`): one row per group, the prompt once and its `n` completions behind it, with the
same log-probabilities and gradients as one row per sample. Mini-batches then shuffle whole groups. Advantages,
GAE and the metrics are computed in the row layout either way.

Departure from some references: PPO advantages are not whitened (GAE on a 0/1 reward is already bounded), and
the critic is trained separately from the actor (the actor's loss runs with `vf_coef = 0`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import ConfigDict

from feynrl_jax.checkpoints.train_state import RunProgress, TrainCheckpointer
from feynrl_jax.config.derived import algorithm_hyperparameters, batch_plan
from feynrl_jax.losses import ALGORITHMS, TrainBatch, compute_metrics
from feynrl_jax.losses.advantages import gae
from feynrl_jax.models import ModelConfig
from feynrl_jax.rollout.types import FINISH_STOP, Rollouts
from feynrl_jax.sharding import batch_size_multiple
from feynrl_jax.train import run_setup
from feynrl_jax.train.critic import critic_params_shape, critic_values, init_critic_params, make_critic_train_step
from feynrl_jax.train.frozen_logprobs import make_logprob_fn
from feynrl_jax.train.nonfinite import NonFiniteGuard
from feynrl_jax.train.rl_batch import rollouts_to_batch, sequence_reward_at_last_token
from feynrl_jax.train.shared_prefix import SharedPrefixRows, cheaper_than_rows, shared_prefix_rows
from feynrl_jax.train.state import TrainState, create_train_state
from feynrl_jax.train.step import logprob_diagnostic_metrics, make_train_step
from feynrl_jax.train.supervised_loop import abstract_train_state

log = logging.getLogger(__name__)


def loss_hyperparameters(config: ConfigDict) -> dict[str, Any]:
    """The RL loss's keyword arguments from `config.algo`, with the run-dependent defaults filled in.

    Dr. GRPO's `seq_mean_token_sum` normaliser `max_tokens` becomes `rollout.max_new_tokens` unless set; a
    critic-based loss gets `vf_coef = 0` (the critic is trained by its own step).
    """
    algorithm = ALGORITHMS[config.algo.name]
    values = algorithm_hyperparameters(config, algorithm.hyperparameters)
    if values.get("loss_agg") == "seq_mean_token_sum" and "max_tokens" not in config.algo.hparams:
        values["max_tokens"] = float(config.rollout.max_new_tokens)
    if algorithm.needs_critic:
        values["vf_coef"] = 0.0
    return values


def uses_reference(config: ConfigDict) -> bool:
    """Whether the trainer runs the reference model.

    It does when the loss has an active KL-to-reference term (the effective `kl_coef > 0`, which needs
    `batch.ref_logprobs`), or when the algorithm is registered with a reference and `algo.reference` names one
    (then `train/kl_ref` is reported even without a penalty).
    """
    kl_coef = float(loss_hyperparameters(config).get("kl_coef", 0.0) or 0.0)
    registered = ALGORITHMS[config.algo.name].needs_reference and config.algo.reference != "none"
    return kl_coef > 0.0 or registered


_COUNTERS = ("/step", "_step", "nonfinite_streak", "nonfinite_total", "learning_rate")


def mean_of_updates(records: list[dict[str, float]]) -> dict[str, float]:
    """Combines per-update metrics over a step's updates: counters (step, non-finite counts, learning rate) take
    the last update's value, `*_max` keys the max, `*_min` the min, the rest the mean."""
    out: dict[str, float] = {}
    for key in records[0]:
        values = [r[key] for r in records if key in r]
        if key.endswith(_COUNTERS):
            out[key] = float(values[-1])
        elif key.endswith("_max"):
            out[key] = float(np.max(values))
        elif key.endswith("_min"):
            out[key] = float(np.min(values))
        else:
            out[key] = float(np.mean(values))
    return out


def _host(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(np.asarray(v)) for k, v in jax.device_get(metrics).items()}


def _rename(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    """`train/x` -> `train/<prefix>x`, `loss/x` -> `loss/<prefix>x` (the critic's metrics beside the actor's)."""
    return {f"{k.split('/', 1)[0]}/{prefix}{k.split('/', 1)[1]}": v for k, v in metrics.items()}


def _rows(batch: TrainBatch, rows: np.ndarray) -> TrainBatch:
    return jax.tree.map(lambda x: x[rows], batch)


def _shared_layout_batch(batch: TrainBatch, shared: SharedPrefixRows) -> TrainBatch:
    """A row-layout RL batch moved to the shared-prefix layout (every per-token field packed)."""
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
class Restored:
    """Where a (re)started run begins: `step` updates done, and the driver's state at that step.

    Attributes:
        step: RL steps completed.
        policy_version: version of the params now held (and published).
        rng: the driver's PRNG key data (`uint32` array) after `step` steps, or None for a fresh run.
        data_state: the prompt iterator's state after `step` steps, or None for a fresh run.
    """

    step: int
    policy_version: int
    rng: np.ndarray | None
    data_state: Any


class RLTrainer:
    """The trainer of a sync RL run: policy (and critic) state, reference model, checkpoints, evaluation.

    Args:
        config: a validated RL config (the trainer unpacks it here; nothing below sees it).
    """

    def __init__(self, config: ConfigDict):
        self.config = config
        self.algorithm = ALGORITHMS[config.algo.name]
        self.source = run_setup.resolve_model_source(config.model, config.run_dir)
        self.tokenizer = run_setup.load_run_tokenizer(self.source)
        self.model_config: ModelConfig = run_setup.model_config(config.model, self.source, self.tokenizer)
        self.mesh, self.rules = run_setup.build_mesh(config.mesh)
        self.plan = batch_plan(config)
        self.seq_len = config.data.max_seq_len
        self.pad_id = self.model_config.pad_token_id if self.model_config.pad_token_id is not None else 0
        self.temperature = config.rollout.temperature if config.rollout.temperature > 0 else 1.0
        self.recompute_old = config.train.recompute_old_logprobs
        self.total_updates = config.train.steps * config.train.ppo_epochs * config.train.mini_batches
        # One update per step: its own forward pass runs on the pre-update params, so it gives pi_old (and the
        # mismatch and entropy metrics) without a separate pass.
        self.separate_old_pass = self.recompute_old and config.train.ppo_epochs * config.train.mini_batches > 1
        self.prompt_width = config.data.max_prompt_len
        self.group_size = config.rollout.n_samples
        self.completion_width = self.group_size * config.rollout.max_new_tokens  # a group's completions, at most
        self.shared_prefix = self._choose_shared_prefix(config)
        first_column = self.prompt_width if self.shared_prefix else 1
        # Rows per forward pass: a micro-batch's samples, or its groups in the shared-prefix layout.
        chunk_rows = self.plan.micro_batch_size // (self.group_size if self.shared_prefix else 1)
        self.optimizer, schedule = run_setup.build_optimizer(config.optim, self.total_updates)
        self.train_step = make_train_step(
            self.algorithm.make_loss(**loss_hyperparameters(config)),
            self.optimizer,
            self.mesh,
            self.rules,
            config=self.model_config,
            grad_accum=self.plan.grad_accum_steps,
            with_entropy=self.algorithm.uses_entropy,
            temperature=self.temperature,
            logprob_first_column=first_column,
            old_logprobs_from_current=self.recompute_old and not self.separate_old_pass,
            logprob_diagnostics=not self.separate_old_pass,
            learning_rate_fn=schedule,
        )
        self.logprobs = make_logprob_fn(
            self.model_config,
            self.mesh,
            self.rules,
            chunk_rows=chunk_rows,
            temperature=self.temperature,
            with_entropy=True,
            first_column=first_column,
        )
        self.critic_step = None
        if self.algorithm.needs_critic:
            critic_optim = config.optim.copy_and_resolve_references()
            with critic_optim.unlocked():
                critic_optim.lr = config.algo.critic_lr
            self.critic_optimizer, _ = run_setup.build_optimizer(critic_optim, self.total_updates)
            value_clip = self.algorithm.hyperparameters.get("value_clip")
            self.critic_step = make_critic_train_step(
                self.model_config,
                self.critic_optimizer,
                self.mesh,
                self.rules,
                value_clip=value_clip,
                grad_accum=self.plan.grad_accum_steps,
            )
            self._values = jax.jit(functools.partial(critic_values, config=self.model_config))
        self.guard = NonFiniteGuard(config.optim.max_consecutive_nonfinite)
        self.checkpointer = TrainCheckpointer(
            config.run_dir,
            save_every=config.checkpoint.every_steps or config.train.steps,
            keep=config.checkpoint.keep,
            async_save=config.checkpoint.async_save,
        )
        self.state: TrainState | None = None
        self.critic_state: TrainState | None = None
        self.reference: Any = None
        self.policy_version = 0
        self.evaluator = None

    def _choose_shared_prefix(self, config: ConfigDict) -> bool:
        """Whether forward and backward passes run on the shared-prefix layout (`train.shared_prefix`).

        "off" never; "on" always (an error when the batch plan cannot keep groups whole); "auto" when groups
        stay whole and the layout costs fewer FLOPs (`cheaper_than_rows`).

        Raises:
            ValueError: naming `train.shared_prefix` when it is "on" but the layout cannot be used.
        """
        mode = config.train.shared_prefix
        if mode == "off":
            return False
        n, micro, shards = self.group_size, self.plan.micro_batch_size, batch_size_multiple(self.mesh)
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
            seq_len=self.seq_len,
            prompt_width=self.prompt_width,
            completion_width=self.completion_width,
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
            self.model_config, self.source, seed=self.config.seed, shardings=self.train_step.state_shardings.params
        )

    def _reference_params(self) -> Any:
        reference = self.config.algo.reference
        ref_source = run_setup.ModelSource(weights_dir=reference, tokenizer_dir=self.source.tokenizer_dir)
        ref_config = run_setup.model_config(self.config.model, ref_source, self.tokenizer)
        if ref_config != self.model_config:
            raise ValueError(f"config.algo.reference={reference!r} has another architecture than the policy")
        return run_setup.load_params(
            ref_config, ref_source, seed=self.config.seed, shardings=self.train_step.state_shardings.params
        )

    def _abstract_state(self) -> dict[str, Any]:
        tree = {"policy": abstract_train_state(self.train_step, self.optimizer, self.model_config)}
        if self.critic_step is not None:
            shapes = jax.eval_shape(
                lambda p: create_train_state(p, self.critic_optimizer), critic_params_shape(self.model_config)
            )
            tree["critic"] = jax.tree.map(
                lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                shapes,
                self.critic_step.state_shardings,
            )
        return tree

    def start(self) -> Restored:
        """Builds the state (fresh, or restored from the run folder's latest checkpoint).

        Raises:
            FileExistsError: the run folder holds checkpoints but `checkpoint.resume` is False.
        """
        latest = self.checkpointer.latest_step()
        if latest is not None and not self.config.checkpoint.resume:
            raise FileExistsError(
                f"run folder {self.config.run_dir} already holds checkpoints (latest step {latest}) and "
                "checkpoint.resume is False; pass --resume to continue it or choose another config.run_dir"
            )
        params = self._initial_params() if latest is None or self.config.algo.reference == "initial" else None
        if uses_reference(self.config):
            # A copy: the train step donates the state's buffers, which must not be the reference's.
            self.reference = (
                jax.tree.map(jnp.copy, params) if self.config.algo.reference == "initial" else self._reference_params()
            )
        if latest is None:
            if self.critic_step is not None:
                self.critic_state = self.critic_step.init_state(init_critic_params(params, self.model_config))
            self.state = self.train_step.init_state(params)
            self.policy_version = 0
            return Restored(step=0, policy_version=0, rng=None, data_state=None)
        tree, progress = self.checkpointer.restore(self._abstract_state())
        self.state = tree["policy"]
        self.critic_state = tree.get("critic")
        self.policy_version = progress.policy_version
        log.info(
            "resumed %s from step %d (policy version %d)", self.config.run_dir, progress.step, progress.policy_version
        )
        rng = np.asarray(jax.random.key_data(progress.rng), np.uint32)
        return Restored(progress.step, progress.policy_version, rng, progress.data_state)

    def host_params(self) -> dict[str, Any]:
        """The policy params fetched to host NumPy (what the parameter store publishes)."""
        return jax.device_get(self.state.params)

    # One RL step -----------------------------------------------------------------------------------------------

    def _advantages(self, rollouts: Rollouts, rewards: np.ndarray) -> np.ndarray:
        fn = self.algorithm.advantage_fn
        out = fn(
            jnp.asarray(rewards, jnp.float32), jnp.asarray(rollouts.group_id), jnp.asarray(rollouts.completion_mask)
        )
        return np.asarray(out, np.float32)

    def train(
        self,
        rollouts: Rollouts,
        rewards: np.ndarray,
        *,
        step: int,
        shuffle_seed: int,
        rng: np.ndarray,
        data_state: Any,
    ) -> dict[str, float]:
        """Runs the updates of RL step `step` on `rollouts`, bumps the policy version and checkpoints if due.

        Args:
            rollouts: `N = train.global_batch_size` sampled rows (groups consecutive).
            rewards: `[N]` total rewards.
            step: the RL step (1-based).
            shuffle_seed: seeds the mini-batch shuffling of this step.
            rng: the driver's PRNG key data after this step (saved in the checkpoint).
            data_state: the prompt iterator's state after this step (saved in the checkpoint).

        Returns:
            `train/`, `loss/`, `rollout/` (mismatch, KL) and `perf/` metrics of the step.
        """
        t0 = time.perf_counter()
        n = rollouts.prompt_ids.shape[0]
        if n != self.plan.global_batch_size:
            raise ValueError(
                f"step {step}: got {n} rollout rows, train.global_batch_size is {self.plan.global_batch_size}"
            )
        rewards = np.asarray(rewards, np.float32)
        batch = rollouts_to_batch(
            rollouts, np.zeros(rollouts.completion_mask.shape, np.float32), seq_len=self.seq_len, pad_id=self.pad_id
        )
        shared = None
        if self.shared_prefix:
            shared = shared_prefix_rows(
                rollouts,
                prompt_width=self.prompt_width,
                completion_width=self.completion_width,
                pad_id=self.pad_id,
            )
        # Forward passes run on the training layout; their per-token outputs come back to the row layout.
        inputs = shared if shared is not None else batch
        placed = [self.train_step.place_batch(x) for x in (inputs.tokens, inputs.positions, inputs.segment_ids)]
        to_rows = (
            (lambda x: np.asarray(x, np.float32))
            if shared is None
            else (lambda x: shared.unpack(np.asarray(x, np.float32), self.seq_len))
        )
        mask = batch.loss_mask
        metrics = {
            "rollout/old_logprobs_recomputed": float(self.recompute_old),
            "train/shared_prefix": float(shared is not None),
        }
        lp = entropy = None
        if self.separate_old_pass:
            lp, entropy = (to_rows(x) for x in self.logprobs(self.state.params, *placed))
        # With one update, the train step replaces `old` by its own log-probabilities when recomputing.
        old = lp * mask if lp is not None else batch.behavior_logprobs
        ref = None
        if self.reference is not None:
            ref = to_rows(self.logprobs(self.reference, *placed)[0]) * mask
        if lp is not None:
            # The same metrics the train step reports when its own pass gives pi_old.
            diagnostics = logprob_diagnostic_metrics(lp, entropy, dataclasses.replace(batch, ref_logprobs=ref))
            metrics.update(_host(compute_metrics(diagnostics)))
        values = returns = None
        if self.critic_step is not None:
            values = to_rows(self._values(self.critic_state.params, *placed)) * mask
            token_rewards = sequence_reward_at_last_token(rewards, rollouts, self.seq_len)
            done = jnp.asarray(rollouts.finish_reason == FINISH_STOP)
            adv, ret = gae(
                jnp.asarray(token_rewards),
                jnp.asarray(values),
                jnp.asarray(mask),
                done,
                gamma=self.config.algo.gae_gamma,
                lam=self.config.algo.gae_lambda,
            )
            advantages, returns = np.asarray(adv, np.float32), np.asarray(ret, np.float32)
            metrics["train/value_mean"] = float(values[mask > 0].mean()) if mask.any() else 0.0
        else:
            advantages = rollouts_to_batch(
                rollouts, self._advantages(rollouts, rewards), seq_len=self.seq_len, pad_id=self.pad_id
            ).advantages
        batch = dataclasses.replace(
            batch, advantages=advantages, old_logprobs=old, ref_logprobs=ref, values=values, returns=returns
        )
        valid_adv = advantages[mask > 0]
        metrics["train/advantage_mean"] = float(valid_adv.mean()) if valid_adv.size else 0.0
        metrics["train/advantage_abs_mean"] = float(np.abs(valid_adv).mean()) if valid_adv.size else 0.0
        sample_tokens = float((batch.segment_ids > 0).sum())
        if shared is not None:
            batch = _shared_layout_batch(batch, shared)
        prep_seconds = time.perf_counter() - t0

        t1 = time.perf_counter()
        order = np.random.default_rng(shuffle_seed)
        units = batch.tokens.shape[0]  # samples, or groups in the shared-prefix layout
        size = units // self.config.train.mini_batches
        records, critic_records = [], []
        for _ in range(self.config.train.ppo_epochs):
            perm = order.permutation(units)
            for m in range(self.config.train.mini_batches):
                mini = self.train_step.place_batch(_rows(batch, perm[m * size : (m + 1) * size]))
                self.state, update_metrics = self.train_step(self.state, mini)
                update_metrics = _host(update_metrics)
                self.guard.check(update_metrics, step)
                records.append(update_metrics)
                if self.critic_step is not None:
                    self.critic_state, critic_metrics = self.critic_step(self.critic_state, mini)
                    critic_records.append(_rename(_host(critic_metrics), "critic_"))
        train_seconds = time.perf_counter() - t1
        metrics.update(mean_of_updates(records))
        if critic_records:
            metrics.update(mean_of_updates(critic_records))
        self.policy_version += 1
        tokens = sample_tokens * self.config.train.ppo_epochs
        metrics.update(
            {
                "train/policy_version": float(self.policy_version),
                "train/updates": float(len(records)),
                "perf/train_prep_seconds": prep_seconds,
                "perf/train_update_seconds": train_seconds,
                "perf/train_tokens_per_second": tokens / max(train_seconds, 1e-9),
            }
        )
        self._save(step, rng, data_state, force=step == self.config.train.steps)
        return metrics

    def _save(self, step: int, rng: np.ndarray, data_state: Any, *, force: bool) -> None:
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
        self.checkpointer.save(tree, progress, force=force)

    # Evaluation and shutdown -----------------------------------------------------------------------------------

    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out `eval/` metrics of the current policy (`config.eval`), with the native engine on the mesh."""
        if self.evaluator is None:
            from feynrl_jax.eval.evaluate import evaluator_from_config
            from feynrl_jax.train.sft_loop import train_prompts

            self.evaluator = evaluator_from_config(
                self.config,
                self.model_config,
                None,
                self.tokenizer,
                param_shardings=self.train_step.state_shardings.params,
                exclude_prompts=train_prompts(self.config),
            )
            kwargs = dict(self.config.eval.reward_kwargs)
            if kwargs:
                # evaluator_from_config does not take reward keyword arguments (yet): rebuild its scorer with them.
                from feynrl_jax.rollout.rewards import RewardScorer

                self.evaluator.scorer.close()
                self.evaluator.scorer = RewardScorer(
                    {self.config.eval.reward: 1.0}, reward_kwargs={self.config.eval.reward: kwargs}, num_workers=1
                )
        return self.evaluator(self.state.params, step)

    def final_params(self) -> dict[str, Any]:
        """The policy params on host (tests compare them bitwise)."""
        return self.host_params()

    def close(self) -> None:
        """Waits for the last checkpoint and releases the evaluator's reward workers."""
        self.checkpointer.wait_until_finished()
        self.checkpointer.close()
        if self.evaluator is not None:
            self.evaluator.close()
