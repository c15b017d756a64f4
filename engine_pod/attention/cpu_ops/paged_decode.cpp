// Decode attention read straight from the paged KV cache, for CPU engines.
//
// The torch backend gathers each decode group's blocks into a contiguous
// tensor before attending: per layer the K/V bytes are read, written and read
// again, and on a CPU decode step that traffic, not arithmetic, sets the time.
// Here each sequence walks its block table and reads every key and value row
// once: one pass of q.k scores (each KV head's row serving all query heads of
// its GQA group), a softmax in the accumulation type, one pass of p.v.
//
// A score is a dot product over the head size, and summing one vector's lanes
// costs more than the products themselves. The vectorised paths (head size 64
// or 128: float32 on AVX-512, bf16 on AVX-512 BF16) therefore keep 16 keys'
// products as 16 vectors and sum them together through a transposing tree
// (sum_lanes16), about 3 instructions a key where a horizontal sum each costs
// 8. Each tile of 16 positions is read as whole rows and then served from L1
// to every query head. The bf16 path (Bf16Decode) also multiplies the values
// as bf16 pairs and hands sequences to threads longest first.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "bf16_bits.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

inline void prefetch_row(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

// One sequence's rows (a position's K or V for all KV heads) in one cache.
template <typename scalar_t>
struct SequenceRows {
  const scalar_t* cache;
  const int64_t* blocks;
  int64_t block_size, block_stride, token_stride, row_bytes, len;

  const scalar_t* at(int64_t pos) const {
    const int64_t offset = (pos % block_size) * token_stride;
    // Blocks sit anywhere in the pool, so the hardware prefetcher loses the
    // stream at each block boundary: fetch the same row of the next block
    // ahead. (A hint only: with a non-contiguous row it fetches too little.)
    if (pos + block_size < len) prefetch_row(cache + blocks[pos / block_size + 1] * block_stride + offset, row_bytes);
    return cache + blocks[pos / block_size] * block_stride + offset;
  }
};

// s[i] = exp(s[i] - max(s)) over one query head's len scores, in place; returns 1 / their
// sum (a softmax whose division is left to the output).
template <typename T>
T exp_shifted(T* s, int64_t len) {
  T m = s[0];  // scores are finite: no -inf start (built with -ffast-math)
  for (int64_t pos = 1; pos < len; ++pos) m = std::max(m, s[pos]);
  T sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t pos = 0; pos < len; ++pos) {
    s[pos] = std::exp(s[pos] - m);
    sum += s[pos];
  }
  return T(1) / sum;
}

// The decode batch as raw pointers, sizes and strides: what both kernels read.
template <typename scalar_t>
struct DecodeBatch {
  const scalar_t* q;
  const scalar_t* k;
  const scalar_t* v;
  scalar_t* out;
  const int64_t* table;
  const int64_t* lens;
  int64_t num_seqs, num_heads, num_kv_heads, group, block_size, q_seq_stride, q_head_stride, table_stride, max_len;

  DecodeBatch(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
              const at::Tensor& block_table, const at::Tensor& seq_lens, at::Tensor& out_)
      : q(query.data_ptr<scalar_t>()), k(key_cache.data_ptr<scalar_t>()), v(value_cache.data_ptr<scalar_t>()),
        out(out_.data_ptr<scalar_t>()), table(block_table.data_ptr<int64_t>()), lens(seq_lens.data_ptr<int64_t>()),
        num_seqs(query.size(0)), num_heads(query.size(1)), num_kv_heads(key_cache.size(2)),
        group(num_heads / num_kv_heads), block_size(key_cache.size(1)), q_seq_stride(query.stride(0)),
        q_head_stride(query.stride(1)), table_stride(block_table.stride(0)),
        max_len(num_seqs ? *std::max_element(lens, lens + num_seqs) : 0) {}
};

