"""Integration: an RL run on Ray trains with a loss from outside the package, named `algo.name="module:function"`.

The module lives in the run's working directory, as a researcher's file would; Ray's local workers start there,
so the trainer actor imports it too. The loss reports the hyperparameter it was given and its own metric: both
reaching `metrics.jsonl` shows that the trainer actor ran this function with the config's `algo.hparams`.
"""

import logging
import os
import sys
import textwrap

import numpy as np
import pytest

from feynrl_jax.tracking import read_metrics

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "configs"))
import tiny_rl  # noqa: E402

MODULE = textwrap.dedent(
    '''
    """A clipped-weight REINFORCE: the policy gradient weighted by the stop-gradient clipped ratio."""
    import jax
    import jax.numpy as jnp

    from feynrl_jax.losses import Metric, aggregate


    def clipped_reinforce(
        logprobs, batch, *, entropy=None, values=None, clip=0.2, scale=1.0, loss_agg="token_mean", max_tokens=None
    ):
        ratio = jnp.exp(logprobs - batch.old_logprobs)
        weight = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - clip, 1.0 + clip))
        per_token = -scale * weight * batch.advantages * logprobs
        loss = aggregate(per_token, batch.loss_mask, batch.segment_ids, mode=loss_agg, max_tokens=max_tokens)
        tokens = batch.loss_mask.sum()
        metrics = {
            "loss/custom_weight_mean": Metric((weight * batch.loss_mask).sum(), tokens),
            "loss/custom_scale": Metric(scale * tokens, tokens),
        }
        return loss, metrics
    '''
)


@pytest.mark.slow
@pytest.mark.ray
def test_rl_run_with_a_module_function_loss(tmp_path, monkeypatch, caplog, algorithm_registry, ray_actor_devices):
    from feynrl_jax.orchestration import rl_loop

    caplog.set_level(logging.INFO, logger=rl_loop.__name__)

    work = tmp_path / "work"
    work.mkdir()
    (work / "my_losses.py").write_text(MODULE)
    monkeypatch.chdir(work)
    monkeypatch.syspath_prepend(str(work))
    try:
        config = tiny_rl.get_config()
        config.run_dir = str(tmp_path / "run")
        config.eval.during_training = False
        config.algo.name = "my_losses:clipped_reinforce"
        config.algo.reference = "none"
        config.algo.kl_coef = None
        config.algo.hparams = {"scale": 0.5}
        config.checkpoint.every_steps = 0
        rl_loop.run(config)
    finally:
        sys.modules.pop("my_losses", None)
    # The Ray instance the run started gave its actors actor_devices.RAY_ACTOR_DEVICES.
    assert "trainer: mesh {'data': 2, 'fsdp': 1, 'tensor': 1} over 2 devices in 1 process(es)" in caplog.text
    records = read_metrics(config.run_dir)
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert record["loss/custom_scale"] == pytest.approx(0.5)
        assert 0.8 - 1e-6 <= record["loss/custom_weight_mean"] <= 1.2 + 1e-6
        assert np.isfinite(record["train/loss"]) and np.isfinite(record["train/grad_norm"])
