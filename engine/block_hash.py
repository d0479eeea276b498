"""Chained block hashes over token ids — shared by engines and the router.

    hash(block j) = H(hash(block j-1) || token ids of block j)

A block's hash therefore identifies the whole prefix up to and including it,
so two requests share block j only if their first (j+1)*block_size tokens are
equal. Only full blocks are hashed. This module must stay torch-free: the
router imports it to index worker caches with the very same hashes.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence

BlockHash = bytes
"""8-byte digest (a uint64 on the wire); `bytes` so it is hashable and stable across processes.
At a million cached blocks the chance of any collision is about 3e-8."""


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block given its parent's hash (None for the first block)."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(parent if parent is not None else b"\x00" * 8)
    digest.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return digest.digest()


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Chained hashes of every full block of `token_ids` (the tail is ignored).

    The same bytes as `hash_block` per block, packed once for the whole span: an 8k-token prompt
    hashes in a fraction of the per-block cost (the router hashes every prompt, a decode worker
    every imported one)."""
    num_blocks = len(token_ids) // block_size
    data = pack_tokens(token_ids[: num_blocks * block_size])
    step = 4 * block_size
    hashes: list[BlockHash] = []
    for offset in range(0, num_blocks * step, step):
        digest = hashlib.blake2b(digest_size=8)
        digest.update(parent if parent is not None else b"\x00" * 8)
        digest.update(data[offset : offset + step])
        parent = digest.digest()
        hashes.append(parent)
    return hashes


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Little-endian uint32s of `token_ids`, as `hash_block` packs them."""
    if _NATIVE_LE_U32:
        try:
            return array("I", token_ids).tobytes()
        except (OverflowError, TypeError):  # let struct raise its own error for a bad id
            pass
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


_NATIVE_LE_U32 = sys.byteorder == "little" and array("I").itemsize == 4
