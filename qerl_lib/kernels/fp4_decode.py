"""Two FP4 codes into two bf16 values with a handful of integer ops (Marlin's trick; docs/nvfp4_format.md, section 6).

A NVFP4 code ``c = s e1 e0 m`` (sign, two exponent bits, one mantissa bit) becomes a bfloat16 when its
bits are moved into place: ``s << 15 | e1 e0 m << 6`` *is* the bf16 of ``fp4(c) * 2^-126`` (code 1 = 0.5
lands on a bf16 subnormal, exactly right). The 126 is taken back by the block scale, applied as
``s * 2^118`` in one packed ``mul.rn.bf16x2`` (exact: ``fp4 * s`` has at most 6 significant bits), which
leaves ``fp4 * s * 2^-8``; the kernels' epilogues multiply by ``2^8 / gs``.

``code_pair_bits(q, I)`` does this for codes ``I`` and ``I + 4`` of every 32-bit word ``q`` (8 codes per
word, code ``i`` in bits ``4i..4i+3``) at once: one mask keeps the two nibbles, one multiply by
``2^a + 2^b`` makes the two shifted copies a code needs (its sign and its magnitude move by different
amounts), one mask keeps the right bits. Code ``I`` ends in the low half, code ``I + 4`` in the high half.
Shared by the Triton kernels (``fp4_gemm``) and the Gluon kernels (``fp4_wgmma``, whose ``_decode``
``fp4_wgmma_producer`` reuses, and ``fp4_wgmma_ws``), which can call it.

``relabeled_column(c)`` is where natural column ``c`` of ``x`` sits in the Gluon kernels' K relabeling
(``fp4_wgmma.permute_x``'s copy), and ``relabel_tile`` moves a whole tile of columns there in registers:
the kernels that produce ``x`` in the decode step (``engine/glue``, ``engine/attention``) store a second,
relabeled copy with them, so the GEMM needs no permute launch. A store through ``relabeled_column`` scatters
2-byte elements: in a kernel whose tile came out of a ``tl.dot`` (SiLU x up with the LoRA expand) that made the
whole kernel 4-6x slower on an H100 (dev/LOG.md section 38), so the glue kernels use ``relabel_tile`` and store
rows contiguously.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None

if triton is not None:

    @triton.jit
    def code_pair_bits(q, I: tl.constexpr):
        """uint32 holding the bf16 bits of ``fp4 * 2^-126`` for code ``I`` (low half) and code ``I + 4``
        (high half) of each word: sign to bit 15, ``e1 e0 m`` to bits 8..6."""
        if I == 0:  # sign <<12, magnitude <<6: one multiply makes both shifted copies
            p = ((q & 0x000F000F) * ((1 << 12) + (1 << 6))) & 0x81C081C0
        elif I == 1:  # sign <<8, magnitude <<2
            p = ((q & 0x00F000F0) * ((1 << 8) + (1 << 2))) & 0x81C081C0
        elif I == 2:  # sign <<4, magnitude >>2: pre-shift by 2, then <<6 and <<0
            p = (((q >> 2) & 0x03C003C0) * ((1 << 6) + 1)) & 0x81C081C0
        else:  # sign stays, magnitude >>6
            p = (q & 0x80008000) | ((q >> 6) & 0x01C001C0)
        return p

    @triton.jit
    def relabeled_column(c):
        """Position of natural column ``c = 128 B + 32 a + 8 b + 4 z + 2 d + e`` in ``fp4_wgmma.permute_x``'s
        copy: ``128 B + 32 b + 16 e + 8 d + 2 a + z`` (a permutation inside each block of 128 columns)."""
        return ((c & ~127) | (((c >> 3) & 3) << 5) | ((c & 1) << 4) | (((c >> 1) & 1) << 3) | (((c >> 5) & 3) << 1)
                | ((c >> 2) & 1))

    @triton.jit
    def relabel_tile(v, ROWS: tl.constexpr, BLOCKS: tl.constexpr):
        """A ``[ROWS, 128 BLOCKS]`` tile whose columns start on a 128-column boundary, permuted so that column
        ``p`` holds the natural column that ``relabeled_column`` sends to ``p`` (``_permute_x_kernel``'s move)."""
        v = tl.reshape(v, [ROWS, BLOCKS, 4, 4, 2, 2, 2])
        return tl.reshape(tl.permute(v, [0, 1, 3, 6, 5, 2, 4]), [ROWS, BLOCKS * 128])

    @triton.jit
    def relabel_row(v, WIDTH: tl.constexpr):
        """``relabel_tile`` for one row ``[WIDTH]`` (a multiple of 128, starting on a 128-column boundary)."""
        return tl.reshape(relabel_tile(tl.reshape(v, [1, WIDTH]), 1, WIDTH // 128), [WIDTH])

    @triton.jit
    def round_bf16(v, INTERPRETED: tl.constexpr):
        """fp32 -> bf16, round-to-nearest-even (the interpreter truncates: round the bits by hand, finite values
        only)."""
        if INTERPRETED:
            bits = v.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return v.to(tl.bfloat16)
