"""Orbax checkpoints of the train state (atomic: written aside, then renamed), every N steps,
keeping K, with the run's config beside them so an incompatible resume fails loudly."""

from __future__ import annotations

import json
import os
import socket

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


class Checkpointer:
  def __init__(self, workdir: str, cfg: config_lib.Config):
    self.workdir = os.path.abspath(workdir)
    self.directory = os.path.join(self.workdir, "checkpoints")
    self.cfg = cfg
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=cfg.train.keep_checkpoints,
                                             create=True, enable_async_checkpointing=False))

  def latest_step(self):
    return self.manager.latest_step()

  def check_config(self) -> None:
    """An existing checkpoint must come from a compatible config; then record ours."""
    path = os.path.join(self.workdir, "config.json")
    if self.latest_step() is not None:
      if not os.path.exists(path):
        raise ValueError(f"--workdir={self.workdir}: holds checkpoints but no config.json; "
                         "cannot tell whether they fit this config (use a fresh --workdir)")
      with open(path) as f:
        saved = json.load(f)
      diffs = config_lib.incompatible(saved, self.cfg)
      if diffs:
        raise ValueError(f"--workdir={self.workdir}: its checkpoint (step "
                         f"{self.latest_step()}) comes from an incompatible config: "
                         + "; ".join(diffs) + ". Use a fresh --workdir or the saved config.")
    tmp = f"{path}.{socket.gethostname()}.{os.getpid()}.tmp"  # processes write alike
    with open(tmp, "w") as f:
      json.dump(config_lib.to_dict(self.cfg), f, indent=2)
    os.replace(tmp, path)

  def save(self, step: int, state: dict) -> None:
    self.manager.save(step, args=ocp.args.StandardSave(state), force=True)
    self.manager.wait_until_finished()

  def restore(self, step: int, abstract_state: dict) -> dict:
    return self.manager.restore(step, args=ocp.args.StandardRestore(abstract_state))

  def close(self):
    self.manager.close()
