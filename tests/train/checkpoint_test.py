"""train/checkpoint.py: the workdir is proven writable before any compute; a checkpoint restores
bitwise (synchronous or asynchronous); the newest train.keep_checkpoints are kept; a save cut
short leaves no checkpoint (only a temporary directory, which the next start removes, as the
StorageError says) and the previous one restores; a filesystem refusal is a StorageError naming the step, the error and
what is intact; the saved config refuses an incompatible resume by field; a damaged newest
checkpoint is never moved on several processes."""

import errno
import functools
import json
import os
import types

import jax
import numpy as np
import pytest

from branch_replay import config as config_lib
from branch_replay.train import checkpoint
from branch_replay.train import state as train_state
from helpers import fail_finalize_of, tiny_run


@functools.cache
def _initial_state():
  """A tiny run's checkpointable dict (its KL copy included): built once."""
  return train_state.state_dict(train_state.init_state(_cfg()))


def _state(cfg, shift=0):
  """The state to save as step `shift` (params moved by it; `cfg`: the Checkpointer's)."""
  d = dict(_initial_state())
  d["params"] = jax.tree.map(lambda x: x + shift, d["params"])
  d["step"] = d["step"] + shift
  return d


def _assert_bitwise(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a, b)


def _cfg(*overrides):
  return tiny_run("loss.kl_coef=0.05", *overrides)


# ----------------------------------------------------------------------------- the workdir


def test_check_workdir_creates_it_proves_it_writable_and_names_it_when_not(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  path = checkpoint.check_workdir("a/b")
  assert path == str(tmp_path / "a" / "b") and os.listdir(path) == []  # the probe is gone
  assert checkpoint.check_workdir(path) == path  # an existing one
  (tmp_path / "file").write_text("x")
  for bad in ("file", "file/sub"):
    with pytest.raises(ValueError, match=rf"^--workdir='{bad}': not a writable directory \("):
      checkpoint.check_workdir(bad)


# ----------------------------------------------------------------------------- save, restore


@pytest.mark.parametrize("asynchronous", [True, False], ids=["async", "sync"])
def test_restore_is_bitwise_and_the_newest_keep_checkpoints_stay(tmp_path, asynchronous):
  cfg = _cfg("train.keep_checkpoints=2", f"train.async_checkpoints={str(asynchronous).lower()}")
  ckpt = checkpoint.Checkpointer(str(tmp_path), cfg)
  assert ckpt.restore_latest(lambda step: None) == (0, None) and ckpt.latest_step() is None
  saved = {s: _state(cfg, s) for s in (1, 2, 3, 4)}
  for step, state in saved.items():
    ckpt.save(step, state)
  ckpt.wait()
  assert ckpt.manager.all_steps() == [3, 4] and ckpt.latest_step() == 4
  assert sorted(os.listdir(ckpt.directory)) == ["3", "4"]
  template = _state(cfg)
  assert set(template) == {"params", "opt_state", "step", "rng", "ref_params"}
  _assert_bitwise(ckpt.restore(3, template), saved[3])
  asked = []
  step, restored = ckpt.restore_latest(lambda s: asked.append(s) or template)
  assert step == 4 and asked == [4]
  _assert_bitwise(restored, saved[4])
  ckpt.close()


def _cut_short(tmp_path, monkeypatch, cfg):
  """Step 1 saved, then the rename that commits step 2 fails (as a kill at that moment would
  leave it). Returns step 1's state."""
  ckpt = checkpoint.Checkpointer(str(tmp_path), cfg)
  first = _state(cfg, 1)
  ckpt.save(1, first)
  fail_finalize_of(monkeypatch, 2, RuntimeError("cut short"))
  with pytest.raises(RuntimeError, match="cut short") as e:
    ckpt.save(2, _state(cfg, 2))
  assert not isinstance(e.value, checkpoint.StorageError)  # not dressed as a disk error
  monkeypatch.undo()
  assert ckpt.latest_step() == 1
  ckpt.close()
  return first


def test_a_save_cut_short_leaves_no_checkpoint_and_the_previous_restores(tmp_path, monkeypatch):
  """Step 2 is no checkpoint (only a temporary directory); the next start resumes from step
  1, bitwise, and saving step 2 again commits it with no temporary left."""
  cfg = _cfg("train.async_checkpoints=false")
  first = _cut_short(tmp_path, monkeypatch, cfg)
  directory = tmp_path / "checkpoints"
  leftover = [p for p in os.listdir(directory) if p != "1"]
  assert leftover and all(p.startswith("2.") and "tmp" in p for p in leftover), leftover
  again = checkpoint.Checkpointer(str(tmp_path), cfg)  # the next start
  step, restored = again.restore_latest(lambda s: _state(cfg))
  assert step == 1 and again.manager.all_steps() == [1]
  _assert_bitwise(restored, first)
  second = _state(cfg, 2)
  again.save(2, second)
  assert sorted(os.listdir(directory)) == ["1", "2"]
  _assert_bitwise(again.restore(2, _state(cfg)), second)
  again.close()


def test_the_next_start_removes_a_cut_short_saves_temporary_directory(tmp_path, monkeypatch):
  """The resumed run saves other steps than the one cut short: its temporary directory is
  gone by the first of them (not left until step 2 is saved again)."""
  cfg = _cfg("train.async_checkpoints=false")
  _cut_short(tmp_path, monkeypatch, cfg)
  again = checkpoint.Checkpointer(str(tmp_path), cfg)  # the next start
  again.save(3, _state(cfg, 3))
  again.close()
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "3"]


