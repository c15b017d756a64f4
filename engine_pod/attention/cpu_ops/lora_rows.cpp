// A LoRA adapter's update row by row, for CPU steps of few rows (decode
// steps mixing adapters): out[t] += (x[t] . A[s]^T) . Bt[s], with s the row's
// adapter slot (rows of slot -1, the base model, untouched).
//
// Why not two GEMMs: at a few dozen rows each oneDNN call costs 30-60 us
// whatever its size, a mixed step multiplies every row by every slot's
// factors (the other slots' columns masked), and a layer needs a dozen such
// calls; a decode step of 32 rows on the bench model then spends a third of
// its time in them. Here one call per projection reads only the row's own
// slot, in float, and rounds once into out: the shrink row by row, the expand
// by blocks of output columns over every row. With AVX-512 BF16 (bf16
// models) both run as dot products of bf16 pairs (lora_rows_bf16).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "bf16_bits.h"

namespace {

using tessera_cpu::bits_float;
using tessera_cpu::to_bf16_bits;

template <typename scalar_t>
inline float load_float(const scalar_t* p) {
  return static_cast<float>(*p);
}
template <>
inline float load_float(const c10::BFloat16* p) {
  return bits_float(static_cast<uint32_t>(p->x) << 16);
}
template <typename scalar_t>
inline void store_float(scalar_t* p, float v) {
  *p = static_cast<scalar_t>(v);
}
template <>
inline void store_float(c10::BFloat16* p, float v) {
  p->x = to_bf16_bits(v);
}

// Output columns one expand task covers: every slot's B over them (4 slots x rank 16 x 128 bf16,
// 16 KiB) stays in L1 while all the rows pass, so each B element comes from memory once a call;
// row by row, a row re-read its slot's whole B (tens of KiB a projection) from L2 or beyond.
constexpr int64_t kColumnBlock = 128;
// Input features one shrink pass covers, for the same reason.
constexpr int64_t kInputBlock = 256;

template <typename scalar_t>
void lora_rows_impl(const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt, const at::Tensor& slots,
                    const std::vector<int64_t>& ranks, at::Tensor& out) {
  const int64_t rows = x.size(0), in = x.size(1), num_slots = a.size(0), max_rank = a.size(1), cols = bt.size(2);
  const int64_t x_stride = x.stride(0), out_stride = out.stride(0);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* ap = a.data_ptr<scalar_t>();
  const scalar_t* bp = bt.data_ptr<scalar_t>();
  const int32_t* sp = slots.data_ptr<int32_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  auto rank_of = [&](int64_t t) -> int64_t {
    const int64_t s = sp[t];
    return s < 0 || s >= num_slots ? 0 : ranks[s];
  };
  // 1. Shrink, a block of input features at a time over every row of a task's rows: every slot's
  //    A over the block (4 slots x rank 16 x 256 bf16, 32 KiB) stays in L1 while the rows pass.
  std::vector<float> shrunk(rows * max_rank, 0.f);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t k0 = 0; k0 < in; k0 += kInputBlock) {
      const int64_t width = std::min(kInputBlock, in - k0);
      float x_block[kInputBlock];
      for (int64_t t = begin; t < end; ++t) {
        const int64_t rank = rank_of(t);
        if (rank == 0) continue;
        for (int64_t k = 0; k < width; ++k) x_block[k] = load_float(xp + t * x_stride + k0 + k);
        for (int64_t r = 0; r < rank; ++r) {
          const scalar_t* a_row = ap + (sp[t] * max_rank + r) * in + k0;
          float acc = 0.f;
          for (int64_t k = 0; k < width; ++k) acc += x_block[k] * load_float(a_row + k);
          shrunk[t * max_rank + r] += acc;
        }
      }
    }
  });
  // 2. Expand, a block of output columns per task, every row in it.
  const int64_t blocks = (cols + kColumnBlock - 1) / kColumnBlock;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    float acc[kColumnBlock];
    for (int64_t block = begin; block < end; ++block) {
      const int64_t c0 = block * kColumnBlock, width = std::min(kColumnBlock, cols - c0);
      for (int64_t t = 0; t < rows; ++t) {
        const int64_t rank = rank_of(t);
        if (rank == 0) continue;
        scalar_t* o = op + t * out_stride + c0;
        for (int64_t c = 0; c < width; ++c) acc[c] = load_float(o + c);
        for (int64_t r = 0; r < rank; ++r) {
          const scalar_t* b_row = bp + (sp[t] * max_rank + r) * cols + c0;
          const float v = shrunk[t * max_rank + r];
          for (int64_t c = 0; c < width; ++c) acc[c] += v * load_float(b_row + c);
        }
        for (int64_t c = 0; c < width; ++c) store_float(o + c, acc[c]);
      }
    }
  });
}

