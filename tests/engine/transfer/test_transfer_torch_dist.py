"""torch.distributed (gloo) point-to-point between three real processes. Each case assigns every
process a source or destination plan rank; data travels as one packed buffer per (src, dst) pair,
in layer-cut chunks where the case sets `chunk_bytes` (1 byte: a chunk per layer of every op), and
block runs of at least `direct_bytes` (one layer's K) of ops holding every local head on at least
one side go as their own messages, in place on such a side (1 byte: every such run)."""

from __future__ import annotations

from kvtransfer_helpers import gloo_process, gloo_silent_peer_process, run_processes

CASES = [
    # tp 2 -> 1 with a cached prefix, every run its own message: sent from the source pools, received
    # into staging and copied into the head slices; processes 0, 1 send, process 2 receives.
    (dict(src=dict(tp=2, pp=1, kv_heads=4), dst=dict(tp=1, pp=1, kv_heads=4), num_blocks=5, pool=8, seed=1,
          first_block=1, direct_bytes=1),
     {0: ("src", 0), 1: ("src", 1), 2: ("dst", 0)}),
    # tp 1 -> 2 with one replicated kv head: process 2 sends it to both destination ranks.
    (dict(src=dict(tp=1, pp=1, kv_heads=1), dst=dict(tp=2, pp=1, kv_heads=1), num_blocks=4, pool=8, seed=2,
          first_block=0, dst_contiguous=True, direct_bytes=1),
     {0: ("dst", 0), 1: ("dst", 1), 2: ("src", 0)}),
    # pp 2 -> 1 with GQA heads: both stages (processes 1, 2) send to process 0.
    (dict(src=dict(tp=1, pp=2, kv_heads=2), dst=dict(tp=1, pp=1, kv_heads=2), num_blocks=3, pool=8, seed=3,
          first_block=2, chunk_bytes=3000),
     {0: ("dst", 0), 1: ("src", 0), 2: ("src", 1)}),
    # pp 1 -> 2, whole heads: the 3-block run (to blocks 4-6) goes pool to pool (a block's K is 64
    # bytes), the 1-block runs are packed in per-layer chunks, on the same pair.
    (dict(src=dict(tp=1, pp=1, kv_heads=2), dst=dict(tp=1, pp=2, kv_heads=2), num_blocks=6, pool=8, seed=4,
          first_block=0, src_tables={0: [0, 1, 2, 3, 4, 5]}, dst_tables={0: [4, 5, 6, 0, 2, 1], 1: [1, 2, 3, 7, 5, 0]},
          chunk_bytes=1, direct_bytes=2 * 64),
     {0: ("src", 0), 1: ("dst", 0), 2: ("dst", 1)}),
    # tp 1 -> 2, every run its own message: gathered from the source's head slices into staging,
    # received straight into the destination pools.
    (dict(src=dict(tp=1, pp=1, kv_heads=4), dst=dict(tp=2, pp=1, kv_heads=4), num_blocks=4, pool=6, seed=5,
          first_block=1, direct_bytes=1),
     {0: ("dst", 1), 1: ("src", 0), 2: ("dst", 0)}),
    # Layer-wise pushes: the sources write each layer only once the push asks for it (kvtransfer_helpers.
    # layerwise_send). pp 2 -> 1 with GQA heads in per-layer chunks, two sources to one destination:
    (dict(src=dict(tp=1, pp=2, kv_heads=2), dst=dict(tp=1, pp=1, kv_heads=2), num_blocks=3, pool=8, seed=6,
          first_block=1, chunk_bytes=3000, layerwise=True),
     {0: ("dst", 0), 1: ("src", 0), 2: ("src", 1)}),
    # tp 1 -> 2 reshard, runs as messages (staged head slices) and packed 1-block runs, one source to two
    # destinations, layer after layer over both pairs:
    (dict(src=dict(tp=1, pp=1, kv_heads=4), dst=dict(tp=2, pp=1, kv_heads=4), num_blocks=6, pool=8, seed=7,
          first_block=0, src_tables={0: [0, 1, 2, 3, 4, 5]}, dst_tables={0: [4, 5, 6, 0, 2, 1], 1: [1, 2, 3, 7, 5, 0]},
          chunk_bytes=1, direct_bytes=2 * 64, layerwise=True),
     {0: ("dst", 1), 1: ("src", 0), 2: ("dst", 0)}),
]


def test_gloo_handoffs_between_three_processes(tmp_path, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    cases = [case for case, _ in CASES]
    roles = [role for _, role in CASES]
    run_processes([(gloo_process, cases, roles, rank, 3, str(tmp_path / "pg")) for rank in range(3)])


def test_gloo_receive_from_a_silent_peer_times_out(tmp_path, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    run_processes([(gloo_silent_peer_process, rank, str(tmp_path / "pg")) for rank in range(2)])
