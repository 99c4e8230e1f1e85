"""Gated DeltaNet (Qwen3.5 / Qwen3-Next `linear_attention` layers) in JAX: the gated delta
rule in its chunked-parallel (WY/UT) form for training and its recurrent form for decoding,
the causal depthwise convolution with its state, the gated RMSNorm, and the decoder layer.

Shape letters as in transformer.py, plus for the linear layer:
  K key (and query) heads · N value heads (N = K*G: key head n // G serves value head n) ·
  H key head dim · J value head dim · C conv channels (2*K*H + N*J) · W conv kernel - 1 ·
  n chunks · c positions in a chunk.

A linear layer's "cache" is its `LinearState`: the final recurrent state S [B, N, H, J] and
the last W inputs of its convolution, constant in the sequence length. Padding never touches
it: padding tokens enter the convolution as zeros (as Hugging Face masks them) and the
recurrence with decay 1 and learning rate 0, and the conv state is read at the last valid
token, so a right-padded tail's state is the state after its last real token. A call that
starts from a (nonzero) context state must hold its valid tokens first (right padding: tails,
tree levels, decode steps); a left-padded call must start from the zero state (a prefix).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.config import ACTIVATIONS, ModelConfig
from models.layers import RMSNorm, rms_norm

Array = jax.Array


class LinearState(NamedTuple):
  """What a linear layer passes on: the recurrent state and the last W conv inputs."""

  state_BNHJ: Array
  conv_BWC: Array


def _acc(dtype):
  return jnp.float64 if dtype == jnp.float64 else jnp.float32


def l2norm(x, eps: float = 1e-6):
  """x / sqrt(sum x^2 + eps) over the last axis (the FLA / Hugging Face convention)."""
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


# ----------------------------------------------------------------------------- the delta rule


def recurrent_delta_rule(q_BTNH, k_BTNH, v_BTNJ, g_BTN, beta_BTN, state_BNHJ):
  """The gated delta rule one token at a time (decoding; the oracle of the chunked form).

  S <- S * exp(g);  S <- S + k (beta (v - S^T k))^T;  o = S^T q.  Queries come scaled and
  q, k normalised. Returns (o_BTNJ, final state)."""

  def step(S_BNHJ, xs):
    q_BNH, k_BNH, v_BNJ, g_BN, beta_BN = xs
    S_BNHJ = S_BNHJ * jnp.exp(g_BN)[..., None, None]
    mem_BNJ = jnp.einsum("BNHJ,BNH->BNJ", S_BNHJ, k_BNH)
    delta_BNJ = (v_BNJ - mem_BNJ) * beta_BN[..., None]
    S_BNHJ = S_BNHJ + jnp.einsum("BNH,BNJ->BNHJ", k_BNH, delta_BNJ)
    return S_BNHJ, jnp.einsum("BNHJ,BNH->BNJ", S_BNHJ, q_BNH)

  xs = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), (q_BTNH, k_BTNH, v_BTNJ, g_BTN, beta_BTN))
  state_BNHJ, o_TBNJ = jax.lax.scan(step, state_BNHJ, xs)
  return jnp.swapaxes(o_TBNJ, 0, 1), state_BNHJ


def chunked_delta_rule(q_BTNH, k_BTNH, v_BTNJ, g_BTN, beta_BTN, state_BNHJ, chunk: int = 64):
  """The same rule in chunks of c positions (the WY/UT form of Qwen3.5's torch reference).

  Inside a chunk, with Gamma the cumulative log-decay and A = strict_lower((beta k) k^T *
  exp(Gamma_i - Gamma_j)): u = (I + A)^-1 (beta v) and w = (I + A)^-1 (beta k exp(Gamma)); the
  chunk's new values are u - w S, its outputs (q exp(Gamma)) S + tril(q k^T decay) (u - w S),
  and S <- exp(Gamma_c) S + (k exp(Gamma_c - Gamma))^T (u - w S). Chunks run under `lax.scan`,
  each chunk rematerialised in the backward: the gradient keeps one [B, N, H, J] state per
  chunk and the inputs, not the [c, c] intra-chunk matrices (cost: the chunk's forward once
  more in the backward)."""
  T = k_BTNH.shape[1]
  c = min(chunk, T)
  # Padding positions: decay 1 (g = 0) and learning rate 0 leave the state as it is.
  xs = tuple(to_chunks(x, c) for x in (q_BTNH, k_BTNH, v_BTNJ, g_BTN, beta_BTN))
  state_BNHJ, o_nBcNJ = jax.lax.scan(jax.checkpoint(delta_chunk), state_BNHJ, xs)
  return from_chunks(o_nBcNJ, T), state_BNHJ


def to_chunks(x_BT, c: int):
  """[B, T, ...] -> [n, B, c, ...]: T zero-padded to n = ceil(T / c) chunks of c."""
  B, T = x_BT.shape[:2]
  n = -(-T // c)
  x_BT = jnp.pad(x_BT, ((0, 0), (0, n * c - T)) + ((0, 0),) * (x_BT.ndim - 2))
  return jnp.moveaxis(x_BT.reshape(B, n, c, *x_BT.shape[2:]), 1, 0)


def from_chunks(x_nBc, T: int):
  """[n, B, c, ...] -> [B, T, ...] (the padding dropped)."""
  n, B, c = x_nBc.shape[:3]
  return jnp.moveaxis(x_nBc, 0, 1).reshape(B, n * c, *x_nBc.shape[3:])[:, :T]


def delta_chunk(S_BNHJ, xs):
  """One chunk of c positions of the chunked rule: (state after it, outputs o_BcNJ)."""
  q_BcNH, k_BcNH, v_BcNJ, g_BcN, beta_BcN = xs
  c = k_BcNH.shape[1]
  lower_cc = jnp.tril(jnp.ones((c, c), bool))
  strict_cc = jnp.tril(jnp.ones((c, c), bool), -1)
  gamma_BNc = jnp.cumsum(jnp.swapaxes(g_BcN, 1, 2), axis=-1)
  diff_BNcc = gamma_BNc[..., :, None] - gamma_BNc[..., None, :]
  decay_BNcc = jnp.exp(jnp.where(lower_cc, diff_BNcc, -jnp.inf))  # 0 above the diagonal
  kb_BcNH = k_BcNH * beta_BcN[..., None]
  A_BNcc = jnp.where(
    strict_cc, jnp.einsum("BiNh,BjNh->BNij", kb_BcNH, k_BcNH) * decay_BNcc, 0.0
  ) + jnp.eye(c, dtype=decay_BNcc.dtype)
  inv_BNcc = unit_lower_inverse(A_BNcc)
  solve = lambda rhs_BNcX: jnp.einsum("BNij,BNjX->BNiX", inv_BNcc, rhs_BNcX)
  u_BNcJ = solve(jnp.einsum("BcNJ,BcN->BNcJ", v_BcNJ, beta_BcN))
  w_BNcH = solve(jnp.swapaxes(kb_BcNH, 1, 2) * jnp.exp(gamma_BNc)[..., None])
  new_BNcJ = u_BNcJ - jnp.einsum("BNch,BNhJ->BNcJ", w_BNcH, S_BNHJ)
  attn_BNcc = jnp.einsum("BiNh,BjNh->BNij", q_BcNH, k_BcNH) * decay_BNcc
  qd_BNcH = jnp.swapaxes(q_BcNH, 1, 2) * jnp.exp(gamma_BNc)[..., None]
  o_BNcJ = jnp.einsum("BNch,BNhJ->BNcJ", qd_BNcH, S_BNHJ) + jnp.einsum(
    "BNij,BNjJ->BNiJ", attn_BNcc, new_BNcJ
  )
  kd_BNcH = jnp.swapaxes(k_BcNH, 1, 2) * jnp.exp(gamma_BNc[..., -1:] - gamma_BNc)[..., None]
  S_BNHJ = S_BNHJ * jnp.exp(gamma_BNc[..., -1])[..., None, None] + jnp.einsum(
    "BNch,BNcJ->BNhJ", kd_BNcH, new_BNcJ
  )
  return S_BNHJ, jnp.swapaxes(o_BNcJ, 1, 2)


def unit_lower_inverse(L_Xcc):
  """The inverse of unit lower-triangular matrices [..., c, c] by blocked forward
  substitution: diagonal blocks of size s are inverted, then pairs of them merged,
  inv([[L11, 0], [L21, L22]]) = [[I11, 0], [-I22 L21 I11, I22]], s = 1, 2, 4, ... (c padded
  to a power of two with the identity). Plain matmuls: XLA:CPU's LAPACK triangular solve
  inside the chunks' scan stalls every thread (hybrid_small, P >= 512, jax 0.10.2)."""
  c = L_Xcc.shape[-1]
  m = 1 << (c - 1).bit_length()
  batch = L_Xcc.shape[:-2]
  eye = jnp.eye(m, dtype=L_Xcc.dtype)
  L_Xmm = eye.at[:c, :c].set(0).astype(L_Xcc.dtype) + jnp.pad(
    L_Xcc, [(0, 0)] * len(batch) + [(0, m - c), (0, m - c)]
  )
  inv_Xbss = jnp.ones(batch + (m, 1, 1), L_Xcc.dtype)  # 1 x 1 diagonal blocks: unit
  s = 1
  while s < m:
    nb = m // (2 * s)
    blocks_Xb22 = L_Xmm.reshape(batch + (nb, 2 * s, nb, 2 * s))
    diag_Xbtt = jnp.einsum("...iaib->...iab", blocks_Xb22)  # the 2s x 2s diagonal blocks
    L21_Xbss = diag_Xbtt[..., s:, :s]
    I11_Xbss, I22_Xbss = inv_Xbss[..., 0::2, :, :], inv_Xbss[..., 1::2, :, :]
    new21_Xbss = -jnp.einsum("...ij,...jk,...kl->...il", I22_Xbss, L21_Xbss, I11_Xbss)
    top_Xbst = jnp.concatenate([I11_Xbss, jnp.zeros_like(I11_Xbss)], axis=-1)
    bottom_Xbst = jnp.concatenate([new21_Xbss, I22_Xbss], axis=-1)
    inv_Xbss = jnp.concatenate([top_Xbst, bottom_Xbst], axis=-2)
    s *= 2
  return inv_Xbss[..., 0, :c, :c]


# ----------------------------------------------------------------------------- convolution


def causal_conv(x_BTC, w_KC, conv_BWC, valid_BT):
  """Depthwise causal convolution (kernel W+1, weight row W on the current input) after the
  W context inputs conv_BWC, then SiLU. Returns (y_BTC, the last W inputs up to the last valid
  token: the next call's conv state)."""
  W = w_KC.shape[0] - 1
  T = x_BTC.shape[1]
  ext_BSC = jnp.concatenate([conv_BWC.astype(x_BTC.dtype), x_BTC], axis=1)
  y_BTC = sum(ext_BSC[:, i : i + T] * w_KC[i] for i in range(W + 1))
  # The index after the last valid token (0: no valid token, the old state is kept).
  end_B = jnp.max(jnp.where(valid_BT, jnp.arange(1, T + 1), 0), axis=1)
  idx_BW = end_B[:, None] + jnp.arange(W)
  conv_BWC = jnp.take_along_axis(ext_BSC, idx_BW[..., None], axis=1)
  return jax.nn.silu(y_BTC), conv_BWC


def token_mix(
  cfg: ModelConfig,
  valid_BT,
  h_BTD,
  state_BNHJ,
  conv_BWC,
  w_qkv_DC,
  w_conv_KC,
  w_b_DN,
  w_a_DN,
  A_log_N,
  dt_bias_N,
  w_z_DNJ,
  norm_scale_J,
  w_out_NJD,
):
  """A linear layer's token mixer, from its normed input h to its output a (added to the
  residual stream): projections, causal conv, head split, l2norm, beta and decay, the delta
  rule, the gated norm and the output projection. Returns (a_BTD, the new recurrent state,
  the new conv state, up to the last valid token).

  One token (decoding): the recurrent form. More: the whole mixer runs chunk by chunk of
  c = linear_chunk positions under `lax.scan` (the chunked rule's chunks), carrying the
  recurrent state, the last W conv inputs and the conv state at the last valid token; with
  `linear_remat` each chunk is rematerialised in the backward, so what the gradient keeps
  per token is h alone and the mixer's temporaries live one chunk at a time (cost: the
  mixer's forward once more in the backward)."""
  weights = (
    w_qkv_DC,
    w_conv_KC,
    w_b_DN,
    w_a_DN,
    A_log_N,
    dt_bias_N,
    w_z_DNJ,
    norm_scale_J,
    w_out_NJD,
  )
  T = h_BTD.shape[1]
  if T == 1:
    a_BTD, state_BNHJ, _, conv_BWC = _mix_chunk(
      cfg,
      weights,
      recurrent_delta_rule,
      (state_BNHJ, conv_BWC.astype(h_BTD.dtype), conv_BWC.astype(h_BTD.dtype)),
      (h_BTD, valid_BT),
    )
    return a_BTD, state_BNHJ, conv_BWC
  c = min(cfg.linear_chunk, T)  # padding positions: h = 0, not valid (decay 1, rate 0)
  rule = lambda *xs: delta_chunk(xs[-1], xs[:-1])[::-1]  # (o, S) as recurrent_delta_rule
  body = lambda carry, xs: _mix_chunk(cfg, weights, rule, carry, xs)
  if cfg.linear_remat:
    body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
  conv_BWC = conv_BWC.astype(h_BTD.dtype)
  scan_body = lambda carry, xs: (lambda a, *carry: (tuple(carry), a))(*body(carry, xs))
  (state_BNHJ, _, conv_BWC), a_nBcD = jax.lax.scan(
    scan_body, (state_BNHJ, conv_BWC, conv_BWC), (to_chunks(h_BTD, c), to_chunks(valid_BT, c))
  )
  return from_chunks(a_nBcD, T), state_BNHJ, conv_BWC


def _mix_chunk(cfg: ModelConfig, weights, rule, carry, xs):
  """The token mixer on c positions after `carry` = (recurrent state, the last W conv inputs,
  the conv state at the last valid token so far): (a_BcD, *the carry after them)."""
  (w_qkv_DC, w_conv_KC, w_b_DN, w_a_DN, A_log_N, dt_bias_N, w_z_DNJ, norm_scale_J, w_out_NJD) = (
    weights
  )
  S_BNHJ, last_BWC, conv_BWC = carry
  h_BcD, valid_Bc = xs
  B, c, _ = h_BcD.shape
  K, N = cfg.linear_key_heads, cfg.linear_value_heads
  H, J = cfg.linear_key_head_dim, cfg.linear_value_head_dim
  dt, acc = h_BcD.dtype, _acc(h_BcD.dtype)
  x_BcC = jnp.einsum("BcD,DC->BcC", h_BcD, w_qkv_DC.astype(dt))
  mixed_BcC, chunk_conv_BWC = causal_conv(x_BcC, w_conv_KC.astype(dt), last_BWC, valid_Bc)
  last_BWC = jnp.concatenate([last_BWC, x_BcC], axis=1)[:, c:]
  conv_BWC = jnp.where(jnp.any(valid_Bc, axis=1)[:, None, None], chunk_conv_BWC, conv_BWC)
  q_BcKH, k_BcKH, v_BcNJ = jnp.split(mixed_BcC, [K * H, 2 * K * H], axis=-1)
  G = N // K
  heads = lambda x_BcC, n, d: jnp.repeat(x_BcC.reshape(B, c, n, d).astype(acc), G, axis=2)
  q_BcNH, k_BcNH = l2norm(heads(q_BcKH, K, H)) * H**-0.5, l2norm(heads(k_BcKH, K, H))
  v_BcNJ = v_BcNJ.reshape(B, c, N, J).astype(acc)
  beta_BcN = jax.nn.sigmoid(jnp.einsum("BcD,DN->BcN", h_BcD, w_b_DN.astype(dt)).astype(acc))
  a_BcN = jnp.einsum("BcD,DN->BcN", h_BcD, w_a_DN.astype(dt)).astype(acc)
  g_BcN = -jnp.exp(A_log_N.astype(acc)) * jax.nn.softplus(a_BcN + dt_bias_N.astype(acc))
  # Padding leaves the state untouched: decay exp(0) = 1, learning rate 0.
  g_BcN = jnp.where(valid_Bc[..., None], g_BcN, 0.0)
  beta_BcN = jnp.where(valid_Bc[..., None], beta_BcN, 0.0)
  o_BcNJ, S_BNHJ = rule(q_BcNH, k_BcNH, v_BcNJ, g_BcN, beta_BcN, S_BNHJ)
  # The output gate: the gated RMSNorm over J (no offset) times silu(h W_z), then W_out.
  z_BcNJ = jnp.einsum("BcD,DNJ->BcNJ", h_BcD, w_z_DNJ.astype(dt))
  o_BcNJ = rms_norm(o_BcNJ.astype(dt), norm_scale_J, cfg.norm_eps).astype(acc) * jax.nn.silu(
    z_BcNJ.astype(acc)
  )
  a_BcD = jnp.einsum("BcNJ,NJD->BcD", o_BcNJ.astype(dt), w_out_NJD.astype(dt))
  return a_BcD, S_BNHJ, last_BWC, conv_BWC


# ----------------------------------------------------------------------------- the layer


def zero_state(cfg: ModelConfig, rows: int, dtype) -> LinearState:
  N, H, J = cfg.linear_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
  C = 2 * cfg.linear_key_heads * H + N * J
  return LinearState(
    jnp.zeros((rows, N, H, J), dtype), jnp.zeros((rows, cfg.linear_conv_kernel - 1, C), dtype)
  )


class GatedDeltaNetBlock(nn.Module):
  """Pre-norm decoder layer whose token mixer is a Gated DeltaNet, then the gated MLP.

  Parameters (Hugging Face `linear_attn.*`): qkv [D, C] (channels q | k | v), conv [W+1, C],
  z [D, N, J] (the output gate), b [D, N] (beta), a [D, N], dt_bias [N], A_log [N],
  norm (the gated RMSNorm over J, no offset), out [N, J, D]."""

  cfg: ModelConfig
  index: int = 0

  def setup(self):
    cfg = self.cfg
    D, F = cfg.d_model, cfg.mlp_hidden
    K, N = cfg.linear_key_heads, cfg.linear_value_heads
    H, J = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    C = 2 * K * H + N * J
    pd = cfg.weight_dtype

    def param(name, shape, axes, init):
      return self.param(name, nn.with_logical_partitioning(init, axes), shape, pd)

    normal = lambda fan_in: nn.initializers.normal(fan_in**-0.5)
    self.w_qkv_DC = param("qkv", (D, C), ("embed", None), normal(D))
    self.w_conv_KC = param(
      "conv", (cfg.linear_conv_kernel, C), (None, None), normal(cfg.linear_conv_kernel)
    )
    self.w_z_DNJ = param("z", (D, N, J), ("embed", None, None), normal(D))
    self.w_b_DN = param("b", (D, N), ("embed", None), normal(D))
    self.w_a_DN = param("a", (D, N), ("embed", None), normal(D))
    self.dt_bias_N = param("dt_bias", (N,), (None,), nn.initializers.ones)
    self.A_log_N = param(
      "A_log",
      (N,),
      (None,),
      lambda key, shape, dtype: jnp.log(jax.random.uniform(key, shape, dtype, 0.5, 4.0)),
    )
    self.w_out_NJD = param("out", (N, J, D), (None, None, "embed"), normal(N * J))
    self.w_gate_DF = param("gate", (D, F), ("embed", "mlp"), normal(D))
    self.w_up_DF = param("up", (D, F), ("embed", "mlp"), normal(D))
    self.w_down_FD = param("down", (F, D), ("mlp", "embed"), normal(F))
    self.gated_norm = RMSNorm(cfg.norm_eps, pd, 0.0, (None,))
    self.attn_norm = RMSNorm(cfg.norm_eps, pd, cfg.norm_offset)
    self.mlp_norm = RMSNorm(cfg.norm_eps, pd, cfg.norm_offset)

  def __call__(self, x_BTD, positions_BT, valid_BT, context: Optional[LinearState]):
    """Returns (x_BTD, own LinearState). `context`: the state after everything before these
    tokens (rows may be fewer: token rows [i*g, (i+1)*g) read its row i), None for zero."""
    del positions_BT  # a linear layer is position-free
    cfg = self.cfg
    B, T, _ = x_BTD.shape
    dt, acc = x_BTD.dtype, _acc(x_BTD.dtype)
    if context is None:
      context = zero_state(cfg, B, acc)
    context = LinearState(*(_rows(s, B) for s in context))

    # Padding tokens enter as zeros (Hugging Face's apply_mask_to_padding_states).
    h_BTD = self.attn_norm(x_BTD) * valid_BT[..., None].astype(dt)
    if self.is_initializing():  # create the gated norm's scale (read below as an array)
      self.gated_norm(jnp.zeros((1, cfg.linear_value_head_dim), dt))
    norm_scale_J = nn.unbox(self.gated_norm.variables["params"]["scale"])
    a_BTD, state_BNHJ, conv_BWC = token_mix(
      cfg,
      valid_BT,
      h_BTD,
      context.state_BNHJ.astype(acc),
      context.conv_BWC,
      self.w_qkv_DC,
      self.w_conv_KC,
      self.w_b_DN,
      self.w_a_DN,
      self.A_log_N,
      self.dt_bias_N,
      self.w_z_DNJ,
      norm_scale_J,
      self.w_out_NJD,
    )
    x_BTD = x_BTD + a_BTD
    h_BTD = self.mlp_norm(x_BTD)
    gate_BTF = jnp.einsum("BTD,DF->BTF", h_BTD, self.w_gate_DF.astype(dt))
    up_BTF = jnp.einsum("BTD,DF->BTF", h_BTD, self.w_up_DF.astype(dt))
    m_BTD = jnp.einsum(
      "BTF,FD->BTD", ACTIVATIONS[cfg.activation](gate_BTF) * up_BTF, self.w_down_FD.astype(dt)
    )
    x_BTD = nn.with_logical_constraint(x_BTD + m_BTD, ("batch", "seq", None))
    return x_BTD, LinearState(state_BNHJ, conv_BWC.astype(acc))


def _rows(x_B, rows: int):
  """x repeated along axis 0 to `rows` rows (each row rows / len(x) times, in order)."""
  return x_B if x_B.shape[0] == rows else jnp.repeat(x_B, rows // x_B.shape[0], axis=0)
