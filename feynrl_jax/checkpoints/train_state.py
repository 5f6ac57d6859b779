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
systems, so a process killed at any moment leaves either a complete step folder or a temporary one, which the
next `TrainCheckpointer` removes. Old steps beyond `keep` are first renamed into `checkpoints/_deleted/`
(atomic) and only then removed, so a kill during clean-up never leaves a half-deleted folder under a step name
either.

Committed and usable steps. Orbax lists every folder with a step's name; this module trusts only a committed
one: a step folder whose commit marker orbax wrote on finalize, `commit_success.txt` (orbax >= 0.12) or a
`commit_timestamp_nsecs` in its step metadata `_CHECKPOINT_METADATA` (every supported version). A folder
without either (copied in part, or a marker removed) is not a checkpoint: it is never listed or restored, and
a writing `TrainCheckpointer` moves it into `checkpoints/_unusable/` at start-up. A committed step can still
be damaged later (a truncated or deleted file, a corrupt JSON item, a bad array): `restore()` without a step
then logs why and falls back to the previous committed step, and moves the damaged folder into `_unusable/`
as well, so it neither blocks the re-save of its step nor counts toward `keep` (orbax's `max_to_keep` keeps
the newest `keep` step folders it lists, damaged or not, and would delete the intact fallback first). Nothing
is ever deleted for being unusable; when no step is usable, nothing is moved and the run stops with an
`InputError` naming every step's problem.

Several processes (a multi-host job) share one checkpoint folder, which must then be on a file system every
host sees (or a bucket): every process writes the shards of the arrays its devices hold and reads them back
(orbax coordinates the commit), process 0 alone writes the JSON items and does the housekeeping above (removing
unfinished saves, setting steps aside, purging deleted ones), and the others wait for it at a barrier. Every
barrier, ours and orbax's, is one of the coordination service's (`jax.distributed`), never a device collective:
an asynchronous save finishes in a background thread while the training thread runs the next step's
collectives, and two threads' collectives interleaved differently on two processes mismatch (on CPU, gloo
aborts with "Received data size doesn't match expected size").

Saves are asynchronous: `save` returns once the arrays are copied off the accelerator; the files are written
by a background thread while training continues. The next save (or `wait_until_finished`/`close`, or a
restore) waits for the previous one.

Replicated arrays. In a job of several processes, orbax splits a replicated array among its replicas so that each
host writes a part ("replica-parallel"). In one process every part would be written by that process anyway, and
splitting costs a slice per device and leaf, each compiled on first use: about 5 s at a run's first save of a
tiny model on 8 CPU devices. So a one-process job writes each replicated array from its first replica whole
(`_arrays_written_by_replicas`); the files read back the same either way.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint._src.metadata import array_metadata_store
from orbax.checkpoint._src.serialization import type_handler_registry

from feynrl_jax.checkpoints.hf_safetensors import CheckpointError
from feynrl_jax.errors import InputError

log = logging.getLogger(__name__)

CHECKPOINT_SUBDIR = "checkpoints"
DELETED_SUBDIR = "_deleted"
UNUSABLE_SUBDIR = "_unusable"  # step folders set aside (uncommitted or damaged), never deleted by this module
ITEMS = ("state", "data", "rng", "progress", "config")
TMP_MARKER = ".orbax-checkpoint-tmp"  # in the name of a step folder that is still being written
COMMIT_MARKER = ocp.path.atomicity.COMMIT_SUCCESS_FILE  # "commit_success.txt", written by orbax >= 0.12 on finalize
STEP_METADATA = "_CHECKPOINT_METADATA"  # orbax's step metadata; finalize sets its commit_timestamp_nsecs
READ_ERRORS = (OSError, ValueError, KeyError, TypeError)
"""What reading a damaged step raises: missing files (OSError), bad JSON or arrays (ValueError, from tensorstore
too), JSON of the wrong layout (KeyError, TypeError)."""


