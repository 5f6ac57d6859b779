"""The train step: one ``jax.jit`` over the mesh, with donated state and explicit in/out shardings.

``make_train_step`` builds ``step(state, batch) -> (state, metrics)`` from two parts the caller composes:
``predict(params, batch) -> (per_token [B, T], entropy [B, T] or None)`` (the policy's log-probabilities,
``model_logprob_fn``; the critic's values) and the loss (``loss(per_token, batch, *, entropy=None, **hp)``,
possibly wrapped by ``feynrl_jax.train.loss_parts``). The params' logical axes, shapes and dtypes come as a
``ParamsSpec`` (``ParamsSpec.of_model(config)`` for a model config); its dtypes are the train state's.

Mixed precision (docs/DTYPES.md): with ``ParamsSpec.of_model(config).with_master_dtype("float32")`` the state holds
float32 master params and a float32 optimizer state while ``predict`` (the model) rounds them to the model's
``param_dtype`` (``feynrl_jax.models.as_param_dtype``) and computes in its ``compute_dtype``: the gradient of the
bfloat16 forward pass is applied to the float32 masters, so updates smaller than a bfloat16 ulp accumulate.

1. the batch ``[B, T]`` is dealt into ``grad_accum`` micro-batches (``microbatch.split_microbatches``);
2. ``lax.scan`` over them runs ``predict`` (cast to float32), calls the loss (with ``entropy=`` when predict
   returned one), and accumulates the gradient of the loss's ``total`` together with its ``denom``. Where
   ``predict`` takes a sink (``model_logprob_fn`` under rematerialisation "full", the CPU's default in bfloat16;
   float32 defaults to "dots" there, which takes none) and every param trains in float32, the model adds the layers'
   gradient into the accumulator in place during its backward pass (``models.forward``'s ``grad_sink``), as PyTorch
   adds into ``.grad``: no second buffer of the layers' size (a SmolLM2-135M GRPO step of 4 micro-batches: 1.00 GiB
   of temporaries instead of 1.25, ``benchmarks/bench_grad_sink.py``);
3. the summed gradient is divided by the summed denominator, so any number of micro-batches gives the
   gradient of one large batch (the losses return ``(total, denom)``, not means; Tunix's ``WeightedMetric``);
4. the optimizer is applied; when the gradient norm or the loss is not finite, or (``check_updated``, the
   default) the updated params or optimizer state are not (``nonfinite.all_finite``, one fused reduction per leaf),
   the update is skipped instead: params and optimizer state unchanged, the counters in ``TrainState`` incremented
   (``nonfinite.NonFiniteGuard`` reads them on the host). Testing the updated state keeps it beside the old one
   until the choice is made. An optimizer that cannot turn a finite gradient, params and state into non-finite
   ones (``optimizer.make_optimizer``'s AdamW, which the runs use) needs the first test only
   (``check_updated=False``): the update then runs under a ``lax.cond`` on it, and XLA writes it into the donated
   state's buffers (``donate``; a SmolLM2-135M GRPO step of 4 micro-batches held 1.25 GiB of temporaries instead of
   1.75, and 1.00 since the layers' gradient is accumulated in place, ``benchmarks/bench_update_guard.py``). The
   written state is still read once for NaN and infinities (``train/nonfinite_state``, 1 when an applied update left
   any): should an update break that promise, ``NonFiniteGuard`` stops the run at once, before the state is saved.

Frozen params (``ParamsSpec.trainable``; the base weights under LoRA): the step differentiates and updates only the
trained leaves, the optimizer state holds only theirs, and the frozen ones enter the jitted program as a separate
argument that is not donated, so they keep their buffers from step to step.

Shardings: params by the logical axes and the rules table; the optimizer state by the params' (matched by tree
structure); batches over ``("data", "fsdp")`` on ``B``; metrics replicated. XLA's SPMD partitioner inserts the
all-gathers and reduce-scatters of FSDP and the collectives of tensor parallelism.

Metrics: a ``{name: Metric}`` dict, one update's, typed by how several updates combine
(``feynrl_jax.losses.metrics.combine_updates``): the loss's own (``loss/...``, combined exactly across
micro-batches; each "mean" then reported as its value with weight 1, so a step's updates count equally; "max" /
"min" as they are), ``train/loss``, ``train/loss_denom``, ``train/grad_norm`` (before clipping) and
``train/update_skipped`` ("mean", weight 1); ``train/nonfinite_state`` ("max"); ``train/nonfinite_streak``,
``train/nonfinite_total``, ``train/step`` and, given a schedule, ``train/learning_rate`` ("last").
``compute_metrics`` reads the values.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from feynrl_jax.losses import Algorithm, LossSum, TrainBatch, combine_metrics
from feynrl_jax.losses.metrics import Metric, last_metric, max_metric, scalar_metric
from feynrl_jax.models import (
    ModelConfig,
    SegmentBounds,
    init_params,
    logical_axes,
    lora,
    sequence_logprobs,
    sinks_layer_grads,
)
from feynrl_jax.models.logprobs import CHUNK_SIZE, CHUNK_TOKENS
from feynrl_jax.sharding import (
    batch_size_multiple,
    optimizer_state_shardings,
    param_shardings,
    place_batch,
    place_tree,
    replicated,
)
from feynrl_jax.sharding.rules import Rules, batch_pspec
from feynrl_jax.train.microbatch import check_divisible, split_microbatches
from feynrl_jax.train.nonfinite import all_finite
from feynrl_jax.train.state import TrainState, create_train_state

Predict = Callable[..., tuple[jax.Array, jax.Array | None]]
"""``(params, batch) -> (per_token [B, T] f32, entropy [B, T] f32 or None)``: what the loss is a function of. A
train step with ``rng_seed`` calls it as ``predict(params, batch, rng=key)`` (LoRA dropout)."""


@dataclasses.dataclass(frozen=True)
class ParamsSpec:
    """The params' logical axes, shapes and dtypes, and which of them train: what the step needs to shard and hold
    params and optimizer state.

    Attributes:
        logical_axes: pytree of logical-axis tuples (``feynrl_jax.models.logical_axes``), like the params.
        shape: pytree of ``jax.ShapeDtypeStruct`` (or arrays), like the params; their dtypes are the train state's.
        trainable: ``key path -> bool`` for the leaves the step trains (the params must then be nested dicts), or
            None: every leaf. The others are frozen: held in the state and passed to ``predict``, never
            differentiated, never in the optimizer state (LoRA: ``feynrl_jax.models.lora.is_adapter_path``).
    """

    logical_axes: Any
    shape: Any
    trainable: Callable[[tuple[Any, ...]], bool] | None = None

    @classmethod
    def of_model(cls, config: ModelConfig) -> ParamsSpec:
        """The spec of ``init_params(config, key)`` (shapes by ``jax.eval_shape``: nothing is allocated); with LoRA
        adapters (``config.lora_rank``) only they train."""
        shape = jax.eval_shape(functools.partial(init_params, config), jax.random.key(0))
        return cls(logical_axes(config), shape, lora.is_adapter_path if config.lora_rank else None)

    def with_master_dtype(self, dtype: str | None) -> ParamsSpec:
        """The spec of a state holding master weights: every trained floating leaf widened to at least ``dtype``.

        Each trained leaf takes ``jnp.promote_types(leaf dtype, dtype)``: ``"float32"`` makes bfloat16 leaves
        float32 and leaves float32 ones (a critic's value head) as they are. Frozen leaves keep their dtype (they
        take no update to accumulate). The optimizer state follows the params' dtypes.

        Args:
            dtype: the master dtype (``model.master_dtype``), or None: this spec unchanged.
        """
        if dtype is None:
            return self
        master = jnp.dtype(dtype)

        def widen(path: tuple[Any, ...], leaf: Any) -> jax.ShapeDtypeStruct:
            frozen = self.trainable is not None and not self.trainable(path)
            if frozen or not jnp.issubdtype(leaf.dtype, jnp.floating):
                return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
            return jax.ShapeDtypeStruct(leaf.shape, jnp.promote_types(leaf.dtype, master))

        return dataclasses.replace(self, shape=jax.tree_util.tree_map_with_path(widen, self.shape))

    def split(self, tree: Any) -> tuple[Any, Any]:
        """``(frozen, trained)`` parts of a params-shaped nested dict (no copy; ``({}, tree)`` when everything
        trains)."""
        if self.trainable is None:
            return {}, tree
        return lora.partition(tree, self.trainable)

    def trained(self, tree: Any) -> Any:
        """The trained part of a params-shaped tree (``tree`` itself when everything trains)."""
        return self.split(tree)[1]


def mesh_chunk_tokens(mesh: Mesh) -> int:
    """The token-slot cap of a logit chunk (``models.logprobs.chunk_positions``) for a batch whose rows are split over
    ``mesh``'s batch shards: ``CHUNK_TOKENS`` slots on each shard, ``data x fsdp`` times that in all."""
    return CHUNK_TOKENS * batch_size_multiple(mesh)