#if defined(__AVX512F__)
// r[j] = the sum of v[j]'s 16 lanes: four levels of pairwise shuffles and adds
// (45 instructions for 16 sums).
inline __m512 sum_lanes16(const __m512 v[16]) {
  __m512 s[8], t[4], u[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: one partial sum of each of 4 vectors
    t[i] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)  // 128-bit lanes added in pairs
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// One query head held in registers; partial(k) is 16 lanes whose sum is q.k.
template <typename scalar_t, int64_t kDim>
struct QueryRow;

template <int64_t kDim>
struct QueryRow<float, kDim> {
  static constexpr bool kVectorised = true;
  __m512 q[kDim / 16];
  explicit QueryRow(const float* src) {
    for (int64_t c = 0; c < kDim / 16; ++c) q[c] = _mm512_loadu_ps(src + 16 * c);
  }
  __m512 partial(const float* k) const {
    __m512 acc = _mm512_mul_ps(q[0], _mm512_loadu_ps(k));
    for (int64_t c = 1; c < kDim / 16; ++c) acc = _mm512_fmadd_ps(q[c], _mm512_loadu_ps(k + 16 * c), acc);
    return acc;
  }
  static __m512 widen(const float* v) { return _mm512_loadu_ps(v); }
};


template <typename scalar_t, int64_t kDim>
struct QueryRow {
  static constexpr bool kVectorised = false;
};

// The vectorised kernel: one sequence per work item, its KV heads together, so
// each tile of 16 positions is read as whole rows (block_size x Hkv x D runs)
// and then served from L1 to every query head.
template <typename scalar_t, int64_t kDim>
void paged_decode_vectorised(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_table, const at::Tensor& seq_lens, double scale,
                             at::Tensor& out) {
  constexpr int64_t kTile = 16, kChunks = kDim / 16;
  const DecodeBatch<scalar_t> b(query, key_cache, value_cache, block_table, seq_lens, out);
  const int64_t block_stride = key_cache.stride(0), token_stride = key_cache.stride(1), head_stride = key_cache.stride(2);
  const int64_t row_bytes = b.num_kv_heads * head_stride * static_cast<int64_t>(sizeof(scalar_t));
  const int64_t padded_len = (b.max_len + kTile - 1) / kTile * kTile;
  const __m512 alpha = _mm512_set1_ps(static_cast<float>(scale));

  at::parallel_for(0, b.num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(b.num_heads * padded_len), acc(b.num_heads * kDim), inv_sum(b.num_heads);
    for (int64_t seq = begin; seq < end; ++seq) {
      const int64_t len = b.lens[seq];
      const int64_t* blocks = b.table + seq * b.table_stride;
      auto row = [&](const scalar_t* cache, int64_t pos) {  // a position's row: all KV heads
        return cache + blocks[pos / b.block_size] * block_stride + (pos % b.block_size) * token_stride;
      };
      // Scores, 16 positions at a time.
      for (int64_t t0 = 0; t0 < len; t0 += kTile) {
        const int64_t n = std::min(kTile, len - t0);
        const scalar_t* keys[kTile];
        for (int64_t j = 0; j < kTile; ++j) keys[j] = row(b.k, t0 + std::min(j, n - 1));
        for (int64_t h = 0; h < b.num_heads; ++h) {
          const int64_t head_offset = (h / b.group) * head_stride;
          const QueryRow<scalar_t, kDim> q(b.q + seq * b.q_seq_stride + h * b.q_head_stride);
          for (int64_t j = h; j < kTile; j += b.num_heads)
            if (t0 + kTile + j < len) prefetch_row(row(b.k, t0 + kTile + j), row_bytes);
          __m512 partials[kTile];
          for (int64_t j = 0; j < kTile; ++j) partials[j] = q.partial(keys[j] + head_offset);
          _mm512_mask_storeu_ps(scores.data() + h * padded_len + t0, static_cast<__mmask16>((1u << n) - 1),
                                _mm512_mul_ps(sum_lanes16(partials), alpha));
        }
      }
      // Softmax per query head; the 1/sum is applied to the output.
      for (int64_t h = 0; h < b.num_heads; ++h) inv_sum[h] = exp_shifted(scores.data() + h * padded_len, len);
      // Weighted values, 16 positions at a time: the tile's value rows stay in L1
      // while each query head adds it to its accumulators (held in registers).
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < len; t0 += kTile) {
        const int64_t n = std::min(kTile, len - t0);
        const scalar_t* values[kTile];
        for (int64_t j = 0; j < n; ++j) values[j] = row(b.v, t0 + j);
        for (int64_t h = 0; h < b.num_heads; ++h) {
          const int64_t head_offset = (h / b.group) * head_stride;
          const float* p = scores.data() + h * padded_len + t0;
          float* ah = acc.data() + h * kDim;
          for (int64_t j = h; j < kTile; j += b.num_heads)
            if (t0 + kTile + j < len) prefetch_row(row(b.v, t0 + kTile + j), row_bytes);
          __m512 sum[kChunks];
          for (int64_t c = 0; c < kChunks; ++c) sum[c] = _mm512_loadu_ps(ah + 16 * c);
          for (int64_t j = 0; j < n; ++j) {
            const __m512 weight = _mm512_set1_ps(p[j]);
            for (int64_t c = 0; c < kChunks; ++c)
              sum[c] = _mm512_fmadd_ps(weight, QueryRow<scalar_t, kDim>::widen(values[j] + head_offset + 16 * c), sum[c]);
          }
          for (int64_t c = 0; c < kChunks; ++c) _mm512_storeu_ps(ah + 16 * c, sum[c]);
        }
      }
      for (int64_t h = 0; h < b.num_heads; ++h) {
        scalar_t* dst = b.out + (seq * b.num_heads + h) * kDim;
        const float* ah = acc.data() + h * kDim;
        for (int64_t d = 0; d < kDim; ++d) dst[d] = static_cast<scalar_t>(ah[d] * inv_sum[h]);
      }
    }
  });
}
#endif