class CheckpointWriteError(InputError):
    """A checkpoint that could not be written (a full disk, a file-size limit, permissions); names the step."""


class MissingCheckpoint(InputError, FileNotFoundError):
    """No checkpoint folder, no committed step, or not the requested step; the message names the folder."""


_ONE_PROCESS: dict[str, bool] = {}  # the job kind orbax's array handler was last set for in this process


def _arrays_written_by_replicas(one_process: bool) -> None:
    """Sets how orbax writes a replicated `jax.Array` in this process (see the module docstring): whole from its
    first replica in a one-process job, orbax's own default in a job of several (split among the replicas on CPUs
    and TPUs, not on GPUs). Orbax's handler for arrays is one per process; it is replaced only when the job kind
    changes."""
    if _ONE_PROCESS.get("set") == one_process:
        return
    _ONE_PROCESS["set"] = one_process
    # The registry's own `add`: `register_type_handler` would log a warning about the override in every run.
    type_handler_registry.GLOBAL_TYPE_HANDLER_REGISTRY.add(
        jax.Array,
        ocp.type_handlers.ArrayHandler(
            use_replica_parallel=False if one_process else None, array_metadata_store=array_metadata_store.Store()
        ),
        override=True,
        ignore_warnings=True,
    )


def _is_committed(step_dir: str) -> bool:
    """Whether orbax finalized `step_dir`: its commit marker, or a commit time in its step metadata."""
    if os.path.isfile(os.path.join(step_dir, COMMIT_MARKER)):
        return True
    try:
        with open(os.path.join(step_dir, STEP_METADATA), encoding="utf-8") as f:
            metadata = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(metadata, dict) and isinstance(metadata.get("commit_timestamp_nsecs"), int)


def _step_folders(directory: str) -> dict[int, str]:
    """Every folder of `directory` named like a step (digits), committed or not: step -> path."""
    if not os.path.isdir(directory):
        return {}
    return {
        int(name): os.path.join(directory, name)
        for name in os.listdir(directory)
        if name.isdigit() and os.path.isdir(os.path.join(directory, name))
    }


def _committed_steps(directory: str) -> list[int]:
    return sorted(step for step, path in _step_folders(directory).items() if _is_committed(path))


