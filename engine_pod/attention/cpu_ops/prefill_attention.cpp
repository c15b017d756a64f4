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

// Where key (or value) position c of KV head h lies: a contiguous [len, Hkv, D]
// tensor (blocks == nullptr), or the paged cache [blocks, block_size, Hkv, D]
// through one sequence's block table, read in place (no gathered copy).
template <typename T>
struct Rows {
  const T* base;
  const int64_t* blocks;
  int64_t block_size, block_stride, token_stride, head_stride;

  static Rows contiguous(const at::Tensor& t) {
    return {t.data_ptr<T>(), nullptr, 1, 0, t.stride(0), t.stride(1)};
  }
  static Rows paged(const at::Tensor& cache, const at::Tensor& block_table_row) {
    return {cache.data_ptr<T>(), block_table_row.data_ptr<int64_t>(), cache.size(1), cache.stride(0),
            cache.stride(1), cache.stride(2)};
  }
  const T* at(int64_t c, int64_t h) const {
    const int64_t token = blocks ? blocks[c / block_size] * block_stride + (c % block_size) * token_stride
                                 : c * token_stride;
    return base + token + h * head_stride;
  }
};

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
  // Rows per micro-tile: enough independent accumulators to hide the dot product's latency,
  // within the 32 registers (scores: 8 rows x 2 key tiles).
  static constexpr int64_t kValueRows = 16 / kDimBlocks, kScoreRows = 8;
  const at::BFloat16* q;  // [Hkv, n * G, D]
  int64_t q_rows, len;
  std::vector<uint16_t> k_packed, v_packed;  // per KV head: key tiles of [pair][key][2]; key pairs of [d][2]

  Bf16Gemms(const at::Tensor& grouped_query, const Rows<at::BFloat16>& key, const Rows<at::BFloat16>& value,
            int64_t heads, int64_t len)
      : q(grouped_query.data_ptr<at::BFloat16>()), q_rows(grouped_query.size(1)), len(len) {
    const int64_t tiles = (len + kKeyTile - 1) / kKeyTile, key_pairs = (len + 1) / 2;
    // One zero tile past the last head: the scores loop reads key tiles in pairs.
    k_packed.assign((heads * tiles + 1) * kPairs * kKeyTile * 2, 0);
    v_packed.assign(heads * key_pairs * kDim * 2, 0);
    // Each head's keys and values are packed by one thread; a key's (d, d + 1) pair moves as one
    // 32-bit word.
    at::parallel_for(0, heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t h = begin; h < end; ++h) {
        uint32_t* kp = reinterpret_cast<uint32_t*>(k_packed.data()) + h * tiles * kPairs * kKeyTile;
        uint16_t* vp = v_packed.data() + h * key_pairs * kDim * 2;
        for (int64_t c = 0; c < len; ++c) {
          uint32_t krow[kPairs];
          std::memcpy(krow, key.at(c, h), sizeof(krow));
          uint32_t* ktile = kp + (c / kKeyTile) * kPairs * kKeyTile + c % kKeyTile;
          for (int64_t i = 0; i < kPairs; ++i) ktile[i * kKeyTile] = krow[i];
          const uint16_t* vrow = reinterpret_cast<const uint16_t*>(value.at(c, h));
          uint16_t* vpair = vp + (c / 2) * kDim * 2 + c % 2;
          for (int64_t d = 0; d < kDim; ++d) vpair[d * 2] = vrow[d];
        }
      }
    });
  }

  // Probabilities rows padded to an even count of keys (the pairs the dot products read).
  static int64_t prob_stride(int64_t keys) { return (keys + 1) / 2 * 2; }

  void scores(int64_t h, int64_t row0, int64_t rows, int64_t keys, float* out) const {
    const int64_t tiles_per_head = (len + kKeyTile - 1) / kKeyTile;
    const uint16_t* kp = k_packed.data() + h * tiles_per_head * kPairs * kKeyTile * 2;
    const uint16_t* qh = reinterpret_cast<const uint16_t*>(q) + (h * q_rows + row0) * kDim;
    const int64_t tile_elems = kPairs * kKeyTile * 2;
    for (int64_t r0 = 0; r0 < rows; r0 += kScoreRows) {
      const int64_t nr = std::min(kScoreRows, rows - r0);
      for (int64_t tile = 0; tile * kKeyTile < keys; tile += 2) {
        __m512 acc[kScoreRows][2];
        for (auto& row : acc) row[0] = row[1] = _mm512_setzero_ps();
        const uint16_t* kt = kp + tile * tile_elems;
        for (int64_t i = 0; i < kPairs; ++i) {
          const __m512i k0 = _mm512_loadu_si512(kt + i * kKeyTile * 2);
          const __m512i k1 = _mm512_loadu_si512(kt + tile_elems + i * kKeyTile * 2);
          for (int64_t r = 0; r < kScoreRows; ++r) {
            if (r >= nr) break;
            int32_t pair;
            std::memcpy(&pair, qh + (r0 + r) * kDim + 2 * i, sizeof(pair));
            const __m512bh q = (__m512bh)_mm512_set1_epi32(pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], q, (__m512bh)k0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], q, (__m512bh)k1);
          }
        }
        for (int64_t half = 0; half < 2 && (tile + half) * kKeyTile < keys; ++half) {
          const int64_t width = std::min(kKeyTile, keys - (tile + half) * kKeyTile);
          const __mmask16 mask = static_cast<__mmask16>((1u << width) - 1);
          for (int64_t r = 0; r < nr; ++r)
            _mm512_mask_storeu_ps(out + (r0 + r) * keys + (tile + half) * kKeyTile, mask, acc[r][half]);
        }
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

// [Hkv, n * G, D]: the G query heads of a KV head, token after token, as one matrix.
at::Tensor grouped_query(const at::Tensor& query, int64_t num_kv_heads) {
  const int64_t n = query.size(0), group = query.size(1) / num_kv_heads, dim = query.size(2);
  return query.view({n, num_kv_heads, group, dim}).permute({1, 0, 2, 3}).contiguous()
      .view({num_kv_heads, n * group, dim});
}

// Whether the bf16 dot-product GEMMs run this query (else the float32 ones).
bool bf16_gemms(const at::Tensor& query) {
#if defined(__AVX512BF16__)
  return query.scalar_type() == at::kBFloat16 && (query.size(2) == 64 || query.size(2) == 128);
#else
  return false;
#endif
}

// The bf16 path, keys and values read through `key` and `value` (len positions of Hkv heads).
void bf16_prefill(const at::Tensor& query, const Rows<at::BFloat16>& key, const Rows<at::BFloat16>& value,
                  int64_t num_kv_heads, int64_t len, double scale, at::Tensor& out) {
#if defined(__AVX512BF16__)
  const int64_t n = query.size(0), num_heads = query.size(1), dim = query.size(2);
  const at::Tensor grouped = grouped_query(query, num_kv_heads);
  if (dim == 64)
    return prefill_blocks(Bf16Gemms<64>(grouped, key, value, num_kv_heads, len), n, len, num_heads, num_kv_heads,
                          dim, scale, out);
  return prefill_blocks(Bf16Gemms<128>(grouped, key, value, num_kv_heads, len), n, len, num_heads, num_kv_heads,
                        dim, scale, out);
#endif
}

void prefill_kernel(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, double scale,
                    at::Tensor& out) {
  const int64_t n = query.size(0), num_heads = query.size(1), dim = query.size(2);
  const int64_t len = key.size(0), num_kv_heads = key.size(1);
  if (bf16_gemms(query)) {
    const at::Tensor k = key.stride(2) == 1 ? key : key.contiguous(), v = value.stride(2) == 1 ? value : value.contiguous();
    return bf16_prefill(query, Rows<at::BFloat16>::contiguous(k), Rows<at::BFloat16>::contiguous(v), num_kv_heads,
                        len, scale, out);
  }
  prefill_blocks(FloatGemms(grouped_query(query, num_kv_heads), key, value), n, len, num_heads, num_kv_heads, dim,
                 scale, out);
}

void check_query_and_out(const at::Tensor& query, const at::Tensor& out, const char* op) {
  TORCH_CHECK(query.dim() == 3, op, ": query [n, Hq, D] expected");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type(),
              op, ": out must be a contiguous tensor shaped like query");
  TORCH_CHECK(query.device().is_cpu() && out.device().is_cpu(), op, ": CPU tensors expected");
  TORCH_CHECK(query.scalar_type() != at::kDouble, op, ": float32, bfloat16 or float16 expected");
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
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type(),
              "prefill_attention: query, key and value must share a dtype");
  TORCH_CHECK(key.device().is_cpu() && value.device().is_cpu(), "prefill_attention: CPU tensors expected");
  if (query.size(0) == 0) return;
  check_query_and_out(query, out, "prefill_attention");
  prefill_kernel(query, key, value, scale, out);
}

