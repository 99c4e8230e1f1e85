"""experiments/plan_1gpu.py: the plan's model options, its step-time arithmetic against a hand
computation, bad input; and (slow) a compile-only row in a subprocess. gpu_check.sh's run of
its one-GPU row: tests/experiments/gpu_check_test.py."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import pytest

from experiments import flops, plan_1gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_plans_model_is_the_bf16_lora_step_with_chunks():
  cfg = plan_1gpu.model_config("llama3_8b")
  assert (cfg.n_layers, cfg.d_model, cfg.mlp_hidden, cfg.vocab_size) == (32, 4096, 14336, 128256)
  assert cfg.dtype == cfg.param_dtype == "bfloat16" and cfg.remat == "full" and cfg.scan_layers
  assert cfg.mlp_chunk == 8192 and cfg.logits_chunk_rows and cfg.logits_chunk == 1024
  q = plan_1gpu.model_config("qwen3_8b", layers=2, mlp_chunk=0)
  assert q.qk_norm and q.n_layers == 2 and q.mlp_chunk is None and q.vocab_size == 151936
  with pytest.raises(ValueError, match="--model='llama'"):
    plan_1gpu.model_config("llama")
  with pytest.raises(ValueError, match="--branches=0"):
    plan_1gpu.check_row(131072, 512, 0, 1, 16)


def test_the_plan_compiles_the_trainers_state_and_step():
  """The plan's arguments are init_state's TrainState of the run's Config (abstract: no
  allocation), its step the trainer's jitted rl_step; state bytes per parameter by shapes:
  Llama-3-8B with a bf16 base and float32 rank-16 adapters + AdamW is 2 B/param + 12 B per
  adapter param (42M adapter params: 2.063 B/param); full fine-tuning's float32 masters with a
  KL reference copy are 16 B/param; the recipe's SmolLM2-135M base at rank 16 in bf16 2.26."""
  from branch_replay.config import Config
  from branch_replay.train import state as train_state
  from branch_replay.train import runtime
  from branch_replay.data.tokenizer import TOKENIZER
  from models import gguf, hf

  cfg = plan_1gpu.train_config(plan_1gpu.model_config("llama3_8b"), 16, 1, 16)
  assert cfg.loss.kl_coef > 0 and cfg.lora.rank == 16 and cfg.model.param_dtype == "bfloat16"
  assert plan_1gpu.trainer_step(cfg) is runtime.Runtime(cfg, TOKENIZER).fns(2).rl_step
  state, batch = plan_1gpu.abstract_args(cfg, 1, 1024, 16, 8)
  assert batch.leaves.ref_logp_BRT.shape == batch.leaves.old_logp_BRT.shape == (1, 16, 8)
  assert {x.dtype.name for x in jax.tree.leaves(state.base)} == {"bfloat16"}
  assert {x.dtype.name for x in jax.tree.leaves((state.params, state.opt_state))} >= {"float32"}
  b = plan_1gpu.state_bytes(state)
  n, adapters = b["model_params"], b["params"] // 4
  assert n == 8_030_261_248 and adapters == 41_943_040  # Llama-3-8B; rank 16 on 7 projections
  assert b["base"] == 2 * n and b["opt_state"] == 2 * 4 * adapters + 4  # mu, nu; Adam's count
  assert b["bytes_per_param"] == pytest.approx(2 + 12 * adapters / n, rel=1e-6)
  full = Config(model=dataclasses.replace(cfg.model, param_dtype="float32"), loss=cfg.loss)
  fb = plan_1gpu.state_bytes(train_state.abstract_state(full))
  assert fb["bytes_per_param"] == pytest.approx(16.0, rel=1e-6)  # params, mu, nu, reference
  recipe = hf.config_from_hf(gguf.read_model_config(gguf.smollm2_path()), "bfloat16", "bfloat16")
  rb = plan_1gpu.state_bytes(train_state.abstract_state(plan_1gpu.train_config(recipe, 16, 2, 8)))
  assert rb["base"] == 2 * rb["model_params"] and 2 < rb["bytes_per_param"] < 2.5


def test_step_time_at_mfu_is_useful_flops_over_the_peak():
  cfg = plan_1gpu.model_config("llama3_8b")
  out = plan_1gpu.predict(cfg, 1, 131072, 16, 512)
  # by hand: 3 passes x 2 FLOPs per MAC; per token the layers' and the head's MACs, per causal
  # pair of the prefix (P(P+1)/2) and of the tails (R*T*P + R*T(T+1)/2) the attention's
  L, D, N, K, H, F, V = 32, 4096, 32, 8, 128, 14336, 128256
  per_token = L * (D * (N + 2 * K) * H + N * H * D + 3 * D * F)
  pairs = 131072 * 131073 // 2 + 16 * (512 * 131072 + 512 * 513 // 2)
  macs = per_token * (131072 + 16 * 512) + pairs * L * 2 * N * H + 16 * 512 * D * V
  assert flops.step_flops(cfg, flops.flat(1, 16, 131072, 512, "replay")) == 6 * macs
  assert out["useful_pflop"] == round(6 * macs / 1e15, 3)
  assert out["step_s"]["H200"]["mfu_40"] == round(6 * macs / (0.4 * 989e12), 1)
  assert out["step_s"]["H20"]["mfu_60"] == round(6 * macs / (0.6 * 148e12), 1)
  assert out["step_s"]["H200"]["cost_model"] > out["step_s"]["H200"]["mfu_60"]  # remat, flash


def test_gpu_target_compiles_for_an_h200_without_one():
  """The deviceless GPU compile's buffers are the GPU's: a bf16 argument is 2 bytes an element
  (the CPU backend would compute the product in f32) and the product's temporaries fit a
  bf16 [n, n] block, not an f32 one."""
  import jax
  import jax.numpy as jnp

  from experiments import gpu_target

  if not gpu_target.available():
    pytest.skip("no jax CUDA plugin")
  dev = gpu_target.device("H200")
  assert dev.device_kind == "NVIDIA H200"
  n = 1024
  (x,) = gpu_target.place((jax.ShapeDtypeStruct((n, n), jnp.bfloat16),), dev)
  mem = jax.jit(lambda a: (a @ a) @ a).lower(x).compile().memory_analysis()
  assert mem.argument_size_in_bytes == 2 * n * n
  assert mem.output_size_in_bytes == 2 * n * n
  assert mem.temp_size_in_bytes < 4 * n * n  # one bf16 product (+ workspace), no f32 copy
  with pytest.raises(ValueError, match="card='A100'"):
    gpu_target.target_config("A100")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gpu", "cpu"])
def test_compile_row_in_a_subprocess(tmp_path, backend):
  path = tmp_path / "plan.jsonl"
  out = subprocess.run(
    [
      sys.executable,
      "experiments/plan_1gpu.py",
      f"--backend={backend}",
      "--model=tiny",
      "--prefix_len=64",
      "--tail_len=8",
      "--branches=4",
      "--rank=2",
      "--mlp_chunk=16",
      "--target=H100",
      f"--out={path}",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  (row,) = [json.loads(l) for l in open(path)]
  assert "error" not in row, row
  assert row["total_bytes"] > 0 and row["fits_with_headroom"]["H100"]
  assert row["mem_fraction"] == 0.95 and row["adapter_dtype"] == "float32"
  assert row["base_dtype"] == "bfloat16" and row["kl_coef"] > 0
  assert row["mlp_chunk"] == 16 and row["logits_chunk_rows"]
  assert row["memory_backend"].startswith("xla:gpu" if backend == "gpu" else "cpu")
