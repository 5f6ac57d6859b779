"""LoRA (feynrl_jax.models.lora): the adapted model, the step that trains adapters alone, PEFT folders in and out,
and SFT / DPO runs with adapters.

Tolerances: the model tests compare float32 programs that differ only in the order of their additions (merged
`W + s A B` against `x W + s (x A) B`): each sum over at most D = 64 products of O(1) values rounds to about
1e-6, so 1e-4 on logits of O(1) leaves two orders of magnitude of margin and still catches a wrong scale, a
transposed adapter or a missing target (each changes logits at 1e-2 or more). PEFT parity uses the 1e-4 of
tests/test_hf_parity.py (float32 PyTorch against float32 XLA on the same weights).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from feynrl_jax.checkpoints.peft_adapters import export_peft, load_peft_adapters, read_adapter_config
from feynrl_jax.config import validation
from feynrl_jax.errors import InputError
from feynrl_jax.losses import ALGORITHMS, compute_metrics
from feynrl_jax.models import ModelConfig, forward, init_params, logical_axes, logits, lora
from feynrl_jax.models.config import LORA_TARGETS
from feynrl_jax.sharding import RULES, make_mesh
from feynrl_jax.train.optimizer import make_optimizer
from feynrl_jax.train.step import ParamsSpec, make_algorithm_train_step

sys.path.insert(0, os.path.dirname(__file__))
from test_train_step import FAST_COMPILE, make_batch  # noqa: E402

TOL = 1e-4
LR = 1e-2
"""The learning rate of the adapter steps (`build_step`)."""
ALL = LORA_TARGETS
CONFIG = ModelConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    lora_rank=4,
    lora_alpha=8.0,
    lora_targets=ALL,
)


def trained_adapters(params: dict, seed: int = 1, scale: float = 0.05) -> dict:
    """`params` with every `lora_b` random (a fresh adapter's is zero), as after some training."""
    key = jax.random.key(seed)

    def perturb(path, leaf):
        if lora.is_adapter_path(path) and path[-1].key == "lora_b":
            return scale * jax.random.normal(
                jax.random.fold_in(key, hash(jax.tree_util.keystr(path)) % 2**31), leaf.shape
            )
        return leaf

    return jax.tree_util.tree_map_with_path(perturb, params)


def tokens_and_positions(batch: int = 2, length: int = 7):
    tokens = (jnp.arange(batch * length).reshape(batch, length) * 37) % CONFIG.vocab_size
    return tokens.astype(jnp.int32), jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))


def model_logits(params, config):
    tokens, positions = tokens_and_positions()
    hidden, _ = forward(params, tokens, positions, config=config)
    return np.asarray(logits(params, hidden, config=config))


def test_config_layer_names_the_same_targets():
    assert validation.LORA_TARGETS == LORA_TARGETS


def test_adapters_sit_beside_their_kernels_with_the_kernels_axes():
    params = init_params(CONFIG, jax.random.key(0))
    axes = logical_axes(CONFIG)
    r = CONFIG.lora_rank
    for target in ALL:
        kernel = params["layers"][target]["kernel"]
        n = 1 + lora.input_dims(target)
        assert params["layers"][target]["lora_a"].shape == (*kernel.shape[:n], r)
        assert params["layers"][target]["lora_b"].shape == (kernel.shape[0], r, *kernel.shape[n:])
        kernel_axes = axes["layers"][target]["kernel"]
        assert axes["layers"][target]["lora_a"] == (*kernel_axes[:n], "lora_rank")
        assert axes["layers"][target]["lora_b"] == (kernel_axes[0], "lora_rank", *kernel_axes[n:])
        assert not np.any(np.asarray(params["layers"][target]["lora_b"]))  # B = 0 (Hu et al. 2021)
        bound = 1 / np.sqrt(np.prod(kernel.shape[1:n]))
        a = np.asarray(params["layers"][target]["lora_a"])
        assert np.abs(a).max() <= bound and a.std() > bound / 4  # uniform in +-1/sqrt(fan_in)


def test_a_fresh_adapter_is_the_base_model_exactly():
    params = init_params(CONFIG, jax.random.key(0))
    np.testing.assert_array_equal(
        model_logits(params, CONFIG), model_logits(lora.base_params(params), CONFIG.without_lora())
    )


def test_merged_weights_compute_what_the_adapters_compute():
    params = trained_adapters(init_params(CONFIG, jax.random.key(0)))
    adapted = model_logits(params, CONFIG)
    base = model_logits(lora.base_params(params), CONFIG.without_lora())
    assert np.abs(adapted - base).max() > 1e-2  # the adapters do change the model
    merged = model_logits(lora.merge(params, CONFIG), CONFIG.without_lora())
    np.testing.assert_allclose(merged, adapted, atol=TOL, rtol=0)