#if defined(__AVX512BF16__)
// bf16 on AVX-512 BF16: the shrink as dot products of bf16 pairs (32 inputs an instruction), the
// expand over pairs of ranks (the row's two shrunk values, rounded to bf16 as a bf16 GEMM rounds
// its output, against two rows of B interleaved per column), 32 output columns at a time in two
// accumulators whose lanes hold columns {8L + j} and {8L + 4 + j} (the in-lane order of
// unpacklo/hi_epi16; out is loaded and stored in the same order). Columns past the last 32 and
// inputs past the last 32 take the plain loops. Needs an even max_rank (a slot's padding is zero).
void lora_rows_bf16(const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt, const at::Tensor& slots,
                    const std::vector<int64_t>& ranks, at::Tensor& out) {
  using bf16 = c10::BFloat16;
  const int64_t rows = x.size(0), in = x.size(1), num_slots = a.size(0), max_rank = a.size(1), cols = bt.size(2);
  const int64_t x_stride = x.stride(0), out_stride = out.stride(0), pairs = max_rank / 2;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<bf16>());
  const uint16_t* ap = reinterpret_cast<const uint16_t*>(a.data_ptr<bf16>());
  const uint16_t* bp = reinterpret_cast<const uint16_t*>(bt.data_ptr<bf16>());
  const int32_t* sp = slots.data_ptr<int32_t>();
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<bf16>());
  auto rank_of = [&](int64_t t) -> int64_t {
    const int64_t s = sp[t];
    return s < 0 || s >= num_slots ? 0 : ranks[s];
  };
  const int64_t in_vec = in / 32 * 32, cols_vec = cols / 32 * 32;
  std::vector<float> shrunk(rows * max_rank, 0.f);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t rank = rank_of(t);
      const uint16_t* xr = xp + t * x_stride;
      for (int64_t r = 0; r < rank; ++r) {
        const uint16_t* ar = ap + (sp[t] * max_rank + r) * in;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t k = 0; k < in_vec; k += 32) {
          acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(xr + k), (__m512bh)_mm512_loadu_si512(ar + k));
        }
        float sum = _mm512_reduce_add_ps(acc);
        for (int64_t k = in_vec; k < in; ++k) {
          sum += bits_float(static_cast<uint32_t>(xr[k]) << 16) * bits_float(static_cast<uint32_t>(ar[k]) << 16);
        }
        shrunk[t * max_rank + r] = sum;
      }
    }
  });
  // Each row's shrunk values as bf16 pairs (rank r in the low half, r + 1 in the high half).
  std::vector<int32_t> weights(rows * pairs);
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t q = 0; q < pairs; ++q) {
      const uint32_t lo = to_bf16_bits(shrunk[t * max_rank + 2 * q]);
      const uint32_t hi = to_bf16_bits(shrunk[t * max_rank + 2 * q + 1]);
      weights[t * pairs + q] = static_cast<int32_t>(lo | (hi << 16));
    }
  }
  const int64_t chunks = cols_vec / 32;
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<__m512i> b_pairs(num_slots * pairs * 2);
    const __m512i zero = _mm512_setzero_si512(), round = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      const int64_t c0 = chunk * 32;
      for (int64_t s = 0; s < num_slots; ++s) {
        for (int64_t q = 0; q < pairs; ++q) {
          const uint16_t* b0 = bp + (s * max_rank + 2 * q) * cols + c0;
          const uint16_t* b1 = b0 + cols;
          // B's rows are a row of B^T apart (cols * 2 bytes): 2 * slots * pairs streams the hardware
          // prefetcher does not follow, so the next chunk's lines are asked for by hand.
          if (chunk + 1 < end) {
            _mm_prefetch(reinterpret_cast<const char*>(b0 + 32), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(b1 + 32), _MM_HINT_T0);
          }
          const __m512i r0 = _mm512_loadu_si512(b0);
          const __m512i r1 = _mm512_loadu_si512(b1);
          b_pairs[(s * pairs + q) * 2] = _mm512_unpacklo_epi16(r0, r1);
          b_pairs[(s * pairs + q) * 2 + 1] = _mm512_unpackhi_epi16(r0, r1);
        }
      }
      for (int64_t t = 0; t < rows; ++t) {
        const int64_t rank = rank_of(t);
        if (rank == 0) continue;
        uint16_t* o = op + t * out_stride + c0;
        const __m512i o_bits = _mm512_loadu_si512(o);
        __m512 lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, o_bits));
        __m512 hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, o_bits));
        const __m512i* b = b_pairs.data() + sp[t] * pairs * 2;
        for (int64_t q = 0; q < (rank + 1) / 2; ++q) {
          const __m512bh w = (__m512bh)_mm512_set1_epi32(weights[t * pairs + q]);
          lo = _mm512_dpbf16_ps(lo, w, (__m512bh)b[2 * q]);
          hi = _mm512_dpbf16_ps(hi, w, (__m512bh)b[2 * q + 1]);
        }
        // Round to nearest even bf16 and pack back into column order (in-lane, as unpacked).
        auto rounded = [&](__m512 v) {
          const __m512i u = _mm512_castps_si512(v);
          const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
          return _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(round, odd)), 16);
        };
        _mm512_storeu_si512(o, _mm512_packus_epi32(rounded(lo), rounded(hi)));
      }
    }
  });
  // The last cols % 32 columns, plainly.
  if (cols_vec < cols) {
    for (int64_t t = 0; t < rows; ++t) {
      const int64_t rank = rank_of(t);
      for (int64_t c = cols_vec; c < cols; ++c) {
        uint16_t* o = op + t * out_stride + c;
        float acc = bits_float(static_cast<uint32_t>(*o) << 16);
        for (int64_t r = 0; r < rank; ++r) {
          acc += shrunk[t * max_rank + r] * bits_float(static_cast<uint32_t>(bp[(sp[t] * max_rank + r) * cols + c]) << 16);
        }
        *o = to_bf16_bits(acc);
      }
    }
  }
}
#endif

