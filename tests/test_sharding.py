"""Meshes, rules tables, placement and resharding on 8 fake CPU devices (set in conftest.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from feynrl_jax.sharding import (
    RULES,
    batch_sharding,
    get_rules,
    logical_to_pspec,
    make_mesh,
    optimizer_state_shardings,
    param_shardings,
    place_batch,
    place_process_batch,
    place_tree,
    reshard,
    reshard_to_mesh,
    resolve_mesh_shape,
    tree_bytes_per_device,
)

# Every logical name of docs/CONTRACTS.md.
PARAM_NAMES = ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "layers", "norm", "lora_rank", "quant_blocks")

# A params-like pytree with contract logical axes: L=2, D=16, H=4, K=2, Dh=8, F=32, V=64.
AXES = {
    "embed": {"embedding": ("vocab", "embed")},
    "layers": {
        "attn_norm": {"scale": ("layers", "norm")},
        "q_proj": {"kernel": ("layers", "embed", "heads", "head_dim")},
        "k_proj": {"kernel": ("layers", "embed", "kv_heads", "head_dim")},
        "o_proj": {"kernel": ("layers", "heads", "head_dim", "embed")},
        "up_proj": {"kernel": ("layers", "embed", "mlp")},
        "down_proj": {"kernel": ("layers", "mlp", "embed")},
    },
    "final_norm": {"scale": ("norm",)},
}
SHAPES = {
    "embed": {"embedding": (64, 16)},
    "layers": {
        "attn_norm": {"scale": (2, 16)},
        "q_proj": {"kernel": (2, 16, 4, 8)},
        "k_proj": {"kernel": (2, 16, 2, 8)},
        "o_proj": {"kernel": (2, 4, 8, 16)},
        "up_proj": {"kernel": (2, 16, 32)},
        "down_proj": {"kernel": (2, 32, 16)},
    },
    "final_norm": {"scale": (16,)},
}


def _params(seed: int = 0):
    shapes = jax.tree.map(lambda s: s, SHAPES, is_leaf=lambda x: isinstance(x, tuple))
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    rng = np.random.default_rng(seed)
    return jax.tree.unflatten(treedef, [rng.standard_normal(s).astype(np.float32) for s in leaves])


# ---------------------------------------------------------------- mesh


@pytest.mark.parametrize(
    "sizes, expected",
    [((1, -1, 1), (1, 8, 1)), ((2, -1, 2), (2, 2, 2)), ((-1, 1, 1), (8, 1, 1)), ((1, 4, -1), (1, 4, 2))],
)
def test_mesh_fills_the_free_axis(sizes, expected):
    assert resolve_mesh_shape(*sizes, num_devices=8) == expected
    mesh = make_mesh(*sizes)
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert tuple(mesh.shape.values()) == expected
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


@pytest.mark.parametrize(
    "sizes, message",
    [
        ((3, -1, 1), r"mesh.fsdp=-1 cannot fill the mesh: data=3 .* does not divide the 8 devices"),
        ((2, 2, 1), r"uses 4 devices but 8 are available"),
        ((-1, -1, 1), r"at most one mesh axis may be -1"),
        ((1, 0, 1), r"mesh.fsdp must be a positive integer or -1"),
        ((1, -2, 8), r"mesh.fsdp must be a positive integer or -1"),
    ],
)
def test_mesh_rejects_sizes_that_do_not_fit(sizes, message):
    with pytest.raises(ValueError, match=message):
        make_mesh(*sizes)


def test_mesh_on_a_subset_of_devices_keeps_their_order():
    devices = jax.devices()[4:]
    mesh = make_mesh(1, 2, 2, devices=devices)
    assert [d.id for d in mesh.devices.flat] == [d.id for d in devices]


# ---------------------------------------------------------------- rules


@pytest.mark.parametrize("name", sorted(RULES))
def test_every_rules_table_covers_every_contract_name(name):
    table = dict(get_rules(name))
    assert set(PARAM_NAMES) == set(table)


def test_unknown_rules_and_names_are_rejected():
    with pytest.raises(ValueError, match="unknown sharding rules 'zero3'"):
        get_rules("zero3")
    with pytest.raises(ValueError, match="logical axis 'experts' has no entry"):
        logical_to_pspec(("experts", "embed"), RULES["fsdp"])


def test_logical_to_pspec_per_strategy():
    mesh = make_mesh(1, 4, 2)
    q_axes, q_shape = ("layers", "embed", "heads", "head_dim"), (2, 16, 4, 8)
    assert logical_to_pspec(q_axes, RULES["dp"], shape=q_shape, mesh=mesh) == PartitionSpec(None, None, None, None)
    assert logical_to_pspec(q_axes, RULES["fsdp"], shape=q_shape, mesh=mesh) == PartitionSpec(None, "fsdp", None, None)
    assert logical_to_pspec(q_axes, RULES["fsdp_tp"], shape=q_shape, mesh=mesh) == PartitionSpec(
        None, "fsdp", "tensor", None
    )
    # Without a mesh nothing is dropped for size.
    assert logical_to_pspec(("vocab", "embed"), RULES["fsdp_tp"]) == PartitionSpec("tensor", "fsdp")


def test_indivisible_dimension_falls_back_to_replication():
    mesh = make_mesh(1, 4, 2)
    # 9 heads (SmolLM2-135M) do not split over tensor=2; 30 is not a multiple of fsdp=4.
    spec = logical_to_pspec(("layers", "embed", "heads", "head_dim"), RULES["fsdp_tp"], shape=(2, 30, 9, 8), mesh=mesh)
    assert spec == PartitionSpec(None, None, None, None)


def test_a_mesh_axis_is_used_once_per_array():
    rules = (("a", "fsdp"), ("b", "fsdp"))
    assert logical_to_pspec(("a", "b"), rules, shape=(8, 8), mesh=make_mesh(1, 8, 1)) == PartitionSpec("fsdp", None)


def test_param_shardings_rank_mismatch_names_the_parameter():
    bad_axes = {"w": ("embed",)}
    with pytest.raises(ValueError, match=r"parameter \['w'\]: logical axes \('embed',\) have rank 1"):
        param_shardings(bad_axes, make_mesh(1, 8, 1), RULES["fsdp"], shapes={"w": np.zeros((4, 4))})


@pytest.mark.parametrize("rules_name, sizes", [("fsdp", (1, 8, 1)), ("fsdp_tp", (1, 4, 2)), ("dp", (8, 1, 1))])
def test_place_params_keeps_values_and_splits_bytes(rules_name, sizes):
    mesh = make_mesh(*sizes)
    params = _params()
    shardings = param_shardings(AXES, mesh, RULES[rules_name], shapes=params)
    placed = place_tree(params, shardings)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, placed), params)
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    per_device = tree_bytes_per_device(placed)
    assert len(per_device) == 8
    if rules_name == "dp":
        assert set(per_device.values()) == {total}
    else:
        # Norm scales stay replicated; everything else is split 8 ways.
        norm_leaves = (params["final_norm"]["scale"], params["layers"]["attn_norm"]["scale"])
        norms = sum(x.nbytes for x in norm_leaves)
        assert max(per_device.values()) == pytest.approx((total - norms) / 8 + norms)


def test_optimizer_state_follows_param_shardings():
    mesh = make_mesh(1, 8, 1)
    params = _params()
    shardings = param_shardings(AXES, mesh, RULES["fsdp"], shapes=params)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    opt_shardings = optimizer_state_shardings(optimizer.init, params, shardings, mesh)
    adam_state = opt_shardings[1][0]
    assert adam_state.mu == shardings and adam_state.nu == shardings
    assert adam_state.count.spec == PartitionSpec()
    opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(place_tree(params, shardings))
    assert opt_state[1][0].mu["layers"]["q_proj"]["kernel"].sharding.spec == PartitionSpec(None, "fsdp", None, None)
    params_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    # mu and nu: twice the params, split 8 ways up to the replicated norms and counters.
    assert max(tree_bytes_per_device(opt_state).values()) < 2 * params_bytes / 8 * 1.2


def test_place_batch_splits_rows_and_rejects_ragged_batches():
    mesh = make_mesh(2, 4, 1)
    batch = {"tokens": np.arange(16 * 5).reshape(16, 5), "mask": np.ones((16, 5), np.float32), "extra": None}
    placed = place_batch(batch, mesh)
    assert placed["extra"] is None
    assert placed["tokens"].sharding == batch_sharding(mesh)
    assert {s.data.shape for s in placed["tokens"].addressable_shards} == {(2, 5)}
    np.testing.assert_array_equal(np.asarray(placed["tokens"]), batch["tokens"])
    with pytest.raises(ValueError, match=r"batch field \['tokens'\] has 12 rows, not a multiple of 8"):
        place_batch({"tokens": np.zeros((12, 5))}, mesh)


def test_process_local_batch_on_one_process_equals_the_global_batch():
    mesh = make_mesh(1, 8, 1)
    batch = {"tokens": np.arange(8 * 3).reshape(8, 3)}
    local = place_process_batch(batch, mesh)
    assert local["tokens"].sharding.is_equivalent_to(place_batch(batch, mesh)["tokens"].sharding, 2)
    np.testing.assert_array_equal(np.asarray(local["tokens"]), batch["tokens"])
    with pytest.raises(ValueError, match=r"has 6 local rows, not a multiple of 8"):
        place_process_batch({"tokens": np.zeros((6, 3))}, mesh)


# ---------------------------------------------------------------- reshard


def test_reshard_trainer_mesh_to_rollout_mesh():
    params = _params(1)
    trainer_mesh = make_mesh(1, 4, 2)
    trained = place_tree(params, param_shardings(AXES, trainer_mesh, RULES["fsdp_tp"], shapes=params))
    # A rollout engine on the last 4 devices with tensor parallelism only.
    rollout_mesh = make_mesh(1, 1, 4, devices=jax.devices()[4:])
    moved = reshard_to_mesh(trained, AXES, rollout_mesh, RULES["fsdp_tp"])
    q = moved["layers"]["q_proj"]["kernel"]
    assert q.sharding.mesh == rollout_mesh and q.sharding.spec == PartitionSpec(None, None, "tensor", None)
    assert {d.id for d in q.devices()} == {4, 5, 6, 7}
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, moved), params)
    # And back to one device, replicated, donating the source buffers.
    single = NamedSharding(make_mesh(1, 1, 1, devices=jax.devices()[:1]), PartitionSpec())
    back = reshard(moved, jax.tree.map(lambda _: single, moved), donate=True)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, back), params)


def test_reshard_rejects_mismatched_trees_and_shapes():
    mesh = make_mesh(1, 8, 1)
    x = {"w": jnp.zeros((6, 4))}
    with pytest.raises(ValueError, match="different structures"):
        reshard(x, {"v": NamedSharding(mesh, PartitionSpec())})
    with pytest.raises(ValueError, match=r"cannot reshard \['w'\] of shape \(6, 4\)"):
        reshard(x, {"w": NamedSharding(mesh, PartitionSpec("fsdp"))})