// The same for a chunk after cached context, its keys and values (the chunk's own
// included) read from the paged cache [blocks, block_size, Hkv, D] through the
// sequence's block-table row: out [n, Hq, D], query i seeing positions 0 ..
// seq_len - n + i.
void prefill_attention_paged(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_table_row, int64_t seq_len, double scale, at::Tensor out) {
  const char* op = "prefill_attention_paged";
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(), op,
              ": query [n, Hq, D] and caches [blocks, block_size, Hkv, D] of one shape expected");
  TORCH_CHECK(query.size(2) == key_cache.size(3) && query.size(1) % key_cache.size(2) == 0, op,
              ": query and cache head sizes differ, or query heads are not a multiple of KV heads");
  TORCH_CHECK(key_cache.scalar_type() == query.scalar_type() && value_cache.scalar_type() == query.scalar_type(), op,
              ": query and caches must share a dtype");
  TORCH_CHECK(key_cache.stride(3) == 1 && value_cache.strides() == key_cache.strides(), op,
              ": the caches' head dimension must be contiguous, and both laid out alike");
  TORCH_CHECK(block_table_row.dim() == 1 && block_table_row.scalar_type() == at::kLong &&
              block_table_row.is_contiguous(), op, ": block_table_row must be a contiguous int64 vector");
  TORCH_CHECK(seq_len >= query.size(0), op, ": seq_len is shorter than the chunk");
  const int64_t block_size = key_cache.size(1), num_blocks = (seq_len + block_size - 1) / block_size;
  TORCH_CHECK(block_table_row.size(0) >= num_blocks, op, ": the block-table row is shorter than seq_len");
  const int64_t* blocks = block_table_row.data_ptr<int64_t>();
  for (int64_t b = 0; b < num_blocks; ++b)
    TORCH_CHECK(blocks[b] >= 0 && blocks[b] < key_cache.size(0), op, ": block id ", blocks[b], " outside the cache");
  TORCH_CHECK(key_cache.device().is_cpu() && value_cache.device().is_cpu(), op, ": CPU tensors expected");
  if (query.size(0) == 0) return;
  check_query_and_out(query, out, op);
  const int64_t num_kv_heads = key_cache.size(2);
  if (bf16_gemms(query))
    return bf16_prefill(query, Rows<at::BFloat16>::paged(key_cache, block_table_row),
                        Rows<at::BFloat16>::paged(value_cache, block_table_row), num_kv_heads, seq_len, scale, out);
  // Elsewhere the float32 GEMMs take the context gathered into one tensor.
  const at::Tensor ids = block_table_row.narrow(0, 0, num_blocks);
  auto gather = [&](const at::Tensor& cache) {
    return cache.index_select(0, ids).view({num_blocks * block_size, num_kv_heads, cache.size(3)}).narrow(0, 0, seq_len);
  };
  prefill_kernel(query, gather(key_cache), gather(value_cache), scale, out);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tessera_cpu, m) {
  m.def("prefill_attention(Tensor query, Tensor key, Tensor value, float scale, Tensor(a!) out) -> ()");
  m.def("prefill_attention_paged(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table_row, "
        "int seq_len, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(tessera_cpu, CPU, m) {
  m.impl("prefill_attention", &prefill_attention);
  m.impl("prefill_attention_paged", &prefill_attention_paged);
}
