"""Orbax checkpoints of the train state (atomic: written aside, then renamed), every N steps,
keeping K, with the run's config beside them so an incompatible resume fails loudly.
Asynchronous by default (train.async_checkpoints): `save` returns once the arrays are copied
off the devices; orbax writes and renames in the background, and the next save, `wait` or
`close` waits for it (and raises its error). A damaged newest checkpoint is moved aside and
the run resumes from the newest one that restores; a full disk is a `StorageError`."""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import time

import jax
import orbax.checkpoint as ocp

from branch_replay import config as config_lib


def check_workdir(workdir: str) -> str:
  """Create the workdir and prove it is writable, before any compute."""
  path = os.path.abspath(workdir)
  try:
    os.makedirs(path, exist_ok=True)
    probe = os.path.join(path, f".write_probe.{socket.gethostname()}.{os.getpid()}")
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    raise ValueError(f"--workdir={workdir!r}: not a writable directory ({e})") from None
  return path


class StorageError(OSError):
  """A checkpoint or metrics write that the filesystem refused (a full disk, ...): the message
  says what was being written, what is intact and how to go on."""


def _os_error(e: BaseException):
  """The OSError behind `e` (itself, or along its causes: orbax wraps its writers' errors;
  tensorstore's C++ writers report a full disk as a ValueError saying so)."""
  seen, first = set(), e
  while e is not None and id(e) not in seen:
    if isinstance(e, OSError) and e.errno is not None:
      return e
    seen.add(id(e))
    e = e.__cause__ or e.__context__
  if "No space left on device" in str(first):
    return OSError(errno.ENOSPC, "No space left on device")
  return None


def describe_os_error(e: OSError) -> str:
  name = errno.errorcode.get(e.errno, str(e.errno))
  return f"{e.strerror or e} ({name})"


DAMAGED = "damaged_checkpoints"  # in the workdir: checkpoints that did not restore


