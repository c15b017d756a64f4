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
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
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
// K and V in the layouts AVX-512 BF16 dot products (vdpbf16ps: two bf16 products added
// into each float lane) read, in tiles of 16 positions of one KV head: a key tile is
// [pair of dims][key][2], a value tile [pair of keys][dim][2]. Both hold kDim * 16 values.
template <int64_t kDim>
struct Bf16Tile {
  static constexpr int64_t kPairs = kDim / 2, kKeys = 16, kElems = kDim * kKeys;

  // Positions first .. first + valid - 1 of KV head h; the tile's other rows are zero, so a
  // read past the context's end multiplies zeros (a cache row there may hold anything).
  static void pack(const Rows<at::BFloat16>& key, const Rows<at::BFloat16>& value, int64_t first, int64_t valid,
                   int64_t h, uint16_t* k_tile, uint16_t* v_tile) {
    if (valid < kKeys) {  // full tiles are overwritten whole
      std::memset(k_tile, 0, kElems * sizeof(uint16_t));
      std::memset(v_tile, 0, kElems * sizeof(uint16_t));
    }
    uint32_t* kt = reinterpret_cast<uint32_t*>(k_tile);
    for (int64_t j = 0; j < valid; ++j) {
      uint32_t krow[kPairs];  // a key's (d, d + 1) pair moves as one 32-bit word
      std::memcpy(krow, key.at(first + j, h), sizeof(krow));
      for (int64_t i = 0; i < kPairs; ++i) kt[i * kKeys + j] = krow[i];
      const uint16_t* vrow = reinterpret_cast<const uint16_t*>(value.at(first + j, h));
      uint16_t* vpair = v_tile + (j / 2) * kDim * 2 + j % 2;
      for (int64_t d = 0; d < kDim; ++d) vpair[d * 2] = vrow[d];
    }
  }
};

// The two GEMMs in bf16 with float accumulation, for bf16 models with head size 64 or 128.
// torch's BLAS offers bf16 GEMMs only with bf16 results, which would round the scores; these
// keep them float. The chunk's keys and values are read through tables of packed tiles (per
// KV head, tile after tile), so tiles can be packed for this chunk alone or shared by every
// chunk of a step that reads the same cache blocks.
template <int64_t kDim>
struct Bf16Gemms {
  using prob_t = at::BFloat16;
  using Tile = Bf16Tile<kDim>;
  static constexpr int64_t kPairs = kDim / 2, kKeyTile = Tile::kKeys, kDimBlocks = kDim / 16;
  // Rows per micro-tile: enough independent accumulators to hide the dot product's latency,
  // within the 32 registers (scores: 8 rows x 2 key tiles).
  static constexpr int64_t kValueRows = 16 / kDimBlocks, kScoreRows = 8;
  const uint16_t* q;  // the chunk's grouped query rows: KV head h's start at q + h * q_head_stride
  int64_t q_head_stride, tiles;
  // [h * (tiles + 1) + t]: KV head h's key tile t, then a zero tile (scores read tiles in pairs).
  std::vector<const uint16_t*> k_tiles;
  std::vector<const uint16_t*> v_tiles;  // [h * tiles + t]
  std::unique_ptr<uint16_t[]> own;       // tiles packed for this chunk alone (else none)

  Bf16Gemms(const uint16_t* q, int64_t q_head_stride, int64_t heads, int64_t len)
      : q(q), q_head_stride(q_head_stride), tiles((len + kKeyTile - 1) / kKeyTile),
        k_tiles(heads * (tiles + 1), zero_tile()), v_tiles(heads * tiles) {}