#if defined(__AVX512BF16__)
// bf16 rows, head size 64 or 128: dot products of bf16 pairs into float for
// both passes. A work item is one sequence; items go to whichever thread is
// free, longest first (contexts are long-tailed: a static split leaves one
// core idle at the end). Rows are read whole (all KV heads of a position), as
// the float kernel reads them: walking one KV head's slices of the rows
// instead measured 1.2x slower on a 2-core machine (a strided stream).
//
// Values: a tile's rows are first interleaved two positions at a time
// (v[p][d], v[p+1][d]) into an L1 buffer; each query head then adds both
// positions, weighted by its bf16-rounded probabilities, in one dot product a
// lane. Accumulation is float; rounding the probabilities is what the prefill
// kernel and torch's flash kernel do for bf16.
template <int64_t kDim>
struct Bf16Decode {
  static constexpr int64_t kTile = 16, kPairs = kTile / 2, kRowVectors = kDim / 32, kChunks = kDim / 16;

  // A sequence's rows, position after position, without a division each.
  struct Cursor {
    const uint16_t* base;
    const int64_t* blocks;
    int64_t block_size, block_stride, token_stride, block = 0, offset = 0;
    const uint16_t* next() {
      const uint16_t* row = base + blocks[block] * block_stride + offset * token_stride;
      if (++offset == block_size) offset = 0, ++block;
      return row;
    }
  };

  // Per-thread buffers.
  struct Scratch {
    std::vector<float> scores, acc, inv_sum;
    std::vector<uint16_t> probs;
    std::vector<__m512i> interleaved;  // [KV head][pair][kRowVectors * 2]
    explicit Scratch(const Bf16Decode& d)
        : scores(d.b.num_heads * d.score_stride), acc(d.b.num_heads * kDim), inv_sum(d.b.num_heads),
          probs(d.b.num_heads * d.score_stride), interleaved(d.b.num_kv_heads * kPairs * kChunks) {}
  };

  const DecodeBatch<at::BFloat16>& b;
  const uint16_t* k;
  const uint16_t* v;
  int64_t block_stride, token_stride, head_stride, row_bytes;
  int64_t score_stride;  // per head, in scores and in probs: max_len rounded up to whole tiles
  float scale;

