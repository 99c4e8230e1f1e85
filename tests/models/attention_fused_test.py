"""model.attention=fused on a CPU: the dispatch's host logic (refusal, selection, the merge).

No GPU and no tokamax here, so (1) the refusal is checked as it is, before any compilation,
and (2) with `unavailable_reason` and `kernel` substituted by `reference_kernel` (tokamax's
contract in plain jax), the per-segment forward + the hand merge + the backward with the
global log-sum-exp match the dense oracle at float64 1e-10, on every attention_cases case.
"""

import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import attention
from models.attention import fused as attention_fused
from models import transformer as tfm
import attention_cases as at


def _tiny_case():
  return at.tail_case(np.random.default_rng(0), jnp.float32)


def test_refused_without_tokamax_naming_field_device_and_fallback():
  q, q_pos, q_valid, segs = _tiny_case()
  with pytest.raises(ValueError) as e:
    attention.attend(q, q_pos, q_valid, segs, impl="fused")
  msg = str(e.value)
  assert "model.attention='fused'" in msg and "tokamax is not installed" in msg
  assert "device found: cpu" in msg and "model.attention='blockwise'" in msg


def test_refused_on_cpu_with_tokamax_present(monkeypatch):
  monkeypatch.setitem(sys.modules, "tokamax", types.ModuleType("tokamax"))
  with pytest.raises(ValueError, match=r"sm90/sm100 GPU.*device found: cpu.*'blockwise'"):
    attention_fused.check_available()


def test_refused_at_trace_time_before_compilation(monkeypatch):
  compiled = []
  monkeypatch.setattr(jax.stages.Lowered, "compile", lambda self, *a, **k: compiled.append(1))
  cfg = tfm.preset("tiny", attention="fused")  # the config itself is valid anywhere
  params = jax.eval_shape(lambda: tfm.init_params(tfm.preset("tiny"), jax.random.key(0)))
  tokens = jnp.zeros((1, 4), jnp.int32)
  with pytest.raises(ValueError, match="model.attention='fused'"):
    jax.jit(lambda p: tfm.forward(p, cfg, tokens, tokens >= 0)).lower(params)
  assert not compiled


@pytest.fixture
def reference(monkeypatch):
  monkeypatch.setattr(attention_fused, "unavailable_reason", lambda: None)
  monkeypatch.setattr(attention_fused, "kernel", attention_fused.reference_kernel)


def _assert_fused_matches_dense(case, rtol, **kw):
  dense = at.value_and_grads("dense", case, window=kw.get("window"), softcap=kw.get("softcap"))
  fused = at.value_and_grads("fused", case, window=kw.get("window"), softcap=kw.get("softcap"))
  names = ["out", "dq"] + [f"d{kv}[{i}]" for i in range(len(case[3])) for kv in "kv"]
  for name, a, b in zip(names, jax.tree.leaves(dense), jax.tree.leaves(fused), strict=True):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(b)), name
    err = np.max(np.abs(a - b)) if a.size else 0.0
    assert err <= rtol * (np.max(np.abs(a)) if a.size else 0.0), f"{name}: max err {err:.3g}"


DEFAULT_CASES = ("softcap_window_gqa4", "three_segments", "empty_rows")  # the rest: -m slow
case_params = lambda cases: [
  n if n in DEFAULT_CASES else pytest.param(n, marks=pytest.mark.slow) for n in sorted(cases)
]


@pytest.mark.parametrize("name", case_params(at.PREFIX_CASES))
def test_fused_prefix_matches_dense_float64(reference, name):
  case_kw, kw = at.PREFIX_CASES[name]
  with jax.enable_x64(True):
    _assert_fused_matches_dense(
      at.prefix_case(np.random.default_rng(0), jnp.float64, **case_kw), 1e-10, **kw
    )


@pytest.mark.parametrize("name", case_params(at.TAIL_CASES))
def test_fused_tail_merge_matches_dense_float64(reference, name):
  case_kw, kw = at.TAIL_CASES[name]
  with jax.enable_x64(True):
    _assert_fused_matches_dense(
      at.tail_case(np.random.default_rng(1), jnp.float64, **case_kw), 1e-10, **kw
    )


def test_fused_replay_gradient_matches_blockwise_float64(reference):
  """The whole replay step (prefix cache, folded tails) with the fused dispatch."""
  from branch_replay.core import engine, losses, tree

  with jax.enable_x64(True):
    cfgs = {
      impl: tfm.preset("tiny", attention=impl, dtype="float64", param_dtype="float64")
      for impl in ("blockwise", "fused")
    }
    params = tfm.init_params(cfgs["fused"], jax.random.key(0))
    rng = np.random.default_rng(0)
    batch = tree.flat(
      prefix_BP=jnp.asarray(rng.integers(0, 128, (2, 9)), jnp.int32),
      prefix_valid_BP=jnp.asarray(np.arange(9)[None] >= np.array([[0], [3]])),
      tails_BRT=jnp.asarray(rng.integers(0, 128, (2, 3, 4)), jnp.int32),
      tail_valid_BRT=jnp.asarray(np.arange(4)[None, None] < rng.integers(1, 5, (2, 3, 1))),
      advantages_BR=jnp.asarray(rng.normal(size=(2, 3))),
    )
    out = {
      impl: jax.jit(
        lambda p, b, c=c: engine.loss_and_grad(p, b, c, losses.LossConfig("grpo"), "replay")[::2]
      )(params, batch)
      for impl, c in cfgs.items()
    }
  (loss_b, grads_b), (loss_f, grads_f) = out["blockwise"], out["fused"]
  np.testing.assert_allclose(loss_f, loss_b, rtol=1e-10)
  for a, b in zip(jax.tree.leaves(grads_b), jax.tree.leaves(grads_f), strict=True):
    assert np.max(np.abs(a - b)) <= 1e-10 * np.max(np.abs(a))


@pytest.mark.slow  # three subprocess benches: > 15 min on the loaded 2-core machine
def test_gpu_check_smoke_on_cpu(tmp_path):
  """experiments/gpu_check.sh with SMOKE=1 EXTRA=1: the fused-vs-blockwise check (reference
  kernel) passes and the bench writes a blockwise row and a fused row that records the refusal."""
  import json
  import os
  import subprocess

  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  out = subprocess.run(
    ["bash", "experiments/gpu_check.sh"],
    cwd=root,
    capture_output=True,
    text=True,
    env={**os.environ, "SMOKE": "1", "EXTRA": "1", "OUT": str(tmp_path), "JAX_PLATFORMS": "cpu"},
  )
  assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
  (check,) = [json.loads(l) for l in open(tmp_path / "fused_check.jsonl")]
  assert check["passed"] and check["kernel"] == "reference" and check["max_rel_err"] < 1e-3
  assert len(check["errors"]["step"]) > 10  # the loss and every parameter leaf
  rows = [json.loads(l) for l in open(tmp_path / "gpu_bench.jsonl")]
  by_attn = {r["attention"]: r for r in rows}
  assert by_attn["blockwise"]["speedup"] > 0 and by_attn["blockwise"]["grad_max_rel_err"] < 1e-4
  assert "model.attention='fused'" in by_attn["fused"]["replay_error"]
  assert (tmp_path / "env.txt").read_text()
