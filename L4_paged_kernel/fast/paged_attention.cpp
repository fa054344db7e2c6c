// L4's paged attention as a compiled CPU kernel: the same algorithm as ../paged_attention.py (online
// softmax over a sequence's KV blocks, read in place through its block table), written as loops a C++
// compiler turns into vector instructions, run on every core through ATen's thread pool.
//
// One work item is one query row and one KV head: the G query heads that share that KV head walk the
// sequence's blocks together, so each key and value row is loaded once for all G of them. A row at
// absolute position p sees keys 0..p (causal); for a decode row that is its whole history, for a
// prefill row of a chunk the part up to itself. Items are independent, so the loop over them is the
// parallel loop: decode (32 rows x 3 KV heads) and prefill (hundreds of rows) both fill two cores.
//
// Per block of the item's sequence (keys kept to the visible ones, so nothing is ever masked):
//     s_i   = q . k_i * scale                   (scores of the block's visible keys)
//     m_new = max(m, max_i s_i);  alpha = exp(m - m_new)
//     l     = l * alpha + sum_i exp(s_i - m_new)
//     acc   = acc * alpha + sum_i exp(s_i - m_new) * v_i
// and out = acc / l. The first block always has a visible key (key 0), so m_new is finite and
// exp(-inf - m_new) = 0 folds the empty start in with no special case.
//
// Left out on purpose: split-KV (a GPU occupancy trick; here rows x heads already fill the cores),
// other dtypes than fp32, and hand-written intrinsics (the `omp simd` loops vectorize as they are).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// x . y over d floats; `omp simd` lets the compiler keep several partial sums in one vector register.
inline float dot(const float* x, const float* y, int64_t d) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < d; ++i) sum += x[i] * y[i];
  return sum;
}

}  // namespace

// q: (T, H, D) new tokens of S sequences back to back; k_pool, v_pool: (num_blocks, block_size, H_kv,
// D); block_tables: (S, max_blocks) int64; context_lens: (S,) int64, history including the new
// tokens; cu_q_lens: (S + 1,) int64, sequence s owns rows cu_q_lens[s]..cu_q_lens[s + 1] - 1.
// Returns (T, H, D).
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                              const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                              const torch::Tensor& cu_q_lens, double scale) {
  for (const auto* t : {&q, &k_pool, &v_pool}) {
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous(), "q and the pools must be contiguous fp32");
  }
  for (const auto* t : {&block_tables, &context_lens, &cu_q_lens}) {
    TORCH_CHECK(t->scalar_type() == torch::kInt64 && t->is_contiguous(), "tables and lengths must be contiguous int64");
  }
  const int64_t n_tok = q.size(0), n_heads = q.size(1), d = q.size(2);
  const int64_t block_size = k_pool.size(1), n_kv = k_pool.size(2);
  const int64_t g = n_heads / n_kv, n_seq = context_lens.size(0), max_blocks = block_tables.size(1);
  TORCH_CHECK(n_heads % n_kv == 0, "query heads (", n_heads, ") must be a multiple of KV heads (", n_kv, ")");
  TORCH_CHECK(cu_q_lens.size(0) == n_seq + 1, "cu_q_lens needs S + 1 = ", n_seq + 1, " entries");

  const float* Q = q.data_ptr<float>();
  const float* K = k_pool.data_ptr<float>();
  const float* V = v_pool.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* ctx = context_lens.data_ptr<int64_t>();
  const int64_t* cu = cu_q_lens.data_ptr<int64_t>();
  TORCH_CHECK(cu[n_seq] == n_tok, "cu_q_lens ends at ", cu[n_seq], " but q has ", n_tok, " rows");
  auto out = torch::empty_like(q);
  float* O = out.data_ptr<float>();

  std::vector<int64_t> seq_of(n_tok);  // the sequence each row belongs to
  for (int64_t s = 0; s < n_seq; ++s) std::fill(seq_of.begin() + cu[s], seq_of.begin() + cu[s + 1], s);

  const int64_t key_stride = n_kv * d;  // floats from one key row of a head to the next in a block
  at::parallel_for(0, n_tok * n_kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(g * block_size), acc(g * d), m(g), l(g);  // this thread's scratch
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / n_kv, h = item % n_kv, seq = seq_of[t];
      const int64_t n_keys = ctx[seq] - (cu[seq + 1] - t) + 1;  // row t is at position n_keys - 1
      const float* q_rows = Q + (t * n_heads + h * g) * d;  // (G, D): the heads that read KV head h
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j * block_size < n_keys; ++j) {
        const int64_t block = tables[seq * max_blocks + j];
        const int64_t keys = std::min(block_size, n_keys - j * block_size);  // visible keys of block j
        const float* k = K + (block * block_size * n_kv + h) * d;  // key i of this head: k + i * key_stride
        const float* v = V + (block * block_size * n_kv + h) * d;
        for (int64_t gi = 0; gi < g; ++gi) {
          float* sg = s.data() + gi * block_size;
          float block_max = -std::numeric_limits<float>::infinity();
          for (int64_t i = 0; i < keys; ++i) {
            sg[i] = dot(q_rows + gi * d, k + i * key_stride, d) * static_cast<float>(scale);
            block_max = std::max(block_max, sg[i]);
          }
          const float m_new = std::max(m[gi], block_max);
          const float alpha = std::exp(m[gi] - m_new);  // rescales what was summed under the old max
          float* a = acc.data() + gi * d;
          float p_sum = 0.f;
#pragma omp simd
          for (int64_t x = 0; x < d; ++x) a[x] *= alpha;
          for (int64_t i = 0; i < keys; ++i) {
            const float p = std::exp(sg[i] - m_new);
            const float* vi = v + i * key_stride;
            p_sum += p;
#pragma omp simd
            for (int64_t x = 0; x < d; ++x) a[x] += p * vi[x];
          }
          l[gi] = l[gi] * alpha + p_sum;
          m[gi] = m_new;
        }
      }
      float* o = O + (t * n_heads + h * g) * d;  // (G, D)
      for (int64_t gi = 0; gi < g; ++gi) {
#pragma omp simd
        for (int64_t x = 0; x < d; ++x) o[gi * d + x] = acc[gi * d + x] / l[gi];
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention over a flat batch (fp32, CPU)");
}
