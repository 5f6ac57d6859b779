"""The algorithm registry: one record per algorithm, one line each, and nothing imported until it is used.

An :class:`Algorithm` names its loss as ``"module:function"``, its advantage estimator by the name of a function
of :mod:`advantages` (or ``"module:function"``), and which extra models the loop must run. Records are plain
data, so the config layer checks ``algo.name`` and the traits it needs (paradigm, reference, groups) without
importing JAX; the loss's module is imported the first time ``loss_fn`` or ``hyperparameters`` is read.
``hyperparameters`` lists every keyword of the loss with this algorithm's default (read from the loss
signature, then overridden per entry), so a config can be checked against it key by key.

Algorithms from outside the package, found by :func:`get_algorithm`:

* ``algo.name = "my_pkg.my_losses:my_loss"`` imports ``my_pkg.my_losses`` and reads ``my_loss``: an
  :class:`Algorithm` (what :func:`register_algorithm` returns) is used as it is; a loss function that the module
  registered (once) gets its registered traits; any other loss function is an RL loss with GRPO's estimator and no
  critic (see `_plain_loss`). The module must be importable where the loss runs: installed, or in the working
  directory (the `feynrl-jax` command puts it on the import path; Ray's local workers start there).
* ``register_algorithm("my_loss", my_loss, advantage="rloo")`` registers a short name in this process. The RL
  loop hands the record to its trainer actors, so a loss defined in a notebook cell trains too.

Advantage estimators (see :mod:`advantages`): sequence-level ones take ``(rewards [N], group_id [N],
completion_mask [N, C])``; ``gae`` (algorithms with ``needs_critic``) takes per-token rewards, values, mask and
``done``. SFT and DPO have no advantage estimator.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

PARADIGMS = ("sft", "dpo", "rl")
"""Paradigms an algorithm trains in (the config's `paradigm` must match; "eval" runs no algorithm)."""

GROUP_ADVANTAGES = ("group_zscore", "group_mean", "rloo")
"""Estimators of `advantages` that compare the samples of one prompt, so a step needs `n_samples >= 2`."""

SEQUENCE_ADVANTAGES = (*GROUP_ADVANTAGES, "reinforce_pp")
"""Estimators of `advantages` with the sequence-level signature `(rewards, group_id, completion_mask)`."""

_ADVANTAGES_MODULE = "feynrl_jax.losses.advantages"
_INPUT_KEYWORDS = ("entropy", "values")


def load_reference(reference: str) -> Any:
    """Imports ``"package.module:attribute"`` (dots in the attribute follow attributes) and returns the object.

    Raises:
        ValueError: the reference is not of that form, its module cannot be imported, or it has no such attribute;
            the message names the reference.
    """
    module_name, sep, attribute = reference.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"{reference!r} is not a 'package.module:function' reference")
    try:
        found = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"{reference!r}: cannot import module {module_name!r} ({error}); it must be installed or in the "
            "working directory"
        ) from error
    except Exception as error:  # The user's module failed while importing: name it rather than crash.
        raise ValueError(
            f"{reference!r}: importing module {module_name!r} raised {type(error).__name__}: {error}"
        ) from error
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise ValueError(f"{reference!r}: module {module_name!r} has no attribute {attribute!r}")
        found = getattr(found, part)
    return found


def _resolve(target: str | Callable[..., Any], what: str) -> Callable[..., Any]:
    function = load_reference(target) if isinstance(target, str) else target
    if not callable(function):
        raise ValueError(f"{what} {target!r} is not callable")
    return function


