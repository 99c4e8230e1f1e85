"""Training from an imported Hugging Face folder: its weights and its tokenizer.json are used."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from branch_replay.data import tasks
from branch_replay.train import runtime
from branch_replay.train import metrics, trainer
from branch_replay.train import state as train_state
from branch_replay.data import tokenizer as tokenizer_lib
from branch_replay.config import Config, apply_overrides
from branch_replay.data.tokenizer import TOKENIZER
from models import hf
from models import transformer as tfm
from helpers import make_hf_folder as make_folder


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_hf_tokenizer_adapter_round_trip(tmp_path):
  make_folder(tmp_path)
  tok = tokenizer_lib.from_model_dir(str(tmp_path), hf.read_config(str(tmp_path)))
  assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (1, 2, 0, 79)
  text = "K7 ab?K"
  ids = tok.encode(text, bos=True, eos=True)
  assert ids[0] == 1 and ids[-1] == 2
  assert ids[1:-1] != tokenizer_lib.TOKENIZER.encode(text)  # its own ids, not ours
  assert tok.decode(ids) == text
  ids_BP, valid_BP = tasks.encode_left([text], 12, tok)
  assert ids_BP[0, 0] == tok.pad_id and valid_BP.sum() == len(text) + 1


def test_train_starts_from_imported_params_with_its_tokenizer(tmp_path):
  model_cfg, params = make_folder(tmp_path / "hf")
  loaded_cfg, loaded = hf.load(str(tmp_path / "hf"))
  tok = tokenizer_lib.from_model_dir(str(tmp_path / "hf"), hf.read_config(str(tmp_path / "hf")))
  cfg = apply_overrides(
    Config(model=loaded_cfg),
    [
      "task.prompt_len=20",
      "task.n_keys=2",
      "train.sft_steps=1",
      "train.rl_steps=1",
      "train.batch_size=2",
      "train.n_branches=2",
      "train.sft_batch_size=2",
      "sampler.max_new_tokens=2",
      "train.eval_size=0",
      "train.progress=false",
      "train.plot=false",
      "train.learning_rate=1e-4",
      "train.sft_learning_rate=1e-4",
      "train.weight_decay=0.0",
    ],
  )
  state = train_state.init_state(cfg, loaded)
  jax.tree.map(np.testing.assert_array_equal, state.params, params)  # not a random init
  s = trainer.run(cfg, str(tmp_path / "run"), init_params=loaded, tokenizer=tok)
  assert s["steps"] == 2
  # An AdamW step moves each parameter by about the learning rate: the run trained the
  # imported weights, not a fresh init (which differs from them by O(0.1-1)).
  moved = jax.tree.map(
    lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))), s["final_params"], params
  )
  assert 0 < max(jax.tree.leaves(moved)) <= 3e-4
  with pytest.raises(ValueError, match="parameter tree does not match"):
    train_state.init_state(
      dataclasses.replace(cfg, model=tfm.preset("tiny", vocab_size=128)), loaded
    )


@pytest.mark.slow
def test_run_py_model_dir(tmp_path):
  make_folder(tmp_path / "hf")
  out = subprocess.run(
    [
      sys.executable,
      "run.py",
      f"--model_dir={tmp_path / 'hf'}",
      f"--workdir={tmp_path / 'w'}",
      "--set=train.sft_steps=0",
      "--set=train.rl_steps=1",
      "--set=train.eval_size=0",
      "--set=train.plot=false",
      "--set=train.progress=false",
      "--set=task.prompt_len=20",
      "--set=task.n_keys=2",
      "--set=train.batch_size=2",
      "--set=train.n_branches=2",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert out.returncode == 0, out.stderr[-2000:]
  assert "token positions computed" in out.stdout


def test_run_py_bad_model_dir(tmp_path):
  out = subprocess.run(
    [sys.executable, "run.py", f"--model_dir={tmp_path}"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert out.returncode != 0 and "config.json: missing" in out.stderr


def test_folder_without_tokenizer_needs_the_explicit_flag(tmp_path):
  make_folder(tmp_path)
  os.remove(tmp_path / "tokenizer.json")
  hf_config = hf.read_config(str(tmp_path))
  with pytest.raises(ValueError, match=r"tokenizer.json: missing.*--char_tokenizer"):
    tokenizer_lib.from_model_dir(str(tmp_path), hf_config)
  assert (
    tokenizer_lib.from_model_dir(str(tmp_path), hf_config, char_tokenizer=True)
    is tokenizer_lib.TOKENIZER
  )
  out = subprocess.run(
    [sys.executable, "run.py", f"--model_dir={tmp_path}", f"--workdir={tmp_path / 'w'}"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert out.returncode != 0 and "tokenizer.json: missing" in out.stderr, out.stderr[-2000:]


def test_char_tokenizer_flag_refused_when_the_folder_has_one(tmp_path):
  make_folder(tmp_path)
  with pytest.raises(ValueError, match="has its own tokenizer"):
    tokenizer_lib.from_model_dir(str(tmp_path), hf.read_config(str(tmp_path)), char_tokenizer=True)


def test_tokenizer_larger_than_the_embedding_is_an_error(tmp_path):
  make_folder(tmp_path, vocab_size=64)  # the tokenizer has 79 tokens
  with pytest.raises(ValueError, match=r"vocabulary of 79 tokens exceeds .*vocab_size=64"):
    tokenizer_lib.from_model_dir(str(tmp_path), hf.read_config(str(tmp_path)))


def test_missing_weights_name_the_file(tmp_path):
  make_folder(tmp_path)
  os.remove(tmp_path / "model.safetensors")
  with pytest.raises(ValueError, match="no weights: model.safetensors"):
    hf.load(str(tmp_path))


def test_generation_config_eos_ids_stop_the_sampler(tmp_path):
  make_folder(tmp_path)
  with open(tmp_path / "generation_config.json", "w") as f:
    json.dump({"eos_token_id": [2, 5]}, f)
  tok = tokenizer_lib.from_model_dir(str(tmp_path), hf.read_config(str(tmp_path)))
  assert tok.stop_ids == (2, 5)
  text = tok.decode(tok.encode("ab") + [5] + tok.encode("cd"))
  assert text == "ab"  # decoding (the rewards' text) stops at any stop id
  with open(tmp_path / "generation_config.json", "w") as f:
    json.dump({"eos_token_id": "x"}, f)
  with pytest.raises(ValueError, match="generation_config.json: eos_token_id"):
    tokenizer_lib.from_model_dir(str(tmp_path), hf.read_config(str(tmp_path)))


def test_trainer_samples_with_every_stop_id():
  """train.run hands the tokenizer's stop ids to both samplers (sampling and greedy eval)."""
  cfg = Config(model=tfm.preset("tiny", vocab_size=96))
  rt = runtime.Runtime(cfg, TOKENIZER)
  fns = rt.fns((2, 5))
  for fn in (fns.sample, fns.greedy):
    partial = fn.__wrapped__
    while "stop_tokens" not in partial.keywords:
      partial = partial.func
    assert partial.keywords["stop_tokens"] == (2, 5)
  partial = rt.fns(2).greedy.__wrapped__
  assert partial.keywords["stop_tokens"] == (2,)


