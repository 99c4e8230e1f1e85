"""Chat templates of imported checkpoints: a Hugging Face folder's Jinja template (in
`tokenizer_config.json`, or `chat_template.jinja` beside it), rendered for one user turn with
the generation prompt, so prompts look like what the instruction-tuned model was trained on.

BOS: a template that writes `{{ bos_token }}` gets the BOS id (the text is stripped and the id
put first, so it is never tokenized as text or doubled); one that does not, gets no BOS.
EOS: the tokenizer config's `eos_token` (often an end-of-turn token such as `<|im_end|>`)
becomes the stop token and ends the warm-up answers (tokenizer.from_model_dir).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional


def _token(value) -> str:
  if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...}
    value = value.get("content")
  return value if isinstance(value, str) else ""


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
  source: str  # the Jinja text
  bos_token: str = ""
  eos_token: str = ""
  where: str = ""  # the file it came from (error messages)

  def render(self, prompt: str, system: Optional[str] = None) -> tuple[str, bool]:
    """(text after BOS, whether the template starts with BOS) for one user turn."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
      raise ValueError(f"{self.where}: chat template: {message}")

    env = ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = raise_exception
    messages = ([{"role": "system", "content": system}] if system else []) + [
      {"role": "user", "content": prompt}
    ]
    try:
      text = env.from_string(self.source).render(
        messages=messages,
        add_generation_prompt=True,
        bos_token=self.bos_token,
        eos_token=self.eos_token,
      )
    except jinja2.TemplateError as e:
      raise ValueError(f"{self.where}: chat template does not render: {e}") from None
    if self.bos_token and text.startswith(self.bos_token):
      return text[len(self.bos_token) :], True
    return text, False


def load(model_dir: str) -> Optional[ChatTemplate]:
  """The folder's chat template, or None when it has none."""
  config_path = os.path.join(model_dir, "tokenizer_config.json")
  config = {}
  if os.path.exists(config_path):
    with open(config_path) as f:
      try:
        config = json.load(f)
      except json.JSONDecodeError as e:
        raise ValueError(f"{config_path}: not valid JSON ({e})") from None
  source, where = config.get("chat_template"), config_path
  if isinstance(source, list):  # [{"name": "default", "template": ...}, {"name": "tool_use"...}]
    named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
    source = named.get("default", next(iter(named.values()), None))
  jinja_path = os.path.join(model_dir, "chat_template.jinja")
  if not source and os.path.exists(jinja_path):  # transformers >= 4.43 saves it apart
    with open(jinja_path) as f:
      source, where = f.read(), jinja_path
  if not source:
    return None
  if not isinstance(source, str):
    raise ValueError(f"{where}: chat_template: expected a string, got {type(source).__name__}")
  return ChatTemplate(
    source, _token(config.get("bos_token")), _token(config.get("eos_token")), where
  )