  Bf16Decode(const DecodeBatch<at::BFloat16>& b, const at::Tensor& key_cache, double scale)
      : b(b), k(reinterpret_cast<const uint16_t*>(b.k)), v(reinterpret_cast<const uint16_t*>(b.v)),
        block_stride(key_cache.stride(0)), token_stride(key_cache.stride(1)), head_stride(key_cache.stride(2)),
        row_bytes(b.num_kv_heads * key_cache.stride(2) * 2), score_stride((b.max_len + kTile - 1) / kTile * kTile),
        scale(static_cast<float>(scale)) {}

  Cursor cursor(const uint16_t* cache, int64_t seq, int64_t start) const {
    return {cache, b.table + seq * b.table_stride, b.block_size, block_stride, token_stride, start / b.block_size,
            start % b.block_size};
  }

  // The tile's rows (nullptr past len), and the next tile's rows to prefetch (nullptr past len).
  void next_tile(Cursor& rows, Cursor& ahead, int64_t t0, int64_t len, const uint16_t* (&tile)[kTile],
                 const uint16_t* (&upcoming)[kTile]) const {
    for (int64_t j = 0; j < kTile; ++j) tile[j] = t0 + j < len ? rows.next() : nullptr;
    for (int64_t j = 0; j < kTile; ++j) upcoming[j] = t0 + kTile + j < len ? ahead.next() : nullptr;
  }

  // Head h's share of the next tile's prefetches: spread over the heads' work, not all at once.
  void prefetch_share(const uint16_t* const (&upcoming)[kTile], int64_t h) const {
    for (int64_t j = h; j < kTile; j += b.num_heads)
      if (upcoming[j]) prefetch_row(upcoming[j], row_bytes);
  }

  // scores[h][pos] = scale * q_h . k_pos, 16 positions at a time.
  void scores(int64_t seq, int64_t len, float* scores) const {
    const __m512 alpha = _mm512_set1_ps(scale);
    Cursor rows = cursor(k, seq, 0), ahead = cursor(k, seq, std::min(kTile, len));
    for (int64_t t0 = 0; t0 < len; t0 += kTile) {
      const int64_t n = std::min(kTile, len - t0);
      const uint16_t* keys[kTile];
      const uint16_t* upcoming[kTile];
      next_tile(rows, ahead, t0, len, keys, upcoming);
      for (int64_t j = n; j < kTile; ++j) keys[j] = keys[n - 1];
      for (int64_t h = 0; h < b.num_heads; ++h) {
        const at::BFloat16* qh = b.q + seq * b.q_seq_stride + h * b.q_head_stride;
        __m512bh q[kRowVectors];
        for (int64_t c = 0; c < kRowVectors; ++c) q[c] = (__m512bh)_mm512_loadu_si512(qh + 32 * c);
        prefetch_share(upcoming, h);
        const int64_t offset = (h / b.group) * head_stride;
        __m512 partials[kTile];
        for (int64_t j = 0; j < kTile; ++j) {
          __m512 acc = _mm512_setzero_ps();
          for (int64_t c = 0; c < kRowVectors; ++c)
            acc = _mm512_dpbf16_ps(acc, q[c], (__m512bh)_mm512_loadu_si512(keys[j] + offset + 32 * c));
          partials[j] = acc;
        }
        _mm512_mask_storeu_ps(scores + h * score_stride + t0, static_cast<__mmask16>((1u << n) - 1),
                              _mm512_mul_ps(sum_lanes16(partials), alpha));
      }
    }
  }

