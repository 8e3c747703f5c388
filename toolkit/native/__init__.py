"""Native CPU kernels: every csrc/*.c compiled into one shared library per build, loaded with ctypes.

A build is a named target (an ISA level: `x86-64`, `x86-64-v2`, `x86-64-v3` (AVX2 + FMA), `x86-64-v4`
(AVX-512), `armv8-a` (NEON), `generic` (the compiler's default), `scalar` (plain C, one lane)), a
compiler, and optionally a lane count. The kernels' source is width-generic (csrc/simd.h): the bits a
kernel gives depend only on the build's profile, its lanes and whether it fuses multiply-adds, never on
the compiler or the CPU beyond that (every build is -ffp-contract=off; fused multiply-adds are explicit).

By default the process uses the best target this CPU runs (`host_target()`), the compiler from $CC,
else cc / gcc / clang; `TOOLKIT_KERNEL_TARGET` names another (e.g. `x86-64-v2`, or `x86-64-v3/4` for 4
lanes). `TOOLKIT_NATIVE=0` switches the native path off: everything takes the torch fallback. A build
that fails (no compiler, a compile error) is remembered for the process, and the first use prints one
warning line on stderr naming the cause and the fix; the engine then runs the torch path and its
manifest says so. Libraries are cached under $TOOLKIT_CACHE/kernels, keyed by the sources, the
compiler's version and the flags.
"""