def test_run_py_bf16_lora_base_loads_bf16_trains_resumes_and_exports_peft(tmp_path):
  """run.py --model_dir=<bf16 safetensors> --model_dtype=bfloat16 --set=lora.rank=4: the base
  is read as bf16 tensor by tensor (the values bitwise the file's), the adapters and their
  AdamW state are float32; a step trains, a run stopped after 1 step resumes to the
  uninterrupted run's adapters bitwise, the PEFT export is float32 as before. Without LoRA
  the same flags keep float32 masters."""
  import run
  from models import lora as lora_lib

  model_cfg, params = make_folder(tmp_path / "hf")
  params16 = jax.tree.map(lambda x: x.astype(jax.numpy.bfloat16), params)
  hf.save(  # a bf16 checkpoint (hf.save writes the compute dtype)
    str(tmp_path / "hf"),
    dataclasses.replace(model_cfg, dtype="bfloat16"),
    params16,
    extra_config=dict(bos_token_id=1, eos_token_id=2, pad_token_id=0),
  )
  argv = [
    "run.py",
    f"--model_dir={tmp_path / 'hf'}",
    "--model_dtype=bfloat16",
    "--set=lora.rank=4",
    "--set=loss.kl_coef=0.05",
    "--set=train.sft_steps=1",
    "--set=train.sft_batch_size=2",
    "--set=train.rl_steps=1",
    "--set=train.eval_size=0",
    "--set=train.plot=false",
    "--set=train.progress=false",
    "--set=train.tensorboard=false",
    "--set=train.checkpoint_every=1",
    "--set=task.prompt_len=20",
    "--set=task.n_keys=2",
    "--set=train.batch_size=2",
    "--set=train.n_branches=2",
    "--set=sampler.max_new_tokens=2",
  ]
  _, cfg, base, tok = run.parse(argv)
  assert (cfg.model.dtype, cfg.model.param_dtype) == ("bfloat16", "bfloat16")
  assert {x.dtype for x in jax.tree.leaves(base)} == {np.dtype(jax.numpy.bfloat16)}
  jax.tree.map(np.testing.assert_array_equal, base, params16)
  state = train_state.init_state(cfg, base)
  assert {x.dtype for x in jax.tree.leaves(state.params)} == {np.dtype(np.float32)}
  full = trainer.run(cfg, str(tmp_path / "full"), init_params=base, tokenizer=tok)
  assert full["steps"] == 2
  # replay.verify (auto: on for --model_dir) ran on the RL batch, or deferred it when every
  # advantage was zero (equal rewards: a gradient of bf16 noise, verify.has_signal)
  (rl,) = [r for r in metrics.read(full["metrics"]) if r.get("phase") == "rl"]
  assert "verify/max_rel_err" in rl or rl.get("verify/deferred") == 1
  if "verify/max_rel_err" in rl:  # it judged what the step trains: an adapter's gradient
    assert rl["verify/worst_leaf"].endswith(("['a']", "['b']")), rl["verify/worst_leaf"]
    assert rl["verify/dtype"] == "float32"  # a bf16 run is checked in float32 (verify.py)
  part = str(tmp_path / "part")
  one = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, rl_steps=0))
  trainer.run(one, part, init_params=base, tokenizer=tok)
  resumed = trainer.run(cfg, part, init_params=base, tokenizer=tok)
  jax.tree.map(np.testing.assert_array_equal, resumed["final_params"], full["final_params"])
  jax.tree.map(np.testing.assert_array_equal, full["base_params"], params16)  # frozen
  _, loaded = lora_lib.load_peft(full["adapter"], cfg.model, cfg.lora)
  jax.tree.map(np.testing.assert_array_equal, loaded, full["final_params"])
  import safetensors.numpy

  tensors = safetensors.numpy.load_file(os.path.join(full["adapter"], lora_lib.WEIGHTS_FILE))
  assert {t.dtype for t in tensors.values()} == {np.dtype(np.float32)}
  _, cfg32, base32, _ = run.parse([a for a in argv if a != "--set=lora.rank=4"])
  assert cfg32.model.param_dtype == "float32"
  assert {x.dtype for x in jax.tree.leaves(base32)} == {np.dtype(np.float32)}