  // Each head's softmax, left unnormalised and rounded to bf16 in probs (zero past len up
  // to the tile's end); 1 / sum to inv_sum.
  void probabilities(int64_t len, float* scores, uint16_t* probs, float* inv_sum) const {
    const int64_t padded = (len + kTile - 1) / kTile * kTile;
    for (int64_t h = 0; h < b.num_heads; ++h) {
      float* s = scores + h * score_stride;
      uint16_t* p = probs + h * score_stride;
      inv_sum[h] = exp_shifted(s, len);
      for (int64_t pos = 0; pos < len; ++pos) p[pos] = tessera_cpu::to_bf16_bits(s[pos]);
      std::fill(p + len, p + padded, uint16_t(0));
    }
  }

  void values(int64_t seq, int64_t len, Scratch& s) const {
    std::fill(s.acc.begin(), s.acc.end(), 0.f);
    Cursor rows = cursor(v, seq, 0), ahead = cursor(v, seq, std::min(kTile, len));
    for (int64_t t0 = 0; t0 < len; t0 += kTile) {
      const uint16_t* tile[kTile];
      const uint16_t* upcoming[kTile];
      next_tile(rows, ahead, t0, len, tile, upcoming);
      // Interleave the tile's rows in pairs of positions, per KV head (a missing row is zeros:
      // its probability is zero too, but 0 * garbage could be NaN).
      for (int64_t pair = 0; pair < kPairs && t0 + 2 * pair < len; ++pair) {
        const uint16_t* first = tile[2 * pair];
        const uint16_t* second = tile[2 * pair + 1];
        for (int64_t kv = 0; kv < b.num_kv_heads; ++kv) {
          __m512i* dst = s.interleaved.data() + (kv * kPairs + pair) * kChunks;
          for (int64_t c = 0; c < kRowVectors; ++c) {
            const __m512i a = _mm512_loadu_si512(first + kv * head_stride + 32 * c);
            const __m512i z = second ? _mm512_loadu_si512(second + kv * head_stride + 32 * c) : _mm512_setzero_si512();
            dst[2 * c] = _mm512_unpacklo_epi16(a, z);
            dst[2 * c + 1] = _mm512_unpackhi_epi16(a, z);
          }
        }
      }
      const int64_t pairs = std::min(kPairs, (len - t0 + 1) / 2);
      for (int64_t h = 0; h < b.num_heads; ++h) {
        const __m512i* src = s.interleaved.data() + (h / b.group) * kPairs * kChunks;
        const uint16_t* p = s.probs.data() + h * score_stride + t0;
        float* ah = s.acc.data() + h * kDim;
        prefetch_share(upcoming, h);
        __m512 acc[kChunks];
        for (int64_t c = 0; c < kChunks; ++c) acc[c] = _mm512_loadu_ps(ah + 16 * c);
        for (int64_t pair = 0; pair < pairs; ++pair) {
          int32_t weights;
          std::memcpy(&weights, p + 2 * pair, sizeof(weights));
          const __m512bh w = (__m512bh)_mm512_set1_epi32(weights);
          for (int64_t c = 0; c < kChunks; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], w, (__m512bh)src[pair * kChunks + c]);
        }
        for (int64_t c = 0; c < kChunks; ++c) _mm512_storeu_ps(ah + 16 * c, acc[c]);
      }
    }
    // Lane 4L + j of chunk 2c holds dimension 32c + 8L + j, of chunk 2c + 1 dimension 32c + 8L + 4 + j.
    for (int64_t h = 0; h < b.num_heads; ++h) {
      uint16_t* dst = reinterpret_cast<uint16_t*>(b.out + (seq * b.num_heads + h) * kDim);
      const float* ah = s.acc.data() + h * kDim;
      for (int64_t d = 0; d < kDim; ++d) {
        const int64_t c = d / 32, r = d % 32;
        dst[d] = tessera_cpu::to_bf16_bits(ah[(2 * c + (r / 4) % 2) * 16 + (r / 8) * 4 + r % 4] * s.inv_sum[h]);
      }
    }
  }

  void attend(int64_t seq, Scratch& s) const {
    const int64_t len = b.lens[seq];
    if (len == 0) {  // nothing to attend to: zeros, not whatever the output held
      std::fill_n(b.out + seq * b.num_heads * kDim, b.num_heads * kDim, at::BFloat16(0.f));
      return;
    }
    scores(seq, len, s.scores.data());
    probabilities(len, s.scores.data(), s.probs.data(), s.inv_sum.data());
    values(seq, len, s);
  }

  void run() const {
    std::vector<int64_t> order(b.num_seqs);
    for (int64_t seq = 0; seq < b.num_seqs; ++seq) order[seq] = seq;
    std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return b.lens[x] > b.lens[y]; });
    std::atomic<size_t> next{0};
    at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), b.num_seqs), 1, [&](int64_t, int64_t) {
      Scratch s(*this);
      for (size_t i = next++; i < order.size(); i = next++) attend(order[i], s);
    });
  }
};
#endif

