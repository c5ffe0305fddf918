// KV blocks in and out of a paged cache for the transfer, with the frame's CRC-32C folded in.
//
// A push gathers a layer's blocks out of the prefill cache into one frame payload and hashes it;
// the decode side checks the hash and writes the payload's blocks into the cache. torch's
// index_select / index_copy_ move a block element-strided; a memcpy per block is faster, on
// cores the socket and gRPC also need (45 MiB, one thread: gather and CRC 11-13 -> 8.4-9.5 ms,
// scatter 11 -> ~4 ms). The gather hashes each group of blocks right after copying it, while
// it is still in L2 (a separate pass cost ~2 ms more). The decode side hashes first and copies
// after (frame.py's check), so a corrupt frame never reaches the cache.
//
// The CRC is Castagnoli's (the crc32c package's, frame.py's checksum), with the CPU's CRC
// instruction on three independent streams combined by shift tables (after Mark Adler's
// crc32c.c); a table-driven byte loop where SSE 4.2 is absent.
#include "cpu_kernels.h"

#include <cstring>

#if defined(__SSE4_2__)
#include <nmmintrin.h>
#endif

namespace {

constexpr uint32_t kPoly = 0x82f63b78u;  // CRC-32C, reflected

uint32_t gf2_matrix_times(const uint32_t* mat, uint32_t vec) {
  uint32_t sum = 0;
  for (; vec; vec >>= 1, ++mat) {
    if (vec & 1) sum ^= *mat;
  }
  return sum;
}

void gf2_matrix_square(uint32_t* square, const uint32_t* mat) {
  for (int n = 0; n < 32; ++n) square[n] = gf2_matrix_times(mat, mat[n]);
}

// The linear operator that appends `len` zero bytes to a CRC register; len a power of two.
void zeros_operator(uint32_t* even, size_t len) {
  uint32_t odd[32];
  odd[0] = kPoly;  // one zero bit
  for (int n = 1; n < 32; ++n) odd[n] = 1u << (n - 1);
  gf2_matrix_square(even, odd);  // two zero bits
  gf2_matrix_square(odd, even);  // four
  for (;;) {
    gf2_matrix_square(even, odd);  // first time round: one zero byte
    len >>= 1;
    if (len == 0) return;
    gf2_matrix_square(odd, even);
    len >>= 1;
    if (len == 0) break;
  }
  std::memcpy(even, odd, sizeof(odd));
}

// The operator as four byte-indexed tables: shift(crc) = crc followed by `len` zero bytes.
struct ShiftTable {
  uint32_t t[4][256];
  explicit ShiftTable(size_t len) {
    uint32_t op[32];
    zeros_operator(op, len);
    for (uint32_t n = 0; n < 256; ++n) {
      for (int b = 0; b < 4; ++b) t[b][n] = gf2_matrix_times(op, n << (8 * b));
    }
  }
  uint32_t shift(uint32_t crc) const {
    return t[0][crc & 0xff] ^ t[1][(crc >> 8) & 0xff] ^ t[2][(crc >> 16) & 0xff] ^ t[3][crc >> 24];
  }
};

struct ByteTable {
  uint32_t t[256];
  ByteTable() {
    for (uint32_t n = 0; n < 256; ++n) {
      uint32_t c = n;
      for (int k = 0; k < 8; ++k) c = c & 1 ? (c >> 1) ^ kPoly : c >> 1;
      t[n] = c;
    }
  }
};

#if defined(__SSE4_2__)
constexpr size_t kLong = 8192, kShort = 256;  // stream lengths; powers of two (zeros_operator)

// Three CRC instructions in flight (the instruction's latency is three cycles, its throughput
// one): streams a, b, c over consecutive `len`-byte runs, then crc(abc) = shift(shift(a) ^ b) ^ c.
const uint8_t* three_streams(uint64_t& crc, const uint8_t* p, size_t& n, size_t len,
                             const ShiftTable& table) {
  while (n >= 3 * len) {
    uint64_t c1 = 0, c2 = 0;
    const uint8_t* end = p + len;
    for (; p < end; p += 8) {
      uint64_t w0, w1, w2;
      std::memcpy(&w0, p, 8);
      std::memcpy(&w1, p + len, 8);
      std::memcpy(&w2, p + 2 * len, 8);
      crc = _mm_crc32_u64(crc, w0);
      c1 = _mm_crc32_u64(c1, w1);
      c2 = _mm_crc32_u64(c2, w2);
    }
    crc = table.shift(static_cast<uint32_t>(crc)) ^ c1;
    crc = table.shift(static_cast<uint32_t>(crc)) ^ c2;
    p += 2 * len;
    n -= 3 * len;
  }
  return p;
}
#endif

}  // namespace

