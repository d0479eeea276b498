"""A soak of a running cluster through its OpenAI API: a burst of mixed requests — streamed,
whole, n=3, chat with log-probs, and streams the client drops after 3 chunks — then, once they
end, every worker's `CheckIntegrity`: what it still holds (blocks in use, pins, requests) must be
nothing. Prints outcome counts and the integrity reports.

    splitserve up --port 8020 --inference-shards 'tp=1,dp=2,role=prefill+tp=2,role=decode'
    python benchmarks/gateway_soak.py --url http://127.0.0.1:8020 --control-plane HOST:PORT   # from up's banner
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import time


async def _one(client, model: str, i: int, max_tokens: int) -> str:
    rnd = random.Random(i)
    kind = rnd.choice(["stream", "whole", "dropped", "n3", "chat"])
    prompt = f"def f{rnd.randint(0, 5)}(x):\n    return " + "x" * rnd.randint(1, 300)
    try:
        if kind in ("stream", "dropped"):
            stream = await client.completions.create(model=model, prompt=prompt, stream=True,
                                                     max_tokens=rnd.randint(1, max_tokens), temperature=rnd.choice([0, 0.8]))  # fmt: skip
            async for n, _ in aiter_enumerate(stream):
                if kind == "dropped" and n == 2:
                    await stream.close()
                    break
        elif kind == "n3":
            await client.completions.create(model=model, prompt=prompt, max_tokens=20, n=3, temperature=0.9, seed=i)
        elif kind == "chat":
            await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                 max_tokens=30, logprobs=True, top_logprobs=3)  # fmt: skip
        else:
            await client.completions.create(model=model, prompt=prompt, max_tokens=rnd.randint(1, max_tokens))
        return kind
    except Exception as e:  # noqa: BLE001 - every failure is counted by its kind and message
        return f"error {type(e).__name__}: {str(e)[:160]}"


async def aiter_enumerate(stream):
    n = 0
    async for item in stream:
        yield n, item
        n += 1


async def soak(url: str, requests: int, concurrency: int, max_tokens: int) -> collections.Counter:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = (await client.models.list()).data[0].id
    gate = asyncio.Semaphore(concurrency)

    async def guarded(i):
        async with gate:
            return await _one(client, model, i, max_tokens)

    return collections.Counter(await asyncio.gather(*(guarded(i) for i in range(requests))))


def integrity(control_plane: str) -> list[str]:
    """Each registered worker's CheckIntegrity, one line each."""
    import grpc

    from splitserve.proto.v1 import (
        common_pb2,
        control_plane_pb2,
        control_plane_pb2_grpc,
        decode_worker_pb2_grpc,
        prefill_worker_pb2_grpc,
    )

    with grpc.insecure_channel(control_plane) as channel:
        topology = control_plane_pb2_grpc.ControlPlaneStub(channel).GetTopology(control_plane_pb2.GetTopologyRequest(),
                                                                               timeout=10)  # fmt: skip
    lines = []
    for worker in topology.workers:
        is_prefill = worker.role == common_pb2.ROLE_PREFILL
        with grpc.insecure_channel(worker.address) as channel:
            stub = (prefill_worker_pb2_grpc.PrefillWorkerStub if is_prefill
                    else decode_worker_pb2_grpc.DecodeWorkerStub)(channel)  # fmt: skip
            r = stub.CheckIntegrity(common_pb2.IntegrityRequest(), timeout=10)
        lines.append(f"{'prefill' if is_prefill else 'decode':8} {worker.worker_id}: ok={r.is_ok} "
                     f"in_use={r.num_in_use_blocks} pinned={r.num_pinned_blocks} requests={r.num_requests} "
                     f"cached={r.num_cached_blocks}")  # fmt: skip
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--control-plane", default=None, help="HOST:PORT (up's banner) for the integrity reports")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=80)
    p.add_argument("--settle-s", type=float, default=2.0, help="wait before the integrity reports")
    args = p.parse_args()
    started = time.monotonic()
    outcomes = asyncio.run(soak(args.url, args.requests, args.concurrency, args.max_tokens))
    print(f"{args.requests} requests, {args.concurrency} at once, in {time.monotonic() - started:.1f} s:")
    for outcome, n in outcomes.most_common():
        print(f"  {n:5}  {outcome}")
    if args.control_plane:
        time.sleep(args.settle_s)
        print(f"{args.settle_s:.0f} s later:")
        for line in integrity(args.control_plane):
            print("  " + line)


if __name__ == "__main__":
    main()