def model_logprob_fn(
    config: ModelConfig,
    *,
    temperature: float = 1.0,
    chunk_size: int = CHUNK_SIZE,
    chunk_tokens: int = CHUNK_TOKENS,
    remat: str | None = None,
    first_column: int = 1,
    with_entropy: bool = False,
    segment_bounds: SegmentBounds | None = None,
) -> Predict:
    """The policy's log-probabilities of ``batch.tokens`` under ``config``'s model (contract alignment).

    Args:
        config: the model config.
        temperature: the sampling temperature the rollouts used (logits are divided by it).
        chunk_size: the most sequence positions per chunk of the output projection (bounds the ``[B, T, V]``
            logits).
        chunk_tokens: the most token slots (rows x positions) per chunk, all batch shards together: a step whose
            rows are split over a mesh's batch shards passes ``mesh_chunk_tokens(mesh)``.
        remat: rematerialisation policy for the layers ("none", "full", "dots"; None: ``config.remat``).
        first_column: no token before this column is scored (the shared-prefix layout's prompt width).
        with_entropy: also return the entropy of each predictive distribution (else None); the step then passes
            it to the loss as ``entropy=``.
        segment_bounds: static bounds on the batches' segments (``models.SegmentBounds``: attention in blocks
            where that is cheaper), or None.

    Returns:
        A ``Predict``: ``(params, batch, rng=None, grad_sink=None) -> (logprobs [B, T] f32, entropy [B, T] f32 or
        None)``; ``rng`` is the LoRA dropout key of a training pass (``config.lora_dropout``; ``make_train_step``'s
        ``rng_seed``), ``grad_sink`` the accumulator the layers' gradient is added into (``models.forward``). Its
        attribute ``layer_sink`` (``("layers",)``, or None) says whether it takes one (``layer_sink_path``).
    """

    def predict(
        params: Any, batch: TrainBatch, rng: jax.Array | None = None, grad_sink: Any | None = None
    ) -> tuple[jax.Array, jax.Array | None]:
        return sequence_logprobs(
            params,
            batch.tokens,
            batch.positions,
            config=config,
            segment_ids=batch.segment_ids,
            temperature=temperature,
            with_entropy=with_entropy,
            chunk_size=chunk_size,
            chunk_tokens=chunk_tokens,
            remat=remat,
            first_column=first_column,
            dropout_rng=rng,
            segment_bounds=segment_bounds,
            grad_sink=grad_sink,
        )

    predict.layer_sink = layer_sink_path(config, remat, ("layers",))
    return predict


