from pagedmoe.layers import cpu_build


def test_avx2_targets_vectorise_256_bits_wide(monkeypatch):
    """Zen 1's GCC tuning auto-vectorises in 128-bit halves; a native AVX2 build asks for 256 bits, an AVX-512
    one keeps its default, and a named target (x86-64-v3 checks) is left as the compiler tunes it."""
    monkeypatch.setattr(cpu_build, "detected_cpu_flags", lambda: frozenset({"avx", "avx2", "fma"}))
    assert "-mprefer-vector-width=256" in cpu_build.compile_flags("native")
    assert "-mprefer-vector-width=256" not in cpu_build.compile_flags("x86-64-v3")
    monkeypatch.setattr(cpu_build, "detected_cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f"}))
    assert "-mprefer-vector-width=256" not in cpu_build.compile_flags("native")
    monkeypatch.setattr(cpu_build, "detected_cpu_flags", lambda: frozenset())  # not x86
    assert cpu_build.compile_flags("native") == [*cpu_build.COMPILE_FLAGS, "-march=native"]
