"""Prompt scoring on a GPU: the runner on CUDA (Triton attention, CUDA graphs, pipelined steps) against
transformers on the same GPU. Skipped without CUDA; run on the device machine with `pytest -m gpu`."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaForCausalLM

from pagedserve.common.config import WorkerConfig
from pagedserve.common.messages import SamplingParams
from pagedserve.worker.model_runner import ModelRunner
from tests.test_prompt_logprobs import _prompt_logprobs, _run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _reference(model_dir, prompt: list[int]) -> torch.Tensor:
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt], device="cuda")).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1].cpu()


@pytest.mark.parametrize(
    "dtype,tolerance", [("float32", 1e-3), ("bfloat16", 0.15)], ids=["float32", "bfloat16"]
)
@pytest.mark.parametrize("chunk", [1, 128], ids=["token-by-token-graphs", "chunked"])
def test_prompt_logprobs_on_the_gpu_match_transformers(tiny_model_dir, dtype, tolerance, chunk):
    """chunk 1: every step is one token per sequence, so the prompt is scored from the decode graphs' logits;
    chunk 128: from the hidden states of chunked prefills."""
    config = WorkerConfig(model=str(tiny_model_dir), device="cuda", dtype=dtype, num_kv_blocks=256)
    runner = ModelRunner(config, attention_backend="triton")
    rng = random.Random(3)
    prompts = [[rng.randrange(runner.vocab_size) for _ in range(n)] for n in (2, 17, 40, 300)]
    if chunk == 1:
        prompts = prompts[:3]
    requests = [(p, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=5)) for p in prompts]
    outputs, _ = _run(runner, requests, True, max_num_seqs=4, max_num_batched_tokens=chunk)
    for i, prompt in enumerate(prompts):
        entries, _ = _prompt_logprobs(outputs[i])
        assert len(entries) == len(prompt) - 1
        ref = _reference(tiny_model_dir, prompt)
        expected = ref.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        got = torch.tensor([e.logprob for e in entries])
        assert (got - expected).abs().max().item() < tolerance
        top = torch.tensor([e.top_logprobs for e in entries])
        assert (top - ref.topk(5, dim=-1).values).abs().max().item() < tolerance
