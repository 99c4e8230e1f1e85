"""Two processes x 4 CPU devices (jax.distributed, gloo collectives) take the same training
step (loss, grads, params after one AdamW step) as one process with 8 devices.

Run as a script, this file is one worker process:
  python tests/system/multihost_test.py --coordinator_address=localhost:PORT --num_processes=2 \\
      --process_id=I --out=DIR
"""

import argparse
import os
import subprocess
import sys

import pytest
from helpers import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MESH = "data:2,fsdp:2,context:2"


def train_step_outputs(mesh_spec):
  """One sharded AdamW step on the tiny model; every output gathered to host numpy."""
  import jax
  import optax

  from branch_replay.core import engine, sharding
  from models import transformer as tfm
  from helpers import SHARDING_LOSS, logp_batch

  cfg = tfm.preset("tiny")
  mesh = sharding.make_mesh(mesh_spec)
  p_shardings = sharding.param_shardings(mesh, cfg)
  params = sharding.put(tfm.init_params(cfg, jax.random.key(0)), p_shardings)
  batch = logp_batch(0, B=4, R=4, P=16, T=3)
  batch = sharding.put(batch, sharding.batch_shardings(mesh, batch))
  optimizer = optax.adamw(1e-2, weight_decay=0.1)
  state_shardings = sharding.opt_state_shardings(
    mesh, optimizer, jax.eval_shape(optimizer.init, params), p_shardings
  )
  opt_state = jax.jit(optimizer.init, out_shardings=state_shardings)(params)

  def step(params, opt_state, batch):
    loss, _, grads = engine.loss_and_grad(params, batch, cfg, SHARDING_LOSS, "replay", mesh=mesh)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return loss, grads, optax.apply_updates(params, updates), opt_state

  loss, grads, new_params, _ = jax.jit(step, donate_argnums=(1,))(params, opt_state, batch)
  flat = lambda prefix, tree: {
    prefix + jax.tree_util.keystr(k): v
    for k, v in jax.tree_util.tree_leaves_with_path(sharding.to_host(tree))
  }
  return {"loss": sharding.to_host(loss), **flat("grads", grads), **flat("params", new_params)}


def worker():
  parser = argparse.ArgumentParser()
  for flag in ("coordinator_address", "out"):
    parser.add_argument(f"--{flag}", required=True)
  for flag in ("num_processes", "process_id"):
    parser.add_argument(f"--{flag}", type=int, required=True)
  args = parser.parse_args()  # (the repository and test rooms: PYTHONPATH, conftest.py)
  import jax
  import numpy as np

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
  assert jax.device_count() == 8 and jax.local_device_count() == 4, jax.devices()
  outputs = train_step_outputs(MESH)
  if jax.process_index() == 0:
    np.savez(os.path.join(args.out, "step.npz"), **outputs)
  jax.distributed.shutdown()