template <typename scalar_t, int64_t kHeadDim>
void paged_decode_kernel(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                         const at::Tensor& block_table, const at::Tensor& seq_lens, double scale,
                         at::Tensor& out) {
  using acc_t = at::opmath_type<scalar_t>;
  const DecodeBatch<scalar_t> b(query, key_cache, value_cache, block_table, seq_lens, out);
  // A compile-time head size lets the compiler unroll the D loops; 0 is the generic build.
  const int64_t head_dim = kHeadDim ? kHeadDim : query.size(2);
  const int64_t k_block_stride = key_cache.stride(0), k_token_stride = key_cache.stride(1),
                k_head_stride = key_cache.stride(2);
  const int64_t v_block_stride = value_cache.stride(0), v_token_stride = value_cache.stride(1),
                v_head_stride = value_cache.stride(2);
  const int64_t row_bytes = b.num_kv_heads * head_dim * static_cast<int64_t>(sizeof(scalar_t));

  // One sequence per work item, all its KV heads together: a block's rows
  // (block_size x Hkv x D) are then read front to back as one run.
  at::parallel_for(0, b.num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> q(b.num_heads * head_dim), acc(b.num_heads * head_dim), scores(b.num_heads * b.max_len),
        inv_sum(b.num_heads);
    for (int64_t seq = begin; seq < end; ++seq) {
      const int64_t len = b.lens[seq];
      const int64_t* blocks = b.table + seq * b.table_stride;
      const SequenceRows<scalar_t> keys{b.k, blocks, b.block_size, k_block_stride, k_token_stride, row_bytes, len};
      const SequenceRows<scalar_t> values{b.v, blocks, b.block_size, v_block_stride, v_token_stride, row_bytes, len};
      for (int64_t h = 0; h < b.num_heads; ++h) {
        const scalar_t* src = b.q + seq * b.q_seq_stride + h * b.q_head_stride;
        for (int64_t d = 0; d < head_dim; ++d) q[h * head_dim + d] = static_cast<acc_t>(src[d]) * scale;
      }
      // Scores: each key row is loaded once for its query-head group.
      for (int64_t pos = 0; pos < len; ++pos) {
        const scalar_t* k_row = keys.at(pos);
        for (int64_t kv_head = 0; kv_head < b.num_kv_heads; ++kv_head) {
          const scalar_t* k = k_row + kv_head * k_head_stride;
          for (int64_t g = 0; g < b.group; ++g) {
            const int64_t h = kv_head * b.group + g;
            const acc_t* qh = q.data() + h * head_dim;
            acc_t s = 0;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < head_dim; ++d) s += qh[d] * static_cast<acc_t>(k[d]);
            scores[h * len + pos] = s;
          }
        }
      }
      // Softmax per query head, in the accumulation type.
      for (int64_t h = 0; h < b.num_heads; ++h) inv_sum[h] = exp_shifted(scores.data() + h * len, len);
      // Weighted values: each value row is loaded once for its group.
      std::fill(acc.begin(), acc.end(), acc_t(0));
      for (int64_t pos = 0; pos < len; ++pos) {
        const scalar_t* v_row = values.at(pos);
        for (int64_t kv_head = 0; kv_head < b.num_kv_heads; ++kv_head) {
          const scalar_t* v = v_row + kv_head * v_head_stride;
          for (int64_t g = 0; g < b.group; ++g) {
            const int64_t h = kv_head * b.group + g;
            const acc_t p = scores[h * len + pos];
            acc_t* ah = acc.data() + h * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) ah[d] += p * static_cast<acc_t>(v[d]);
          }
        }
      }
      scalar_t* dst = b.out + seq * b.num_heads * head_dim;
      for (int64_t i = 0; i < b.num_heads * head_dim; ++i) dst[i] = static_cast<scalar_t>(acc[i] * inv_sum[i / head_dim]);
    }
  });
}