@dataclasses.dataclass(frozen=True, eq=False)
class Algorithm:
    """A registered algorithm (hashable by identity, so usable as a static jit argument).

    Attributes:
        name: registry key.
        loss: ``loss(logprobs, batch, *, entropy=None, values=None, **hyperparameters)``, or its
            ``"module:function"`` reference (imported on first use).
        advantage: the advantage estimator: the name of a function of :mod:`advantages`, a ``"module:function"``
            reference or a function with the sequence-level signature; None for SFT and DPO.
        paradigm: "sft", "dpo" or "rl".
        needs_reference: the loss uses reference-model log-probabilities (a KL term, or DPO's log-ratios); the
            loop fills ``batch.ref_logprobs``.
        needs_critic: the loop runs a critic (``values`` argument, ``batch.values``/``returns``; GAE advantages).
        uses_entropy: the loss reads the ``entropy`` argument.
        group_based: the estimator compares the samples of one prompt, so a step needs ``n_samples >= 2`` (and
            DAPO's dynamic sampling can drop groups of equal rewards).
        overrides: this algorithm's hyperparameter defaults where they differ from the loss signature's.
    """

    name: str
    loss: str | Callable[..., Any]
    advantage: str | Callable[..., Any] | None
    paradigm: str
    needs_reference: bool = False
    needs_critic: bool = False
    uses_entropy: bool = False
    group_based: bool = False
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)

    @functools.cached_property
    def loss_fn(self) -> Callable[..., Any]:
        """The loss function (its module imported on first use)."""
        return _resolve(self.loss, f"algorithm {self.name!r}: loss")

    @functools.cached_property
    def advantage_fn(self) -> Callable[..., Any] | None:
        """The advantage estimator, or None (SFT, DPO)."""
        if self.advantage is None:
            return None
        if isinstance(self.advantage, str) and ":" not in self.advantage:
            return getattr(importlib.import_module(_ADVANTAGES_MODULE), self.advantage)
        return _resolve(self.advantage, f"algorithm {self.name!r}: advantage")

    @functools.cached_property
    def hyperparameters(self) -> dict[str, Any]:
        """Every keyword of the loss with this algorithm's default.

        Raises:
            ValueError: an override names no keyword of the loss.
        """
        signature = inspect.signature(self.loss_fn)
        defaults = {
            key: p.default
            for key, p in signature.parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY and key not in _INPUT_KEYWORDS
        }
        missing = sorted(key for key, value in defaults.items() if value is inspect.Parameter.empty)
        if missing:
            raise ValueError(f"algorithm {self.name!r}: loss keyword(s) {missing} need a default value")
        unknown = sorted(set(self.overrides) - set(defaults))
        if unknown:
            raise ValueError(f"algorithm {self.name!r}: {self.loss_fn.__name__} has no keyword(s) {unknown}")
        return {**defaults, **self.overrides}

    def make_loss(self, **overrides: Any) -> Callable[..., Any]:
        """The loss with this algorithm's defaults bound, updated by ``overrides``.

        Raises:
            ValueError: naming an override that is not a hyperparameter of this algorithm.
        """
        unknown = sorted(set(overrides) - set(self.hyperparameters))
        if unknown:
            raise ValueError(
                f"algorithm {self.name!r} has no hyperparameter(s) {unknown}; known: {sorted(self.hyperparameters)}"
            )
        return functools.partial(self.loss_fn, **{**self.hyperparameters, **overrides})


def algorithm(
    name: str,
    loss: str | Callable[..., Any],
    advantage: str | Callable[..., Any] | None = "group_zscore",
    *,
    paradigm: str = "rl",
    needs_reference: bool = False,
    needs_critic: bool = False,
    uses_entropy: bool = False,
    group_based: bool | None = None,
    **overrides: Any,
) -> Algorithm:
    """Builds a record, checking its traits (nothing is imported).

    Args:
        name: the registry key.
        loss: the loss function, or its ``"module:function"`` reference.
        advantage: the estimator: a name of :mod:`advantages` (``group_zscore``, ``group_mean``, ``rloo``,
            ``reinforce_pp``, ``gae``), a ``"module:function"`` reference or a function
            ``(rewards [N], group_id [N], completion_mask [N, C]) -> [N, C]``; None for SFT and DPO.
        paradigm: "sft", "dpo" or "rl".
        needs_reference, needs_critic, uses_entropy: see :class:`Algorithm`.
        group_based: whether the estimator compares samples of one prompt; None derives it from a built-in
            estimator's name and is an error for an estimator of your own.
        **overrides: hyperparameter defaults that differ from the loss signature's.

    Raises:
        ValueError: naming the trait that is inconsistent.
    """
    where = f"algorithm {name!r}"
    if paradigm not in PARADIGMS:
        raise ValueError(f"{where}: paradigm must be one of {PARADIGMS}, got {paradigm!r}")
    if paradigm == "rl" and advantage is None:
        raise ValueError(f"{where}: an RL algorithm needs an advantage estimator")
    if paradigm != "rl" and advantage is not None:
        raise ValueError(f"{where}: a {paradigm} algorithm has no advantage estimator, got {advantage!r}")
    builtin = isinstance(advantage, str) and ":" not in advantage
    if builtin and advantage not in (*SEQUENCE_ADVANTAGES, "gae"):
        raise ValueError(
            f"{where}: advantage {advantage!r} is not an estimator of {_ADVANTAGES_MODULE} "
            f"({', '.join((*SEQUENCE_ADVANTAGES, 'gae'))}) nor a 'module:function' reference"
        )
    if (advantage == "gae") != needs_critic:
        raise ValueError(f"{where}: GAE advantages and needs_critic go together (advantage={advantage!r})")
    if group_based is None:
        if advantage is not None and not builtin:
            raise ValueError(f"{where}: say whether your advantage estimator compares a prompt's samples (group_based)")
        group_based = advantage in GROUP_ADVANTAGES
    return Algorithm(
        name=name,
        loss=loss,
        advantage=advantage,
        paradigm=paradigm,
        needs_reference=needs_reference,
        needs_critic=needs_critic,
        uses_entropy=uses_entropy,
        group_based=group_based,
        overrides=overrides,
    )


