"""Orbax checkpoints of a training run: the train state plus everything needed to continue it exactly.

One checkpoint step is a folder `<run_dir>/checkpoints/<step>/` with five orbax items:

| item | handler | holds |
|---|---|---|
| `state` | `StandardSave` / `StandardRestore` | the train-state pytree (params, optimizer state, step counter) |
| `data` | `JsonSave` | the data iterator's state (grain / mixture state, JSON) |
| `rng` | `JsonSave` | the run's PRNG key: its implementation name and raw key data |
| `progress` | `JsonSave` | the step and the policy version |
| `config` | `JsonSave` | the run's config as a plain dict (what `export` and `eval` read back) |

Atomicity. Orbax writes a step into `<step>.orbax-checkpoint-tmp-<n>` and renames it to `<step>` only after
every item and the step metadata are on disk (`AtomicRenameTemporaryPath`); a rename is atomic on POSIX file
systems, so a process killed at any moment leaves either a complete step folder or a temporary one, which
`latest_step` ignores and the next `TrainCheckpointer` removes. Old steps beyond `keep` are first renamed into
`checkpoints/_deleted/` (atomic) and only then removed, so a kill during clean-up never leaves a half-deleted
folder under a step name either.

Saves are asynchronous: `save` returns once the arrays are copied off the accelerator; the files are written
by a background thread while training continues. The next save (or `wait_until_finished`/`close`) waits for
the previous one.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import os
import shutil
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)

CHECKPOINT_SUBDIR = "checkpoints"
DELETED_SUBDIR = "_deleted"
ITEMS = ("state", "data", "rng", "progress", "config")
TMP_MARKER = ".orbax-checkpoint-tmp"  # in the name of a step folder that is still being written


@dataclasses.dataclass(frozen=True)
class RunProgress:
    """Everything besides the train-state pytree that a resume needs.

    Attributes:
        step: the number of optimizer steps completed when the checkpoint was taken.
        rng: the run's PRNG key after `step` steps (a typed key `jax.random.key(...)` or a raw `uint32[2]` key).
        data_state: the data iterator's state, JSON-serialisable (dicts, lists, strings, numbers, bytes).
        policy_version: version of the policy weights (RL loops bump it on every publish; SFT/DPO keep it equal
            to `step`).
        config: the run's config as a plain, JSON-serialisable dict.
    """

    step: int
    rng: Any
    data_state: Any
    policy_version: int
    config: Mapping[str, Any]


def checkpoint_dir(run_dir: str | os.PathLike) -> str:
    """The folder that holds a run's orbax steps: `<run_dir>/checkpoints`."""
    return os.path.join(os.path.abspath(os.fspath(run_dir)), CHECKPOINT_SUBDIR)


def abstract_like(state: Any) -> Any:
    """The restore target of `state`: a pytree of `jax.ShapeDtypeStruct` with each leaf's sharding.

    Args:
        state: a pytree of `jax.Array` (or NumPy arrays, restored onto the default device).

    Returns:
        The same tree with every leaf replaced by `ShapeDtypeStruct(shape, dtype, sharding=leaf.sharding)`.
    """

    def leaf(x):
        sharding = getattr(x, "sharding", None)
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)

    return jax.tree.map(leaf, state)


def _encode_rng(rng: Any) -> dict:
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        return {"impl": str(jax.random.key_impl(rng)), "data": np.asarray(jax.random.key_data(rng)).tolist()}
    if rng.dtype != jnp.uint32:
        raise TypeError(f"checkpoint rng must be a typed PRNG key or a uint32 raw key, got dtype {rng.dtype}")
    return {"impl": None, "data": np.asarray(rng).tolist()}


def _decode_rng(payload: Mapping[str, Any]) -> jax.Array:
    data = jnp.asarray(np.asarray(payload["data"], dtype=np.uint32))
    if payload["impl"] is None:
        return data
    return jax.random.wrap_key_data(data, impl=payload["impl"])