def layer_sink_path(config: ModelConfig, remat: str | None, path: tuple[str, ...]) -> tuple[str, ...] | None:
    """The mark a ``Predict`` carries as its attribute ``layer_sink``: ``path``, the keys from the params it is
    given to the model's stacked layers, where it passes ``grad_sink=`` on to ``models.forward`` for them; None where
    the model cannot take a sink (``models.sinks_layer_grads``).

    ``make_train_step`` uses the mark only where the layers train in float32: float32 params, or bfloat16 compute
    from float32 masters (each layer cast inside the sink's scan). Measured on a SmolLM2-135M-shaped step
    (benchmarks/bench_grad_sink.py, 4 micro-batches, 2-core CPU): float32 0.80x the temporaries at 1.01x the time;
    bfloat16 from float32 masters 0.64x the temporaries at 0.89x the time.
    """
    return tuple(path) if sinks_layer_grads(config, remat) else None


def _subtree(tree: Any, path: tuple[str, ...]) -> Any:
    """``tree[path[0]][path[1]]...``, or None where a key is missing."""
    for key in path:
        if not isinstance(tree, Mapping) or key not in tree:
            return None
        tree = tree[key]
    return tree


def _with_subtree(tree: Mapping, path: tuple[str, ...], value: Any) -> dict:
    """A copy of the nested dict ``tree`` with ``value`` at ``path``."""
    head, *rest = path
    return {**tree, head: _with_subtree(tree[head], tuple(rest), value) if rest else value}