@pytest.mark.parametrize("target", ALL)
def test_each_target_is_applied_at_its_own_projection(target):
    config = dataclasses.replace(CONFIG, lora_targets=(target,))
    params = trained_adapters(init_params(config, jax.random.key(0)))
    assert set(lora.adapters_of(params)["layers"]) == {target}
    merged = model_logits(lora.merge(params, config), config.without_lora())
    np.testing.assert_allclose(merged, model_logits(params, config), atol=TOL, rtol=0)
    assert np.abs(merged - model_logits(lora.base_params(params), config.without_lora())).max() > 1e-3


def test_split_and_combine_are_inverse_and_share_arrays():
    params = init_params(CONFIG, jax.random.key(0))
    base, adapters = lora.split(params)
    assert all(not lora.is_adapter_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(base)[0])
    assert all(lora.is_adapter_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(adapters)[0])
    again = lora.combine(base, adapters)
    assert jax.tree.structure(again) == jax.tree.structure(params)
    assert all(a is b for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(params), strict=True))
    with pytest.raises(ValueError, match="both"):
        lora.combine(params, adapters)


def test_model_config_rejects_bad_lora_fields():
    with pytest.raises(ValueError, match="lora_targets"):
        dataclasses.replace(CONFIG, lora_targets=("qkv",))
    with pytest.raises(ValueError, match="lora_targets"):
        dataclasses.replace(CONFIG, lora_targets=())
    with pytest.raises(ValueError, match="lora_alpha"):
        dataclasses.replace(CONFIG, lora_alpha=0.0)
    with pytest.raises(ValueError, match="lora_dropout"):
        dataclasses.replace(CONFIG, lora_dropout=-0.1)


# LoRA dropout -----------------------------------------------------------------------------------------------------


def test_lora_dropout_drops_adapter_inputs_only_and_rescales_the_kept_ones():
    from feynrl_jax.models.decoder import _dense

    n, rate = 4096, 0.25
    x = jax.random.normal(jax.random.key(0), (1, 1, n)) + 3.0  # no exact zeros
    # kernel 0, A = I, B = I: the output is exactly the adapter's (dropped, rescaled) input, times the scale 2.
    proj = {"kernel": jnp.zeros((n, n)), "lora_a": jnp.eye(n), "lora_b": jnp.eye(n)}
    out = np.asarray(_dense(x, proj, jnp.float32, 2.0, (jax.random.key(1), rate)))[0, 0]
    x = np.asarray(x)[0, 0]
    kept = out != 0
    np.testing.assert_allclose(out[kept], 2.0 * x[kept] / (1 - rate), rtol=1e-6)
    # The dropped fraction is Binomial(4096, 0.25)/4096: standard deviation 0.0068, the bound is 5 of them.
    assert abs((~kept).mean() - rate) < 0.034
    # The frozen projection sees the input whole: no adapter, no dropout.
    frozen = {"kernel": jnp.eye(n)}
    np.testing.assert_array_equal(
        np.asarray(_dense(x[None, None], frozen, jnp.float32, 2.0, (jax.random.key(1), rate)))[0, 0], x
    )


def test_forward_draws_lora_dropout_only_from_a_given_key():
    config = dataclasses.replace(CONFIG, lora_dropout=0.5)
    params = trained_adapters(init_params(config, jax.random.key(0)))
    tokens, positions = tokens_and_positions()

    def hidden(config, key):
        return np.asarray(forward(params, tokens, positions, config=config, dropout_rng=key)[0])

    plain = hidden(CONFIG, None)
    np.testing.assert_array_equal(hidden(config, None), plain)  # evaluation and rollouts: no key, no dropout
    np.testing.assert_array_equal(hidden(CONFIG, jax.random.key(1)), plain)  # lora_dropout 0: the key is unused
    dropped = hidden(config, jax.random.key(1))
    assert np.abs(dropped - plain).max() > 1e-3
    np.testing.assert_array_equal(hidden(config, jax.random.key(1)), dropped)
    assert np.abs(hidden(config, jax.random.key(2)) - dropped).max() > 1e-3
    # Fresh adapters (B = 0) add nothing, dropped or not.
    fresh = init_params(config, jax.random.key(0))
    np.testing.assert_array_equal(
        np.asarray(forward(fresh, tokens, positions, config=config, dropout_rng=jax.random.key(1))[0]),
        np.asarray(forward(fresh, tokens, positions, config=config)[0]),
    )