  // A chunk whose keys and values are packed here, each KV head by one thread.
  Bf16Gemms(const at::Tensor& grouped_query, const Rows<at::BFloat16>& key, const Rows<at::BFloat16>& value,
            int64_t heads, int64_t len)
      : Bf16Gemms(reinterpret_cast<const uint16_t*>(grouped_query.data_ptr<at::BFloat16>()),
                  grouped_query.stride(0), heads, len) {
    own.reset(new uint16_t[heads * tiles * 2 * Tile::kElems]);  // each tile fills (or zeroes) all of itself
    at::parallel_for(0, heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t h = begin; h < end; ++h)
        for (int64_t t = 0; t < tiles; ++t) {
          uint16_t* k_tile = own.get() + ((h * tiles + t) * 2) * Tile::kElems;
          uint16_t* v_tile = k_tile + Tile::kElems;
          Tile::pack(key, value, t * kKeyTile, std::min(kKeyTile, len - t * kKeyTile), h, k_tile, v_tile);
          set_tile(h, t, k_tile, v_tile);
        }
    });
  }

  static const uint16_t* zero_tile() {
    static const std::vector<uint16_t> zeros(Tile::kElems, 0);
    return zeros.data();
  }

  void set_tile(int64_t h, int64_t t, const uint16_t* k_tile, const uint16_t* v_tile) {
    k_tiles[h * (tiles + 1) + t] = k_tile;
    v_tiles[h * tiles + t] = v_tile;
  }

  // Probabilities rows padded to an even count of keys (the pairs the dot products read).
  static int64_t prob_stride(int64_t keys) { return (keys + 1) / 2 * 2; }

  void scores(int64_t h, int64_t row0, int64_t rows, int64_t keys, float* out) const {
    const uint16_t* const* kh = k_tiles.data() + h * (tiles + 1);
    const uint16_t* qh = q + h * q_head_stride + row0 * kDim;
    for (int64_t r0 = 0; r0 < rows; r0 += kScoreRows) {
      const int64_t nr = std::min(kScoreRows, rows - r0);
      for (int64_t tile = 0; tile * kKeyTile < keys; tile += 2) {
        __m512 acc[kScoreRows][2];
        for (auto& row : acc) row[0] = row[1] = _mm512_setzero_ps();
        const uint16_t* kt0 = kh[tile];
        const uint16_t* kt1 = kh[tile + 1];
        for (int64_t i = 0; i < kPairs; ++i) {
          const __m512i k0 = _mm512_loadu_si512(kt0 + i * kKeyTile * 2);
          const __m512i k1 = _mm512_loadu_si512(kt1 + i * kKeyTile * 2);
          for (int64_t r = 0; r < kScoreRows; ++r) {
            if (r >= nr) break;
            int32_t pair;
            std::memcpy(&pair, qh + (r0 + r) * kDim + 2 * i, sizeof(pair));
            const __m512bh qp = (__m512bh)_mm512_set1_epi32(pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qp, (__m512bh)k0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qp, (__m512bh)k1);
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
    const int64_t ldp = prob_stride(keys);
    const uint16_t* const* vh = v_tiles.data() + h * tiles;
    const uint16_t* p = reinterpret_cast<const uint16_t*>(probs);
    for (int64_t r0 = 0; r0 < rows; r0 += kValueRows) {
      const int64_t nr = std::min(kValueRows, rows - r0);
      __m512 acc[kValueRows][kDimBlocks];
      for (auto& row : acc)
        for (auto& block : row) block = _mm512_setzero_ps();
      for (int64_t pair = 0; pair < ldp / 2; ++pair) {
        const uint16_t* vpair = vh[pair / (kKeyTile / 2)] + (pair % (kKeyTile / 2)) * kDim * 2;
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

// Per-thread buffers of attend_block, for up to kQueryBlock query tokens over `len` keys.
template <typename prob_t>
struct Scratch {
  std::vector<float> scores, acc, inv_sum;
  std::vector<prob_t> probs;
  Scratch(int64_t group, int64_t len, int64_t dim, int64_t prob_stride)
      : scores(kQueryBlock * group * len), acc(kQueryBlock * group * dim), inv_sum(kQueryBlock * group),
        probs(std::is_same_v<prob_t, float> ? 0 : kQueryBlock * group * prob_stride) {}
};

// Query tokens t0 .. t1 - 1 of a chunk of n tokens after len - n cached keys, KV head h: the
// scores GEMM, the causal softmax in float, the values GEMM; written into the chunk's
// [n, Hq, D] output rows.
template <typename Gemms, typename scalar_t>
void attend_block(const Gemms& gemms, int64_t h, int64_t t0, int64_t t1, int64_t n, int64_t len, int64_t num_heads,
                  int64_t group, int64_t dim, float alpha, Scratch<typename Gemms::prob_t>& s, scalar_t* out_rows) {
  using prob_t = typename Gemms::prob_t;
  const int64_t offset = len - n;  // keys before the chunk's first query (the cached context)
  const int64_t rows = (t1 - t0) * group, keys = offset + t1, ldp = Gemms::prob_stride(keys);
  gemms.scores(h, t0 * group, rows, keys, s.scores.data());
  // Float probabilities overwrite their scores; others go to their own rows.
  prob_t* prob_rows = std::is_same_v<prob_t, float> ? reinterpret_cast<prob_t*>(s.scores.data()) : s.probs.data();
  for (int64_t r = 0; r < rows; ++r) {
    float* row = s.scores.data() + r * keys;
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
    s.inv_sum[r] = 1.f / sum;
  }
  gemms.values(h, prob_rows, rows, keys, s.acc.data());
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / group, head = h * group + r % group;
    scalar_t* dst = out_rows + (t * num_heads + head) * dim;
    const float* src = s.acc.data() + r * dim;
    for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<scalar_t>(src[d] * s.inv_sum[r]);
  }
}

// One chunk: its (KV head, block of kQueryBlock queries) items over the threads.
template <typename Gemms>
void prefill_blocks(const Gemms& gemms, int64_t n, int64_t len, int64_t num_heads, int64_t num_kv_heads,
                    int64_t dim, double scale, at::Tensor& out) {
  const int64_t group = num_heads / num_kv_heads, num_blocks = (n + kQueryBlock - 1) / kQueryBlock;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "prefill_attention", [&] {
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    at::parallel_for(0, num_kv_heads * num_blocks, 1, [&](int64_t begin, int64_t end) {
      Scratch<typename Gemms::prob_t> s(group, len, dim, Gemms::prob_stride(len));
      for (int64_t item = begin; item < end; ++item) {
        const int64_t h = item / num_blocks, t0 = (item % num_blocks) * kQueryBlock;
        attend_block(gemms, h, t0, std::min(n, t0 + kQueryBlock), n, len, num_heads, group, dim,
                     static_cast<float>(scale), s, out_ptr);
      }
    });
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
}

void check_kernel_dtype(const at::Tensor& query, const char* op) {
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
  check_query_and_out(query, out, "prefill_attention");
  if (query.size(0) == 0) return;
  check_kernel_dtype(query, "prefill_attention");
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
  check_query_and_out(query, out, op);
  if (query.size(0) == 0) return;
  check_kernel_dtype(query, op);
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

#if defined(__AVX512BF16__)
// Every prefill chunk of a step at once (bf16, head size 64 or 128, a block size that is a
// multiple of 16). The cache blocks their contexts read are packed once each, so a cached
// prefix that many chunks share (a system prompt, a document) is packed once for all of them
// instead of once per chunk; then the (chunk, KV head, query block) items go to the threads,
// the longest first, each thread taking the next free one.
template <int64_t kDim>
void bf16_prefill_batch(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                        const at::Tensor& block_table, const int64_t* qsl, const int64_t* seq_lens, int64_t first,
                        int64_t num_seqs, double scale, at::Tensor& out) {
  using Gemms = Bf16Gemms<kDim>;
  using Tile = Bf16Tile<kDim>;
  const int64_t num_heads = query.size(1), num_kv_heads = key_cache.size(2), group = num_heads / num_kv_heads;
  const int64_t block_size = key_cache.size(1), tiles_per_block = block_size / Tile::kKeys;
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t table_stride = block_table.stride(0);
  // The distinct blocks read, each with the most of its rows any context reaches.
  std::vector<int64_t> slot_of(key_cache.size(0), -1), blocks, valid;
  int64_t max_len = 0;
  for (int64_t seq = first; seq < num_seqs; ++seq) {
    max_len = std::max(max_len, seq_lens[seq]);
    for (int64_t b = 0; b * block_size < seq_lens[seq]; ++b) {
      const int64_t id = table[seq * table_stride + b], rows = std::min(block_size, seq_lens[seq] - b * block_size);
      if (slot_of[id] < 0) {
        slot_of[id] = static_cast<int64_t>(blocks.size());
        blocks.push_back(id);
        valid.push_back(rows);
      } else {
        valid[slot_of[id]] = std::max(valid[slot_of[id]], rows);
      }
    }
  }
  // [slot][KV head][tile of the block][key tile, value tile]
  const int64_t num_tiles = static_cast<int64_t>(blocks.size()) * num_kv_heads * tiles_per_block;
  std::unique_ptr<uint16_t[]> packed(new uint16_t[num_tiles * 2 * Tile::kElems]);  // each tile fills all of itself
  const auto* k_base = key_cache.data_ptr<at::BFloat16>();
  const auto* v_base = value_cache.data_ptr<at::BFloat16>();
  at::parallel_for(0, num_tiles, 8, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t slot = item / (num_kv_heads * tiles_per_block), h = item / tiles_per_block % num_kv_heads;
      const int64_t t = item % tiles_per_block;
      const Rows<at::BFloat16> key{k_base, &blocks[slot], block_size, key_cache.stride(0), key_cache.stride(1),
                                   key_cache.stride(2)};
      const Rows<at::BFloat16> value{v_base, &blocks[slot], block_size, value_cache.stride(0),
                                     value_cache.stride(1), value_cache.stride(2)};
      const int64_t rows = std::clamp<int64_t>(valid[slot] - t * Tile::kKeys, 0, Tile::kKeys);
      uint16_t* k_tile = packed.get() + item * 2 * Tile::kElems;
      Tile::pack(key, value, t * Tile::kKeys, rows, h, k_tile, k_tile + Tile::kElems);
    }
  });
  // Each chunk's tables point into the shared tiles; its grouped query rows follow the previous chunk's.
  const int64_t first_token = qsl[first], tokens = qsl[num_seqs] - first_token;
  const at::Tensor grouped = grouped_query(query.narrow(0, first_token, tokens), num_kv_heads);
  const auto* q_base = reinterpret_cast<const uint16_t*>(grouped.data_ptr<at::BFloat16>());
  std::vector<Gemms> chunks;
  chunks.reserve(num_seqs - first);
  struct Item { int64_t seq, h, t0, cost; };
  std::vector<Item> items;
  for (int64_t seq = first; seq < num_seqs; ++seq) {
    const int64_t n = qsl[seq + 1] - qsl[seq], len = seq_lens[seq];
    Gemms& g = chunks.emplace_back(q_base + (qsl[seq] - first_token) * group * kDim, grouped.stride(0), num_kv_heads,
                                   len);
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t t = 0; t < g.tiles; ++t) {
        const int64_t slot = slot_of[table[seq * table_stride + t / tiles_per_block]];
        const uint16_t* k_tile = packed.get() + ((slot * num_kv_heads + h) * tiles_per_block + t % tiles_per_block) *
                                                     2 * Tile::kElems;
        g.set_tile(h, t, k_tile, k_tile + Tile::kElems);
      }
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t t0 = 0; t0 < n; t0 += kQueryBlock)
        items.push_back({seq, h, t0, std::min(kQueryBlock, n - t0) * (len - n + std::min(n, t0 + kQueryBlock))});
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::atomic<size_t> next{0};
  auto* out_ptr = out.data_ptr<at::BFloat16>();
  const float alpha = static_cast<float>(scale);
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch<at::BFloat16> s(group, max_len, kDim, Gemms::prob_stride(max_len));
    for (size_t i = next++; i < items.size(); i = next++) {
      const Item& it = items[i];
      const int64_t n = qsl[it.seq + 1] - qsl[it.seq];
      attend_block(chunks[it.seq - first], it.h, it.t0, std::min(n, it.t0 + kQueryBlock), n, seq_lens[it.seq],
                   num_heads, group, kDim, alpha, s, out_ptr + qsl[it.seq] * num_heads * kDim);
    }
  });
}
#endif

// Whether prefill_attention_batch takes this step: bf16 dot products for the query, and
// cache blocks that hold whole tiles of 16 positions.
bool prefill_batch_supported(const at::Tensor& query, const at::Tensor& key_cache) {
  return bf16_gemms(query) && key_cache.dim() == 4 && key_cache.size(1) % 16 == 0;
}

// Every prefill chunk of a flattened step: sequences first .. B - 1, sequence i's query rows
// query_start_loc[i] .. query_start_loc[i + 1] - 1 of query [T, Hq, D], its context the
// first seq_lens[i] positions of block_table[i] (its own new keys already written); out rows
// of the same sequences are written, the others left alone.
void prefill_attention_batch(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_table, const at::Tensor& query_start_loc,
                             const at::Tensor& seq_lens, int64_t first, double scale, at::Tensor out) {
  const char* op = "prefill_attention_batch";
  check_query_and_out(query, out, op);
  check_kernel_dtype(query, op);
  TORCH_CHECK(prefill_batch_supported(query, key_cache), op,
              ": bf16 with head size 64 or 128 on AVX-512 BF16, and a block size that is a multiple of 16, expected");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes() && key_cache.strides() == value_cache.strides() &&
              key_cache.stride(3) == 1, op, ": key and value caches of one layout, head dimension contiguous");
  TORCH_CHECK(query.size(2) == key_cache.size(3) && query.size(1) % key_cache.size(2) == 0, op,
              ": query and cache head sizes differ, or query heads are not a multiple of KV heads");
  TORCH_CHECK(key_cache.scalar_type() == query.scalar_type() && value_cache.scalar_type() == query.scalar_type(), op,
              ": query and caches must share a dtype");
  for (const at::Tensor* t : {&block_table, &query_start_loc, &seq_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->device().is_cpu(), op,
                ": block_table, query_start_loc and seq_lens must be int64 CPU tensors");
  TORCH_CHECK(block_table.dim() == 2 && block_table.stride(1) == 1 && query_start_loc.is_contiguous() &&
              seq_lens.is_contiguous(), op, ": block_table rows, query_start_loc and seq_lens must be contiguous");
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1 && block_table.size(0) >= num_seqs, op,
              ": one block-table row and one length per sequence, and one more start than sequences");
  TORCH_CHECK(first >= 0 && first <= num_seqs, op, ": first is outside the sequences");
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t block_size = key_cache.size(1);
  TORCH_CHECK(qsl[first] >= 0 && qsl[num_seqs] <= query.size(0), op, ": query_start_loc outside the query");
  if (first == num_seqs) return;
  for (int64_t seq = first; seq < num_seqs; ++seq) {
    const int64_t n = qsl[seq + 1] - qsl[seq];
    TORCH_CHECK(n >= 0 && lens[seq] >= n, op, ": sequence ", seq, "'s context is shorter than its chunk");
    TORCH_CHECK((lens[seq] + block_size - 1) / block_size <= block_table.size(1), op, ": sequence ", seq,
                "'s block-table row is shorter than its context");
    const int64_t* row = block_table.data_ptr<int64_t>() + seq * block_table.stride(0);
    for (int64_t b = 0; b * block_size < lens[seq]; ++b)
      TORCH_CHECK(row[b] >= 0 && row[b] < key_cache.size(0), op, ": block id ", row[b], " outside the cache");
  }
#if defined(__AVX512BF16__)
  if (query.size(2) == 64)
    return bf16_prefill_batch<64>(query, key_cache, value_cache, block_table, qsl, lens, first, num_seqs, scale, out);
  return bf16_prefill_batch<128>(query, key_cache, value_cache, block_table, qsl, lens, first, num_seqs, scale, out);
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tessera_cpu, m) {
  m.def("prefill_attention(Tensor query, Tensor key, Tensor value, float scale, Tensor(a!) out) -> ()");
  m.def("prefill_attention_paged(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table_row, "
        "int seq_len, float scale, Tensor(a!) out) -> ()");
  m.def("prefill_batch_supported(Tensor query, Tensor key_cache) -> bool");
  m.def("prefill_attention_batch(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, "
        "Tensor query_start_loc, Tensor seq_lens, int first, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(tessera_cpu, CPU, m) {
  m.impl("prefill_attention", &prefill_attention);
  m.impl("prefill_attention_paged", &prefill_attention_paged);
  m.impl("prefill_attention_batch", &prefill_attention_batch);
}

// Answers without tensors to dispatch on: registered for every backend.
TORCH_LIBRARY_IMPL(tessera_cpu, CompositeExplicitAutograd, m) {
  m.impl("prefill_batch_supported", &prefill_batch_supported);
}