def _builtin(name: str, module: str, function: str, advantage: str | None, **traits: Any) -> Algorithm:
    return algorithm(name, f"feynrl_jax.losses.{module}:{function}", advantage, **traits)


# Dr. GRPO's constant normaliser: the maximum generation length; override it with the run's max_new_tokens.
_DEFAULT_MAX_TOKENS = 1024.0

ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        _builtin("sft", "sft", "sft_loss", None, paradigm="sft"),
        _builtin("dpo", "dpo", "dpo_loss", None, paradigm="dpo", needs_reference=True),
        _builtin("ipo", "dpo", "ipo_loss", None, paradigm="dpo", needs_reference=True),
        _builtin("ppo", "ppo", "ppo_loss", "gae", needs_critic=True, uses_entropy=True, entropy_coef=1e-3),
        _builtin("grpo", "grpo", "grpo_loss", "group_zscore", needs_reference=True),
        _builtin(
            "dr_grpo",
            "grpo",
            "grpo_loss",
            "group_mean",
            kl_coef=0.0,
            loss_agg="seq_mean_token_sum",
            max_tokens=_DEFAULT_MAX_TOKENS,
        ),
        _builtin("dapo", "grpo", "grpo_loss", "group_zscore", clip_high=0.28, kl_coef=0.0, loss_agg="token_mean"),
        _builtin("rloo", "grpo", "grpo_loss", "rloo", kl_coef=0.0, loss_agg="token_mean"),
        _builtin("reinforce_pp", "grpo", "grpo_loss", "reinforce_pp", kl_coef=0.0, loss_agg="token_mean"),
        _builtin("cispo", "cispo", "cispo_loss", "group_zscore"),
        _builtin("p3o", "p3o", "p3o_loss", "group_zscore"),
        _builtin("gspo", "gspo", "gspo_loss", "group_zscore"),
    )
}
"""The built-in algorithms, then those registered in this process (`register_algorithm`)."""

BUILTIN_ALGORITHMS = tuple(ALGORITHMS)
"""The names of the algorithms that ship with the package."""

_REFERENCES: dict[str, Algorithm] = {}
"""Records found through "module:function" names, by that name. A reference is not a registration, so they are kept
apart from `ALGORITHMS` (registering a name clears them: they may point at the record it replaces)."""


def register_algorithm(
    name: str,
    loss: str | Callable[..., Any],
    advantage: str | Callable[..., Any] | None = "group_zscore",
    **traits: Any,
) -> Algorithm:
    """Registers an algorithm of your own under ``name`` in this process, and returns its record.

    Arguments are those of :func:`algorithm`. Registering a name again (a module imported twice, a notebook cell
    run again) replaces its record.

    Raises:
        ValueError: ``name`` is a built-in algorithm or holds a ":", or a trait is inconsistent.
    """
    if name in BUILTIN_ALGORITHMS:
        raise ValueError(f"{name!r} is a built-in algorithm; register yours under another name")
    if ":" in name:
        raise ValueError(f"{name!r}: a registered name has no ':' (that form names a module's attribute)")
    record = algorithm(name, loss, advantage, **traits)
    ALGORITHMS[name] = record
    _REFERENCES.clear()
    return record


