// Causal attention of a prefill chunk over contiguous keys and values, for
// CPU engines, as two GEMMs per block of queries.
//
// torch's CPU flash attention (SDPA) runs these shapes (a few hundred tokens,
// head size 64, grouped KV heads) at a tenth of the machine's GEMM rate: it
// multiplies one query head's small tile at a time. Here the query heads that
// share a KV head are stacked into one matrix (their rows side by side), so
// each block of 64 query tokens is one scores GEMM and one values GEMM per KV
// head, with the row softmax between them in float. In bf16 (head size 64 or
// 128, on AVX-512 BF16) the GEMMs are dot products of bf16 pairs into float,
// the probabilities rounded to bf16 for the second one as the flash kernel
// rounds them; otherwise q, k and v are widened to float32 once and the GEMMs
// are torch's. Scores and accumulation are float either way.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "bf16_bits.h"

namespace {

constexpr int64_t kQueryBlock = 64;  // query tokens per work item

// A float matrix over scratch memory, for at::mm_out.
at::Tensor matrix(float* data, int64_t rows, int64_t cols) {
  return at::from_blob(data, {rows, cols}, at::TensorOptions().dtype(at::kFloat));
}

// The two GEMMs in float32 through torch's BLAS: q, k and v widened once.
struct FloatGemms {
  using prob_t = float;
  at::Tensor q, k, v;  // [Hkv, n * G, D], [Hkv, len, D], [Hkv, len, D]

  FloatGemms(const at::Tensor& grouped_query, const at::Tensor& key, const at::Tensor& value)
      : q(grouped_query.to(at::kFloat)),
        k(key.permute({1, 0, 2}).to(at::kFloat).contiguous()),
        v(value.permute({1, 0, 2}).to(at::kFloat).contiguous()) {}

  static int64_t prob_stride(int64_t keys) { return keys; }

  void scores(int64_t h, int64_t row0, int64_t rows, int64_t keys, float* out) const {
    at::Tensor s = matrix(out, rows, keys);
    at::mm_out(s, q[h].narrow(0, row0, rows), k[h].narrow(0, 0, keys).t());
  }

  void values(int64_t h, const float* probs, int64_t rows, int64_t keys, float* out) const {
    at::Tensor o = matrix(out, rows, q.size(2));
    at::mm_out(o, matrix(const_cast<float*>(probs), rows, keys), v[h].narrow(0, 0, keys));
  }
};

#if defined(__AVX512BF16__)
// The two GEMMs in bf16 with float accumulation, AVX-512 BF16 dot products
// (vdpbf16ps: two bf16 products added into each float lane), for bf16 models
// with head size 64 or 128. torch's BLAS offers bf16 GEMMs only with bf16
// results, which would round the scores; these keep them float. K and V are
// packed once per chunk in the pair-interleaved layout the instruction reads.
template <int64_t kDim>
struct Bf16Gemms {
  using prob_t = at::BFloat16;
  static constexpr int64_t kPairs = kDim / 2, kKeyTile = 16, kDimBlocks = kDim / 16;
  // Rows per micro-tile: enough accumulators to hide latency, within the 32 registers.
  static constexpr int64_t kValueRows = 16 / kDimBlocks, kScoreRows = 4;
  const at::BFloat16* q;  // [Hkv, n * G, D]
  int64_t q_rows, len;
  std::vector<uint16_t> k_packed, v_packed;  // per KV head: key tiles of [pair][key][2]; key pairs of [d][2]

  Bf16Gemms(const at::Tensor& grouped_query, const at::Tensor& key, const at::Tensor& value)
      : q(grouped_query.data_ptr<at::BFloat16>()), q_rows(grouped_query.size(1)), len(key.size(0)) {
    const int64_t heads = key.size(1), tiles = (len + kKeyTile - 1) / kKeyTile, key_pairs = (len + 1) / 2;
    k_packed.assign(heads * tiles * kPairs * kKeyTile * 2, 0);
    v_packed.assign(heads * key_pairs * kDim * 2, 0);
    const at::BFloat16* k = key.data_ptr<at::BFloat16>();
    const at::BFloat16* v = value.data_ptr<at::BFloat16>();
    for (int64_t h = 0; h < heads; ++h) {
      uint16_t* kp = k_packed.data() + h * tiles * kPairs * kKeyTile * 2;
      uint16_t* vp = v_packed.data() + h * key_pairs * kDim * 2;
      for (int64_t c = 0; c < len; ++c) {
        const at::BFloat16* krow = k + c * key.stride(0) + h * key.stride(1);
        const at::BFloat16* vrow = v + c * value.stride(0) + h * value.stride(1);
        uint16_t* ktile = kp + (c / kKeyTile) * kPairs * kKeyTile * 2 + (c % kKeyTile) * 2;
        for (int64_t d = 0; d < kDim; ++d) ktile[(d / 2) * kKeyTile * 2 + d % 2] = krow[d].x;
        uint16_t* vpair = vp + (c / 2) * kDim * 2 + c % 2;
        for (int64_t d = 0; d < kDim; ++d) vpair[d * 2] = vrow[d].x;
      }
    }
  }