@dataclasses.dataclass(frozen=True)
class TrainStep:
    """A compiled-on-first-call train step and the shardings it runs with.

    Call it as ``state, metrics = train_step(state, batch)``; ``state`` is donated (do not reuse the argument).

    Attributes:
        mesh: the device mesh.
        state_shardings: ``TrainState`` of ``NamedSharding``.
        abstract_state: ``TrainState`` of ``jax.ShapeDtypeStruct`` with its shardings: the state's shapes and
            dtypes (float32 masters and optimizer state under ``ParamsSpec.with_master_dtype``), the target a
            checkpoint is restored into.
        grad_accum: the number of micro-batches per step.
        rows_per_example: rows kept together in one micro-batch (2 for DPO pairs).
        params_spec: the params' spec: which leaves train (``ParamsSpec.trainable``).
        check_updated: whether an update is also skipped for non-finite new params or optimizer state
            (``make_train_step``).
        sinks_layer_grads: whether the model adds each micro-batch's layer gradients into the accumulator in place
            (``models.forward``'s ``grad_sink``): several micro-batches, a ``predict`` that takes a sink (its
            ``layer_sink``: ``model_logprob_fn``'s or the critic's, with rematerialisation "full"), every param
            trained, and the layers there held in float32 (float32 params, or float32 masters of a bfloat16 model).
    """

    mesh: Mesh
    state_shardings: TrainState
    abstract_state: TrainState
    grad_accum: int
    rows_per_example: int
    params_spec: ParamsSpec
    check_updated: bool
    sinks_layer_grads: bool
    _jitted: Callable[[TrainState, Any, TrainBatch], tuple[TrainState, dict[str, Metric]]]
    _init: Callable[[Any], TrainState]
    _traces: list[int]

    def __call__(self, state: TrainState, batch: TrainBatch) -> tuple[TrainState, dict[str, Metric]]:
        check_divisible(batch.tokens.shape[0], self.grad_accum, self.rows_per_example, batch_size_multiple(self.mesh))
        trained, frozen = self._arguments(state)
        new_state, metrics = self._jitted(trained, frozen, batch)
        return dataclasses.replace(new_state, params=lora.union(frozen, new_state.params)), metrics

    def _arguments(self, state: TrainState) -> tuple[TrainState, Any]:
        """``(state with the trained params alone, the frozen params)``: the jitted step's first two arguments.

        Frozen params (a LoRA base) go in as their own argument, never donated: the arrays stay the same across
        steps, so a view of them (the reference model, ``lora.base_params(state.params)``) stays valid.
        """
        frozen, trained = self.params_spec.split(state.params)
        return dataclasses.replace(state, params=trained), frozen

    def compile(self, state: TrainState, batch: TrainBatch) -> jax.stages.Compiled:
        """Compiles the step for ``state`` and ``batch`` (their shapes, dtypes and shardings) ahead of its first call.

        The compiled program lands in the jit's cache: the first call with arrays like these runs it without
        tracing or compiling again. Nothing runs and nothing is donated, so the trainer can compile in a thread of
        its own while it does other work (`RLTrainer.start`).

        Returns:
            The compiled program (``memory_analysis()`` gives the sizes of its buffers).
        """
        return self._jitted.lower(*self._arguments(state), batch).compile()

    @property
    def trace_count(self) -> int:
        """How many times the step function has been traced (one per new batch shape or dtype)."""
        return self._traces[0]

    def init_state(self, params: Any) -> TrainState:
        """Places ``params`` on the mesh and builds the optimizer state there (never unsharded on one device).

        Args:
            params: host or device params (identical on every process), in any float dtype: the state holds them
                in the spec's dtypes (bfloat16 params become float32 masters under ``with_master_dtype``).

        Returns:
            The sharded ``TrainState`` with zero counters.
        """
        return self._init(place_tree(params, self.state_shardings.params))

    def place_batch(self, batch: TrainBatch) -> TrainBatch:
        """Places a global batch (held in full by every process) with rows over ``("data", "fsdp")``."""
        return place_batch(batch, self.mesh)


