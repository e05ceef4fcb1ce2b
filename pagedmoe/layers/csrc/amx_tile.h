// AMX tiles for the bf16 GEMMs of the CPU kernels (layers/csrc/linear.cpp, layers/moe/csrc/fused_moe.cpp):
// Amx::tile(rows, x, b, K, acc) multiplies up to 32 contiguous rows of x (K apart) by one k-pair packed panel
// (tile_gemm.h's layout, PANEL = 32 columns). Elsewhere HAS_AMX is false and Amx::tile does nothing.
// With AMX, a row block of up to 32 rows is two A tiles sharing a panel's two B tiles per 32 k-steps.
#pragma once
#include "tile_gemm.h"
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace tile_gemm {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
constexpr bool HAS_AMX = true;
constexpr int AMX_ROWS = 32;  // two A tiles of 16 rows share each pair of B tiles

struct TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// The panel is prefetched into L2 this far ahead of the tile loads (two k-steps; measured 2-6 KB alike, 1.1-1.2x
// over tile_gemm's 16 KB at 8-128 rows), by the first row block of a panel only: later blocks find it in L2.
constexpr int AMX_PREFETCH_BYTES = 4096;

inline void prefetch_panel(const BF16 *b) {
    const char *ahead = reinterpret_cast<const char *>(b) + AMX_PREFETCH_BYTES;
    for (int line = 0; line < 32 * PANEL * int(sizeof(BF16)); line += 64) __builtin_prefetch(ahead + line, 0, 2);
}

// Per thread: tmm0 / tmm3 A [16 and rows - 16, 32 bf16], tmm1 / tmm2 B [16 k-pairs, 16 columns x 2],
// tmm4 / tmm5 and tmm6 / tmm7 C [rows of each A tile, 16 columns].
struct Amx {
    int configured_rows = 0;

    void configure(int rows) {
        if (rows == configured_rows) return;
        TileConfig c;
        const int first = std::min(rows, 16), second = rows - first;
        c.rows[0] = c.rows[4] = c.rows[5] = uint8_t(first);
        c.rows[3] = c.rows[6] = c.rows[7] = uint8_t(second);
        c.rows[1] = c.rows[2] = 16;
        for (int t = 0; t < 8; t++) c.colsb[t] = c.rows[t] ? 64 : 0;
        _tile_loadconfig(&c);
        configured_rows = rows;
    }

    // acc[rows][PANEL] = x [rows <= 32, K] (rows K apart) times a k-pair panel b [K / 2][PANEL][2]; K % 32 == 0.
    // prefetch: the panel's first row block, which brings it from memory.
    void tile(int rows, const BF16 *x, const BF16 *b, int64_t K, float *acc, bool prefetch) {
        configure(rows);
        if (rows > 16) return tile_of_two(x, b, K, acc, prefetch);
        _tile_zero(4);
        _tile_zero(5);
        for (int64_t k = 0; k < K; k += 32) {
            if (prefetch) prefetch_panel(b + k * PANEL);
            _tile_loadd(0, x + k, K * 2);
            _tile_loadd(1, b + k * PANEL, PANEL * 4);
            _tile_loadd(2, b + k * PANEL + 32, PANEL * 4);
            _tile_dpbf16ps(4, 0, 1);
            _tile_dpbf16ps(5, 0, 2);
        }
        _tile_stored(4, acc, PANEL * 4);
        _tile_stored(5, acc + 16, PANEL * 4);
    }

    void tile_of_two(const BF16 *x, const BF16 *b, int64_t K, float *acc, bool prefetch) {
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        for (int64_t k = 0; k < K; k += 32) {
            if (prefetch) prefetch_panel(b + k * PANEL);
            _tile_loadd(1, b + k * PANEL, PANEL * 4);
            _tile_loadd(2, b + k * PANEL + 32, PANEL * 4);
            _tile_loadd(0, x + k, K * 2);
            _tile_loadd(3, x + 16 * K + k, K * 2);
            _tile_dpbf16ps(4, 0, 1);
            _tile_dpbf16ps(5, 0, 2);
            _tile_dpbf16ps(6, 3, 1);
            _tile_dpbf16ps(7, 3, 2);
        }
        _tile_stored(4, acc, PANEL * 4);
        _tile_stored(5, acc + 16, PANEL * 4);
        _tile_stored(6, acc + 16 * PANEL, PANEL * 4);
        _tile_stored(7, acc + 16 * PANEL + 16, PANEL * 4);
    }

    ~Amx() {
        if (configured_rows) _tile_release();
    }
};

inline bool amx_ready() {  // Linux hands out the AMX tile state only on request, once per process
    static const bool ready = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return ready;
}
#else
constexpr bool HAS_AMX = false;
constexpr int AMX_ROWS = 1;
struct Amx {
    void tile(int, const BF16 *, const BF16 *, int64_t, float *, bool) {}
};
inline bool amx_ready() { return false; }
#endif

}  // namespace tile_gemm