def test_the_step_draws_dropout_keys_from_its_seed_and_step_counter():
    config = dataclasses.replace(CONFIG, lora_dropout=0.5)

    def run(rng_seed, grad_accum=1):
        step = build_step(grad_accum=grad_accum, config=config, rng_seed=rng_seed)
        state, losses = train(step, steps=3, config=config)
        return np.asarray(state.params["layers"]["q_proj"]["lora_a"]), losses

    a, losses = run(7)
    again, losses_again = run(7)
    np.testing.assert_array_equal(a, again)  # the keys depend on (seed, step, micro-batch) alone
    assert losses == losses_again
    assert np.abs(run(8)[0] - a).max() > 1e-6  # another seed, other masks
    assert np.abs(run(None)[0] - a).max() > 1e-6  # no seed: no dropout


# The train step ---------------------------------------------------------------------------------------------------


def build_step(mesh_sizes=(1, 1, 1), rules="dp", grad_accum=1, params_spec=None, config=CONFIG, rng_seed=None):
    devices = jax.devices()[:1] if mesh_sizes == (1, 1, 1) else None
    mesh = make_mesh(*mesh_sizes, devices=devices)
    optimizer, schedule = make_optimizer(LR, warmup_steps=1, total_steps=10, weight_decay=0.01)
    return make_algorithm_train_step(
        ALGORITHMS["grpo"],
        optimizer,
        mesh,
        RULES[rules],
        config=config,
        hyperparameters={"kl_coef": 0.05},
        grad_accum=grad_accum,
        logprob_chunk_size=8,
        learning_rate_fn=schedule,
        compiler_options=FAST_COMPILE,
        params_spec=params_spec,
        rng_seed=rng_seed,
    )


def train(step, steps=4, config=CONFIG):
    state = step.init_state(jax.tree.map(np.asarray, init_params(config, jax.random.key(0))))
    losses = []
    for i in range(steps):
        state, metrics = step(state, step.place_batch(make_batch("grpo", seed=i % 2)))
        losses.append(float(compute_metrics(metrics)["train/loss"]))
    return state, losses


def test_only_the_adapters_train_and_the_base_keeps_its_arrays():
    step = build_step()
    state = step.init_state(jax.tree.map(np.asarray, init_params(CONFIG, jax.random.key(0))))
    initial = jax.tree.map(np.asarray, state.params)
    base_before = jax.tree.leaves(lora.base_params(state.params))
    # The optimizer state holds adapter leaves alone: Adam's two moments of each, plus scalar counters.
    moments = [p for p, leaf in jax.tree_util.tree_flatten_with_path(state.opt_state)[0] if leaf.ndim > 0]
    assert moments and all(lora.is_adapter_path(p) for p in moments)
    assert len(moments) == 2 * 2 * len(ALL)
    for i in range(3):
        state, _ = step(state, step.place_batch(make_batch("grpo", seed=i)))
    base_after = jax.tree.leaves(lora.base_params(state.params))
    # The very same arrays (frozen params are a separate, undonated argument of the step): a view of them, such as
    # the reference model, stays valid.
    assert all(a is b for a, b in zip(base_before, base_after, strict=True))
    assert not any(a.is_deleted() for a in base_before)
    final = jax.tree.map(np.asarray, state.params)
    for (path, old), new in zip(jax.tree_util.tree_flatten_with_path(initial)[0], jax.tree.leaves(final), strict=True):
        if lora.is_adapter_path(path):
            assert not np.array_equal(old, new), jax.tree_util.keystr(path)
        else:
            np.testing.assert_array_equal(old, new)
    assert step.trace_count == 1


def test_adapter_training_lowers_the_loss_on_a_repeated_batch():
    _, losses = train(build_step(), steps=6)
    assert losses[-1] < losses[1] - 0.05, losses


