"""``tessera bench cpu-kernels``: what a CPU engine's two kernel choices buy,
on the model's own shapes, side by side in one run.

- decode attention over all layers of one step: the torch backend (gather
  each decode group's blocks, then attend) against the cpu backend's C++
  kernel (reads K/V in place through the block table), over a scattered
  paged cache, for several batch sizes;
- prefill attention over all layers for one fresh chunk of several lengths:
  the torch backend (SDPA) against the cpu backend's kernel (the query heads
  of each KV head stacked, two GEMMs per block of queries);
- a shared-prefix step over all layers (`bench prefix-cache`'s shape): many
  requests' short chunks after one long cached prefix held in the same
  blocks, then as many decodes over it; there the context is read from
  cache, not memory, and the kernels' arithmetic sets the time;
- the layers' element-wise work (RMSNorm with the residual add, rotary
  embedding, SiLU-times-up; one layer's worth, times the layers) at several
  token counts: torch's operator chain against the C++ kernels;
- the projections of all layers (q/k/v, o, gate/up, down) and the LM head at
  several token counts: dense weights through torch's GEMM against weights
  packed for oneDNN, and in float32 where it runs (AVX2 without AVX-512) the
  cpu backend's own GEMM (cpu_ops/linear_f32.cpp). Each layer has its own weights, so like the engine the
  GEMMs stream weights from memory instead of finding them in cache.

Each pair is first checked to compute the same result (the command fails
otherwise).
Times are the best of ``--repeats`` rounds of one full pass over the layers.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from engine_pod.attention.abstract import AttentionMetadata
from engine_pod.model.hf_config import load_arch_config, parse_dtype
from tessera_tools.bench.common import write_report
from tessera_tools.bench.flags import add_common_args, int_at_least, non_negative_int, positive_int, positive_int_list
from tessera_tools.bench.stats import best_of


def _tolerance(dtype) -> float:
    """How far two attention paths may differ: the rounding of the dtype (a bf16 ulp is 1/128)."""
    return 1e-3 if dtype in (torch.float32, torch.float64) else 2e-2


def _decode_step(arch, batch: int, context: int, block_size: int, dtype, gen):
    """One decode per sequence, contexts spread over [context/2, 3*context/2],
    blocks scattered over the pool; per-layer caches."""
    lens = torch.randint(context // 2, context * 3 // 2, (batch,), generator=gen).numpy()
    blocks_per_seq = -(-lens // block_size)
    num_blocks = int(blocks_per_seq.sum())
    perm = torch.randperm(num_blocks, generator=gen).numpy()
    table = np.zeros((batch, int(blocks_per_seq.max())), dtype=np.int64)
    start = 0
    for i, nb in enumerate(blocks_per_seq):
        table[i, :nb] = perm[start : start + nb]
        start += nb
    slots = table[np.arange(batch), (lens - 1) // block_size] * block_size + (lens - 1) % block_size
    qsl = np.arange(batch + 1, dtype=np.int64)
    md = AttentionMetadata(batch, batch, torch.from_numpy(slots), torch.from_numpy(qsl), torch.from_numpy(lens),
                           torch.from_numpy(table), qsl, lens.astype(np.int64), block_size)
    shape = (2, num_blocks, block_size, arch.num_key_value_heads, arch.head_dim)
    caches = [torch.randn(shape, generator=gen).to(dtype) for _ in range(arch.num_hidden_layers)]
    q = torch.randn(batch, arch.num_attention_heads, arch.head_dim, generator=gen).to(dtype)
    kv = torch.randn(batch, arch.num_key_value_heads, arch.head_dim, generator=gen).to(dtype)
    return md, caches, q, kv


def _compare_backends(forward, layers: int, repeats: int, dtype, what: str) -> dict:
    """`forward(backend, layer)` on the torch backend and on the cpu backend: one call of each
    checked to agree (timing means nothing otherwise; raises naming `what`), then the best of
    `repeats` passes over `layers` calls each, in ms, and the speedup."""
    from engine_pod.attention.cpu_backend import CpuAttentionBackend
    from engine_pod.attention.torch_backend import TorchAttentionBackend

    row, outputs = {}, []
    for backend in (TorchAttentionBackend(), CpuAttentionBackend()):
        outputs.append(forward(backend, 0))
        def run(backend=backend):
            for layer in range(layers):
                forward(backend, layer)
        row[f"{backend.name}_ms"] = best_of(run, repeats) * 1e3
    row["max_abs_diff"] = float((outputs[0].double() - outputs[1].double()).abs().max())
    if not torch.allclose(outputs[0].double(), outputs[1].double(), rtol=_tolerance(dtype), atol=_tolerance(dtype)):
        raise RuntimeError(f"{what}: the cpu kernels and the torch backend disagree "
                           f"(max |diff| {row['max_abs_diff']:.3g})")
    row["speedup"] = row["torch_ms"] / row["cpu_ms"]
    return row


def bench_attention(arch, dtype, batches, context, block_size, repeats, gen) -> list[dict]:
    rows = []
    for batch in batches:
        md, caches, q, kv = _decode_step(arch, batch, context, block_size, dtype, gen)

        def forward(backend, layer, md=md, caches=caches, q=q, kv=kv):
            if layer == 0:
                md.backend_cache.clear()  # planned once per step, as in the engine
            return backend.forward(q, kv, kv, caches[layer], md, arch.head_dim**-0.5)

        row = {"batch": batch, "mean_context": float(md.seq_lens_cpu.mean()),
               **_compare_backends(forward, arch.num_hidden_layers, repeats, dtype, f"decode batch {batch}")}
        kv_bytes = 2 * float(md.seq_lens_cpu.sum()) * arch.num_key_value_heads * arch.head_dim * q.element_size()
        row["kv_gb_per_s_cpu"] = kv_bytes * arch.num_hidden_layers / (row["cpu_ms"] / 1e3) / 1e9
        rows.append(row)
        print(f"decode attention, batch {batch:4d}, mean context {row['mean_context']:6.0f}: torch "
              f"{row['torch_ms']:8.1f} ms, cpu kernel {row['cpu_ms']:7.1f} ms ({row['speedup']:.1f}x, "
              f"K/V read at {row['kv_gb_per_s_cpu']:.1f} GB/s)", flush=True)
    return rows


def _prefill_chunk(arch, length: int, block_size: int, dtype, gen):
    """One fresh prefill chunk of `length` tokens (nothing cached before it): metadata, one cache, q/k/v."""
    num_blocks = -(-length // block_size)
    table = torch.arange(num_blocks, dtype=torch.int64).view(1, -1)
    lens = np.array([length], dtype=np.int64)
    qsl = np.array([0, length], dtype=np.int64)
    md = AttentionMetadata(length, 0, torch.arange(length), torch.from_numpy(qsl), torch.from_numpy(lens), table,
                           qsl, lens, block_size)
    cache = torch.zeros(2, num_blocks, block_size, arch.num_key_value_heads, arch.head_dim, dtype=dtype)
    q = torch.randn(length, arch.num_attention_heads, arch.head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(length, arch.num_key_value_heads, arch.head_dim, generator=gen).to(dtype) for _ in range(2))
    return md, cache, q, k, v


def bench_prefill(arch, dtype, lengths, block_size, repeats, gen) -> list[dict]:
    rows, scale = [], arch.head_dim**-0.5
    for length in lengths:
        md, cache, q, k, v = _prefill_chunk(arch, length, block_size, dtype, gen)

        def forward(backend, layer, md=md, cache=cache, q=q, k=k, v=v):
            return backend.forward(q, k, v, cache, md, scale)

        row = {"tokens": length, **_compare_backends(forward, arch.num_hidden_layers, repeats, dtype,
                                                     f"prefill of {length} tokens")}
        rows.append(row)
        print(f"prefill attention, a fresh chunk of {length:5d} tokens: torch (SDPA) {row['torch_ms']:8.1f} ms, "
              f"cpu kernel {row['cpu_ms']:7.1f} ms ({row['speedup']:.1f}x)", flush=True)
    return rows


def _shared_prefix_step(arch, requests: int, prefix: int, new: int, block_size: int, dtype, gen):
    """`requests` sequences that share the full blocks of a `prefix`-token prompt prefix (what a
    prefix-cache hit shares) and hold the rest of their context (the chunk and one decoded token)
    in blocks of their own; one cache for all layers."""
    shared_blocks = prefix // block_size
    own_blocks = -(-(prefix + new + 1 - shared_blocks * block_size) // block_size)
    num_blocks = shared_blocks + requests * own_blocks
    table = np.zeros((requests, shared_blocks + own_blocks), dtype=np.int64)
    table[:, :shared_blocks] = np.arange(shared_blocks)
    table[:, shared_blocks:] = shared_blocks + np.arange(requests * own_blocks).reshape(requests, own_blocks)
    cache = torch.randn(2, num_blocks, block_size, arch.num_key_value_heads, arch.head_dim, generator=gen).to(dtype)
    return table, cache


def _metadata(table: np.ndarray, q_lens: np.ndarray, seq_lens: np.ndarray, block_size: int) -> AttentionMetadata:
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    positions = [np.arange(s - q, s) for q, s in zip(q_lens, seq_lens)]
    slots = np.concatenate([table[i, pos // block_size] * block_size + pos % block_size
                            for i, pos in enumerate(positions)])
    return AttentionMetadata(int(qsl[-1]), int((q_lens == 1).sum()), torch.from_numpy(slots), torch.from_numpy(qsl),
                             torch.from_numpy(seq_lens.astype(np.int64)), torch.from_numpy(table), qsl,
                             seq_lens.astype(np.int64), block_size)


def bench_shared_prefix(arch, dtype, requests: int, prefix: int, new: int, block_size: int, repeats: int,
                        gen) -> list[dict]:
    """The prefill step (every request's `new`-token chunk) and then the decode step, each over all
    layers, torch backend against cpu backend."""
    table, cache = _shared_prefix_step(arch, requests, prefix, new, block_size, dtype, gen)
    steps = {"prefill": (np.full(requests, new), np.full(requests, prefix + new)),
             "decode": (np.ones(requests, dtype=np.int64), np.full(requests, prefix + new + 1))}
    rows, scale = [], arch.head_dim**-0.5
    for kind, (q_lens, seq_lens) in steps.items():
        md = _metadata(table, q_lens, seq_lens, block_size)
        tokens = md.num_actual_tokens
        q = torch.randn(tokens, arch.num_attention_heads, arch.head_dim, generator=gen).to(dtype)
        kv = torch.randn(tokens, arch.num_key_value_heads, arch.head_dim, generator=gen).to(dtype)

        def forward(backend, layer, md=md, q=q, kv=kv):
            if layer == 0:
                md.backend_cache.clear()  # planned once per step, as in the engine
            return backend.forward(q, kv, kv, cache, md, scale)

        row = {"step": kind, "requests": requests, "prefix": prefix, "new": new,
               **_compare_backends(forward, arch.num_hidden_layers, repeats, dtype, f"shared prefix, {kind}")}
        rows.append(row)
        what = f"{requests} chunks of {new}" if kind == "prefill" else f"{requests} decodes"
        print(f"shared {prefix}-token prefix, {what}: torch {row['torch_ms']:8.1f} ms, cpu kernels "
              f"{row['cpu_ms']:7.1f} ms ({row['speedup']:.1f}x)", flush=True)
    return rows


def bench_layers(arch, dtype, token_counts, repeats, gen) -> list[dict]:
    from engine_pod.model.layers import RMSNorm, silu_and_mul
    from engine_pod.model.rotary import RotaryEmbedding, compute_inv_freq

    inv_freq, scale = compute_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling,
                                       arch.max_position_embeddings, arch.max_position_embeddings)
    q_size, kv_size = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    rows = []
    for tokens in token_counts:
        hidden = torch.randn(tokens, arch.hidden_size, generator=gen).to(dtype)
        residual = torch.randn(tokens, arch.hidden_size, generator=gen).to(dtype)
        qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=gen).to(dtype)
        gate_up = torch.randn(tokens, 2 * arch.intermediate_size, generator=gen).to(dtype)
        positions = torch.randint(0, arch.max_position_embeddings, (tokens,), generator=gen)
        row: dict = {"tokens": tokens}
        results = []
        for kernels in (False, True):
            norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, kernels)
            norm.weight.data = torch.ones(arch.hidden_size, dtype=dtype)
            rope = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, inv_freq, scale, dtype, kernels)

            def layer(norm=norm, rope=rope, kernels=kernels):
                # A layer's element-wise work: two residual adds with their norms, rotary, the activation.
                out = [norm.add_and_norm(residual, hidden.clone())[1]]
                q, k, _ = qkv.clone().split([q_size, kv_size, kv_size], dim=-1)
                out += rope(positions, q.view(tokens, -1, arch.head_dim), k.view(tokens, -1, arch.head_dim))
                out.append(norm.add_and_norm(residual, hidden.clone())[1])
                out.append(silu_and_mul(gate_up, kernels))
                return out

            with torch.inference_mode():
                results.append(layer())
                row["kernels_ms" if kernels else "torch_ms"] = best_of(
                    lambda layer=layer: [layer() for _ in range(arch.num_hidden_layers)], repeats) * 1e3
        # Equal to the bit, except that in float32 SiLU's last (width % 32) elements of a row may differ
        # from torch's scalar tail by an ulp (fused_layers.cpp); anything more is a bug.
        row["bit_exact"] = all(torch.equal(a, b) for a, b in zip(*results))
        if not all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(*results)):
            raise RuntimeError(f"{tokens} tokens: the layer kernels and torch's operators differ")
        row["speedup"] = row["torch_ms"] / row["kernels_ms"]
        rows.append(row)
        exact = "equal to the bit" if row["bit_exact"] else "within an ulp"
        print(f"layers' element-wise work, {tokens:4d} tokens: torch operators {row['torch_ms']:7.1f} ms, "
              f"kernels {row['kernels_ms']:6.1f} ms ({row['speedup']:.1f}x, {exact})", flush=True)
    return rows


def _projection_shapes(arch) -> list[tuple[int, int]]:
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    return [(q + 2 * kv, arch.hidden_size), (arch.hidden_size, q), (2 * arch.intermediate_size, arch.hidden_size),
            (arch.hidden_size, arch.intermediate_size)]


def bench_linear(arch, dtype, token_counts, repeats, gen) -> list[dict]:
    shapes = _projection_shapes(arch)
    dense = [[torch.randn(n, k, generator=gen).to(dtype) * 0.02 for n, k in shapes]
             for _ in range(arch.num_hidden_layers)]
    dense.append([torch.randn(arch.vocab_size, arch.hidden_size, generator=gen).to(dtype) * 0.02])
    try:
        packed = [[torch.ops.mkldnn._reorder_linear_weight(w, None) for w in layer] for layer in dense]
    except RuntimeError as exc:
        print(f"oneDNN cannot pack {dtype} here: {exc}")
        return []
    own = None  # the cpu backend's float32 GEMM, where it runs (the engine's choice there)
    if dtype == torch.float32 and torch.ops.tessera_cpu.linear_f32_supported():
        own = [[torch.ops.tessera_cpu.pack_linear_f32(w) for w in layer] for layer in dense]
    flops_per_token = 2 * sum(w.shape[0] * w.shape[1] for layer in dense for w in layer)
    rows = []
    for tokens in token_counts:
        widths = {w.shape[1] for layer in dense for w in layer}
        inputs = {k: torch.randn(tokens, k, generator=gen).to(dtype) for k in widths}

        def run_dense():
            for layer in dense:
                for w in layer:
                    torch.nn.functional.linear(inputs[w.shape[1]], w)

        def run_packed():
            for layer in packed:
                for w in layer:
                    torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], w, None, "none", [None], "")

        def run_own():
            for layer, weights in zip(dense, own):
                for w, p in zip(layer, weights):
                    torch.ops.tessera_cpu.linear_f32(inputs[w.shape[1]], p, w.shape[0], None)

        with torch.inference_mode():
            x = inputs[dense[0][0].shape[1]]
            expected = torch.nn.functional.linear(x, dense[0][0])
            products = {"oneDNN-packed": torch.ops.mkldnn._linear_pointwise(x, packed[0][0], None, "none", [None], "")}
            if own is not None:
                products["tessera"] = torch.ops.tessera_cpu.linear_f32(x, own[0][0], dense[0][0].shape[0], None)
            for name, product in products.items():
                diff = (product - expected).abs().max()
                if diff > 1e-3 * max(1.0, float(x.abs().max())):
                    raise RuntimeError(f"{tokens} tokens: {name} and dense products disagree (max |diff| {diff:.3g})")
            dense_s, packed_s = best_of(run_dense, repeats), best_of(run_packed, repeats)
            own_s = best_of(run_own, repeats) if own is not None else None
        row = {"tokens": tokens, "dense_ms": dense_s * 1e3, "packed_ms": packed_s * 1e3,
               "dense_gflops": flops_per_token * tokens / dense_s / 1e9,
               "packed_gflops": flops_per_token * tokens / packed_s / 1e9, "speedup": dense_s / packed_s}
        line = (f"all projections + LM head, {tokens:4d} tokens: dense {row['dense_ms']:7.1f} ms "
                f"({row['dense_gflops']:5.1f} GFLOP/s), oneDNN-packed {row['packed_ms']:7.1f} ms "
                f"({row['packed_gflops']:5.1f} GFLOP/s), {row['speedup']:.2f}x")
        if own_s is not None:
            row.update(own_ms=own_s * 1e3, own_gflops=flops_per_token * tokens / own_s / 1e9,
                       own_vs_packed=packed_s / own_s)
            line += (f"; tessera GEMM {row['own_ms']:7.1f} ms ({row['own_gflops']:5.1f} GFLOP/s), "
                     f"{row['own_vs_packed']:.2f}x oneDNN")
        rows.append(row)
        print(line, flush=True)
    return rows


def main(args: argparse.Namespace) -> int:
    from engine_pod.attention.cpu_ops.build import load_cpu_ops
    from engine_pod.worker.cpu_malloc import keep_freed_memory_in_heap

    reason = load_cpu_ops()
    if reason is not None:
        print(f"the cpu attention kernels cannot run here: {reason}")
        return 1
    keep_freed_memory_in_heap()  # as the engine does: no page faults on every step's buffers
    arch = load_arch_config(args.model)
    dtype = torch.float32 if args.dtype == "auto" else parse_dtype(args.dtype)
    gen = torch.Generator().manual_seed(args.seed)
    print(f"{args.model}: {arch.num_hidden_layers} layers, {torch.get_num_threads()} threads, {dtype}")
    report = {
        "dtype": str(dtype), "threads": torch.get_num_threads(),
        "attention": bench_attention(arch, dtype, args.batches, args.context, args.block_size, args.repeats, gen),
        "prefill": bench_prefill(arch, dtype, args.prefill_tokens, args.block_size, args.repeats, gen),
        "shared_prefix": bench_shared_prefix(arch, dtype, args.shared_requests, args.shared_prefix, args.shared_new,
                                             args.block_size, args.repeats, gen) if args.shared_requests else [],
        "layers": bench_layers(arch, dtype, args.tokens, args.repeats, gen),
        "linear": bench_linear(arch, dtype, args.tokens, args.repeats, gen),
    }
    write_report(report, args.output)
    return 0


def add_parser(kinds) -> None:
    p = kinds.add_parser("cpu-kernels", help="CPU attention and layer kernels, packed GEMMs: each vs the torch path")
    add_common_args(p)
    p.add_argument("--batches", type=positive_int_list, default=[1, 8, 32, 128], help="decode batch sizes")
    # Contexts are drawn from [context/2, 3*context/2): at 1, every one would be empty.
    p.add_argument("--context", type=int_at_least(2), default=400, help="mean context length of the decodes")
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--tokens", type=positive_int_list, default=[1, 8, 32, 128, 512, 2048],
                   help="token counts of the GEMMs and of the layers' element-wise work")
    p.add_argument("--prefill-tokens", type=positive_int_list, default=[64, 187, 512, 2048],
                   help="lengths of the fresh prefill chunks")
    p.add_argument("--shared-requests", type=non_negative_int, default=64,
                   help="requests of the shared-prefix step (0: skip it)")
    p.add_argument("--shared-prefix", type=positive_int, default=1024, help="tokens of the shared cached prefix")
    p.add_argument("--shared-new", type=positive_int, default=32, help="each request's own new tokens")
    p.add_argument("--repeats", type=positive_int, default=5, help="timed passes; the best counts")
    p.set_defaults(bench_func=main)