# ----------------------------------------------------------------------------- storage errors


def test_describe_os_error_names_the_error_and_its_code():
  assert (
    checkpoint.describe_os_error(OSError(errno.ENOSPC, "No space left on device"))
    == "No space left on device (ENOSPC)"
  )
  assert checkpoint.describe_os_error(OSError(errno.EROFS, "Read-only")) == "Read-only (EROFS)"
  assert checkpoint.describe_os_error(OSError(99999, "odd")) == "odd (99999)"


@pytest.mark.parametrize(
  "error",
  [
    OSError(errno.ENOSPC, "No space left on device"),
    ValueError("tensorstore: writing chunk: No space left on device [source locations...]"),
    RuntimeError("a writer failed"),  # with the OSError as its cause (set below)
  ],
  ids=["oserror", "tensorstore", "cause"],
)
@pytest.mark.parametrize("asynchronous", [True, False], ids=["async", "sync"])
def test_a_full_disk_is_a_storage_error_naming_the_step_and_what_is_intact(
  tmp_path, monkeypatch, error, asynchronous
):
  if isinstance(error, RuntimeError):
    error.__cause__ = OSError(errno.ENOSPC, "No space left on device")
  cfg = _cfg(f"train.async_checkpoints={str(asynchronous).lower()}")
  ckpt = checkpoint.Checkpointer(str(tmp_path), cfg)
  state = _state(cfg)
  fail_finalize_of(monkeypatch, 1, error)
  with pytest.raises(checkpoint.StorageError) as first:
    ckpt.save(1, state)  # (synchronous: raises here)
    if asynchronous:
      ckpt.wait()  # the error surfaces here
  assert str(first.value).startswith(
    f"checkpoint save of step 1 in {ckpt.directory} failed: No space left on device "
    "(ENOSPC); no earlier checkpoint exists"
  ), str(first.value)
  assert first.value.errno == errno.ENOSPC
  monkeypatch.undo()
  ckpt.save(2, state)
  fail_finalize_of(monkeypatch, 3, error)
  with pytest.raises(
    checkpoint.StorageError,
    match=r"save of step 3 .*\(ENOSPC\); the previous checkpoint \(step 2\) is intact .* "
    r"free space and run the same command to resume$",
  ):
    ckpt.save(3, state)
    ckpt.close()
  monkeypatch.undo()
  ckpt.close()


