"""Tree GRPO on a two-turn lookup task whose turns branch (branch_replay/data/tree_task.py).

  python run.py --experiment=tree_haystack --workdir=runs/tree

The prompt hides four key records `Kv` in 256 characters of filler and ends with `?k` (a key
in lowercase); turn 1 must name the key (`K`), turn 2 its value (`v<eos>`). A 2-layer d=64
model warms up on short haystacks through the tree engine (root = a 32-token haystack, one
opening `?kK` per record with the question `?k` unscored, one second turn `v<eos>` each),
then RL samples a 4 x 4 tree per long prompt: the prompt prefilled once, 4 first turns
sharing its K/V, 4 second turns of each sharing the prompt's and the first turn's K/V; leaf
reward 1 when both turns are right; tree-aware advantages (leaves normalised among
siblings, a first turn gets its leaves' mean reward, normalised among the first turns); one
jitted step through tree replay.
No results file records a run of it yet: convert a finished workdir with
experiments/provenance.py --workdir=... before quoting a number of it.
"""

from branch_replay.data.tasks import TaskConfig
from branch_replay.core.tree import TreeConfig
from experiments.configs import base


def get_config():
  return base.config(
    TaskConfig(name="tree_haystack", prompt_len=256, n_keys=4, value_len=1, sft_prompt_len=32),
    tree=TreeConfig(fanouts="4x4"),
  )
