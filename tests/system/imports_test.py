"""The package's import graph (every import statement, top-level or inside a function): the
rooms import downward only (models < core < data < config < train < rollout < algorithms <
experiments), no circles (experiments/ included), the config imports no algorithm, the
trainer loop imports no algorithm, and no module imports another's private names."""

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALGORITHM_MODULES = (
  "branch_replay.train.steps",
  "branch_replay.data.dpo",
  "branch_replay.train.trainer",
  "branch_replay.algorithms",
)


def _modules():
  out = {}
  for pkg in ("branch_replay", "models", "experiments"):
    for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
      for f in files:
        if f.endswith(".py"):
          rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].replace(os.sep, ".")
          out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(
            dirpath, f
          )
  return out


def _imports(path, modules):
  """(module imported, names used from it) for every import in the file: names imported
  from it, and attributes read from it (`train._compiled(...)`)."""
  found, alias = [], {}
  tree = ast.parse(open(path).read())
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        if a.name in modules:
          found.append((a.name, ()))
          alias[a.asname or a.name] = a.name
    elif isinstance(node, ast.ImportFrom) and node.module:
      for a in node.names:
        sub = f"{node.module}.{a.name}"
        found.append((sub, ()) if sub in modules else (node.module, (a.name,)))
        if sub in modules:
          alias[a.asname or a.name] = sub
  for node in ast.walk(tree):
    if (
      isinstance(node, ast.Attribute)
      and isinstance(node.value, ast.Name)
      and node.value.id in alias
    ):
      found.append((alias[node.value.id], (node.attr,)))
  return [(m, names) for m, names in found if m in modules]


def _graph():
  modules = _modules()
  return {m: _imports(p, modules) for m, p in modules.items()}


def test_no_import_circles():
  graph = {m: {d for d, _ in deps} for m, deps in _graph().items()}
  state = {}

  def visit(m, path):
    state[m] = "open"
    for d in sorted(graph[m]):
      assert state.get(d) != "open", "import circle: " + " -> ".join(path + [m, d])
      if d not in state:
        visit(d, path + [m])
    state[m] = "done"

  for m in sorted(graph):
    if m not in state:
      visit(m, [])


# The floors, bottom to top: a module imports only modules on its own floor or below.
FLOORS = (
  ("models",),
  ("branch_replay.core", "branch_replay.sections"),
  ("branch_replay.data", "branch_replay.registry"),
  ("branch_replay.config",),
  ("branch_replay.train",),
  ("branch_replay.rollout",),
  ("branch_replay.algorithms",),
  ("experiments",),
)
# Known upward imports, each with the step of the redesign that removes it.
UPWARD = {
  # a GGUF's chat template is read into data/chat.py's ChatTemplate
  ("models.gguf", "branch_replay.data.chat"),
}


def floor(module: str) -> int:
  if module == "branch_replay":
    return 0
  for i, prefixes in enumerate(FLOORS):
    if any(module == p or module.startswith(p + ".") for p in prefixes):
      return i
  raise AssertionError(f"{module}: in no room of FLOORS (add it to one)")


def test_rooms_import_downward():
  graph = _graph()
  up = sorted(
    (m, d)
    for m, deps in graph.items()
    for d, _ in deps
    if floor(d) > floor(m) and (m, d) not in UPWARD
  )
  assert not up, "imports upward, against the rooms' order: " + ", ".join(
    f"{m} -> {d}" for m, d in up
  )
  stale = sorted(e for e in UPWARD if e[1] not in {d for d, _ in graph.get(e[0], ())})
  assert not stale, f"UPWARD lists imports that no longer exist: {stale}"


def test_config_and_trainer_import_no_algorithm():
  """The config and the trainer reach an algorithm (its Options, check, class) only by name,
  through the registry (`branch_replay/registry.py`, importlib); neither imports anything of
  algorithms/. The registry itself imports no algorithm, and nothing in branch_replay/ imports
  upward (UPWARD lists none there)."""
  graph = _graph()
  for m in ("branch_replay.config", "branch_replay.train.trainer", "branch_replay.registry"):
    deps = {d for d, _ in graph[m]}
    bad = sorted(d for d in deps if d != m and d.startswith(ALGORITHM_MODULES))
    assert not bad, f"{m} imports {bad}"
  assert not [e for e in UPWARD if e[0].startswith("branch_replay")], UPWARD


def test_no_private_names_across_modules():
  modules = _modules()
  users = dict(_graph())  # the package, and the experiments and run.py that use it
  for path in [os.path.join(ROOT, "run.py")] + [
    os.path.join(ROOT, "experiments", f)
    for f in os.listdir(os.path.join(ROOT, "experiments"))
    if f.endswith(".py")
  ]:
    users[os.path.relpath(path, ROOT)] = _imports(path, modules)
  bad = [
    (m, d, n)
    for m, deps in users.items()
    for d, names in deps
    for n in names
    if n.startswith("_") and not n.startswith("__")
  ]
  assert not bad, bad