// The vectorised kernel where this CPU and dtype have one, else the portable one.
template <typename scalar_t, int64_t kDim>
void paged_decode_dispatch(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                           const at::Tensor& block_table, const at::Tensor& seq_lens, double scale, at::Tensor& out) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    if (value_cache.strides() == key_cache.strides()) {
      const DecodeBatch<at::BFloat16> b(query, key_cache, value_cache, block_table, seq_lens, out);
      return Bf16Decode<kDim>(b, key_cache, scale).run();
    }
  }
#endif
#if defined(__AVX512F__)
  if constexpr (QueryRow<scalar_t, kDim>::kVectorised) {
    if (value_cache.strides() == key_cache.strides())
      return paged_decode_vectorised<scalar_t, kDim>(query, key_cache, value_cache, block_table, seq_lens, scale, out);
  }
#endif
  paged_decode_kernel<scalar_t, kDim>(query, key_cache, value_cache, block_table, seq_lens, scale, out);
}

void check_inputs(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                  const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& out) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.dim() == 4,
              "paged_decode: query [B, Hq, D] and caches [blocks, block_size, Hkv, D] expected");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "paged_decode: key and value caches differ in shape");
  TORCH_CHECK(query.size(2) == key_cache.size(3), "paged_decode: query and cache head sizes differ");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "paged_decode: query heads not a multiple of KV heads");
  TORCH_CHECK(query.stride(2) == 1 && key_cache.stride(3) == 1 && value_cache.stride(3) == 1,
              "paged_decode: the head dimension must be contiguous");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && key_cache.scalar_type() == value_cache.scalar_type(),
              "paged_decode: query and caches must share a dtype");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "paged_decode: block_table and seq_lens must be int64");
  TORCH_CHECK(block_table.dim() == 2 && block_table.stride(1) == 1 && seq_lens.is_contiguous(),
              "paged_decode: block_table rows and seq_lens must be contiguous");
  TORCH_CHECK(block_table.size(0) >= query.size(0) && seq_lens.size(0) >= query.size(0),
              "paged_decode: one block-table row and one length per query needed");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type(),
              "paged_decode: out must be a contiguous tensor shaped like query");
  TORCH_CHECK(query.device().is_cpu() && key_cache.device().is_cpu(), "paged_decode: CPU tensors expected");
}

// out[b] = softmax(scale * q[b] . K[b]^T) V[b] over the seq_lens[b] cached
// positions of sequence b, its keys found through block_table[b].
void paged_decode(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                  const at::Tensor& block_table, const at::Tensor& seq_lens, double scale, at::Tensor out) {
  check_inputs(query, key_cache, value_cache, block_table, seq_lens, out);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode", [&] {
    switch (query.size(2)) {
      case 64: return paged_decode_dispatch<scalar_t, 64>(query, key_cache, value_cache, block_table, seq_lens, scale, out);
      case 128: return paged_decode_dispatch<scalar_t, 128>(query, key_cache, value_cache, block_table, seq_lens, scale, out);
      default: return paged_decode_kernel<scalar_t, 0>(query, key_cache, value_cache, block_table, seq_lens, scale, out);
    }
  });
}

}  // namespace

TORCH_LIBRARY(tessera_cpu, m) {
  m.def("paged_decode(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, "
        "Tensor seq_lens, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(tessera_cpu, CPU, m) { m.impl("paged_decode", &paged_decode); }