uint32_t crc32c_extend(uint32_t crc, const uint8_t* p, size_t n) {
#if defined(__SSE4_2__)
  static const ShiftTable long_table(kLong), short_table(kShort);
  uint64_t c = crc ^ 0xffffffffu;
  for (; n && (reinterpret_cast<uintptr_t>(p) & 7); ++p, --n) c = _mm_crc32_u8(c, *p);
  p = three_streams(c, p, n, kLong, long_table);
  p = three_streams(c, p, n, kShort, short_table);
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c = _mm_crc32_u64(c, w);
  }
  for (; n; ++p, --n) c = _mm_crc32_u8(c, *p);
  return static_cast<uint32_t>(c) ^ 0xffffffffu;
#else
  static const ByteTable table;
  uint32_t c = crc ^ 0xffffffffu;
  for (; n; ++p, --n) c = table.t[(c ^ *p) & 0xff] ^ (c >> 8);
  return c ^ 0xffffffffu;
#endif
}

namespace {

constexpr size_t kGroupBytes = 64 * 1024;  // hashed while still in L2 from its copy

struct BlockCopy {
  uint8_t* k_base;
  uint8_t* v_base;
  size_t block_bytes;
  int64_t num_blocks;
};

BlockCopy check_caches(const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_ids) {
  TORCH_CHECK(k_cache.device().is_cpu() && v_cache.device().is_cpu(), "caches must be on the CPU");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.dtype() == v_cache.dtype(),
              "k_cache and v_cache differ in shape or dtype");
  TORCH_CHECK(k_cache.dim() >= 2, "a cache is [num_blocks, block_size, ...]");
  TORCH_CHECK(block_ids.dtype() == at::kLong && block_ids.dim() == 1 && block_ids.is_contiguous(),
              "block_ids must be a contiguous 1-D int64 tensor");
  const int64_t num_blocks = k_cache.size(0);
  const int64_t* ids = block_ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < block_ids.numel(); ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < num_blocks, "block id ", ids[i], " outside the cache of ",
                num_blocks, " blocks");
  }
  const size_t block_bytes = static_cast<size_t>(k_cache[0].numel()) * k_cache.element_size();
  return {static_cast<uint8_t*>(k_cache.data_ptr()), static_cast<uint8_t*>(v_cache.data_ptr()),
          block_bytes, num_blocks};
}

void check_payload(const at::Tensor& payload, const BlockCopy& c, int64_t n) {
  TORCH_CHECK(payload.device().is_cpu() && payload.is_contiguous(), "payload must be contiguous");
  TORCH_CHECK(static_cast<size_t>(payload.numel()) * payload.element_size() ==
                  2 * static_cast<size_t>(n) * c.block_bytes,
              "payload holds ", payload.numel() * payload.element_size(), " bytes; ", n,
              " blocks of K and V need ", 2 * n * c.block_bytes);
}

// Copies the blocks into the payload (K then V, each in block_ids order) in groups of
// ~kGroupBytes, hashing each group right after its copy, while it is still in L2.
uint32_t gather_and_hash(const BlockCopy& c, const int64_t* ids, int64_t n, uint8_t* payload) {
  const int64_t per_group = std::max<int64_t>(1, kGroupBytes / c.block_bytes);
  uint32_t crc = 0;
  for (int64_t half = 0; half < 2; ++half) {
    const uint8_t* base = half == 0 ? c.k_base : c.v_base;
    uint8_t* out = payload + half * n * c.block_bytes;
    for (int64_t g = 0; g < n; g += per_group) {
      const int64_t end = std::min(n, g + per_group);
      for (int64_t i = g; i < end; ++i) {
        std::memcpy(out + i * c.block_bytes, base + ids[i] * c.block_bytes, c.block_bytes);
      }
      crc = crc32c_extend(crc, out + g * c.block_bytes, (end - g) * c.block_bytes);
    }
  }
  return crc;
}

}  // namespace

int64_t crc32c(const at::Tensor& data) {
  TORCH_CHECK(data.device().is_cpu() && data.is_contiguous(), "data must be a contiguous CPU tensor");
  return crc32c_extend(0, static_cast<const uint8_t*>(data.data_ptr()),
                       static_cast<size_t>(data.numel()) * data.element_size());
}

int64_t gather_kv_blocks(const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& block_ids, at::Tensor& out) {
  const BlockCopy c = check_caches(k_cache, v_cache, block_ids);
  check_payload(out, c, block_ids.numel());
  return gather_and_hash(c, block_ids.data_ptr<int64_t>(), block_ids.numel(),
                         static_cast<uint8_t*>(out.data_ptr()));
}

void scatter_kv_blocks(const at::Tensor& payload, at::Tensor& k_cache, at::Tensor& v_cache,
                       const at::Tensor& block_ids) {
  const BlockCopy c = check_caches(k_cache, v_cache, block_ids);
  const int64_t n = block_ids.numel();
  check_payload(payload, c, n);
  const int64_t* ids = block_ids.data_ptr<int64_t>();
  const uint8_t* in = static_cast<const uint8_t*>(payload.data_ptr());
  for (int64_t half = 0; half < 2; ++half) {
    uint8_t* base = half == 0 ? c.k_base : c.v_base;
    for (int64_t i = 0; i < n; ++i, in += c.block_bytes) {
      std::memcpy(base + ids[i] * c.block_bytes, in, c.block_bytes);
    }
  }
}