// x [T, in], a [slots, max_rank, in], bt [slots, max_rank, cols] (B times its
// scaling, transposed), slots [T] int32, ranks per slot; out [T, cols] with
// unit column stride (a column slice of a merged layer's output is fine).
void lora_rows(const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt, const at::Tensor& slots,
               at::IntArrayRef ranks, at::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "lora_rows: x must be [T, in] with unit column stride");
  TORCH_CHECK(a.dim() == 3 && a.is_contiguous() && a.size(2) == x.size(1), "lora_rows: a must be [slots, rank, in]");
  TORCH_CHECK(bt.dim() == 3 && bt.is_contiguous() && bt.size(0) == a.size(0) && bt.size(1) == a.size(1),
              "lora_rows: bt must be [slots, rank, cols] like a");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(0) && out.size(1) == bt.size(2),
              "lora_rows: out must be [T, cols] with unit column stride");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == x.size(0) && slots.scalar_type() == at::kInt &&
                  slots.is_contiguous(), "lora_rows: slots must be [T] int32");
  TORCH_CHECK(static_cast<int64_t>(ranks.size()) == a.size(0), "lora_rows: one rank per slot");
  TORCH_CHECK(x.scalar_type() == a.scalar_type() && x.scalar_type() == bt.scalar_type() &&
                  x.scalar_type() == out.scalar_type(), "lora_rows: x, a, bt and out must share a dtype");
  std::vector<int64_t> slot_ranks(ranks.begin(), ranks.end());
  for (int64_t r : slot_ranks) TORCH_CHECK(0 <= r && r <= a.size(1), "lora_rows: a rank is outside [0, max_rank]");
  if (x.scalar_type() == at::kFloat) {
    lora_rows_impl<float>(x, a, bt, slots, slot_ranks, out);
  } else if (x.scalar_type() == at::kBFloat16) {
#if defined(__AVX512BF16__)
    if (a.size(1) % 2 == 0) {
      lora_rows_bf16(x, a, bt, slots, slot_ranks, out);
      return;
    }
#endif
    lora_rows_impl<c10::BFloat16>(x, a, bt, slots, slot_ranks, out);
  } else {
    TORCH_CHECK(false, "lora_rows: float32 or bfloat16 only");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tessera_cpu, m) {
  m.def("lora_rows(Tensor x, Tensor a, Tensor bt, Tensor slots, int[] ranks, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(tessera_cpu, CPU, m) {
  m.impl("lora_rows", &lora_rows);
}
