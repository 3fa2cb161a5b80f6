"""Peer prefill accelerators (FlexPrefill, XAttention, MInference) as systems beside uniprefill.

A user choosing a prefill accelerator compares it with the ones they know, on the same model
and prompts. This package runs the peers' own kernels, taken from the `minference` package
(`pip install 'uniprefill[peers]'`, see `minference_loader`), inside a Hugging Face model
through transformers' attention interface (`attention`), so `uniprefill bench` and
`uniprefill eval` time and score them in the same process as the plain model and uniprefill.

- `spec`: `PeerSpec`, a peer method and its settings (parsed from "flexprefill:gamma=0.9").
- `methods`: each peer's prefill attention on [batch, heads, tokens, head_dim] tensors,
  returning the output and the share of causal blocks it computed (its density).
- `reference`: a PyTorch block-sparse attention, the reference of the block kernel and the
  stand-in that CI runs on CPU (`PeerSpec("blocks", ...)`, no `minference` needed).
- `attention`: the adapter: registers a peer with transformers' `AttentionInterface` and
  switches a model to it for the length of a call; SDPA serves what a peer does not
  (decode steps, padded or masked batches, sliding-window layers, short inputs), each
  counted with its reason.
"""

from .spec import PEER_METHODS, PeerSpec, parse_peer

__all__ = ["PEER_METHODS", "PeerSpec", "parse_peer"]
