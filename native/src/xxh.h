// XXH3 for the core: inlined, with the bulk calls going to libxxhash's run-time CPU dispatch
// where the build found it (x86-64: AVX2 / AVX-512 when the CPU has them; 256 KiB hashed at
// 38 GB/s instead of 24 here). Same digests either way: only the code path differs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#define XXH_INLINE_ALL
#include <xxhash.h>

#if defined(TC_XXH_DISPATCH)
extern "C" {
XXH64_hash_t XXH3_64bits_dispatch(const void* input, size_t len);
XXH_errorcode XXH3_64bits_update_dispatch(XXH3_state_t* state, const void* input, size_t len);
XXH128_hash_t XXH3_128bits_dispatch(const void* input, size_t len);
XXH_errorcode XXH3_128bits_update_dispatch(XXH3_state_t* state, const void* input, size_t len);
}
#endif

namespace tc::xxh {

// The canonical (big-endian) 16 bytes of a 128-bit hash, written to `out`.
inline void store_canonical(XXH128_hash_t hash, uint8_t* out) {
    XXH128_canonical_t canonical;
    XXH128_canonicalFromHash(&canonical, hash);
    std::memcpy(out, canonical.digest, 16);
}

inline XXH64_hash_t hash64(const void* input, size_t len) {
#if defined(TC_XXH_DISPATCH)
    return XXH3_64bits_dispatch(input, len);
#else
    return XXH3_64bits(input, len);
#endif
}

inline void update64(XXH3_state_t* state, const void* input, size_t len) {
#if defined(TC_XXH_DISPATCH)
    XXH3_64bits_update_dispatch(state, input, len);
#else
    XXH3_64bits_update(state, input, len);
#endif
}

inline XXH128_hash_t hash128(const void* input, size_t len) {
#if defined(TC_XXH_DISPATCH)
    return XXH3_128bits_dispatch(input, len);
#else
    return XXH3_128bits(input, len);
#endif
}

inline void update128(XXH3_state_t* state, const void* input, size_t len) {
#if defined(TC_XXH_DISPATCH)
    XXH3_128bits_update_dispatch(state, input, len);
#else
    XXH3_128bits_update(state, input, len);
#endif
}

}  // namespace tc::xxh
