"""SIGTERM / SIGINT during a run: finish the step in progress, checkpoint it, exit.

  guard = preemption.Guard(grace_s=120)   # installs the handlers (main thread only)
  with guard:
    for step in ...:
      ...                                 # the step, its metrics line
      if guard.agreed():                  # every process: the same answer at the same step
        save(step + 1); raise preemption.Preempted(step + 1, guard.signum)

A scheduler (SLURM, Kubernetes, spot instances) sends SIGTERM and, seconds later, SIGKILL.
The first signal only raises a flag: the step in progress (a jitted call cannot be cut
short) runs to its end, its metrics line is written, then the trainer checkpoints that step
and raises `Preempted`; run.py exits 128 + the signal (143 for SIGTERM, 130 for SIGINT).
A watchdog bounds it: `grace_s` seconds after the signal, or at a second signal, the process
exits at once with EXIT_GRACE (124), losing the step in progress (the last committed
checkpoint stands: saves are atomic). On several processes only some may receive the
signal: `agreed` is a collective (one int per process, gathered every step) so all of them
stop after the same step and save the same checkpoint. (JAX's own preemption sync point,
`multihost_utils.reached_preemption_sync_point`, is fed by a SIGTERM notifier of the
coordination service only: it sees neither SIGINT nor a signal Python handles.)
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import numpy as np

SIGNALS = (signal.SIGTERM, signal.SIGINT)
EXIT_GRACE = 124  # the grace ran out (or a second signal): exited without a new checkpoint


def exit_code(signum: int) -> int:
  """run.py's exit status after a preemption checkpoint: the shell's 128 + the signal."""
  return 128 + signum


class Preempted(Exception):
  """Raised by trainer.run after the preemption checkpoint (step: the checkpoint's step, the
  step the same command resumes at)."""

  def __init__(self, step: int, signum: int, workdir: str, saved: bool = True):
    self.step, self.signum, self.workdir, self.saved = step, signum, workdir, saved
    done = (
      f"stopped after step {step - 1}; checkpoint {step} written"
      if saved
      else f"stopped before step {step} (nothing new to checkpoint)"
    )
    super().__init__(
      f"{signal.Signals(signum).name}: {done} in {workdir}; run the same "
      f"command to resume at step {step}"
    )


class Guard:
  """The handlers of one run (restored on exit); `agreed()` at each step's end."""

  def __init__(self, grace_s: float, on_timeout=None):
    self.grace_s = grace_s
    self.signum = None  # the first signal received here
    self.on_timeout = on_timeout  # () -> str: what the watchdog prints before exiting
    self._previous = {}
    self._timer = None
    self.t_signal = None

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():  # Python's rule for handlers
      for s in SIGNALS:
        self._previous[s] = signal.signal(s, self._handle)
    return self

  def __exit__(self, *exc):
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    self._previous = {}
    if self._timer is not None:
      self._timer.cancel()
    return False

  def _handle(self, signum, frame):
    if self.signum is not None:  # a second signal: do not wait for the step
      self._exit(f"a second {signal.Signals(signum).name}")
    self.signum, self.t_signal = signum, time.time()
    print(
      f"{signal.Signals(signum).name} received: finishing the step in progress, then "
      f"checkpointing it (within train.preemption_grace_s={self.grace_s:g} s)",
      file=sys.stderr,
      flush=True,
    )
    self._timer = threading.Timer(
      self.grace_s, self._exit, (f"train.preemption_grace_s={self.grace_s:g} s ran out",)
    )
    self._timer.daemon = True
    self._timer.start()

  def _exit(self, why: str):
    where = self.on_timeout() if self.on_timeout else ""
    print(
      f"preemption: {why}: exiting now ({EXIT_GRACE}) without a checkpoint of the step "
      f"in progress{'; ' + where if where else ''}",
      file=sys.stderr,
      flush=True,
    )
    os._exit(EXIT_GRACE)

  def agreed(self) -> bool:
    """Whether this process or any other received a signal: on several processes a
    collective every process calls at the same point of each step."""
    import jax

    local = np.int32(0 if self.signum is None else self.signum)
    if jax.process_count() == 1:
      return bool(local)
    from jax.experimental import multihost_utils

    gathered = np.asarray(multihost_utils.process_allgather(local))
    if self.signum is None and gathered.any():  # another process was signalled
      self.signum = int(gathered[gathered > 0][0])
    return bool(gathered.any())
