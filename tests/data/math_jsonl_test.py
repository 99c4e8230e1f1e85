"""The math recipe end to end on a tiny random Qwen2 checkpoint (BPE tokenizer, chat template,
two generation eos ids) that the test writes; the final_number reward; k-shot prompts."""

import json

import numpy as np
import pytest

from branch_replay.data import rewards, tasks
from branch_replay.train import trainer
from branch_replay.data import tokenizer as tokenizer_lib
from branch_replay.config import apply_overrides
from branch_replay.data.tasks import Example
from experiments.configs import math_jsonl
from models import hf


def test_final_number_reward():
  ex = [Example("q", "so 3*7=21. #### 1,234")] * 5
  got = rewards.final_number(
    ex, ["work #### 1234", "1,234", "answer 7 then 1234.0", "#### 1235", "no number"]
  )
  assert got == [1.0, 1.0, 1.0, 0.0, 0.0]
  assert rewards.final_number([Example("q", "#### -3")], ["x #### -3 and 5"]) == [1.0]
  with pytest.raises(ValueError, match="holds no number"):
    rewards.compute(rewards.get("final_number"), [Example("q", "none")], [["1"]])


def test_k_shot_prompts_share_a_long_prefix(tmp_path):
  out = math_jsonl.build_prompts(shots=3, out=str(tmp_path / "p.jsonl"))
  rows = [json.loads(line) for line in open(out)]
  data = [json.loads(line) for line in open(math_jsonl.DATA)]
  assert len(rows) == len(data) - 3
  header = math_jsonl.SEP.join(math_jsonl.shot(r["question"], r["answer"]) for r in data[:3])
  assert all(r["prompt"].startswith(header) for r in rows)
  assert rows[0]["prompt"].endswith(math_jsonl.shot(data[3]["question"]))
  assert rows[0]["answer"].strip() == data[3]["answer"]
  bad = tmp_path / "bad.jsonl"
  bad.write_text(json.dumps({"question": "q", "answer": "no mark"}) + "\n")
  with pytest.raises(ValueError, match=r"bad.jsonl:1: expected fields .*####"):
    math_jsonl.build_prompts(str(bad), 0)


@pytest.mark.slow  # ~10 min on the loaded 2-core CPU (a compile of the sampler and the step)
def test_math_recipe_end_to_end_on_a_tiny_checkpoint(tmp_path, caplog):
  folder = math_jsonl.write_tiny_checkpoint(str(tmp_path / "hf"))
  hf_config = hf.read_config(folder)
  model_cfg, params = hf.load(folder)
  tok = tokenizer_lib.from_model_dir(folder, hf_config)
  im_end, endoftext = tok._tok.token_to_id("<|im_end|>"), tok._tok.token_to_id("<|endoftext|>")
  assert tok.eos_id == im_end and set(tok.stop_ids) == {im_end, endoftext}
  base = math_jsonl.get_config()
  cfg = apply_overrides(
    base.__class__(**{**base.__dict__, "model": model_cfg}),
    [
      "train.rl_steps=1",
      "train.batch_size=2",
      "train.n_branches=2",
      "train.eval_size=0",
      "train.progress=false",
      "train.plot=false",
      "sampler.max_new_tokens=8",
      "task.prompt_len=400",
    ],
  )
  task = tasks.make(cfg.task, tok)
  ids = task.train[0].prompt_ids
  text = tok._tok.decode(list(ids), skip_special_tokens=False)
  assert text.startswith("<|im_start|>user\nQuestion:") and text.endswith(
    "<|im_start|>assistant\n"
  )  # the checkpoint's chat template
  assert text.count("####") == math_jsonl.SHOTS  # the k shots' answers, before the question
  assert len(ids) > 100 and task.n_truncated == 0  # a long shared prefix, not cut
  with caplog.at_level("WARNING"):
    task.check(cfg)  # answers are longer than 8 new tokens: said, not silent
  assert "sampler.max_new_tokens=8" in caplog.text
  s = trainer.run(cfg, str(tmp_path / "run"), init_params=params, tokenizer=tok)
  assert s["steps"] == 1
  rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  assert any("reward/mean" in r and np.isfinite(r["loss/policy"]) for r in rows)