def test_algorithms_never_read_the_rollout_shape():
  """Flat or tree is rollout.py's decision: no algorithm reads `cfg.tree` or calls the tree
  task's helpers (`tree_task.`); it gets its batches from rollout.py."""
  folder = os.path.join(ROOT, "branch_replay", "algorithms")
  bad = []
  for f in sorted(os.listdir(folder)):
    if f.endswith(".py"):
      for number, line in enumerate(open(os.path.join(folder, f)), 1):
        if re.search(r"\bcfg\.tree\b|\btree_task\.", line.split("#")[0]):
          bad.append(f"algorithms/{f}:{number}: {line.strip()}")
  assert not bad, bad


def test_the_rollout_path_and_train_never_branch_on_the_shape():
  """Flat group or tree of turns is the task's shape (`tasks.Shape`, data/): it picks the
  sampler, and the samples lay themselves out (`Samples.batch`, `TreeSamples.batch`), so the
  code of rollout.py and train/ reads no `.tree.fanouts`/`.fanout_tuple`, no `.turns`, and asks
  no samples their type (docstrings may name them)."""
  files = [os.path.join(ROOT, "branch_replay", "rollout.py")]
  folder = os.path.join(ROOT, "branch_replay", "train")
  files += [os.path.join(folder, f) for f in sorted(os.listdir(folder)) if f.endswith(".py")]
  bad = []
  for path in files:
    for node in ast.walk(ast.parse(open(path).read())):
      where = f"{os.path.relpath(path, ROOT)}:{getattr(node, 'lineno', 0)}"
      if isinstance(node, ast.Attribute) and (
        node.attr in ("turns", "fanout_tuple")
        or (node.attr == "fanouts" and ast.unparse(node.value).endswith("tree"))
      ):
        bad.append(f"{where}: {ast.unparse(node)}")
      if (
        isinstance(node, ast.Call)
        and ast.unparse(node.func) == "isinstance"
        and "Samples" in ast.unparse(node)
      ):
        bad.append(f"{where}: {ast.unparse(node)}")
  assert not bad, bad


def test_the_trainer_asks_the_algorithm_nothing_optional():
  """Every member of the protocol has a default (algorithms/base.py): the loop calls them, it
  never probes the algorithm with getattr or hasattr."""
  tree = ast.parse(open(os.path.join(ROOT, "branch_replay", "train", "trainer.py")).read())
  probes = [
    node.lineno
    for node in ast.walk(tree)
    if isinstance(node, ast.Call)
    and isinstance(node.func, ast.Name)
    and node.func.id in ("getattr", "hasattr")
    and node.args
    and isinstance(node.args[0], ast.Name)
    and node.args[0].id == "algo"
  ]
  assert not probes, f"trainer.py probes the algorithm at lines {probes}"


def test_config_names_no_algorithms_rules():
  """An algorithm's rules live with it (its class's declarations, its check(cfg)): outside
  the migration of configs saved before the `algo` section (`migrate`), config.py compares no
  field with an algorithm's name."""
  src = open(os.path.join(ROOT, "branch_replay", "config.py")).read()
  tree = ast.parse(src)
  migrate = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "migrate")
  names = {"ppo", "dpo", "sft", "rollouts"}  # not "grpo": also an objective's (loss.name) name
  bad = [
    f"config.py:{n.lineno}: {ast.unparse(n)}"
    for n in ast.walk(tree)
    if isinstance(n, ast.Compare)
    and not (migrate.lineno <= n.lineno <= migrate.end_lineno)
    and any(isinstance(c, ast.Constant) and c.value in names for c in [n.left, *n.comparators])
  ]
  assert not bad, bad


def test_rollout_calls_the_task_not_a_tasks_helpers():
  """A task states its rollouts and rewards its leaves (tasks.Task, turns.TurnsTask):
  rollout.py calls the task, never one task's module (`tree_task`)."""
  graph = _graph()
  assert "branch_replay.data.tree_task" not in {d for d, _ in graph["branch_replay.rollout"]}


def test_no_sys_path_edits():
  """The checkout is installed (`pip install -e .`, the README's commands and .ci/run) or on
  pytest's pythonpath (pyproject.toml): no script, test or notebook edits sys.path."""
  bad = []
  for dirpath, dirs, files in os.walk(ROOT):
    dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("results", "__pycache__")]
    for f in files:
      if f.endswith((".py", ".ipynb")):
        path = os.path.join(dirpath, f)
        for number, line in enumerate(open(path, encoding="utf-8"), 1):
          if re.search(r"sys\.path\.(insert|append)", line) and path != os.path.abspath(__file__):
            bad.append(f"{os.path.relpath(path, ROOT)}:{number}")
  assert not bad, bad


def test_no_test_module_imports_another():
  """Test modules share through tests/helpers.py, tests/oracles.py and cases modules (e.g.
  tests/models/attention_cases.py), never by importing another test module (by basename, as
  pytest imports them, or as `tests.<room>.<name>_test`): a test file can then be moved,
  split or deleted alone. The fixture generators under tests/ follow the same rule."""
  tests_dir = os.path.join(ROOT, "tests")
  bad = []
  for dirpath, _, files in os.walk(tests_dir):
    for f in files:
      if not f.endswith(".py"):
        continue
      path = os.path.join(dirpath, f)
      for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        names = []
        if isinstance(node, ast.Import):
          names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
          names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
          if name.rsplit(".", 1)[-1].endswith("_test") and (
            "." not in name or name.startswith("tests.")
          ):
            bad.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: {name}")
  assert not bad, "test modules import test modules: " + ", ".join(sorted(set(bad)))