def assert_same_adapters(params, want, lr: float = LR) -> None:
    """The adapters of two runs of `train` whose programs add the same float32 products in another order.

    Their gradients differ in the last bits. Adam divides each entry's update by its own gradient scale, so an entry
    whose gradient is itself at rounding level (next to Adam's eps) can move by a sizeable part of lr = 1e-2 per step
    however small the difference; the other entries' updates change by the relative error times lr. So nearly every
    entry must agree to rtol 2e-4 and atol 2e-6 = 2e-4 lr (3 LoRA steps on an AMD EPYC with AVX2 differed by 8.5e-7 at
    most), at most 1% of a leaf's entries (one at least) may differ by more, and none by more than lr / 10 (4 QLoRA
    steps on another AMD EPYC with AVX2 left one of 512 entries 9.6e-6 apart, 4.5e-4 of its value). A real fault (a
    partial sum or a micro-batch missing, an adapter sharded on the wrong axis) changes the gradients by O(1), hence
    most entries' updates by O(lr), two to four orders above these bounds.
    """
    for a, b in zip(jax.tree.leaves(lora.adapters_of(params)), jax.tree.leaves(lora.adapters_of(want)), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        loose = ~np.isclose(a, b, rtol=2e-4, atol=2e-6)
        assert loose.sum() <= max(1, loose.size // 100), (loose.sum(), loose.size, np.abs(a - b).max())
        np.testing.assert_allclose(a, b, rtol=0, atol=lr / 10)


def test_sharded_and_accumulated_adapter_steps_equal_one_device():
    # 8 fake CPU devices, adapters sharded like their kernels (the rank axis replicated); 2 micro-batches
    # (4 fsdp and 2 tp partial sums, two micro-batch gradients: `assert_same_adapters`).
    single, _ = train(build_step(), steps=3)
    sharded, _ = train(build_step((1, 4, 2), "fsdp_tp", grad_accum=2), steps=3)
    assert_same_adapters(sharded.params, single.params)


@pytest.mark.parametrize("master_dtype", [None, "float32"])
def test_adapters_are_float32_and_a_bf16_base_stays_bf16(master_dtype):
    config = dataclasses.replace(CONFIG, param_dtype="bfloat16", compute_dtype="bfloat16")
    spec = ParamsSpec.of_model(config).with_master_dtype(master_dtype)
    for path, leaf in jax.tree_util.tree_flatten_with_path(spec.shape)[0]:
        want = jnp.float32 if lora.is_adapter_path(path) else jnp.bfloat16
        assert leaf.dtype == want, jax.tree_util.keystr(path)


# QLoRA: the NF4 base ----------------------------------------------------------------------------------------------

QCONFIG = dataclasses.replace(CONFIG, base_quantization="nf4")


def test_nf4_picks_the_nearest_level_of_each_block_and_packs_two_codes_a_byte():
    from feynrl_jax.models import quant

    w = np.random.default_rng(0).standard_normal((3, 64, 48)).astype(np.float32)
    w[0, 0, :] = 0.0  # a block of zeros
    leaves = quant.quantize(jnp.asarray(w))
    block = quant.block_size(48)
    assert block == 48 and quant.block_size(576) == 64 and quant.block_size(8) == 8
    assert leaves["kernel_nf4"].shape == (3, 64, 24) and leaves["kernel_nf4"].dtype == jnp.uint8
    assert leaves["kernel_absmax"].shape == (3, 64, 1)
    back = np.asarray(quant.dequantize(leaves, jnp.float32), np.float64)
    # Reference in float64: each value is the nearest NF4 level of value / absmax(block), times absmax.
    absmax = np.abs(w).astype(np.float64).max(axis=-1, keepdims=True)
    scaled = w / np.where(absmax > 0, absmax, 1.0)
    distance = np.abs(scaled[..., None] - quant.NF4_LEVELS.astype(np.float64))
    want = quant.NF4_LEVELS.astype(np.float64)[distance.argmin(-1)] * absmax
    second = np.sort(distance, axis=-1)[..., 1] - distance.min(-1)
    clear = second > 1e-6  # values (almost) halfway between two levels may round either way in float32
    np.testing.assert_allclose(back[clear], want[clear], rtol=1e-6, atol=0)
    assert clear.mean() > 0.999
    # The error is at most half the widest gap between levels (0.304, between -1 and -0.696), in block units.
    assert (np.abs(back - w) <= 0.153 * absmax).all()
    assert (back[0, 0] == 0).all()


def test_the_quantized_model_computes_with_the_dequantized_kernels():
    from feynrl_jax.models import quant

    params = trained_adapters(init_params(QCONFIG, jax.random.key(0)))
    assert quant.is_quantized(params["layers"]["down_proj"]) and "kernel" not in params["layers"]["q_proj"]
    plain = quant.dequantize_base(params, jnp.float32)
    unquantized = dataclasses.replace(QCONFIG, base_quantization=None)
    # The same kernel values, multiplied the same way: equal up to how XLA fuses the dequantization (float32).
    np.testing.assert_allclose(model_logits(params, QCONFIG), model_logits(plain, unquantized), atol=1e-5, rtol=0)
    # Merging dequantizes the base too: a plain model (no NF4 leaf, no adapter) computing the same.
    merged = lora.merge(params, QCONFIG)
    assert not any(quant.is_quant_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(merged)[0])
    np.testing.assert_allclose(model_logits(merged, QCONFIG.without_lora()), model_logits(params, QCONFIG), atol=TOL)
    spec = ParamsSpec.of_model(QCONFIG)
    assert jax.tree.structure(spec.shape) == jax.tree.structure(params)


def test_qlora_steps_train_the_adapters_over_a_frozen_4bit_base_on_any_mesh():
    single, losses = train(build_step(config=QCONFIG), steps=4, config=QCONFIG)
    assert losses[3] < losses[1]  # the same batch (train alternates two), after two updates
    codes = single.params["layers"]["gate_proj"]["kernel_nf4"]
    initial = init_params(QCONFIG, jax.random.key(0))["layers"]["gate_proj"]["kernel_nf4"]
    np.testing.assert_array_equal(np.asarray(codes), np.asarray(initial))
    # A base weight takes 4 + 32 / block bits: blocks of 16 (q, k, v: head_dim 16) to 64 here, so at most 6 bits,
    # against bfloat16's 16 and float32's 32.
    from feynrl_jax.models.decoder import param_shapes
    from feynrl_jax.models.quant import PROJECTIONS

    shapes = param_shapes(CONFIG)["layers"]
    weights = sum(int(np.prod(shapes[name]["kernel"])) for name in PROJECTIONS)
    layers = single.params["layers"]
    stored = sum(layers[name][leaf].nbytes for name in PROJECTIONS for leaf in ("kernel_nf4", "kernel_absmax"))
    assert 4 < stored * 8 / weights <= 6
    # The NF4 codes and scales shard like their kernels (fsdp 4 x tensor 2): the same adapters as one device
    # (`assert_same_adapters`).
    sharded, _ = train(build_step((1, 4, 2), "fsdp_tp", config=QCONFIG), steps=4, config=QCONFIG)
    assert_same_adapters(sharded.params, single.params)


# PEFT folders -----------------------------------------------------------------------------------------------------


def test_peft_adapters_merged_into_hf_tensors_are_the_merged_model():
    from feynrl_jax.checkpoints.hf_names import hf_tensors
    from feynrl_jax.checkpoints.peft_adapters import merge_into_hf, peft_tensors

    params = jax.tree.map(np.asarray, trained_adapters(init_params(CONFIG, jax.random.key(0))))
    base = dict(hf_tensors(lora.base_params(params), CONFIG.without_lora(), np.float32))
    merged = merge_into_hf(base, peft_tensors(params, CONFIG), CONFIG)
    want = dict(hf_tensors(lora.merge(params, CONFIG), CONFIG.without_lora(), np.float32))
    assert merged.keys() == want.keys()
    for name in want:
        # Both add the same r = 4 float32 products to W (in another order): agreement to a few ulps of W's O(0.1).
        np.testing.assert_allclose(merged[name], want[name], rtol=0, atol=1e-6, err_msg=name)
    assert any(not np.array_equal(merged[name], base[name]) for name in base)


def test_peft_folder_round_trip_is_exact(tmp_path):
    params = trained_adapters(init_params(CONFIG, jax.random.key(0)))
    folder = export_peft(params, CONFIG, str(tmp_path / "adapter"))
    assert read_adapter_config(folder) == {"lora_rank": 4, "lora_alpha": 8.0, "lora_targets": ALL}
    loaded = load_peft_adapters(folder, CONFIG)
    want = jax.tree.map(np.asarray, lora.adapters_of(params))
    assert jax.tree.structure(loaded) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"use_rslora": True}, "use_rslora"),
        ({"peft_type": "IA3"}, "peft_type"),
        ({"target_modules": ["qkv_proj"]}, "target_modules"),
        ({"r": 0}, "'r'|r=0"),
        ({"bias": "all"}, "bias"),
        ({"init_lora_weights": "pissa"}, "init_lora_weights"),
        ({"layers_to_transform": [0]}, "layers_to_transform"),
    ],
)
def test_unsupported_peft_configs_are_refused_with_the_file_named(tmp_path, change, message):
    folder = export_peft(init_params(CONFIG, jax.random.key(0)), CONFIG, str(tmp_path / "adapter"))
    path = os.path.join(folder, "adapter_config.json")
    with open(path) as f:
        raw = json.load(f)
    raw.update(change)
    with open(path, "w") as f:
        json.dump(raw, f)
    with pytest.raises(InputError, match=message) as error:
        read_adapter_config(folder)
    assert path in str(error.value)