def _constrain_batch(batch: TrainBatch, mesh: Mesh) -> TrainBatch:
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, batch_pspec(x.ndim))), batch)


def _fold_metrics(stacked: dict[str, Any], num: int) -> dict[str, Any]:
    folded = jax.tree.map(lambda x: x[0], stacked)
    for m in range(1, num):
        folded = combine_metrics(folded, jax.tree.map(lambda x, m=m: x[m], stacked))
    return folded


def _neutral(metric: Any) -> Metric:
    """A metric that leaves any other unchanged when combined with it (weight 0; the extreme's identity)."""
    fill = {"max": -jnp.inf, "min": jnp.inf}.get(metric.reduce, 0.0)
    return Metric(jnp.full(metric.total.shape, fill, metric.total.dtype), jnp.zeros_like(metric.weight), metric.reduce)


def _padding_alone(run: Callable[[Any], Any], acc: Any) -> Any:
    """What ``run(acc)`` (a micro-batch's ``(accumulated gradients, total, denom, metrics)``) returns for a micro-batch
    of padding alone: the accumulator as it is, zero total and denominator, and neutral metrics (``_neutral``),
    without running it."""
    _, total, denom, metrics = jax.eval_shape(run, acc)
    zeros = lambda x: jnp.zeros(x.shape, x.dtype)  # noqa: E731
    return acc, zeros(total), zeros(denom), {name: _neutral(m) for name, m in metrics.items()}


def _per_update(metric: Metric) -> Metric:
    """A mean as its value with weight 1 (a step's updates count equally); max, min and last as they are."""
    return scalar_metric(metric.value, 1.0) if metric.reduce == "mean" else metric