def test_an_error_that_is_not_the_filesystems_propagates_as_it_is(tmp_path, monkeypatch):
  cfg = _cfg("train.async_checkpoints=false")
  ckpt = checkpoint.Checkpointer(str(tmp_path), cfg)
  fail_finalize_of(monkeypatch, 1, ValueError("a shape mismatch"))
  with pytest.raises(ValueError, match="a shape mismatch") as e:
    ckpt.save(1, _state(cfg))
  assert not isinstance(e.value, checkpoint.StorageError)
  monkeypatch.undo()
  ckpt.close()


# ----------------------------------------------------------------------------- the config


def test_the_saved_config_refuses_an_incompatible_resume_by_field(tmp_path):
  cfg = _cfg("train.async_checkpoints=false")
  ckpt = checkpoint.Checkpointer(str(tmp_path), cfg)
  ckpt.check_config()  # a fresh workdir: records the config
  with open(tmp_path / "config.json") as f:
    assert json.load(f) == json.loads(json.dumps(config_lib.to_dict(cfg)))
  ckpt.save(1, _state(cfg))
  ckpt.close()
  resumable = _cfg("train.async_checkpoints=false", "train.rl_steps=99")
  checkpoint.Checkpointer(str(tmp_path), resumable).check_config()  # more steps: fine
  with open(tmp_path / "config.json") as f:
    assert json.load(f)["train"]["rl_steps"] == 99  # ... and recorded
  assert sorted(os.listdir(tmp_path)) == ["checkpoints", "config.json"]  # no temporary left
  with pytest.raises(
    ValueError,
    match=r"its checkpoint \(step 1\) comes from an incompatible config: "
    r"model.d_model: saved 32, now 64. Use a fresh --workdir or the saved config.$",
  ):
    checkpoint.Checkpointer(str(tmp_path), _cfg("model.d_model=64")).check_config()
  os.remove(tmp_path / "config.json")
  with pytest.raises(ValueError, match=r"holds checkpoints but no config.json"):
    checkpoint.Checkpointer(str(tmp_path), cfg).check_config()


# ----------------------------------------------------------------------------- damage


def test_a_damaged_newest_checkpoint_is_set_aside_on_one_process_only(tmp_path, monkeypatch):
  """With several processes the newest not restoring is a refusal naming it, nothing moved
  (each process must see the same checkpoints); with one it moves to damaged_checkpoints/
  and the previous restores. (Through the trainer: preemption_test.py.)"""
  cfg = _cfg("train.async_checkpoints=false", "train.keep_checkpoints=3")
  ckpt = checkpoint.Checkpointer(str(tmp_path), cfg)
  first = _state(cfg, 1)
  ckpt.save(1, first)
  ckpt.save(2, _state(cfg, 2))
  os.remove(os.path.join(ckpt.directory, "2", "default", "_METADATA"))
  # (checkpoint.py's view alone: orbax itself must go on as one process)
  monkeypatch.setattr(checkpoint, "jax", types.SimpleNamespace(process_count=lambda: 2))
  with pytest.raises(
    ValueError,
    match=r"(?s)checkpoint .*checkpoints/2 does not restore .*; step 1 does. On several "
    r"processes nothing is moved automatically",
  ):
    ckpt.restore_latest(lambda s: _state(cfg))
  assert sorted(os.listdir(ckpt.directory)) == ["1", "2"]
  assert not os.path.exists(tmp_path / checkpoint.DAMAGED)
  monkeypatch.undo()
  step, restored = ckpt.restore_latest(lambda s: _state(cfg))
  assert step == 1
  _assert_bitwise(restored, first)
  assert sorted(os.listdir(ckpt.directory)) == ["1"] and ckpt.manager.all_steps() == [1]
  assert [p.split(".")[0] for p in os.listdir(tmp_path / checkpoint.DAMAGED)] == ["2"]
  ckpt.close()
