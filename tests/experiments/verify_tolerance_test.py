"""experiments/verify_tolerance.py: replay vs naive at every RL step of a (tiny) run, the rows
it writes, and the summary over the batches the trainer would check."""

import pytest

from experiments import registry, verify_tolerance as vt

TINY = [
  "train.sft_steps=1",
  "train.sft_batch_size=2",
  "task.prompt_len=20",
  "task.n_keys=2",
  "train.batch_size=2",
  "train.n_branches=2",
  "sampler.max_new_tokens=2",
  "train.checkpoint_every=100",
  "train.tensorboard=false",
]


def test_every_rl_step_is_checked_on_its_own_batch(tmp_path):
  argv = vt.run_argv("grpo_haystack", TINY, None, "float32", 3)
  assert "--set=replay.verify=off" in argv and "--set=train.rl_steps=3" in argv
  parsed = registry.run_module().parse(argv)
  seen = []
  summary = vt.measure(parsed, str(tmp_path / "w"), lambda step, stats: seen.append((step, stats)))
  assert [s for s, _ in seen] == [1, 2, 3] and summary["steps"] == 4  # 1 warm-up + 3 RL
  for _, stats in seen:
    assert 0 <= stats["verify/max_rel_err"] < 2e-3 and isinstance(stats["has_signal"], bool)
    assert stats["verify/loss_replay"] == pytest.approx(stats["verify/loss_naive"], abs=1e-5)
    # full fine-tuning in float32, KL off: no base, no reference copy; parameters 4 B + AdamW's
    # two moments 8 B (and its step counters)
    assert stats["base_dtype"] is None and stats["trained_dtype"] == "float32"
    assert 12.0 <= stats["state_bytes_per_param"] < 12.01


def test_layout_of_a_bf16_base_with_float32_adapters():
  """What the LoRA check runs over: a bf16 base (2 B a parameter) and float32 adapters with
  their AdamW moments (12 B per adapter parameter), so about 2 B per model parameter."""
  import jax

  from branch_replay.config import Config, apply_overrides
  from branch_replay.data.tokenizer import TOKENIZER
  from branch_replay.train import state as train_state
  from models import transformer as tfm

  cfg = apply_overrides(
    Config(model=tfm.preset("tiny", vocab_size=TOKENIZER.vocab_size, dtype="bfloat16")),
    ["lora.rank=4", "model.param_dtype=bfloat16"],
  )
  state = train_state.init_state(cfg)
  got = vt.layout(state)
  n_base = sum(x.size for x in jax.tree.leaves(state.base))
  n_adapters = sum(x.size for x in jax.tree.leaves(state.params))
  assert (got["base_dtype"], got["trained_dtype"], got["model_params"]) == (
    "bfloat16",
    "float32",
    n_base,
  )
  optimizer_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.opt_state))
  assert got["state_bytes"] == 2 * n_base + 4 * n_adapters + optimizer_bytes
  assert optimizer_bytes >= 8 * n_adapters  # AdamW's mu and nu in float32


def test_summary_reads_the_batches_with_signal():
  rows = [
    {"max_rel_err": 1e-6, "loss_rel_err": 1e-8, "has_signal": True, "tolerance": 2e-3},
    {"max_rel_err": 3e-6, "loss_rel_err": 2e-8, "has_signal": True, "tolerance": 2e-3},
    {"max_rel_err": 0.9, "loss_rel_err": 1e-8, "has_signal": False, "tolerance": 2e-3},
  ]
  s = vt.summary_row(rows)
  assert (s["n_steps"], s["n_no_signal"], s["max_rel_err_no_signal"]) == (2, 1, 0.9)
  assert s["max_rel_err_max"] == 3e-6 and s["max_rel_err_median"] == pytest.approx(2e-6)
  assert s["margin"] == pytest.approx(2e-3 / 3e-6) and "dtype" not in s
  rows[0].update(dtype="bfloat16", base_dtype="bfloat16", state_bytes_per_param=2.1)
  s = vt.summary_row(rows)
  assert (s["dtype"], s["base_dtype"], s["state_bytes_per_param"]) == ("bfloat16", "bfloat16", 2.1)
  with pytest.raises(ValueError, match="none of the 1 batches had signal"):
    vt.summary_row(rows[2:])


def test_dtype_gap_of_a_bf16_run_against_float32():
  """--dtype_gap: replay and naive in the run's bf16 against each other and against the
  float32 gradient of the same stored weights (the check's own dtype)."""
  import jax
  import jax.numpy as jnp

  from branch_replay.config import Config, apply_overrides
  from branch_replay.data.tokenizer import TOKENIZER
  from branch_replay.train import state as train_state
  from helpers import make_batch
  from models import transformer as tfm

  cfg = apply_overrides(
    Config(model=tfm.preset("tiny", vocab_size=TOKENIZER.vocab_size, dtype="bfloat16")),
    ["lora.rank=4", "model.param_dtype=bfloat16"],
  )
  state = train_state.init_state(cfg)
  keys = iter(jax.random.split(jax.random.key(0), 64))
  state = state.replace(  # B = 0 at init: every adapter leaf gets a gradient
    params=jax.tree.map(
      lambda x: x + 0.2 * jax.random.normal(next(keys), x.shape, x.dtype), state.params
    )
  )
  batch = make_batch(4, B=2, R=3, P=6, T=4, vocab=cfg.model.vocab_size, logps=True)
  got = vt.dtype_gap(cfg, state, batch)
  assert got["half_worst_leaf"].endswith(("['a']", "['b']"))
  assert 0 < got["half_max_rel_err"] < float("inf")
  for side in ("replay", "naive"):  # bf16 rounding moves the gradient, but not past its size
    assert 0 < got["half_vs_float32_global"][side] < 1
    assert got["half_vs_float32_max_rel_err"][side] > 0
  losses = got["half_loss"]
  assert losses["float32_naive"] != losses["naive"]  # two dtypes, two computations
  assert jnp.isfinite(jnp.asarray(list(losses.values()))).all()
  summary = vt.half_summary([{**got}, {"max_rel_err": 0.0}])
  assert summary["half_max_rel_err_max"] == got["half_max_rel_err"]
  assert summary["half_vs_float32_global_max"] == got["half_vs_float32_global"]