def make_train_step(
    loss_fn: Callable[..., tuple[LossSum, dict[str, Metric]]],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    rules: Rules,
    *,
    predict: Predict,
    params_spec: ParamsSpec,
    grad_accum: int = 1,
    rows_per_example: int = 1,
    learning_rate_fn: optax.Schedule | None = None,
    donate: bool = True,
    compiler_options: Mapping[str, Any] | None = None,
    rng_seed: int | None = None,
    check_updated: bool = True,
) -> TrainStep:
    """Builds the jitted train step from its parts.

    Args:
        loss_fn: a loss with the contract signature ``loss(per_token [B, T], batch, *, entropy=None) ->
            (LossSum, metrics)``, hyperparameters bound (e.g. ``ALGORITHMS[name].make_loss(...)``), possibly
            wrapped by ``feynrl_jax.train.loss_parts`` (``old_logprobs_from_current``,
            ``with_logprob_diagnostics``).
        optimizer: an optax optimizer (e.g. from ``feynrl_jax.train.optimizer.make_optimizer``).
        mesh: the device mesh (``feynrl_jax.sharding.make_mesh``).
        rules: a rules table (``feynrl_jax.sharding.RULES[...]``).
        predict: ``(params, batch) -> (per_token [B, T], entropy [B, T] or None)``: the policy's
            log-probabilities (``model_logprob_fn``) or another per-token prediction (the critic's values). The
            loss gets ``entropy=`` only when predict returns one. It is called with ``rng=`` given ``rng_seed``,
            and with ``grad_sink=`` (the accumulator of ``params[path]``) when its attribute ``layer_sink`` is such a
            path (``layer_sink_path``: ``model_logprob_fn``'s and the critic's predictions).
        params_spec: the params' logical axes, shapes and dtypes (``ParamsSpec.of_model(config)`` for a model
            config; ``.with_master_dtype("float32")`` for float32 master weights): the dtypes of the state's params
            and optimizer state. ``predict`` sees the state's params and casts them as it needs.
        grad_accum: micro-batches per step; ``B`` must be a multiple of
            ``grad_accum * rows_per_example * data * fsdp``.
        rows_per_example: consecutive rows that form one example and stay in one micro-batch (2 for DPO).
        learning_rate_fn: the optimizer's schedule, to report ``train/learning_rate``.
        donate: donate the input state's buffers to the output (halves peak memory; the input is consumed).
        compiler_options: XLA options for this program (e.g. ``{"xla_backend_optimization_level": 0}`` to
            compile tiny CPU test models fast, or GPU scheduler flags).
        rng_seed: when set, ``predict`` is called with ``rng=``: a key folded from ``(rng_seed, state.step,
            micro-batch index)`` (LoRA dropout, ``model_logprob_fn``). It depends on nothing else, so a resumed run
            draws the masks the uninterrupted run drew, and the micro-batches of one step draw different ones.
        check_updated: skip an update whose new params or optimizer state are not finite, besides one whose
            gradient norm or loss is not (a NaN learning rate of a user's optimizer gives NaN weights from a
            finite gradient). False for an optimizer that maps a finite gradient, params and state to finite ones
            (``make_optimizer``'s): the update is then chosen before it is computed and written in place, which
            saves temporary memory about the size of the trained params (module docstring).

    Returns:
        A ``TrainStep``: call it as ``state, metrics = step(state, batch)`` (``metrics``: ``{name: Metric}``, see
        the module docstring); ``step.init_state(params)`` makes the sharded initial state.

    Raises:
        ValueError: when ``grad_accum`` or ``rows_per_example`` is not positive.
    """
    if grad_accum < 1:
        raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
    if rows_per_example < 1:
        raise ValueError(f"rows_per_example must be >= 1, got {rows_per_example}")
    params_logical_axes, params_shape = params_spec.logical_axes, params_spec.shape

    p_shardings = param_shardings(params_logical_axes, mesh, rules, shapes=params_shape)
    rep = replicated(mesh)
    trained_shape, trained_shardings = params_spec.trained(params_shape), params_spec.trained(p_shardings)
    state_shardings = TrainState(
        params=p_shardings,
        opt_state=optimizer_state_shardings(optimizer.init, trained_shape, trained_shardings, mesh),
        step=rep,
        nonfinite_streak=rep,
        nonfinite_total=rep,
    )
    traces = [0]

    # Accumulating micro-batches, the model adds the layers' gradient into the accumulator in place (`grad_sink`,
    # `models.forward`) instead of returning a stack of its own to be added afterwards: one buffer of the layers'
    # size instead of two. Where every param trains in float32, the accumulator's dtype. The accumulator comes back
    # through the model's backward pass, which JAX skips only for a loss that does not depend on the model's output
    # at all; every micro-batch's gradient, and so the sum it would drop, is then zero.
    sink_path = getattr(predict, "layer_sink", None)
    sunk_shape = _subtree(params_shape, sink_path) if grad_accum > 1 and sink_path else None
    sink = (
        sunk_shape is not None
        and params_spec.trainable is None
        and all(jnp.dtype(x.dtype) == jnp.float32 for x in jax.tree.leaves(sunk_shape))
    )

    def micro_loss(
        trained: Any, frozen: Any, micro: TrainBatch, rng: jax.Array | None, layer_sink: Any | None
    ) -> tuple[jax.Array, tuple[jax.Array, dict[str, Any]]]:
        params = lora.union(frozen, trained)
        options = {} if rng is None else {"rng": rng}
        if layer_sink is not None:
            options["grad_sink"] = layer_sink
        per_token, entropy = predict(params, micro, **options)
        extra = {} if entropy is None else {"entropy": entropy}
        loss_sum, metrics = loss_fn(per_token.astype(jnp.float32), micro, **extra)
        return loss_sum.total, (loss_sum.denom, metrics)

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def micro_rng(step: jax.Array, index: int | jax.Array) -> jax.Array | None:
        if rng_seed is None:
            return None
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(rng_seed), step), index)

    def micro_grads(
        params: Any, frozen: Any, micro: TrainBatch, rng: jax.Array | None, acc: Any | None = None
    ) -> tuple[Any, jax.Array, jax.Array, dict[str, Any]]:
        """A micro-batch's gradient, or with ``acc`` (an accumulator) the sum of the two."""
        layer_sink = _subtree(acc, sink_path) if acc is not None and sink else None
        (total, (denom, metrics)), grads = grad_fn(params, frozen, _constrain_batch(micro, mesh), rng, layer_sink)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        if acc is not None:  # the layers' part already holds the accumulator (`grad_sink`)
            summed = jax.tree.map(jnp.add, acc, grads)
            grads = summed if layer_sink is None else _with_subtree(summed, sink_path, _subtree(grads, sink_path))
        grads = jax.lax.with_sharding_constraint(grads, trained_shardings)
        return grads, total.astype(jnp.float32), denom.astype(jnp.float32), metrics

    def step(state: TrainState, frozen: Any, batch: TrainBatch) -> tuple[TrainState, dict[str, Metric]]:
        """One update; ``state.params`` is the trained part alone (differentiated), ``frozen`` the rest."""
        traces[0] += 1
        params = state.params
        if grad_accum == 1:
            grads, total, denom, metrics = micro_grads(params, frozen, batch, micro_rng(state.step, 0))
        else:
            micro = split_microbatches(batch, grad_accum, rows_per_example)

            def body(carry, one):
                g_acc, t_acc, d_acc = carry
                one, index = one
                rng = micro_rng(state.step, index)
                run = lambda acc: micro_grads(params, frozen, one, rng, acc)  # noqa: E731
                # A micro-batch of padding alone (the tail of a packed mini-batch, `packed_units`) is skipped:
                # `lax.cond` runs one branch, so it costs no forward or backward pass.
                skip = functools.partial(_padding_alone, run)
                g_acc, t, d, m = jax.lax.cond(jnp.any(one.segment_ids != 0), run, skip, g_acc)
                g_acc = jax.lax.with_sharding_constraint(g_acc, trained_shardings)
                return (g_acc, t_acc + t, d_acc + d), m

            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
            zeros = jax.lax.with_sharding_constraint(zeros, trained_shardings)
            init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
            (grads, total, denom), stacked = jax.lax.scan(body, init, (micro, jnp.arange(grad_accum)))
            metrics = _fold_metrics(stacked, grad_accum)

        safe_denom = jnp.where(denom != 0, denom, 1.0)
        grads = jax.tree.map(lambda g: g / safe_denom, grads)
        loss = jnp.where(denom != 0, total / safe_denom, 0.0)
        grad_norm = optax.tree.norm(grads)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)

        def updated(operand):
            grads, opt_state, params = operand
            updates, new_opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), new_opt_state

        finite = jnp.isfinite(grad_norm) & jnp.isfinite(loss)
        if check_updated:
            new_params, new_opt_state = updated((grads, state.opt_state, params))
            # A finite gradient can still give non-finite weights (a NaN learning rate, an overflowing update).
            finite = finite & all_finite(new_params, new_opt_state)
            keep = lambda new, old: jnp.where(finite, new, old)
            new_params = jax.tree.map(keep, new_params, params)
            new_opt_state = jax.tree.map(keep, new_opt_state, state.opt_state)
            nonfinite_state = jnp.zeros((), jnp.float32)  # no non-finite update is kept
        else:
            # Chosen first, the update can overwrite the old state: the skipping branch returns it untouched.
            new_params, new_opt_state = jax.lax.cond(
                finite, updated, lambda operand: (operand[2], operand[1]), (grads, state.opt_state, params)
            )
            # Read once the update is written (no copy of it): 1 only if an applied update broke the optimizer's
            # promise.
            nonfinite_state = (finite & ~all_finite(new_params, new_opt_state)).astype(jnp.float32)
        streak = jnp.where(finite, 0, state.nonfinite_streak + 1).astype(jnp.int32)
        new_state = TrainState(
            params=new_params,
            opt_state=new_opt_state,
            step=state.step + finite.astype(jnp.int32),
            nonfinite_streak=streak,
            nonfinite_total=state.nonfinite_total + (~finite).astype(jnp.int32),
        )
        out = {name: _per_update(m) for name, m in metrics.items()}
        out.update(
            {
                "train/loss": scalar_metric(loss, 1.0),
                "train/loss_denom": scalar_metric(denom, 1.0),
                "train/grad_norm": scalar_metric(grad_norm, 1.0),
                "train/update_skipped": scalar_metric((~finite).astype(jnp.float32), 1.0),
                "train/nonfinite_state": max_metric(nonfinite_state, jnp.ones(())),
                "train/nonfinite_streak": last_metric(new_state.nonfinite_streak),
                "train/nonfinite_total": last_metric(new_state.nonfinite_total),
                "train/step": last_metric(new_state.step),
            }
        )
        if learning_rate_fn is not None:
            out["train/learning_rate"] = last_metric(jnp.asarray(learning_rate_fn(state.step), jnp.float32))
        return new_state, out

    batch_in = NamedSharding(mesh, batch_pspec(1))
    options = dict(compiler_options) if compiler_options else None
    frozen_shardings = params_spec.split(p_shardings)[0]
    trained_state_shardings = dataclasses.replace(state_shardings, params=trained_shardings)
    jitted = jax.jit(
        step,
        in_shardings=(trained_state_shardings, frozen_shardings, batch_in),
        out_shardings=(trained_state_shardings, rep),
        donate_argnums=(0,) if donate else (),
        compiler_options=options,
    )

    def init_state(params: Any) -> TrainState:
        params = jax.tree.map(lambda p, s: p.astype(s.dtype), params, params_shape)
        return create_train_state(params, optimizer, trained=params_spec.trained(params))

    init = jax.jit(init_state, in_shardings=(p_shardings,), out_shardings=state_shardings, compiler_options=options)
    abstract_state = jax.tree.map(
        lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
        jax.eval_shape(init_state, params_shape),
        state_shardings,
    )
    return TrainStep(
        mesh,
        state_shardings,
        abstract_state,
        grad_accum,
        rows_per_example,
        params_spec,
        check_updated,
        sink,
        jitted,
        init,
        traces,
    )


