"""Plain-torch reference of `pack.copy_head_block_runs` for block ids one by one (the kernel tests compare the two)."""

from __future__ import annotations

import torch


def copy_head_blocks_reference(
    src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor,
    src_head_start: int, dst_head_start: int, num_heads: int,
) -> None:
    """dst[:, dst_ids[i], dst_head_start + h] = src[:, src_ids[i], src_head_start + h], h < num_heads.

    src [2, Ps, Hs, block_size, head_dim], dst [2, Pd, Hd, block_size, head_dim]; ids int [n]."""
    sh = slice(src_head_start, src_head_start + num_heads)
    dh = slice(dst_head_start, dst_head_start + num_heads)
    dst[:, :, dh].index_copy_(1, dst_ids.long(), src[:, :, sh].index_select(1, src_ids.long()))