def _encode_json(value: Any) -> Any:
    """Makes a data-iterator state JSON-safe: bytes become `{"__bytes_b64__": ...}`, tuples become lists."""
    if isinstance(value, bytes):
        return {"__bytes_b64__": base64.b64encode(value).decode("ascii")}
    if isinstance(value, Mapping):
        return {str(k): _encode_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_encode_json(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def _decode_json(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__bytes_b64__"}:
            return base64.b64decode(value["__bytes_b64__"])
        return {k: _decode_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode_json(v) for v in value]
    return value


class TrainCheckpointer:
    """Saves and restores a run's train state and progress with an orbax `CheckpointManager`.

    Args:
        run_dir: the run folder; checkpoints live in `<run_dir>/checkpoints/`.
        save_every: save when `step % save_every == 0` (and whenever `save(..., force=True)`).
        keep: how many most recent steps to keep (older ones are deleted after a newer one is committed).
        async_save: write files in a background thread (`save` returns after the device-to-host copy).
        read_only: only read (export, inspection): nothing in the folder is created, cleaned or deleted, so a
            run that is training in it is not disturbed.

    Use as a context manager or call `close()` at the end: it waits for the last save to commit.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        save_every: int,
        keep: int,
        async_save: bool = True,
        read_only: bool = False,
    ):
        if save_every < 1:
            raise ValueError(f"checkpoint.save_every must be >= 1, got {save_every}")
        if keep < 1:
            raise ValueError(f"checkpoint.keep must be >= 1, got {keep}")
        self.directory = checkpoint_dir(run_dir)
        self.save_every = save_every
        self.read_only = read_only
        if read_only:
            if not os.path.isdir(self.directory):
                raise FileNotFoundError(f"no checkpoint folder {self.directory}")
        else:
            os.makedirs(self.directory, exist_ok=True)
            self._purge_deleted()
            self._remove_unfinished()
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=1,  # the interval is decided here (`force` must be able to override it)
            max_to_keep=keep,
            create=not read_only,
            read_only=read_only,
            cleanup_tmp_directories=not read_only,
            enable_async_checkpointing=async_save,
            todelete_subdir=DELETED_SUBDIR,
        )
        self._manager = ocp.CheckpointManager(self.directory, item_names=ITEMS, options=options)

    # -- queries ---------------------------------------------------------------------------------------------

    def latest_step(self) -> int | None:
        """The newest committed step, or None when the folder holds no complete checkpoint."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Every committed step, ascending (temporary folders of unfinished saves are never listed)."""
        return sorted(self._manager.all_steps())

    def should_save(self, step: int) -> bool:
        """Whether `save(step, ...)` would write (the interval rule, and not already saved)."""
        return step % self.save_every == 0 and step not in self._manager.all_steps()

    # -- save / restore --------------------------------------------------------------------------------------

    def save(self, state: Any, progress: RunProgress, *, force: bool = False) -> bool:
        """Starts saving `state` and `progress` as step `progress.step` when due (or `force`).

        The state's arrays are copied to host before this returns, so the caller may donate or overwrite them.

        Args:
            state: the train-state pytree of `jax.Array`.
            progress: step, RNG, data-iterator state, policy version and config at this step.
            force: save even when `progress.step` is not a multiple of `save_every` (e.g. the final step).

        Returns:
            True when a save was started.
        """
        step = int(progress.step)
        if step in self._manager.all_steps():
            return False
        if not force and step % self.save_every != 0:
            return False
        self._purge_deleted()
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave({"state": _encode_json(progress.data_state)}),
            rng=ocp.args.JsonSave(_encode_rng(progress.rng)),
            progress=ocp.args.JsonSave({"step": step, "policy_version": int(progress.policy_version)}),
            config=ocp.args.JsonSave(_encode_json(dict(progress.config))),
        )
        saved = self._manager.save(step, args=args, force=True)
        if saved:
            log.info("checkpoint: saving step %d to %s", step, self.directory)
        return bool(saved)

    def restore(self, abstract_state: Any, *, step: int | None = None) -> tuple[Any, RunProgress]:
        """Restores a committed step into the shapes, dtypes and shardings of `abstract_state`.

        Args:
            abstract_state: the target pytree, leaves `jax.ShapeDtypeStruct` with `sharding` set (see
                `abstract_like`), or concrete arrays whose shardings are reused.
            step: the step to restore; the newest committed one when None.

        Returns:
            `(state, progress)`.

        Raises:
            FileNotFoundError: no committed checkpoint (or not `step`) exists.
            ValueError: the checkpoint's tree does not match `abstract_state` (names the mismatch).
        """
        steps = self._manager.all_steps()
        if step is None:
            step = self._manager.latest_step()
            if step is None:
                raise FileNotFoundError(f"no committed checkpoint in {self.directory}")
        elif step not in steps:
            raise FileNotFoundError(f"checkpoint step {step} not found in {self.directory}; committed: {sorted(steps)}")
        target = abstract_like(abstract_state)
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(target),
            data=ocp.args.JsonRestore(),
            rng=ocp.args.JsonRestore(),
            progress=ocp.args.JsonRestore(),
            config=ocp.args.JsonRestore(),
        )
        try:
            restored = self._manager.restore(step, args=args)
        except (ValueError, KeyError) as err:
            raise ValueError(
                f"checkpoint {os.path.join(self.directory, str(step))} does not match the train state of this "
                f"run (model or optimizer changed?): {err}"
            ) from err
        meta = restored["progress"]
        progress = RunProgress(
            step=int(meta["step"]),
            rng=_decode_rng(restored["rng"]),
            data_state=_decode_json(restored["data"]["state"]),
            policy_version=int(meta["policy_version"]),
            config=restored["config"],
        )
        return restored["state"], progress

    def restore_config(self, step: int | None = None) -> dict:
        """The config dict saved with `step` (newest when None), without reading the arrays."""
        step = self._require_step(step)
        restored = self._manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
        return restored["config"]

    def restore_state_unsharded(self, step: int | None = None) -> Any:
        """The saved train state as host NumPy arrays, without a target tree (for export and inspection)."""
        step = self._require_step(step)
        path = os.path.join(self.directory, str(step), "state")
        with ocp.StandardCheckpointer() as checkpointer:
            metadata = checkpointer.metadata(path).item_metadata
            target = jax.tree.map(
                lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=_host_sharding()),
                metadata,
                is_leaf=lambda m: hasattr(m, "shape") and hasattr(m, "dtype"),
            )
            state = checkpointer.restore(path, target)
        return jax.tree.map(np.asarray, state)

    # -- lifecycle -------------------------------------------------------------------------------------------

    def wait_until_finished(self) -> None:
        """Blocks until the last started save is committed (re-raises its error, if any)."""
        self._manager.wait_until_finished()
        self._purge_deleted()

    def close(self) -> None:
        """Waits for pending saves and releases the manager's threads."""
        self._manager.wait_until_finished()
        self._manager.close()
        self._purge_deleted()

    def __enter__(self) -> TrainCheckpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _require_step(self, step: int | None) -> int:
        steps = self._manager.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(f"no committed checkpoint in {self.directory}")
            return max(steps)
        if step not in steps:
            raise FileNotFoundError(f"checkpoint step {step} not found in {self.directory}; committed: {sorted(steps)}")
        return step

    def _remove_unfinished(self) -> None:
        """Deletes the temporary folders of saves that never committed (a killed writer), synchronously.

        Orbax's own clean-up may run in the background; doing it here makes the folder clean before the first
        save. Only the run's single writer constructs a non-read-only checkpointer, so nothing is in flight.
        """
        for name in os.listdir(self.directory):
            if TMP_MARKER in name:
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    def _purge_deleted(self) -> None:
        """Removes steps that orbax has already moved out of the step namespace (atomic rename).

        Orbax moves old steps there from its finalize thread, so this runs only while no save is in flight.
        """
        manager = getattr(self, "_manager", None)
        if self.read_only or (manager is not None and manager.is_saving_in_progress()):
            return
        trash = os.path.join(self.directory, DELETED_SUBDIR)
        if os.path.isdir(trash):
            shutil.rmtree(trash, ignore_errors=True)


def _host_sharding() -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])


def latest_step(run_dir: str | os.PathLike) -> int | None:
    """The newest committed checkpoint step of a run folder (None when there is none), without side effects."""
    directory = checkpoint_dir(run_dir)
    if not os.path.isdir(directory):
        return None
    steps = []
    for name in os.listdir(directory):
        if name.isdigit() and os.path.isdir(os.path.join(directory, name)):
            steps.append(int(name))
    return max(steps) if steps else None