def make_algorithm_train_step(
    algorithm: Algorithm,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    rules: Rules,
    *,
    config: ModelConfig,
    hyperparameters: Mapping[str, Any] | None = None,
    logprob_chunk_size: int = CHUNK_SIZE,
    remat: str | None = None,
    params_spec: ParamsSpec | None = None,
    **kwargs: Any,
) -> TrainStep:
    """``make_train_step`` for an ``Algorithm`` of the registry (``feynrl_jax.losses.ALGORITHMS[name]``).

    The parts: the loss is ``algorithm.make_loss(**hyperparameters)`` (the algorithm's defaults, overridden);
    ``predict`` is ``config``'s model at temperature 1, with the entropy when ``algorithm.uses_entropy``; the
    params are ``params_spec`` (default ``ParamsSpec.of_model(config)``). DPO-style algorithms keep chosen/rejected
    pairs in one micro-batch.

    Args:
        algorithm: the ``Algorithm`` record.
        optimizer: the optax optimizer.
        mesh: the mesh.
        rules: the rules table.
        config: the model config.
        hyperparameters: overrides of the algorithm's defaults (every key must be one of them).
        logprob_chunk_size: the most sequence columns per chunk of the output projection (``model_logprob_fn``'s
            ``chunk_size``); a chunk also holds at most ``models.logprobs.CHUNK_TOKENS`` token slots on each batch
            shard.
        remat: rematerialisation policy passed to the model (None: ``config.remat``).
        params_spec: the state's params (None: ``ParamsSpec.of_model(config)``; float32 master weights:
            ``ParamsSpec.of_model(config).with_master_dtype("float32")``).
        **kwargs: ``make_train_step``'s ``grad_accum``, ``learning_rate_fn``, ``donate``, ``compiler_options``,
            ``rng_seed`` (LoRA dropout), ``check_updated``.

    Raises:
        ValueError: naming an unknown hyperparameter, or a critic-based algorithm (no value head here).
    """
    if algorithm.needs_critic:
        raise ValueError(
            f"algorithm {algorithm.name!r} needs a critic (values), which make_algorithm_train_step does not compute"
        )
    return make_train_step(
        algorithm.make_loss(**dict(hyperparameters or {})),
        optimizer,
        mesh,
        rules,
        predict=model_logprob_fn(
            config,
            chunk_size=logprob_chunk_size,
            chunk_tokens=mesh_chunk_tokens(mesh),
            remat=remat,
            with_entropy=algorithm.uses_entropy,
        ),
        params_spec=ParamsSpec.of_model(config) if params_spec is None else params_spec,
        rows_per_example=2 if algorithm.paradigm == "dpo" else 1,
        **kwargs,
    )