class Checkpointer:
  def __init__(self, workdir: str, cfg: config_lib.Config):
    self.workdir = os.path.abspath(workdir)
    self.directory = os.path.join(self.workdir, "checkpoints")
    self.cfg = cfg
    self._pending = None  # the step an asynchronous save is writing
    self.manager = self._manager()

  def _manager(self):
    return ocp.CheckpointManager(
      self.directory,
      options=ocp.CheckpointManagerOptions(
        max_to_keep=self.cfg.train.keep_checkpoints,
        create=True,
        enable_async_checkpointing=self.cfg.train.async_checkpoints,
        # a save cut short (a kill mid-write) leaves a temporary directory, never a checkpoint;
        # the next start removes it (orbax cleans in the background from here and waits for
        # it before the first save; StorageError's message says so)
        cleanup_tmp_directories=True,
      ),
    )

  def latest_step(self):
    return self.manager.latest_step()

  def check_config(self) -> None:
    """An existing checkpoint must come from a compatible config; then record ours."""
    path = os.path.join(self.workdir, "config.json")
    if self.latest_step() is not None:
      if not os.path.exists(path):
        raise ValueError(
          f"--workdir={self.workdir}: holds checkpoints but no config.json; "
          "cannot tell whether they fit this config (use a fresh --workdir)"
        )
      with open(path) as f:
        saved = json.load(f)
      diffs = config_lib.incompatible(saved, self.cfg)
      if diffs:
        raise ValueError(
          f"--workdir={self.workdir}: its checkpoint (step "
          f"{self.latest_step()}) comes from an incompatible config: "
          + "; ".join(diffs)
          + ". Use a fresh --workdir or the saved config."
        )
    tmp = f"{path}.{socket.gethostname()}.{os.getpid()}.tmp"  # processes write alike
    with open(tmp, "w") as f:
      json.dump(config_lib.to_dict(self.cfg), f, indent=2)
    os.replace(tmp, path)

  def save(self, step: int, state: dict) -> None:
    """Checkpoint `state` as `step` (asynchronously: returns before the files are written)."""
    self.wait()  # the previous save's error surfaces here, naming its step
    try:
      self._pending = step
      self.manager.save(step, args=ocp.args.StandardSave(state), force=True)
    except Exception as e:
      self._storage_error(e, step)
      raise
    if not self.cfg.train.async_checkpoints:
      self.wait()

  def wait(self) -> None:
    """Until the save in flight is committed (its error, if any, raised here)."""
    try:
      self.manager.wait_until_finished()
    except Exception as e:
      self._storage_error(e, self._pending)
      raise
    finally:
      self._pending = None

  def _storage_error(self, e: BaseException, step) -> None:
    """A filesystem error behind a failed save -> StorageError naming the step and what is
    intact; any other error is left to propagate as it is."""
    os_error = _os_error(e)
    if os_error is None:
      return
    steps = [s for s in self.manager.all_steps() if s != step]
    intact = (
      f"the previous checkpoint (step {max(steps)}) is intact"
      if steps
      else "no earlier checkpoint exists"
    )
    error = StorageError(
      f"checkpoint save of step {step} in {self.directory} failed: "
      f"{describe_os_error(os_error)}; {intact} (a half-written save is "
      "only a temporary directory, removed at the next start); free space "
      "and run the same command to resume"
    )
    error.errno = os_error.errno
    raise error from e

  def restore(self, step: int, abstract_state: dict) -> dict:
    return self.manager.restore(step, args=ocp.args.StandardRestore(abstract_state))

  def restore_latest(self, template):
    """(step, state) of the newest checkpoint that restores (template(step) -> the abstract
    state); (0, None) when there is none. A newer checkpoint that does not restore (files
    truncated or missing: a disk error, a copy cut short) is reported and moved to
    workdir/damaged_checkpoints/ (kept, not deleted) once an older one restores; when none
    restores nothing moves and the newest's error is raised, naming it."""
    steps = sorted(self.manager.all_steps(), reverse=True)
    failures = []
    for step in steps:
      try:
        restored = self.restore(step, template(step))
      except Exception as e:  # orbax/tensorstore: ValueError, FileNotFoundError, ...
        failures.append((step, e))
        continue
      if failures:
        self._set_aside(failures, step)
      return step, restored
    if failures:
      step, e = failures[0]
      raise ValueError(
        f"--workdir={self.workdir}: checkpoint {os.path.join(self.directory, str(step))} "
        f"does not restore ({type(e).__name__}: {str(e)[:300]}) and no older checkpoint "
        f"does either ({', '.join(str(s) for s, _ in failures)} tried): if the files are "
        "damaged, move checkpoints/ aside to start over from step 0; if the config "
        "changed, use the saved config.json or a fresh --workdir"
      ) from e
    return 0, None

  def _set_aside(self, failures, good_step: int) -> None:
    multi = jax.process_count() > 1
    for step, e in failures:
      source = os.path.join(self.directory, str(step))
      if multi:  # every process must agree: refuse rather than move on some of them
        raise ValueError(
          f"--workdir={self.workdir}: checkpoint {source} does not restore "
          f"({type(e).__name__}: {str(e)[:300]}); step {good_step} does. On several "
          f"processes nothing is moved automatically: move {source} out of checkpoints/ "
          "and run the same command to resume from the previous one"
        ) from e
      target = os.path.join(self.workdir, DAMAGED, f"{step}.{time.strftime('%Y%m%dT%H%M%S')}")
      os.makedirs(os.path.dirname(target), exist_ok=True)
      os.replace(source, target)
      print(
        f"warning: checkpoint {source} does not restore ({type(e).__name__}: "
        f"{str(e)[:300]}): moved to {target}; resuming from step {good_step}",
        file=sys.stderr,
        flush=True,
      )
    self.manager.close()
    self.manager = self._manager()  # it listed the moved steps

  def settle(self) -> None:
    """When an error leaves the run: the save in flight committed or failed (its own error is
    dropped, the run's is the one raised) and the manager closed, so that no background write
    outlives the run (a later Checkpointer of this workdir in the same process, e.g. the
    resumed run of a notebook, removes temporary directories it would find half-written)."""
    try:
      self.manager.wait_until_finished()
    except Exception:
      pass
    finally:
      self._pending = None
      try:
        self.manager.close()
      except Exception:
        pass

  def close(self):
    try:
      self.wait()
    finally:
      self.manager.close()
