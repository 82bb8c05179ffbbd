"""attnforge.distributed: one attention call split over the processes of a torch.distributed group (gloo on CPUs,
NCCL on GPUs) — context parallelism, forward and backward, on attnforge's kernels. docs/DISTRIBUTED.md.

- Ring attention with ring-flash-attn's API (ring, zigzag, stripe; batched and varlen): attnforge.distributed.ring.
- Ulysses (all-to-all over heads) and the hybrid USP (Ulysses × ring): ulysses_attention, hybrid_attention.
- shard / unshard: cutting a sequence into each layout's shards and back.
- CommunicationError: a transfer failed (a peer died, timed out or raised mid-call).
- Context parallelism inside Hugging Face Transformers models (attn_implementation="attnforge_cp", shard_batch, the
  loss over the ranks): attnforge.distributed.transformers (imports Transformers only when registering).
"""
from ._comm import CommunicationError, set_consistency_check
from .ring import (
    ring_flash_attn_func, ring_flash_attn_kvpacked_func, ring_flash_attn_qkvpacked_func,
    ring_flash_attn_varlen_func, ring_flash_attn_varlen_kvpacked_func, ring_flash_attn_varlen_qkvpacked_func,
    stripe_flash_attn_func, stripe_flash_attn_kvpacked_func, stripe_flash_attn_qkvpacked_func,
    stripe_flash_attn_varlen_func, stripe_flash_attn_varlen_kvpacked_func, stripe_flash_attn_varlen_qkvpacked_func,
    zigzag_ring_flash_attn_func, zigzag_ring_flash_attn_kvpacked_func, zigzag_ring_flash_attn_qkvpacked_func,
    zigzag_ring_flash_attn_varlen_func, zigzag_ring_flash_attn_varlen_kvpacked_func,
    zigzag_ring_flash_attn_varlen_qkvpacked_func,
)
from .shard import positions, shard, shard_varlen, unshard, unshard_varlen
from .decode import sharded_decode
from .llama3 import (
    llama3_flash_attn_prepare_cu_seqlens, llama3_flash_attn_varlen_func, llama3_flash_attn_varlen_kvpacked_func,
    llama3_flash_attn_varlen_qkvpacked_func,
)
from .ulysses import ulysses_attention
from .hybrid import hybrid_attention, hybrid_groups, hybrid_shard, hybrid_unshard
from . import transformers  # noqa: E402,F401 (attnforge.distributed.transformers; light to import)
