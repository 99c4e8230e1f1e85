"""Compile for a GPU on a machine without one: XLA:GPU's own compiler, scheduler and buffer
assignment through jax's CUDA plugin (deviceless ahead-of-time compilation), so a memory plan
reads the GPU's footprint instead of the CPU backend's (which stores bf16 intermediates in f32).

  dev = gpu_target.device("H200")           # a device of a one-GPU topology, no GPU needed
  args = gpu_target.place(abstract_args, dev)
  mem = jax.jit(step).lower(*args).compile().memory_analysis()

The card is described by an XLA `GpuTargetConfig` (CARDS: SM count, memory size, bandwidth,
compute capability 9.0); nothing is autotuned against a device, so the kernels may differ from
an on-device compile's, the buffers and their schedule are the GPU compiler's. Works with
JAX_PLATFORMS=cpu (the plugin then skips its driver check) and the `jax[cuda12]` of
requirements.txt; `available()` says whether this jax has the CUDA plugin.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata


@dataclasses.dataclass(frozen=True)
class Card:
  description: str  # what the device reports as device_kind
  core_count: int  # streaming multiprocessors
  memory_bytes: int  # the driver's total (nvidia-smi's MiB x 2^20)
  bandwidth: float  # HBM bytes/s


CARDS = {
  "H200": Card("NVIDIA H200", 132, 143771 * 2**20, 4.8e12),
  "H100": Card("NVIDIA H100 80GB HBM3", 132, 81559 * 2**20, 3.35e12),
  "H20": Card("NVIDIA H20", 78, 97871 * 2**20, 4.0e12),
}


def target_config(card: str) -> str:
  """The GpuTargetConfig text proto of one of CARDS (Hopper, sm_90, CUDA 12.8 runtime)."""
  if card not in CARDS:
    raise ValueError(f"card={card!r}: expected one of {sorted(CARDS)}")
  c = CARDS[card]
  return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: {c.core_count}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(c.bandwidth)}
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: {c.memory_bytes}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 minor: 0 }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 7 }}
runtime_version {{ major: 12 minor: 8 patch: 0 }}
device_description_str: "{c.description}"
"""


def plugin_version() -> str | None:
  try:
    return importlib.metadata.version("jax-cuda12-plugin")
  except importlib.metadata.PackageNotFoundError:
    return None


def available() -> bool:
  return plugin_version() is not None


def device(card: str):
  """The one device of a deviceless one-GPU topology for `card`."""
  config = target_config(card)
  if not available():
    raise RuntimeError(
      "backend=gpu needs jax's CUDA plugin (jax[cuda12] in requirements.txt); "
      "use --backend=cpu for the CPU proxy"
    )
  from jax.experimental import topologies

  topology = topologies.get_topology_desc(platform="cuda", target_config=config, topology="1x1x1")
  return topology.devices[0]


def place(tree, dev):
  """ShapeDtypeStructs on `dev` (the arguments of a deviceless compile)."""
  import jax

  sharding = jax.sharding.SingleDeviceSharding(dev)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def describe(card: str) -> str:
  c = CARDS[card]
  return (
    f"xla:gpu deviceless AOT (jax-cuda12-plugin {plugin_version()}, {c.description}, sm_90, "
    f"{c.core_count} SMs, {c.memory_bytes / 1e9:.1f} GB)"
  )
