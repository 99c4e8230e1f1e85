"""Config sections named by a registry: `name` picks an entry and `options` is that entry's own
frozen dataclass, given flat (`TaskConfig(name="haystack", prompt_len=64)`,
`--set=algo.ppo_epochs=2`) and read flat (`cfg.algo.ppo_epochs`). The task and the algorithm
sections (data/tasks.TaskConfig, config.AlgoConfig) are two of these."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any


@dataclasses.dataclass(frozen=True)
class NoOptions:
  pass


class NamedSection:
  """Subclass as a frozen dataclass with fields `name` and `options`, `init=False`, and define
  `section` (the config's field name, for messages), `default` and `options_class(name)`."""

  section = ""
  default = ""

  @classmethod
  def options_class(cls, name: str) -> type:
    raise NotImplementedError

  def __init__(self, name: str | None = None, options: Any = None, **fields):
    name = self.default if name is None else name
    Options = self.options_class(name)
    if options is not None and not isinstance(options, Options):
      # The name changed (`--set=task.name=...`): keep the options the user set that the new
      # entry also has, drop the rest.
      names = {f.name for f in dataclasses.fields(Options)}
      base = type(options)()
      fields = {
        **{
          f.name: getattr(options, f.name)
          for f in dataclasses.fields(options)
          if f.name in names and getattr(options, f.name) != getattr(base, f.name)
        },
        **fields,
      }
      options = None
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(Options)})
    if unknown:
      raise ValueError(
        f"{self.section}.{unknown[0]}: not an option of {self.section} {name!r}; "
        f"expected one of {['name'] + [f.name for f in dataclasses.fields(Options)]}"
      )
    options = Options() if options is None else options
    if fields:
      options = dataclasses.replace(options, **fields)
    object.__setattr__(self, "name", name)
    object.__setattr__(self, "options", options)

  def __getattr__(self, key):  # cfg.task.prompt_len -> cfg.task.options.prompt_len
    if key.startswith("__") or key == "options":
      raise AttributeError(key)
    return getattr(object.__getattribute__(self, "options"), key)

  def settable(self) -> dict:
    """field -> type for the `--set=section.field=value` parser."""
    return {"name": str, **typing.get_type_hints(type(self.options))}

  def to_dict(self) -> dict:
    return {"name": self.name, **dataclasses.asdict(self.options)}