def _reason(error: BaseException) -> str:
    """A one-line account of a read error (orbax's and tensorstore's messages can span many lines)."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:300]}"


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
        self._pending_step: int | None = None  # the step of the last save started
        if read_only:
            if not os.path.isdir(self.directory):
                raise MissingCheckpoint(f"no checkpoint folder {self.directory}")
        else:
            if _primary():
                os.makedirs(self.directory, exist_ok=True)
                self._purge_deleted()
                self._remove_unfinished()
                self._set_aside_uncommitted()
            _barrier("checkpoint folder ready")
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=1,  # the interval is decided here (`force` must be able to override it)
            max_to_keep=keep,
            create=False,  # made above
            # Naming every process routes orbax's barriers through the coordination service (see the docstring).
            multiprocessing_options=ocp.options.MultiprocessingOptions(active_processes=_all_processes()),
            read_only=read_only,
            cleanup_tmp_directories=not read_only,
            enable_async_checkpointing=async_save,
            todelete_subdir=DELETED_SUBDIR,
        )
        _arrays_written_by_replicas(jax.process_count() == 1)
        self._manager = ocp.CheckpointManager(self.directory, item_names=ITEMS, options=options)

    # -- queries ---------------------------------------------------------------------------------------------

    def latest_step(self) -> int | None:
        """The newest committed step (see the module docstring), or None when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """Every committed step, ascending (unfinished saves and folders without a commit marker are left out)."""
        return [step for step in sorted(self._manager.all_steps()) if _is_committed(self._step_dir(step))]

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
        with self._writing(step):
            saved = self._manager.save(step, args=args, force=True)
        if saved:
            self._pending_step = step
            log.info("checkpoint: saving step %d to %s", step, self.directory)
        return bool(saved)

    def restore(self, abstract_state: Any, *, step: int | None = None) -> tuple[Any, RunProgress]:
        """Restores a committed step into the shapes, dtypes and shardings of `abstract_state`.

        Without `step`, the newest committed step that reads back is restored: a damaged one (a missing or
        truncated file, corrupt JSON, a bad array) is skipped with a warning naming its folder and why, and the
        previous one is tried. Once one restores, the skipped folders are moved into `checkpoints/_unusable/`
        (not in a read-only checkpointer), so the run can save their steps again and `keep` counts only
        usable steps.

        Args:
            abstract_state: the target pytree, leaves `jax.ShapeDtypeStruct` with `sharding` set (see
                `abstract_like`), or concrete arrays whose shardings are reused.
            step: the step to restore (no fall-back); the newest usable one when None.

        Returns:
            `(state, progress)`.

        Raises:
            MissingCheckpoint: no committed checkpoint, or `step` is not a committed step.
            CheckpointError: `step` (or, without `step`, every committed step) cannot be read, naming each
                step folder and its problem; or the saved train state does not match `abstract_state` (tree or
                shapes: the model or optimizer changed), naming the step folder and the first difference.
        """
        self._manager.wait_until_finished()  # a save of this checkpointer still in flight commits first
        target = abstract_like(abstract_state)
        if step is not None:
            self._require_step(step)
            try:
                return self._restore_step(step, target)
            except CheckpointError:
                raise
            except READ_ERRORS as error:
                raise CheckpointError(
                    f"checkpoint step folder {self._step_dir(step)} cannot be read: {_reason(error)}"
                ) from error
        steps = self.all_steps()
        if not steps:
            raise MissingCheckpoint(f"no committed checkpoint in {self.directory}")
        skipped: dict[int, str] = {}
        for candidate in reversed(steps):
            try:
                restored = self._restore_step(candidate, target)
            except CheckpointError:  # a mismatch, not damage: every older step would fail the same way
                raise
            except READ_ERRORS as error:
                skipped[candidate] = _reason(error)
                log.warning(
                    "checkpoint step folder %s cannot be read (%s); trying the previous committed step",
                    self._step_dir(candidate),
                    skipped[candidate],
                )
                continue
            if skipped:
                self._set_aside_damaged(skipped, candidate)
            return restored
        problems = "; ".join(f"step {s} ({self._step_dir(s)}): {why}" for s, why in skipped.items())
        raise CheckpointError(
            f"no checkpoint in {self.directory} can be read: {problems}. Nothing was moved or deleted; repair "
            "or remove these step folders (or choose another run_dir) to go on"
        )

    def _restore_step(self, step: int, target: Any) -> tuple[Any, RunProgress]:
        """Reads one committed step; `READ_ERRORS` when it is damaged, `CheckpointError` when it does not fit."""
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(target),
            data=ocp.args.JsonRestore(),
            rng=ocp.args.JsonRestore(),
            progress=ocp.args.JsonRestore(),
            config=ocp.args.JsonRestore(),
        )
        try:
            restored = self._manager.restore(step, args=args)
        except READ_ERRORS:
            # Orbax raises ValueError for a target that does not fit as for a damaged file; tell them apart.
            difference = self._difference(step, target)
            if difference:
                raise CheckpointError(
                    f"checkpoint {self._step_dir(step)} does not match the train state of this run (model or "
                    f"optimizer changed?): {difference}"
                ) from None
            raise
        meta = restored["progress"]
        progress = RunProgress(
            step=int(meta["step"]),
            rng=_decode_rng(restored["rng"]),
            data_state=_decode_json(restored["data"]["state"]),
            policy_version=int(meta["policy_version"]),
            config=restored["config"],
        )
        if progress.step != step:
            raise ValueError(f"its progress item says step {progress.step}")
        if not isinstance(progress.config, Mapping):
            raise TypeError(f"its config item is a {type(progress.config).__name__}, not a mapping")
        return restored["state"], progress

    def _difference(self, step: int, target: Any) -> str | None:
        """How the saved state's tree or shapes (its metadata) differ from `target`; None when they agree or
        the metadata cannot be read (a damaged step)."""
        try:
            with ocp.StandardCheckpointer() as checkpointer:
                metadata = checkpointer.metadata(os.path.join(self._step_dir(step), "state")).item_metadata
        except READ_ERRORS:
            return None
        if metadata is None:  # orbax returns None (and logs why) when the arrays' metadata cannot be read
            return None
        saved, wanted = ocp.tree.to_flat_dict(metadata), ocp.tree.to_flat_dict(target)
        missing, extra = sorted(set(wanted) - set(saved)), sorted(set(saved) - set(wanted))
        if missing or extra:
            names = lambda keys: ["/".join(map(str, k)) for k in keys[:5]]  # noqa: E731
            return (
                f"entries missing from the checkpoint: {names(missing)}, entries this run does not have: {names(extra)}"
            )
        for keys, leaf in wanted.items():
            have = getattr(saved[keys], "shape", None)
            if have is not None and tuple(have) != tuple(leaf.shape):
                return f"{'/'.join(map(str, keys))} has shape {tuple(have)} there, {tuple(leaf.shape)} here"
        return None

    def restore_config(self, step: int | None = None) -> dict:
        """The config dict saved with `step` (newest committed when None), without reading the arrays.

        Raises:
            MissingCheckpoint: no such committed step.
            CheckpointError: the step's config item cannot be read (names the step folder).
        """
        self._manager.wait_until_finished()
        step = self._require_step(step)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
        except READ_ERRORS as error:
            raise CheckpointError(
                f"checkpoint step folder {self._step_dir(step)} cannot be read: {_reason(error)}"
            ) from error
        return restored["config"]

    def restore_state_unsharded(self, step: int | None = None) -> Any:
        """The saved train state as host NumPy arrays, without a target tree (for export and inspection).

        Raises:
            MissingCheckpoint: no such committed step.
            CheckpointError: the step's state cannot be read (names the step folder).
        """
        self._manager.wait_until_finished()
        step = self._require_step(step)
        path = os.path.join(self._step_dir(step), "state")
        try:
            with ocp.StandardCheckpointer() as checkpointer:
                metadata = checkpointer.metadata(path).item_metadata
                target = jax.tree.map(
                    lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=_host_sharding()),
                    metadata,
                    is_leaf=lambda m: hasattr(m, "shape") and hasattr(m, "dtype"),
                )
                state = checkpointer.restore(path, target)
        except READ_ERRORS as error:
            raise CheckpointError(
                f"checkpoint step folder {self._step_dir(step)} cannot be read: {_reason(error)}"
            ) from error
        return jax.tree.map(np.asarray, state)

    # -- lifecycle -------------------------------------------------------------------------------------------

    def wait_until_finished(self) -> None:
        """Blocks until the last started save is committed.

        Raises:
            CheckpointWriteError: the save failed (a full disk, a file-size limit, permissions).
        """
        with self._writing(self._pending_step):
            self._manager.wait_until_finished()
        self._purge_deleted()

    def close(self) -> None:
        """Waits for pending saves and releases the manager's threads (raises `CheckpointWriteError` as above)."""
        try:
            with self._writing(self._pending_step):
                self._manager.wait_until_finished()
        finally:
            self._manager.close()
        self._purge_deleted()

    @contextlib.contextmanager
    def _writing(self, step: int | None):
        """Turns a failed write (orbax reports disk errors as `ValueError`s of tensorstore) into one line naming the
        step folder; a step left half-written stays an orbax temporary folder, which resume ignores."""
        try:
            yield
        except Exception as error:
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            where = os.path.join(self.directory, str(step)) if step is not None else self.directory
            raise CheckpointWriteError(f"could not write checkpoint {where}: {first}") from error

    def __enter__(self) -> TrainCheckpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def _require_step(self, step: int | None) -> int:
        """`step` when it is committed (the newest committed step when None), else `MissingCheckpoint`."""
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise MissingCheckpoint(f"no committed checkpoint in {self.directory}")
            return steps[-1]
        if step not in steps:
            why = "not found"
            if os.path.isdir(self._step_dir(step)):
                why = f"has no commit marker ({COMMIT_MARKER} or a commit time in {STEP_METADATA})"
            raise MissingCheckpoint(f"checkpoint step {step} {why} in {self.directory}; committed: {steps}")
        return step

    def _set_aside(self, step: int, why: str) -> str | None:
        """Moves step folder `step` into `_unusable/` (atomic rename, never a delete); returns where it went.

        A file `<destination>.why.txt` beside it says why. None when the folder is already gone (another
        process of the run moved it first).
        """
        aside = os.path.join(self.directory, UNUSABLE_SUBDIR)
        os.makedirs(aside, exist_ok=True)
        destination, n = os.path.join(aside, str(step)), 0
        while os.path.exists(destination):
            n += 1
            destination = os.path.join(aside, f"{step}.{n}")
        try:
            os.rename(self._step_dir(step), destination)
        except FileNotFoundError:
            return None
        with open(destination + ".why.txt", "w", encoding="utf-8") as f:
            f.write(why + "\n")
        return destination

    def _set_aside_uncommitted(self) -> None:
        """Moves step folders without a commit marker out of orbax's view (before the manager lists them)."""
        for step, path in sorted(_step_folders(self.directory).items()):
            if _is_committed(path):
                continue
            why = f"no commit marker ({COMMIT_MARKER} or a commit time in {STEP_METADATA}): not a finished save"
            moved = self._set_aside(step, why)
            if moved:
                log.warning(
                    "checkpoint step folder %s has %s; moved it to %s (not used, not deleted)", path, why, moved
                )

    def _set_aside_damaged(self, skipped: Mapping[int, str], restored: int) -> None:
        """After a fall-back to step `restored`: moves the skipped steps out of the step namespace (not in
        read-only mode), so `keep` counts only usable steps and the run can save those steps again."""
        for step, why in skipped.items():
            path = self._step_dir(step)
            if not _primary():
                continue
            if self.read_only:
                log.warning(
                    "resumed from step %d; the damaged step folder %s is left in place (read-only)", restored, path
                )
                continue
            moved = self._set_aside(step, f"cannot be read: {why}")
            log.warning(
                "resumed from step %d; the damaged step folder %s was moved to %s (not deleted: remove it when you "
                "no longer need it)",
                restored,
                path,
                moved,
            )
        if not self.read_only:
            _barrier("damaged steps set aside")
            self._manager.reload()

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
        if self.read_only or not _primary() or (manager is not None and manager.is_saving_in_progress()):
            return
        trash = os.path.join(self.directory, DELETED_SUBDIR)
        if os.path.isdir(trash):
            shutil.rmtree(trash, ignore_errors=True)


def _primary() -> bool:
    """Whether this process does the folder's housekeeping: process 0 of a multi-process job, or the only one."""
    return jax.process_index() == 0


def _all_processes() -> set[int] | None:
    """Every process of a multi-process job (None for one process: orbax then skips its barriers)."""
    return set(range(jax.process_count())) if jax.process_count() > 1 else None


def _barrier(name: str) -> None:
    """Waits until every process of a multi-process job reaches the same named point (nothing on one process),
    at a barrier of the coordination service (thread-safe, unlike a device collective; see the docstring)."""
    if jax.process_count() > 1:
        ocp.multihost.sync_global_processes(f"feynrl-jax {name}", processes=_all_processes())


def _host_sharding() -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])


def latest_step(run_dir: str | os.PathLike) -> int | None:
    """The newest committed checkpoint step of a run folder (None when there is none), without side effects.

    Committed as in the module docstring; whether the step's files still read back is not checked here.
    """
    steps = _committed_steps(checkpoint_dir(run_dir))
    return steps[-1] if steps else None
