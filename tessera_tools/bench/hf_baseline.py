"""Hugging Face ``generate`` with static batches: the baseline we compare against."""

from __future__ import annotations

import multiprocessing
import time
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM

from tessera_tools.bench.workload import BenchRequest


@dataclass
class HFRunResult:
    seconds: float
    useful_tokens: int
    generated_tokens: int


def run_hf_static_batches(
    model_path: str, requests: list[BenchRequest], pad_token_id: int, batch_size: int = 32,
    dtype: torch.dtype = torch.float32, device: str = "cpu",
) -> HFRunResult:
    """Static batching: left-padded batches of ``batch_size`` in arrival
    order; each batch runs until its longest output is done (the padding and
    the finished rows are wasted work, which is the point of comparison)."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
    model.eval()
    generated = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(requests), batch_size):
            batch = requests[b : b + batch_size]
            width = max(len(r.prompt_token_ids) for r in batch)
            ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, r in enumerate(batch):
                ids[i, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
                mask[i, width - len(r.prompt_token_ids) :] = 1
            new = max(r.output_len for r in batch)
            model.generate(
                ids.to(device), attention_mask=mask.to(device), max_new_tokens=new, min_new_tokens=new,
                do_sample=False, pad_token_id=pad_token_id,
            )
            generated += new * len(batch)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return HFRunResult(seconds, sum(r.output_len for r in requests), generated)


def _child(queue, args) -> None:
    queue.put(run_hf_static_batches(*args))


def run_hf_in_fresh_process(*args) -> HFRunResult:
    """Run the baseline in a new interpreter, so nothing the engine did to
    this process (allocator tuning, threads, caches) helps or hurts it."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue, args))
    proc.start()
    result = queue.get()
    proc.join()
    return result