def adopt(name: str, record: Algorithm) -> Algorithm:
    """Records ``record`` under ``name`` (a config's ``algo.name``) unless this process knows that name already.

    The RL loop's trainer actors receive the driver's record this way, so an algorithm registered only in the
    driver (a loss defined in a notebook) trains there too.

    Returns:
        The record this process uses for ``name``.
    """
    return (_REFERENCES if ":" in name else ALGORITHMS).setdefault(name, record)


def _plain_loss(name: str, loss: Callable[..., Any]) -> Algorithm:
    """The record of a loss function named by reference and registered nowhere: an RL loss on GRPO's group z-score
    advantages and no critic; it runs the reference model when its ``kl_coef`` defaults above 0 and gets the
    entropy when it takes ``entropy_coef``."""
    hyperparameters = algorithm(name, loss).hyperparameters
    return algorithm(
        name,
        loss,
        "group_zscore",
        needs_reference=float(hyperparameters.get("kl_coef") or 0.0) > 0,
        uses_entropy="entropy_coef" in hyperparameters,
    )


def check_traits(record: Algorithm) -> None:
    """Checks a record against its loss's keyword defaults, the rules every built-in algorithm follows.

    Raises:
        ValueError: the loss defaults ``kl_coef`` above 0 but the record runs no reference model, takes
            ``entropy_coef`` but is not given the entropy, or defaults ``vf_coef`` above 0 without a critic; or a
            keyword has no default.
    """
    hyperparameters = record.hyperparameters
    where = f"algorithm {record.name!r}"
    if record.paradigm == "rl" and float(hyperparameters.get("kl_coef") or 0.0) > 0 and not record.needs_reference:
        raise ValueError(
            f"{where}: its loss defaults kl_coef to {hyperparameters['kl_coef']} but the record has "
            "needs_reference=False; register it with needs_reference=True or default kl_coef to 0"
        )
    if "entropy_coef" in hyperparameters and not record.uses_entropy:
        raise ValueError(
            f"{where}: its loss takes entropy_coef but the record has uses_entropy=False, so the entropy would "
            "never reach it; register it with uses_entropy=True"
        )
    if float(hyperparameters.get("vf_coef") or 0.0) > 0 and not record.needs_critic:
        raise ValueError(
            f"{where}: its loss defaults vf_coef to {hyperparameters['vf_coef']} but the record has no critic; "
            'register it with advantage="gae", needs_critic=True'
        )


def get_algorithm(name: str) -> Algorithm:
    """The algorithm ``algo.name`` names: a registered name, or a ``"module:function"`` reference.

    A reference is imported once; later calls return the same record, so a jitted step compiled for it is reused.
    It may name an :class:`Algorithm`, a loss function registered (once) in this process, under its registered
    traits, or any other loss function (:func:`_plain_loss`).

    Raises:
        KeyError: ``name`` is neither registered nor a reference.
        ValueError: the reference cannot be imported, is ambiguous, or is not an :class:`Algorithm` or a function.
    """
    if name in ALGORITHMS:
        return ALGORITHMS[name]
    if name in _REFERENCES:
        return _REFERENCES[name]
    if ":" not in name:
        raise KeyError(name)
    target = load_reference(name)
    if isinstance(target, Algorithm):
        record = target
    elif callable(target):
        registered = [
            a for key, a in ALGORITHMS.items() if key not in BUILTIN_ALGORITHMS and (a.loss is target or a.loss == name)
        ]
        if len(registered) > 1:
            raise ValueError(
                f"{name!r} is registered as {sorted(a.name for a in registered)}; name one of those records instead"
            )
        record = dataclasses.replace(registered[0], name=name) if registered else _plain_loss(name, target)
    else:
        raise ValueError(f"{name!r} is neither an Algorithm nor a loss function: {type(target).__name__}")
    return _REFERENCES.setdefault(name, record)