  // Probabilities rows padded to an even count of keys (the pairs the dot products read).
  static int64_t prob_stride(int64_t keys) { return (keys + 1) / 2 * 2; }

  void scores(int64_t h, int64_t row0, int64_t rows, int64_t keys, float* out) const {
    const int64_t tiles_per_head = (len + kKeyTile - 1) / kKeyTile;
    const uint16_t* kp = k_packed.data() + h * tiles_per_head * kPairs * kKeyTile * 2;
    const uint16_t* qh = reinterpret_cast<const uint16_t*>(q) + (h * q_rows + row0) * kDim;
    for (int64_t r0 = 0; r0 < rows; r0 += kScoreRows) {
      const int64_t nr = std::min(kScoreRows, rows - r0);
      for (int64_t tile = 0; tile * kKeyTile < keys; ++tile) {
        __m512 acc[kScoreRows] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        const uint16_t* kt = kp + tile * kPairs * kKeyTile * 2;
        for (int64_t i = 0; i < kPairs; ++i) {
          const __m512i kv = _mm512_loadu_si512(kt + i * kKeyTile * 2);
          for (int64_t r = 0; r < kScoreRows; ++r) {
            if (r >= nr) break;
            int32_t pair;
            std::memcpy(&pair, qh + (r0 + r) * kDim + 2 * i, sizeof(pair));
            acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(pair), (__m512bh)kv);
          }
        }
        const int64_t width = std::min(kKeyTile, keys - tile * kKeyTile);
        const __mmask16 mask = static_cast<__mmask16>((1u << width) - 1);
        for (int64_t r = 0; r < nr; ++r) _mm512_mask_storeu_ps(out + (r0 + r) * keys + tile * kKeyTile, mask, acc[r]);
      }
    }
  }

  void values(int64_t h, const at::BFloat16* probs, int64_t rows, int64_t keys, float* out) const {
    const int64_t ldp = prob_stride(keys), key_pairs_per_head = (len + 1) / 2;
    const uint16_t* vp = v_packed.data() + h * key_pairs_per_head * kDim * 2;
    const uint16_t* p = reinterpret_cast<const uint16_t*>(probs);
    for (int64_t r0 = 0; r0 < rows; r0 += kValueRows) {
      const int64_t nr = std::min(kValueRows, rows - r0);
      __m512 acc[kValueRows][kDimBlocks];
      for (auto& row : acc)
        for (auto& block : row) block = _mm512_setzero_ps();
      for (int64_t pair = 0; pair < ldp / 2; ++pair) {
        const uint16_t* vpair = vp + pair * kDim * 2;
        for (int64_t r = 0; r < kValueRows; ++r) {
          if (r >= nr) break;
          int32_t weights;
          std::memcpy(&weights, p + (r0 + r) * ldp + 2 * pair, sizeof(weights));
          const __m512bh w = (__m512bh)_mm512_set1_epi32(weights);
          for (int64_t b = 0; b < kDimBlocks; ++b)
            acc[r][b] = _mm512_dpbf16_ps(acc[r][b], w, (__m512bh)_mm512_loadu_si512(vpair + b * 32));
        }
      }
      for (int64_t r = 0; r < nr; ++r)
        for (int64_t b = 0; b < kDimBlocks; ++b) _mm512_storeu_ps(out + (r0 + r) * kDim + b * 16, acc[r][b]);
    }
  }
};
#endif

// Round floats to bf16 (nearest even), a loop that vectorises.
inline void to_bf16(const float* x, int64_t n, at::BFloat16* out) {
  for (int64_t i = 0; i < n; ++i) out[i].x = tessera_cpu::to_bf16_bits(x[i]);
}

