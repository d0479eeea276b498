"""Hybrid (NemotronH) disaggregation across real processes: a prefill group and a decode
group, each its own TP × PP world, hand KV and recurrent state (conv + SSM, resharded:
heads and groups split across ranks, conv channels as [x | B | C] runs) over real NIXL or
a gloo pair group; greedy tokens equal the aggregated engine's, log-probs within 1e-5.

Every (prefill tp, pp) × (decode tp, pp) in {1, 2}² runs with both transports; a few run in
the default stage, the rest are marked slow. (Engine level; the same through the gRPC prefill / decode
workers: tests/integration/test_hybrid_workers.py.)"""

import importlib.util
import uuid

import pytest
import torch
from hybrid_disagg_helpers import run_disaggregated

from splitserve import LLM, SamplingParams
from tests.fixtures.models import build_hybrid_checkpoint

HAS_NIXL = importlib.util.find_spec("nixl_cu13") is not None
OPTIONS = dict(block_size_tokens=8, num_blocks=128, max_tokens=32)
PARAMS = SamplingParams(num_tokens_to_generate=32, temperature=0.0, ignore_eos=True, return_log_probs=True,
                        skip_prompt_log_probs=True)


def _prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 29, 40)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hybrid_disagg")
    build_hybrid_checkpoint(path)
    return str(path)


@pytest.fixture(scope="module")
def expected(model_dir):
    return LLM(model_dir, **OPTIONS).generate(_prompts(), PARAMS)


SHAPES = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2), "tp2pp2": (2, 2)}
QUICK = {("nixl", "tp2", "pp2"), ("torch_dist", "tp1", "tp1")}  # ~6-25 s each on 2 CPU cores


def _cases():
    for transport in ("nixl", "torch_dist"):
        for src in SHAPES:
            for dst in SHAPES:
                marks = [] if (transport, src, dst) in QUICK else [pytest.mark.slow]
                if transport == "nixl":
                    marks.append(pytest.mark.skipif(not HAS_NIXL, reason="NIXL (nixl-cu13) is not installed"))
                yield pytest.param(transport, src, dst, id=f"{transport}-{src}-to-{dst}", marks=marks)


@pytest.mark.parametrize("transport, src, dst", list(_cases()))
def test_hybrid_disaggregated_tokens_match_aggregated(model_dir, expected, transport, src, dst):
    case = dict(model=model_dir, options=OPTIONS, params=PARAMS, prompts=_prompts(), transport=transport,
                src=SHAPES[src], dst=SHAPES[dst], tag=uuid.uuid4().hex[:8])
    results = run_disaggregated(case)
    for (tokens, logprobs), ref in zip(results, expected, strict=True):
        assert tokens == ref.generated_tokens
        assert logprobs == pytest.approx(ref.generated_log_probs, abs=1e-5)