def run_two_processes(argv, env, timeout):
  """Start `python argv --process_id=i` for i in 0, 1; wait; assert both exit 0; the logs."""
  procs = [
    subprocess.Popen(
      [sys.executable, *argv, f"--process_id={i}"],
      env=env,
      cwd=ROOT,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  logs = []
  try:
    for proc in procs:
      logs.append(proc.communicate(timeout=timeout)[0])
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
  for proc, log in zip(procs, logs):
    assert proc.returncode == 0, log[-4000:]
  return logs


def test_two_processes_equal_one_process(tmp_path):
  import numpy as np

  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
  address = f"localhost:{free_port()}"
  run_two_processes(
    [
      os.path.abspath(__file__),
      f"--coordinator_address={address}",
      "--num_processes=2",
      f"--out={tmp_path}",
    ],
    env,
    timeout=400,
  )

  two = dict(np.load(tmp_path / "step.npz"))
  one = train_step_outputs(MESH)  # this process: 8 devices (conftest)
  assert sorted(two) == sorted(one)
  for name in one:
    np.testing.assert_allclose(two[name], one[name], rtol=1e-5, atol=1e-6, err_msg=name)
  # The step did something: parameters moved and gradients are not trivially zero.
  import jax
  from models import transformer as tfm

  init = tfm.init_params(tfm.preset("tiny"), jax.random.key(0))
  moved = [
    np.abs(one["params" + jax.tree_util.keystr(k)] - np.asarray(v)).max()
    for k, v in jax.tree_util.tree_leaves_with_path(init)
  ]
  assert min(moved) > 1e-4
  assert max(np.abs(v).max() for k, v in one.items() if k.startswith("grads")) > 1e-3


@pytest.mark.slow
def test_run_py_on_two_processes(tmp_path):
  """run.py --mesh with the multi-host flags: two processes train together; only process 0
  writes metrics; the checkpoint is written once and the run summary printed."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
  address = f"localhost:{free_port()}"
  overrides = [
    "model.vocab_size=128",
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.head_dim=8",
    "model.mlp_hidden=64",
    "task.prompt_len=20",
    "task.n_keys=2",
    "train.sft_steps=0",
    "train.rl_steps=2",
    "train.batch_size=4",
    "train.n_branches=4",
    "sampler.max_new_tokens=2",
    "train.eval_size=0",
    "train.progress=false",
    "train.plot=false",
    "train.checkpoint_every=1",
  ]
  logs = run_two_processes(
    [
      os.path.join(ROOT, "run.py"),
      "--experiment=grpo_haystack",
      f"--workdir={tmp_path}",
      "--mesh=data:2,fsdp:2,tensor:2",
      f"--coordinator_address={address}",
      "--num_processes=2",
      *[f"--set={o}" for o in overrides],
    ],
    env,
    timeout=500,
  )
  import json

  with open(tmp_path / "metrics.jsonl") as f:
    records = [json.loads(line) for line in f if line.strip()]
  assert [r["step"] for r in records if r.get("kind") == "train"] == [0, 1]  # written once
  assert sorted(os.listdir(tmp_path / "checkpoints"))[-1] == "2"
  assert sum("token positions computed" in log for log in logs) == 1  # one summary


@pytest.mark.slow  # 93 s
def test_finished_run_rerun_on_two_processes_does_not_hang(tmp_path):
  """A 1-step run on two processes (one CPU device each, mesh fsdp:2: the parameters are
  split across the processes, so greedy decoding is a collective) with the greedy
  evaluation on, then the same command again on the finished workdir: every process must
  agree on whether the final evaluation is still due (only process 0 can read
  metrics.jsonl), or one enters the collective alone and the other waits forever."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
  overrides = [
    "model.vocab_size=80",
    "model.d_model=16",
    "model.n_layers=1",
    "model.n_kv_heads=2",
    "model.n_heads=2",
    "model.head_dim=8",
    "model.mlp_hidden=32",
    "task.prompt_len=12",
    "task.n_keys=2",
    "train.sft_steps=0",
    "train.rl_steps=1",
    "train.batch_size=2",
    "train.n_branches=2",
    "sampler.max_new_tokens=2",
    "train.eval_size=2",
    "train.progress=false",
    "train.plot=false",
    "train.tensorboard=false",
  ]
  import json

  for attempt in range(2):
    address = f"localhost:{free_port()}"
    logs = run_two_processes(
      [
        os.path.join(ROOT, "run.py"),
        "--experiment=grpo_haystack",
        f"--workdir={tmp_path}",
        "--mesh=fsdp:2",
        f"--coordinator_address={address}",
        "--num_processes=2",
        *[f"--set={o}" for o in overrides],
      ],
      env,
      timeout=400,
    )
    assert sum("greedy eval reward before/after RL" in log for log in logs) == 1
    with open(tmp_path / "metrics.jsonl") as f:
      records = [json.loads(line) for line in f if line.strip()]
    # Written once, by process 0, and not again by the re-run (which trains nothing).
    assert [(r["step"], r["kind"]) for r in records] == [(0, "eval"), (0, "train"), (1, "eval")], (
      attempt
    )


if __name__ == "__main__":
  worker()
