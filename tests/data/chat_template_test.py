"""Chat templates with --model_dir: the checkpoint's Jinja template renders the JSON-lines
prompts (task.chat_template=auto|none), with its BOS (never doubled) and its EOS as the stop
token and the end of warm-up answers. The test writes the template and the tokenizer."""

import json

import numpy as np
import pytest

from branch_replay.data import chat, tasks
from branch_replay.data import supervised
from branch_replay.data import tokenizer as tokenizer_lib
from branch_replay.config import Config, apply_overrides
from models import hf

tokenizers = pytest.importorskip("tokenizers")
from helpers import make_hf_folder as make_folder  # noqa: E402

TEMPLATE = (
  "{{ bos_token }}{% for m in messages %}{{ m['role'][0] | upper }}:{{ m['content'] }};"
  "{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
)
END = 79  # the end-of-turn token's id: the char vocabulary takes 0..78


def checkpoint(path, template=TEMPLATE, as_file=False):
  """model_dir_test's tiny checkpoint, with `<|end|>` added to its tokenizer and a
  tokenizer_config.json holding the chat template (or chat_template.jinja beside it)."""
  make_folder(path)
  tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
  tok.add_special_tokens(["<|end|>"])
  tok.save(str(path / "tokenizer.json"))
  config = {"bos_token": {"content": "<s>"}, "eos_token": "<|end|>"}
  if as_file:
    (path / "chat_template.jinja").write_text(template)
  else:
    config["chat_template"] = template
  (path / "tokenizer_config.json").write_text(json.dumps(config))
  return tokenizer_lib.from_model_dir(str(path), hf.read_config(str(path)))


def data(path):
  path.write_text(
    json.dumps({"prompt": "ab", "answer": "ba"})
    + "\n"
    + json.dumps({"prompt": "xyz", "answer": "zyx"})
    + "\n"
  )
  return str(path)


@pytest.mark.parametrize("as_file", [False, True])
def test_template_renders_prompts_with_bos_once_and_its_eos(tmp_path, as_file):
  tok = checkpoint(tmp_path / "hf", as_file=as_file)
  assert tok.chat_template.render("ab") == ("U:ab;A:", True)
  assert (tok.bos_id, tok.eos_id) == (1, END)  # EOS: the template's end of turn
  path = data(tmp_path / "d.jsonl")
  task = tasks.make(tasks.TaskConfig(name="jsonl", path=path, eval_fraction=0.0), tok)
  ab = task.train[0]
  assert list(ab.prompt_ids) == [1] + tok.encode("U:ab;A:")
  assert list(ab.prompt_ids).count(1) == 1 and tok.decode(ab.prompt_ids) == "U:ab;A:"
  plain = tasks.make(
    tasks.TaskConfig(name="jsonl", path=path, eval_fraction=0.0, chat_template="none"), tok
  )
  assert list(plain.train[0].prompt_ids) == tok.encode("ab", bos=True)
  # Warm-up tails end with the template's EOS; the prefixes are the rendered prompts.
  cfg = apply_overrides(
    Config(),
    ["task.name=jsonl", f"task.path={path}", "task.eval_fraction=0", "train.sft_batch_size=2"],
  )
  batch = supervised.warmup_batch(task, np.random.default_rng(0), cfg.train.sft_batch_size, tok)
  for b in range(2):
    valid = batch.leaves.valid_BRT[b, 0]
    assert batch.leaves.tokens_BRT[b, 0][valid][-1] == END
    ids = batch.root_BP[b][batch.root_valid_BP[b]]
    assert tok.decode(ids).startswith("U:") and ids[0] == 1


def test_template_without_bos_gets_no_bos_and_errors_name_the_file(tmp_path):
  tok = checkpoint(tmp_path / "hf", template="{{ messages[0]['content'] }}=")
  task = tasks.make(
    tasks.TaskConfig(name="jsonl", path=data(tmp_path / "d.jsonl"), eval_fraction=0.0), tok
  )
  assert list(task.train[0].prompt_ids) == tok.encode("ab=")  # no BOS id
  tok = checkpoint(tmp_path / "bad", template="{{ raise_exception('no system role') }}")
  with pytest.raises(
    ValueError,
    match=r"d.jsonl:1: .*tokenizer_config.json: chat template: "
    "no system role",
  ):
    tasks.make(tasks.TaskConfig(name="jsonl", path=data(tmp_path / "d.jsonl")), tok)
  assert chat.load(str(tmp_path)) is None  # no tokenizer_config.json: no template