template <typename Gemms>
void prefill_blocks(const Gemms& gemms, int64_t n, int64_t len, int64_t num_heads, int64_t num_kv_heads,
                    int64_t dim, double scale, at::Tensor& out) {
  using prob_t = typename Gemms::prob_t;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t offset = len - n;  // keys before the chunk's first query (the cached context)
  const int64_t num_blocks = (n + kQueryBlock - 1) / kQueryBlock;
  const float alpha = static_cast<float>(scale);

  at::parallel_for(0, num_kv_heads * num_blocks, 1, [&](int64_t begin, int64_t end) {
    const int64_t max_rows = kQueryBlock * group;
    std::vector<float> scores(max_rows * len), acc(max_rows * dim), inv_sum(max_rows);
    std::vector<prob_t> probs(std::is_same_v<prob_t, float> ? 0 : max_rows * Gemms::prob_stride(len));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / num_blocks, t0 = (item % num_blocks) * kQueryBlock;
      const int64_t t1 = std::min(n, t0 + kQueryBlock), rows = (t1 - t0) * group, keys = offset + t1;
      const int64_t ldp = Gemms::prob_stride(keys);
      gemms.scores(h, t0 * group, rows, keys, scores.data());
      // Float probabilities overwrite their scores; others go to their own rows.
      prob_t* prob_rows = std::is_same_v<prob_t, float> ? reinterpret_cast<prob_t*>(scores.data()) : probs.data();
      for (int64_t r = 0; r < rows; ++r) {
        float* row = scores.data() + r * keys;
        prob_t* p = prob_rows + r * ldp;
        const int64_t visible = offset + t0 + r / group + 1;  // causal: keys up to the query's own position
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t c = 0; c < visible; ++c) m = std::max(m, row[c]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t c = 0; c < visible; ++c) {
          row[c] = std::exp(alpha * (row[c] - m));
          sum += row[c];
        }
        if constexpr (!std::is_same_v<prob_t, float>) to_bf16(row, visible, p);
        std::fill(p + visible, p + ldp, prob_t(0));
        inv_sum[r] = 1.f / sum;
      }
      gemms.values(h, prob_rows, rows, keys, acc.data());
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "prefill_attention", [&] {
        scalar_t* out_ptr = out.data_ptr<scalar_t>();
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t t = t0 + r / group, head = h * group + r % group;
          scalar_t* dst = out_ptr + (t * num_heads + head) * dim;
          const float* src = acc.data() + r * dim;
          for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<scalar_t>(src[d] * inv_sum[r]);
        }
      });
    }
  });
}

void prefill_kernel(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, double scale,
                    at::Tensor& out) {
  const int64_t n = query.size(0), num_heads = query.size(1), dim = query.size(2);
  const int64_t len = key.size(0), num_kv_heads = key.size(1), group = num_heads / num_kv_heads;
  // [Hkv, n * G, D]: the G query heads of a KV head, token after token, as one matrix.
  const at::Tensor grouped = query.view({n, num_kv_heads, group, dim}).permute({1, 0, 2, 3}).contiguous()
                                 .view({num_kv_heads, n * group, dim});
#if defined(__AVX512BF16__)
  if (query.scalar_type() == at::kBFloat16 && dim == 64)
    return prefill_blocks(Bf16Gemms<64>(grouped, key, value), n, len, num_heads, num_kv_heads, dim, scale, out);
  if (query.scalar_type() == at::kBFloat16 && dim == 128)
    return prefill_blocks(Bf16Gemms<128>(grouped, key, value), n, len, num_heads, num_kv_heads, dim, scale, out);
#endif
  prefill_blocks(FloatGemms(grouped, key, value), n, len, num_heads, num_kv_heads, dim, scale, out);
}

// out [n, Hq, D] = causal softmax(scale * q k^T) v, query i seeing keys 0 ..
// len - n + i; key/value [len, Hkv, D] (any strides).
void prefill_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, double scale,
                       at::Tensor out) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3,
              "prefill_attention: query [n, Hq, D], key and value [len, Hkv, D] expected");
  TORCH_CHECK(key.sizes() == value.sizes() && query.size(2) == key.size(2) && query.size(1) % key.size(1) == 0,
              "prefill_attention: key and value must match, and query heads be a multiple of KV heads");
  TORCH_CHECK(key.size(0) >= query.size(0), "prefill_attention: fewer keys than queries");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type(),
              "prefill_attention: out must be a contiguous tensor shaped like query");
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type(),
              "prefill_attention: query, key and value must share a dtype");
  TORCH_CHECK(query.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu(),
              "prefill_attention: CPU tensors expected");
  if (query.size(0) == 0) return;
  TORCH_CHECK(query.scalar_type() != at::kDouble, "prefill_attention: float32, bfloat16 or float16 expected");
  prefill_kernel(query, key, value, scale, out);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tessera_cpu, m) {
  m.def("prefill_attention(Tensor query, Tensor key, Tensor value, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(tessera_cpu, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
