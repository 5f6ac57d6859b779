"""feynrl_jax.testing: property-test your own loss against the contract every registered loss passes.

    from feynrl_jax.testing import check_loss
    report = check_loss(my_loss, ratio_one="token_mean")   # raises LossContractError naming the property
    print(report)

``check_loss`` (in :mod:`contract`) draws examples with the hypothesis strategies of :mod:`strategies` and
checks: jit, finite loss and gradients, ``loss/`` metrics, zero gradient and no influence of masked positions,
zero mask, eager equals jit, no retrace, right-padding invariance, packed equals unpacked, exact micro-batch
accumulation and, where it applies, the reduction to REINFORCE at ratio one. docs/CONTRACTS.md explains each.
Importing this package needs hypothesis (a dependency of feynrl-jax), never pytest.
"""

from feynrl_jax.testing.contract import CHECKS, LossCheckReport, LossContractError, check_loss, reinforce_gradient
from feynrl_jax.testing.strategies import LossExample, LossInputs, loss_examples, loss_inputs, train_batches

__all__ = [
    "CHECKS",
    "LossCheckReport",
    "LossContractError",
    "LossExample",
    "LossInputs",
    "check_loss",
    "loss_examples",
    "loss_inputs",
    "reinforce_gradient",
    "train_batches",
]