def test_a_peft_folder_missing_a_tensor_is_refused(tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = export_peft(init_params(CONFIG, jax.random.key(0)), CONFIG, str(tmp_path / "adapter"))
    path = os.path.join(folder, "adapter_model.safetensors")
    tensors = load_file(path)
    del tensors["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]
    save_file(tensors, path)
    with pytest.raises(InputError, match="layers.1.mlp.down_proj.lora_B.weight is missing"):
        load_peft_adapters(folder, CONFIG)


def test_peft_loads_our_adapter_onto_transformers_with_the_same_logits(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from feynrl_jax.checkpoints import export_hf

    config = dataclasses.replace(CONFIG, tie_word_embeddings=False)
    params = trained_adapters(init_params(config, jax.random.key(0)), scale=0.2)
    export_hf(lora.base_params(params), config.without_lora(), tmp_path / "base")
    export_peft(params, config, str(tmp_path / "adapter"), base_model=str(tmp_path / "base"))
    export_hf(params, config, tmp_path / "merged")  # LoRA params are written merged

    tokens, positions = tokens_and_positions()
    ours = model_logits(params, config)
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        theirs = model(torch.as_tensor(np.array(tokens), dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(theirs, ours, atol=TOL, rtol=0)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = merged(torch.as_tensor(np.array(tokens), dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(theirs, ours, atol=TOL, rtol=0)


# Config ----------------------------------------------------------------------------------------------------------


def test_lora_config_keys_are_validated():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "configs"))
    import tiny_rl

    from feynrl_jax.config.errors import ConfigError

    config = tiny_rl.get_config("grpo")
    config.model.lora.rank = 4
    config.model.lora.targets = ("q_proj", "qkv")
    config.model.lora.alpha = -1.0
    with pytest.raises(ConfigError) as error:
        validation.validate(config, num_devices=1)
    text = str(error.value)
    assert "model.lora.targets" in text and "model.lora.alpha" in text
    config = tiny_rl.get_config("grpo")
    config.model.lora.rank, config.model.lora.dropout = 4, 1.0
    with pytest.raises(ConfigError, match=r"model.lora.dropout=1.0 must be in \[0, 1\)"):
        validation.validate(config, num_devices=1)
    config = tiny_rl.get_config("grpo")
    config.model.lora.dropout = 0.1
    with pytest.raises(ConfigError, match="model.lora.dropout needs model.lora.rank > 0"):
        validation.validate(config, num_devices=1)
    config = tiny_rl.get_config("grpo")
    config.model.lora.quantize_base = "int4"
    with pytest.raises(ConfigError) as error:
        validation.validate(config, num_devices=1)
    assert "model.lora.quantize_base" in str(error.value) and "needs model.lora.rank > 0" in str(error.value)
    config.model.lora.rank, config.model.lora.quantize_base = 4, "nf4"
    config.algo.reference = "/some/model"
    with pytest.raises(ConfigError, match="a QLoRA run's reference is its own quantized base"):
        validation.validate(config, num_devices=1)


def test_the_run_model_config_takes_the_lora_keys(tmp_path):
    from feynrl_jax.config.base import base_config
    from feynrl_jax.train import run_setup

    model = base_config().model
    model.lora.rank, model.lora.alpha, model.lora.targets = 8, 4.0, ("q_proj", "down_proj")
    fields = run_setup.lora_fields(model.lora)
    assert fields == {
        "lora_rank": 8,
        "lora_alpha": 4.0,
        "lora_targets": ("q_proj", "down_proj"),
        "lora_dropout": 0.0,
        "base_quantization": None,
    }
    model.lora.dropout, model.lora.quantize_base = 0.25, "nf4"
    fields = run_setup.lora_fields(model.lora)
    assert fields["lora_dropout"] == 0.25 and fields["base_quantization"] == "nf4"
    # A PEFT adapter of another rank is refused when a run starts from it, naming the key.
    folder = export_peft(init_params(CONFIG, jax.random.key(0)), CONFIG, str(tmp_path / "adapter"))
    with pytest.raises(InputError, match="config.model.lora.rank=8 but the PEFT adapter"):
        load_peft_adapters(folder, dataclasses.replace(CONFIG, **fields))


# Runs ------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    from feynrl_jax.data.toy_tokenizer import build_toy_tokenizer

    root = tmp_path_factory.mktemp("lora")
    sft, dpo = [], []
    for i in range(48):
        a, b = i % 7 + 1, (i * 3) % 5 + 1
        sft.append({"prompt": f"What is {a} plus {b}?", "response": f"#### {a + b}", "answer": str(a + b)})
        dpo.append(
            {"prompt": f"What is {a} plus {b}?", "chosen": f"It is {a + b}.", "rejected": f"It is {a + b + 1}!!"}
        )
    for name, rows in (("sft", sft), ("dpo", dpo)):
        for split, part in (("train", rows[8:]), ("test", rows[:8])):
            with open(root / f"{name}_{split}.jsonl", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in part)
    texts = [r["prompt"] + " " + r["response"] for r in sft] + [r["chosen"] + " " + r["rejected"] for r in dpo]
    build_toy_tokenizer(texts, vocab_size=280).save_pretrained(root / "tokenizer")
    return root


def tiny_run_config(root, paradigm: str, run_dir, steps: int = 6, dropout: float = 0.0):
    from feynrl_jax.config.base import add_data_source, base_config, data_source

    config = base_config()
    config.paradigm = paradigm
    config.run_dir = str(run_dir)
    config.seed = 3
    config.model.random_init = True
    config.model.tokenizer = str(root / "tokenizer")
    arch = config.model.arch
    arch.vocab_size, arch.hidden_size, arch.intermediate_size = 288, 32, 64
    arch.num_heads, arch.num_kv_heads, arch.head_dim = 4, 2, 8
    config.model.lora.rank, config.model.lora.alpha, config.model.lora.dropout = 4, 8.0, dropout
    add_data_source(config, "toy", data_source("jsonl", path=str(root / f"{paradigm}_train.jsonl")))
    add_data_source(config, "toy_test", data_source("jsonl", path=str(root / f"{paradigm}_test.jsonl"), split="test"))
    config.data.max_seq_len = 48
    config.data.max_prompt_len = 32
    config.algo.name = paradigm
    config.algo.reference = "initial" if paradigm == "dpo" else "none"
    config.optim.lr = 1e-2
    config.optim.schedule = "constant"
    config.train.steps = steps
    config.train.global_batch_size = 8
    config.checkpoint.every_steps = 3
    config.tracking.progress_bar = False
    config.eval.during_training = paradigm == "dpo"
    config.eval.reward = ""
    config.eval.num_prompts = 8
    return config


def _losses(run_dir):
    from feynrl_jax.tracking import read_metrics

    return [r["train/loss"] for r in read_metrics(str(run_dir)) if "train/loss" in r]


def _checkpoint_params(run_dir):
    from feynrl_jax.checkpoints.train_state import TrainCheckpointer

    with TrainCheckpointer(str(run_dir), save_every=1, keep=1, read_only=True) as checkpointer:
        return checkpointer.restore_state_unsharded(checkpointer.latest_step())["params"]


@pytest.mark.slow
def test_sft_with_lora_trains_only_adapters_resumes_exactly_and_exports(data_root, tmp_path):
    from feynrl_jax.train import sft_loop
    from feynrl_jax.train.export import ADAPTER_FOLDER, export_run

    # With LoRA dropout: the masks come from (seed, step, micro-batch), so the resumed run draws the same ones.
    straight = tiny_run_config(data_root, "sft", tmp_path / "straight", dropout=0.3)
    sft_loop.run(straight)
    first = tiny_run_config(data_root, "sft", tmp_path / "resumed", steps=3, dropout=0.3)
    sft_loop.run(first)
    again = tiny_run_config(data_root, "sft", tmp_path / "resumed", dropout=0.3)
    again.checkpoint.resume = True
    sft_loop.run(again)
    losses = _losses(tmp_path / "straight")
    assert losses == _losses(tmp_path / "resumed")  # exact resume, bitwise on CPU
    assert losses[-1] < losses[0]
    # model.lora.dropout reaches the step: without it the same run trains otherwise from step 2 on (at step 1 the
    # adapters add nothing, B = 0, dropped or not).
    sft_loop.run(tiny_run_config(data_root, "sft", tmp_path / "no_dropout", steps=3))
    no_dropout = _losses(tmp_path / "no_dropout")
    assert no_dropout[0] == losses[0] and no_dropout[1:] != losses[1:3]
    params = _checkpoint_params(tmp_path / "straight")
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(_checkpoint_params(tmp_path / "resumed")), strict=True):
        np.testing.assert_array_equal(a, b)
    # The base never moved: it is the random init of the same seed without adapters.
    config = ModelConfig(
        vocab_size=288,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
    )
    initial = init_params(config, jax.random.key(3))
    for a, b in zip(jax.tree.leaves(lora.base_params(params)), jax.tree.leaves(initial), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.abs(params["layers"]["q_proj"]["lora_b"]).max() > 0

    out = export_run(tmp_path / "straight", tmp_path / "export")
    assert read_adapter_config(os.path.join(out, ADAPTER_FOLDER))["lora_rank"] == 4
    # Continuing from the exported PEFT adapter starts where the run ended: its first loss is below a fresh one's.
    cont = tiny_run_config(data_root, "sft", tmp_path / "continued", steps=1)
    cont.model.lora.init_from = os.path.join(out, ADAPTER_FOLDER)
    sft_loop.run(cont)
    fresh = tiny_run_config(data_root, "sft", tmp_path / "fresh", steps=1)
    sft_loop.run(fresh)
    assert _losses(tmp_path / "continued")[0] < _losses(tmp_path / "fresh")[0] - 0.1
    # Resuming needs the checkpoint alone: the init_from folder may be gone by then.
    shutil.rmtree(os.path.join(out, ADAPTER_FOLDER))
    cont.train.steps, cont.checkpoint.resume = 2, True
    sft_loop.run(cont)
    assert len(_losses(tmp_path / "continued")) == 2


@pytest.mark.slow
def test_sft_with_qlora_trains_and_exports_a_plain_model(data_root, tmp_path):
    from feynrl_jax.checkpoints import load_hf
    from feynrl_jax.train import sft_loop
    from feynrl_jax.train.export import export_run

    config = tiny_run_config(data_root, "sft", tmp_path / "qlora", steps=3)
    config.model.lora.quantize_base = "nf4"
    sft_loop.run(config)
    losses = _losses(tmp_path / "qlora")
    assert len(losses) == 3 and losses[-1] < losses[0]
    # The checkpoint holds the NF4 base (tests/test_lora_rl.py restores one and compares it exactly).
    params = _checkpoint_params(tmp_path / "qlora")
    assert params["layers"]["q_proj"]["kernel_nf4"].dtype == np.uint8 and "kernel" not in params["layers"]["q_proj"]
    # The export is the plain base architecture: the NF4 base dequantized, the adapters merged in.
    exported, exported_config = load_hf(export_run(tmp_path / "qlora", tmp_path / "export"))
    assert exported_config.base_quantization is None and exported_config.lora_rank == 0
    assert exported["layers"]["q_proj"]["kernel"].shape == (2, 32, 4, 8)


@pytest.mark.slow
@pytest.mark.parametrize("quantize_base", ["", "nf4"])
def test_dpo_with_lora_starts_at_log_2_against_the_base_and_learns(data_root, tmp_path, quantize_base):
    from feynrl_jax.tracking import read_metrics
    from feynrl_jax.train import dpo_loop

    config = tiny_run_config(data_root, "dpo", tmp_path / "dpo")
    # QLoRA: the reference is the policy's own NF4 base, run by the base model's program in its stored form.
    config.model.lora.quantize_base = quantize_base
    config.train.eval_every = 6
    dpo_loop.run(config)
    losses = _losses(tmp_path / "dpo")
    # Fresh adapters (B = 0) make the policy equal to its reference, the base with adapters off: -log sigmoid(0).
    np.testing.assert_allclose(losses[0], np.log(2.0), rtol=1e-6)
    assert losses[-1] < losses[0]
    evals = {r["step"]: r for r in read_metrics(str(tmp_path / "dpo")) if "eval/reward_margin" in r}
    assert evals[0]["eval/reward_margin"] == 0.0 and evals[6]["eval/reward_margin"] > 0


def test_the_initial_reference_is_the_starting_policy_without_a_copy_of_the_base(tmp_path):
    from feynrl_jax.train import run_setup

    params = trained_adapters(init_params(CONFIG, jax.random.key(0)))
    reference = run_setup.lora_reference(params, CONFIG, lora_init_from=None)
    assert all(a is b for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(lora.base_params(params))))
    # Started from a PEFT adapter: the base (same arrays) plus that adapter, read from its folder.
    folder = export_peft(params, CONFIG, str(tmp_path / "adapter"))
    fresh = init_params(CONFIG, jax.random.key(0))
    reference = run_setup.lora_reference(fresh, CONFIG, lora_init_from=folder)
    base_leaves = jax.tree.leaves(lora.base_params(fresh))
    assert all(any(a is b for b in base_leaves) for a in jax.tree.leaves(lora.base_params(reference)))
    np.testing.assert_allclose(model_logits(reference, CONFIG), model_logits(params, CONFIG), atol=0, rtol=0)
