"""MiniMax's lightning attention (linear attention with a per-head decay) as one `torch.library` op.

transformers' `MiniMaxLightningAttention.forward` computes a prefill in blocks of `block_size` tokens:
for each block, the intra-block part `((Q K^T) * decay) V` plus the inter-block part read from a
running `K^T V` state, which decays by `exp(-slope * block)` from block to block. The loop is written
inline in the method, so dynamo unrolls it for the traced prompt's number of blocks and the graph
holds only for prompt lengths with that many blocks (the census's guard `(N + 255) // 256 == 2`):
the layers after a drop point, which see fewer tokens, could not reuse it.

`uniprefill::lightning_attention_blocks` is that loop as one op: the same arithmetic in the same
order (so a model through the op equals the plain model bit for bit), on however many tokens it
receives; its fake gives the shapes and dtypes from the inputs alone. Run on the kept tokens in their
order, it is the method's causal mixer, as the scans of `scan_ops` are. `lightning_forward(original)`
is the drop-in `compat` binds as the class's `forward`: on a prefill (no linear cache yet, no
gradients) it runs the method's own steps around the op; otherwise (a decode step reading the cache,
training) it calls the original method. The original stays reachable as `_uniprefill_original`.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from .scan_ops import MARK, needs_grad


def _dtypes(query, value, slope_rate, query_decay, key_decay, diagonal_decay) -> tuple[torch.dtype, torch.dtype]:
    """(output dtype, state dtype) of the block loop's arithmetic (type promotion, as eager runs it)."""
    intra = torch.promote_types(torch.promote_types(query.dtype, diagonal_decay.dtype), value.dtype)
    inter = torch.promote_types(query.dtype, query_decay.dtype)
    state = torch.promote_types(torch.promote_types(value.dtype, slope_rate.dtype),
                                torch.promote_types(query.dtype, key_decay.dtype))
    return torch.promote_types(torch.promote_types(inter, state), intra), state


@torch.library.custom_op("uniprefill::lightning_attention_blocks", mutates_args=())
def lightning_attention_blocks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slope_rate: torch.Tensor,
                               query_decay: torch.Tensor, key_decay: torch.Tensor, diagonal_decay: torch.Tensor,
                               block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """query/key/value [B, H, N, D]; slope_rate [H, 1, 1]; the decays as `MiniMaxLightningAttention`
    holds them. Returns (output [B, H, N, D], the final K^T V state [B, H, D, D])."""
    batch, heads, seq_len, head_dim = value.shape
    state = torch.zeros(batch, heads, head_dim, head_dim, device=value.device, dtype=value.dtype)
    outputs = []
    for start in range(0, seq_len, block_size):
        end = min(start + block_size, seq_len)
        size = end - start
        q, k, v = query[:, :, start:end], key[:, :, start:end], value[:, :, start:end]
        intra = torch.matmul(torch.matmul(q, k.transpose(-1, -2)) * diagonal_decay[:, :, :size, :size], v)
        inter = torch.matmul(q * query_decay[:, :size], state)
        outputs.append(inter + intra)
        state = state * torch.exp(-slope_rate * size) + torch.matmul((k * key_decay[:, -size:]).transpose(-1, -2), v)
    out = torch.cat(outputs, dim=-2) if outputs else value.new_empty(value.shape)
    expected = _dtypes(query, value, slope_rate, query_decay, key_decay, diagonal_decay)
    if seq_len and (out.dtype, state.dtype) != expected:
        raise TypeError(f"lightning attention computed {out.dtype}/{state.dtype}, expected {expected[0]}/{expected[1]}: "
                        "uniprefill::lightning_attention_blocks' fake would be wrong")
    return out, state


@lightning_attention_blocks.register_fake
def _(query, key, value, slope_rate, query_decay, key_decay, diagonal_decay, block_size):
    out, state = _dtypes(query, value, slope_rate, query_decay, key_decay, diagonal_decay)
    batch, heads, _, head_dim = value.shape
    return value.new_empty(value.shape, dtype=out), value.new_empty((batch, heads, head_dim, head_dim), dtype=state)


def lightning_forward(original):
    """The drop-in for `MiniMaxLightningAttention.forward`: the prefill's block loop through the op."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        cache = kwargs.pop("past_key_values", cache)  # the name transformers deprecates
        cached = cache is not None and cache.get_linear_cache(self.layer_idx) is not None
        if cached or needs_grad(hidden_states, *self.parameters()):
            return original(self, hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
        mask_padding = sys.modules[type(self).__module__].apply_mask_to_padding_states
        batch_size, seq_len, _ = hidden_states.shape
        qkv = mask_padding(self.act_fn(self.qkv_proj(hidden_states)), attention_mask)
        qkv = qkv.reshape(batch_size, seq_len, self.num_attention_heads, 3 * self.head_dim)
        query, key, value = (t.transpose(1, 2) for t in torch.split(qkv, self.head_dim, dim=3))
        out, state = torch.ops.uniprefill.lightning_attention_blocks(
            query, key, value, self.slope_rate, self.query_decay, self.key_decay, self.diagonal_decay, self.block_size)
        out = out.transpose(1, 2).reshape(batch_size, seq_len, self.num_attention_heads * self.head_dim)
        out = self.out_proj(F.sigmoid(self.output_gate(hidden_states)) * self.norm(out))
        if cache is not None:
            cache.set_linear_cache(self.layer_idx, state)
        return out, state

    setattr(forward, MARK, original)
    return forward
